// The tests' main. Built twice: dpt_tests (CPU) and dpt_gpu_tests (DPT_GPU_TESTS), which
// exits 77 when there is no GPU so ctest reports it skipped (SKIP_RETURN_CODE 77). Catch2's
// session is catch_main.cpp's, compiled once.
#include <cstdio>

#include <dptrain/runtime/device.hpp>

int dpt_test_run(int argc, char** argv);

int main(int argc, char** argv) {
#ifdef DPT_GPU_TESTS
  if (dpt::cuda_device_count() == 0) {
    std::printf("no GPU here (%s): the GPU tests are skipped\n",
                dpt::built_with_cuda() ? "no driver or device" : "built without CUDA");
    return 77;
  }
#endif
  return dpt_test_run(argc, argv);
}
