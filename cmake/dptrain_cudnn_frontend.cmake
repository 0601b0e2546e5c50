# dpt_fetch_cudnn_frontend(DIR): unpacks the include/ folder of PyPI's nvidia-cudnn-frontend
# wheel (the header-only cuDNN frontend) into DIR/include, with pip and Python's zipfile.
# Quiet when that is not possible (no pip, no network): the caller checks for the header.
set(DPT_CUDNN_FRONTEND_VERSION "1.32.0" CACHE STRING "the nvidia-cudnn-frontend wheel's version")
function(dpt_fetch_cudnn_frontend dir)
  find_package(Python3 COMPONENTS Interpreter QUIET)
  if(NOT Python3_Interpreter_FOUND)
    return()
  endif()
  message(STATUS "dptrain: fetching nvidia-cudnn-frontend ${DPT_CUDNN_FRONTEND_VERSION} (header-only) with pip")
  execute_process(
    COMMAND ${Python3_EXECUTABLE} -m pip download --quiet --no-deps --only-binary=:all: -d "${dir}/wheel"
            "nvidia-cudnn-frontend==${DPT_CUDNN_FRONTEND_VERSION}"
    RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET TIMEOUT 120)
  file(GLOB wheels "${dir}/wheel/nvidia_cudnn_frontend-*.whl")
  if(NOT rc EQUAL 0 OR NOT wheels)
    message(STATUS "dptrain: could not fetch nvidia-cudnn-frontend (no network?): bf16 attention runs dptrain's kernel")
    return()
  endif()
  list(GET wheels 0 wheel)
  execute_process(
    COMMAND ${Python3_EXECUTABLE} -c
            "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith('include/')])"
            "${wheel}" "${dir}"
    RESULT_VARIABLE rc)
endfunction()
