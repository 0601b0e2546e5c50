// libFuzzer target for the checkpoint loader (run by tests/fuzz_test.sh): any input must
// either parse or throw dpt::Error; anything else (a crash, a sanitizer report, another
// exception, a huge allocation) is a finding.
#include <cstddef>
#include <cstdint>

#include <dptrain/error.hpp>
#include <dptrain/train/checkpoint.hpp>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    dpt::ckpt::parse(data, size, "fuzz");
  } catch (const dpt::Error&) {
  }
  return 0;
}
