// The helper of tests/npy_interop.py. `header FILE.npy` prints the header dptrain reads;
// `dump X.npy [Y.npy]` and `dump FILE.safetensors` load a data set and print every row as
// it is gathered (inputs as float32, labels as int32), one JSON object, for the script to
// compare with what numpy wrote; `write DIR` writes .npy files of known values for numpy
// to read back. A refused file prints its one line on stderr and exits 2.
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include <dptrain/data/dataset.hpp>
#include <dptrain/data/npy.hpp>
#include <span>

#include <dptrain/error.hpp>

using namespace dpt::data;

namespace {

std::string shape_json(std::span<const int64_t> s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? "," : "") + std::to_string(s[i]);
  return out + "]";
}

std::string number(float v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", static_cast<double>(v));  // float32 round-trips at 9 digits
  return buf;
}

std::string dataset_json(const ArrayDataset& d) {
  std::vector<int64_t> rows(static_cast<size_t>(d.rows()));
  std::iota(rows.begin(), rows.end(), 0);
  std::vector<float> x(rows.size() * static_cast<size_t>(dpt::numel(d.input_shape())));
  std::vector<float> y;
  std::vector<int32_t> labels;
  HostRows into{x.data(), nullptr, nullptr};
  if (d.has_targets() && d.task() == dpt::data::Task::classification) {
    labels.resize(rows.size());
    into.labels = labels.data();
  } else if (d.has_targets()) {
    y.resize(rows.size() * static_cast<size_t>(dpt::numel(d.target_shape())));
    into.y = y.data();
  }
  d.gather_host(rows, into);
  std::string out = "{\"rows\":" + std::to_string(d.rows()) + ",\"input_shape\":" + shape_json(d.input_shape()) +
                    ",\"targets\":\"" + (d.has_targets() ? task_name(d.task()) : "none") +
                    "\",\"target_shape\":" + shape_json(d.target_shape()) + ",\"x\":[";
  for (size_t i = 0; i < x.size(); ++i) out += (i ? "," : "") + number(x[i]);
  out += "],\"y\":[";
  for (size_t i = 0; i < y.size(); ++i) out += (i ? "," : "") + number(y[i]);
  for (size_t i = 0; i < labels.size(); ++i) out += (i ? "," : "") + std::to_string(labels[i]);
  return out + "]}";
}

// The half-precision bits of a small integer (exact: i < 2048).
uint16_t half(int i) {
  if (i == 0) return 0;
  int e = 0;
  while ((i >> (e + 1)) != 0) ++e;
  const int mantissa = ((i << 10) >> e) & 0x3ff;
  return static_cast<uint16_t>((e + 15) << 10 | mantissa);
}

void write(const std::string& dir) {
  auto save = [&](const std::string& name, const Array& a, int major) {
    std::ofstream out(dir + "/" + name, std::ios::binary | std::ios::trunc);
    write_npy([&](const void* p, size_t n) { out.write(static_cast<const char*>(p), static_cast<std::streamsize>(n)); },
              a, major);
    if (!out) throw dpt::Error("cannot write " + dir + "/" + name);
  };
  // Each file holds 0, 1, 2, ... (in its dtype), so numpy knows what to expect.
  std::vector<float> f32(24);
  std::vector<double> f64(24);
  std::vector<uint16_t> f16(24);
  std::vector<uint8_t> u8(24);
  std::vector<int32_t> i32(24);
  std::vector<int64_t> i64(24);
  for (int i = 0; i < 24; ++i) {
    f32[i] = static_cast<float>(i), f64[i] = i, u8[i] = static_cast<uint8_t>(i), i32[i] = i, i64[i] = i;
    f16[i] = half(i);
  }
  for (int major : {1, 2, 3}) {
    const std::string v = "_v" + std::to_string(major) + ".npy";
    save("float32" + v, {f32.data(), ArrayDType::f32, {4, 6}}, major);
    save("float64" + v, {f64.data(), ArrayDType::f64, {2, 3, 4}}, major);
    save("float16" + v, {f16.data(), ArrayDType::f16, {24}}, major);
    save("uint8" + v, {u8.data(), ArrayDType::u8, {1, 2, 3, 4}}, major);
    save("int32" + v, {i32.data(), ArrayDType::i32, {24, 1}}, major);
    save("int64" + v, {i64.data(), ArrayDType::i64, {3, 8}}, major);
  }
  save("scalar.npy", {f32.data() + 5, ArrayDType::f32, {}}, 0);
  save("empty.npy", {f32.data(), ArrayDType::f32, {0, 3}}, 0);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string verb = argc >= 3 ? argv[1] : "";
  try {
    if (verb == "header" && argc == 3) {
      const NpyFile f(argv[2]);
      const NpyHeader& h = f.header();
      std::printf("{\"version\":\"%d.%d\",\"dtype\":\"%s\",\"shape\":%s,\"data_offset\":%llu}\n", h.major, h.minor,
                  array_dtype_name(h.dtype), shape_json(h.shape).c_str(),
                  static_cast<unsigned long long>(h.data_offset));
    } else if (verb == "dump" && (argc == 3 || argc == 4)) {
      const std::string path = argv[2];
      if (path.size() > 12 && path.substr(path.size() - 12) == ".safetensors") {
        const DataSplit s = ArrayDataset::from_safetensors(path);
        std::printf("{\"train\":%s,\"val\":%s}\n", dataset_json(s.train).c_str(),
                    s.val ? dataset_json(*s.val).c_str() : "null");
      } else {
        std::printf("%s\n", dataset_json(ArrayDataset::from_npy(path, argc == 4 ? argv[3] : "")).c_str());
      }
    } else if (verb == "write" && argc == 3) {
      write(argv[2]);
    } else {
      std::fprintf(stderr,
                   "usage: data_tool header FILE.npy | dump X.npy [Y.npy] | dump FILE.safetensors | write DIR\n");
      return 2;
    }
  } catch (const dpt::UsageError& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  } catch (const dpt::Error& e) {
    std::fprintf(stderr, "data_tool: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
