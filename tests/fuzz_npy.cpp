// libFuzzer target for the .npy header reader (run by tests/fuzz_test.sh): any input must
// either be read, with a header whose shape's bytes are exactly the file's data, or be
// refused with dpt::UsageError; anything else (a crash, a sanitizer report, another
// exception, a huge allocation) is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include <dptrain/data/npy.hpp>
#include <dptrain/error.hpp>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const dpt::data::NpyHeader h = dpt::data::parse_npy_header(data, size, "fuzz");
    const int64_t count = dpt::data::element_count(h.shape);
    if (count < 0 || h.data_offset > size || h.data_offset % 16 != 0 ||
        (size - h.data_offset) != static_cast<uint64_t>(count) * dpt::data::array_dtype_size(h.dtype))
      std::abort();  // read, but not what the file holds
  } catch (const dpt::UsageError&) {
  }
  return 0;
}
