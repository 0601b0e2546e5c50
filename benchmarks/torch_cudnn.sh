# Sourced by the GPU machine's scripts: dptrain runs with the cuDNN that PyTorch loads (its
# wheel's nvidia/cudnn/lib, where there is one), so that both programs' attention comes from
# one cuDNN (on the GPU machine the system's is 9.14 and PyTorch's 9.19, whose attention
# kernels take 0.2 ms less of a B 16 step), and so that binaries built against a newer
# cuDNN's headers elsewhere (PREBUILT=1) do not load an older library.
torch_cudnn=$(python3 -c 'import nvidia.cudnn as m, os; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null)
if [ -d "$torch_cudnn" ]; then
  export LD_LIBRARY_PATH="$torch_cudnn${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "cuDNN for both: $torch_cudnn"
fi
