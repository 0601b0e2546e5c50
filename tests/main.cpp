// The tests' main. Built twice: dpt_tests (CPU) and dpt_gpu_tests (DPT_GPU_TESTS), which
// exits 77 when there is no GPU so ctest reports it skipped (SKIP_RETURN_CODE 77).
#include <cstdio>

#if __has_include(<catch2/catch_session.hpp>)
#include <catch2/catch_session.hpp>
#else
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#endif

#include <dptrain/runtime/device.hpp>

int main(int argc, char** argv) {
#ifdef DPT_GPU_TESTS
  if (dpt::cuda_device_count() == 0) {
    std::printf("no GPU here (%s): the GPU tests are skipped\n",
                dpt::built_with_cuda() ? "no driver or device" : "built without CUDA");
    return 77;
  }
#endif
  return Catch::Session().run(argc, argv);
}
