# Finds cuDNN and makes the imported target dptrain::cudnn (libcudnn.so, linked
# dynamically, and the folder of cudnn.h). cuDNN sits in the CUDA toolkit on some
# machines (/usr/local/cuda) and in the system's multiarch folders on others
# (/usr/include/x86_64-linux-gnu from the Debian/Ubuntu packages, which find_path and
# find_library search by themselves). Included by the build and by the installed package
# config, so an embedding program finds the library the same way the build did.
if(NOT TARGET dptrain::cudnn)
  find_path(DPT_CUDNN_INCLUDE cudnn.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
  find_library(DPT_CUDNN_LIBRARY cudnn HINTS ${CUDAToolkit_LIBRARY_DIR})
  if(DPT_CUDNN_INCLUDE AND DPT_CUDNN_LIBRARY)
    add_library(dptrain::cudnn SHARED IMPORTED GLOBAL)
    set_target_properties(dptrain::cudnn PROPERTIES
      IMPORTED_LOCATION ${DPT_CUDNN_LIBRARY} INTERFACE_INCLUDE_DIRECTORIES ${DPT_CUDNN_INCLUDE})
  endif()
endif()
