#include <dptrain/data/synthetic.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <dptrain/error.hpp>
#include <dptrain/runtime/autograd.hpp>
#include <dptrain/runtime/context.hpp>
#include <dptrain/runtime/ops.hpp>
#include "kernels/cpu/cpu.hpp"
#if DPT_WITH_CUDA
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/cuda.hpp"
#endif

namespace dpt::data {

namespace {
// Philox streams of a seed: one per kind of value, far from the parameter streams.
constexpr uint64_t kInputs = 1u << 20, kNoise = kInputs + 1, kTeacher1 = kInputs + 2, kTeacher2 = kInputs + 3;

Tensor teacher_weight(int64_t rows, int64_t cols, float gain, uint64_t seed, uint64_t stream, const Device& d) {
  int64_t n = 0;
  if (__builtin_mul_overflow(rows, cols, &n) || n > (int64_t{1} << 40))  // 4 TiB of floats: no host has it
    throw OutOfMemory("out of host memory: the synthetic data's teacher weights of " + std::to_string(rows) + " x " +
                      std::to_string(cols) + " floats; use smaller widths (SyntheticConfig::in, teacher_hidden)");
  std::vector<float> w(static_cast<size_t>(n));
  cpu::normal(w.data(), rows * cols, seed, stream, 0, gain / std::sqrt(static_cast<float>(cols)));
  return Tensor::from_host(w, {rows, cols}, d);
}
}  // namespace

Synthetic::Synthetic(const SyntheticConfig& config, const Device& device) : cfg_(config), device_(device) {
  DPT_CHECK(cfg_.out > 0 && cfg_.teacher_hidden > 0, "Synthetic: widths must be positive");
  DPT_CHECK(cfg_.samples >= 0, "Synthetic: negative sample count");
  if (cfg_.task == Task::language_model) {  // random tokens: no teacher
    DPT_CHECK(cfg_.in > 0 && cfg_.image.empty() && cfg_.out <= std::numeric_limits<int32_t>::max(),
              "Synthetic: tokens need a sequence length (in) and a vocabulary (out) of at most 2^31 - 1");
    return;
  }
  if (!(cfg_.noise >= 0.0f && std::isfinite(cfg_.noise)))
    throw UsageError("SyntheticConfig::noise must be a finite number >= 0, got " + std::to_string(cfg_.noise));
  if (!cfg_.image.empty()) {
    DPT_CHECK(cfg_.image.size() == 3 && numel(cfg_.image) > 0, "Synthetic: an image is [C, H, W]");
    DPT_CHECK(cfg_.task == Task::classification, "Synthetic: images come with classification only");
    cfg_.in = numel(cfg_.image);
    // The teacher CNN: a 3x3 convolution to teacher_hidden channels, standard normal
    // before its tanh, then the same head as the MLP teacher's.
    const int64_t fan_in = cfg_.image[0] * 9;
    w1_ = teacher_weight(cfg_.teacher_hidden, fan_in, 1.0f, cfg_.seed, kTeacher1, device)
              .reshape({cfg_.teacher_hidden, cfg_.image[0], 3, 3});
    w2_ = teacher_weight(cfg_.out, cfg_.teacher_hidden, 1.6f, cfg_.seed, kTeacher2, device);
    context(device).synchronize();  // the uploads done: other streams (a trainer's data streams) read them
    return;
  }
  DPT_CHECK(cfg_.in > 0, "Synthetic: widths must be positive");
  // Scaled so the teacher's outputs have a variance near 1 whatever the widths: W1 x is
  // standard normal, tanh of it has a variance of about 0.39, which the gain 1.6 undoes.
  w1_ = teacher_weight(cfg_.teacher_hidden, cfg_.in, 1.0f, cfg_.seed, kTeacher1, device);
  w2_ = teacher_weight(cfg_.out, cfg_.teacher_hidden, 1.6f, cfg_.seed, kTeacher2, device);
  context(device).synchronize();  // the uploads done: other streams (a trainer's data streams) read them
}

Batch Synthetic::batch(int64_t first, int64_t count) const {
  if (!(first >= 0 && count > 0 && count <= std::numeric_limits<int64_t>::max() - first))
    throw UsageError("Synthetic::batch: " + std::to_string(count) + " rows from row " + std::to_string(first));
  return rows({first, count, count, cfg_.samples}, count);
}

Batch Synthetic::rows(const RowMap& map, int64_t count, const Batch& into) const {
  DPT_CHECK(map.first >= 0 && map.per_group > 0 && map.group_stride >= map.per_group && count > 0,
            "Synthetic::rows: bad rows");
  const RowMap wrapped{map.first, map.per_group, map.group_stride, cfg_.samples};
  NoGradGuard no_grad;
  auto fits = [&](const Tensor& given, DType dtype, const Shape& row) {
    Shape s = row;
    s.insert(s.begin(), count);
    DPT_CHECK(
        given.dtype() == dtype && given.device() == device_ && given.shape() == s,
        "Synthetic::rows: `into` does not hold " + std::to_string(count) + " rows of this set on " + device_.str());
  };
  if (cfg_.task == Task::language_model) return token_rows(wrapped, count, into);
  if (into.x.defined()) {
    fits(into.x, DType::f32, input_shape());
    fits(into.y, cfg_.task == Task::classification ? DType::i32 : DType::f32, target_shape());
  }
  Batch b;
  // Sample i's features are elements i*in .. i*in+in-1 of the input stream.
  b.x = into.x.defined() ? into.x : Tensor::empty({count, cfg_.in}, DType::f32, device_);
  if (!cfg_.image.empty()) b.x = b.x.reshape({count, cfg_.image[0], cfg_.image[1], cfg_.image[2]});
  normal_rows_(b.x, cfg_.seed, kInputs, wrapped);
  auto labels = [&](const Tensor& out) {  // classification: the teacher's argmax
    b.y = argmax_rows(out);
    if (into.y.defined()) {
      copy(into.y, b.y);
      b.y = into.y;
    }
  };
  if (!cfg_.image.empty()) {
    // Every op of the teacher works sample by sample, so a label does not depend on
    // the batch it is made in.
    const Shape& im = cfg_.image;
    Tensor h = activation(conv2d(b.x, w1_, Tensor(), 1, 1), Act::tanh);
    h = flatten(pool2d(h, Pool::avg, im[1], im[2], 1));
    labels(linear(h, w2_, Tensor(), Act::none));
    return b;
  }
  Tensor h = linear(b.x, w1_, Tensor(), Act::tanh);
  if (cfg_.task == Task::classification) {
    labels(linear(h, w2_, Tensor(), Act::none));
    return b;
  }
  Tensor out = linear(h, w2_, Tensor(), Act::none, into.y);
  // Noise for sample i is elements i*out .. of the noise stream, added in the same pass.
  if (cfg_.noise > 0.0f) normal_rows_(out, cfg_.seed, kNoise, wrapped, cfg_.noise, /*add=*/true);
  b.y = out;
  return b;
}

Batch Synthetic::token_rows(const RowMap& map, int64_t count, const Batch& into) const {
  const int64_t T = cfg_.in;
  if (into.x.defined())
    DPT_CHECK(into.x.dtype() == DType::i32 && into.y.dtype() == DType::i32 && into.x.numel() == count * T &&
                  into.y.numel() == count * T && into.x.device() == device_ && into.y.device() == device_,
              "Synthetic::rows: `into` does not hold " + std::to_string(count) + " windows of tokens");
  // Made where they are asked for, on the device's stream: no host loop, no copy.
  const Batch b = into.x.defined() ? into
                                   : Batch{Tensor::empty({count, T}, DType::i32, device_),
                                           Tensor::empty({count, T}, DType::i32, device_)};
  if (device_.is_cuda()) {
#if DPT_WITH_CUDA
    cuda::set_device(device_.index);
    cuda::random_tokens(b.x.i32(), b.y.i32(), count, T, cfg_.out, cfg_.seed, kInputs, map,
                        static_cast<cudaStream_t>(context(device_).stream()));
#else
    throw Error("synthetic tokens on CUDA need dptrain built with CUDA");
#endif
  } else {
    cpu::random_tokens(b.x.i32(), b.y.i32(), count, T, cfg_.out, cfg_.seed, kInputs, map);
  }
  return b;
}

Shape Synthetic::input_shape() const { return cfg_.image.empty() ? Shape{cfg_.in} : cfg_.image; }

Shape Synthetic::target_shape() const {
  if (cfg_.task == Task::language_model) return {cfg_.in};
  return cfg_.task == Task::classification ? Shape{} : Shape{cfg_.out};
}

template <class F>
void Synthetic::for_runs(std::span<const int64_t> rows, F&& f) const {
  size_t at = 0;
  while (at < rows.size()) {
    const int64_t first = rows[at];
    if (first < 0 || (cfg_.samples > 0 && first >= cfg_.samples))
      throw Error("Synthetic: row " + std::to_string(first) + " is outside [0, " + std::to_string(cfg_.samples) + ")");
    size_t end = at + 1;
    while (end < rows.size() && rows[end] == rows[end - 1] + 1 && (cfg_.samples == 0 || rows[end] < cfg_.samples))
      ++end;
    f(at, first, static_cast<int64_t>(end - at));
    at = end;
  }
}

void Synthetic::gather_host(std::span<const int64_t> rows, const HostRows& into) const {
  DPT_CHECK(!into.y || cfg_.task == Task::regression, "Synthetic::gather_host: no regression targets to gather");
  DPT_CHECK(!into.labels || cfg_.task != Task::regression, "Synthetic::gather_host: no class labels to gather");
  const auto in = static_cast<size_t>(cfg_.in), out = static_cast<size_t>(cfg_.out);
  for_runs(rows, [&](size_t at, int64_t first, int64_t count) {
    const Batch b = batch(first, count);
    if (cfg_.task == Task::language_model) {  // tokens: x_i32 and their next tokens as labels
      const std::vector<int32_t> x = b.x.to_host_i32(), y = b.y.to_host_i32();
      if (into.x_i32) std::memcpy(into.x_i32 + at * in, x.data(), x.size() * sizeof(int32_t));
      if (into.labels) std::memcpy(into.labels + at * in, y.data(), y.size() * sizeof(int32_t));
      return;
    }
    if (into.x) {
      const std::vector<float> x = b.x.to_host();
      std::memcpy(into.x + at * in, x.data(), x.size() * sizeof(float));
    }
    if (into.y) {
      const std::vector<float> y = b.y.to_host();
      std::memcpy(into.y + at * out, y.data(), y.size() * sizeof(float));
    }
    if (into.labels) {
      const std::vector<int32_t> y = b.y.to_host_i32();
      std::memcpy(into.labels + at, y.data(), y.size() * sizeof(int32_t));
    }
  });
}

void Synthetic::gather(std::span<const int64_t> rows, const Batch& into, int64_t /*classes: its labels fit*/) const {
  DPT_CHECK(into.x.defined() && into.x.size(0) == static_cast<int64_t>(rows.size()) &&
                into.x.numel() == static_cast<int64_t>(rows.size()) * cfg_.in,
            "Synthetic::gather: x does not hold the rows");
  DPT_CHECK(!into.y.defined() || into.y.size(0) == static_cast<int64_t>(rows.size()),
            "Synthetic::gather: y does not hold the rows");
  for_runs(rows, [&](size_t at, int64_t first, int64_t count) {
    const Batch b = batch(first, count);
    const auto row = static_cast<int64_t>(at);
    copy(into.x.view(row * cfg_.in, b.x.shape()), b.x);
    if (into.y.defined()) copy(into.y.view(row * (b.y.numel() / count), b.y.shape()), b.y);
  });
}

Batch Synthetic::batch(int64_t first, int64_t count, const Device& device) const {
  Batch b = batch(first, count);
  if (device == device_) return b;
  Batch moved;
  moved.x = Tensor::empty(b.x.shape(), b.x.dtype(), device);
  moved.y = Tensor::empty(b.y.shape(), b.y.dtype(), device);
  copy(moved.x, b.x);
  copy(moved.y, b.y);
  return moved;
}

Tensor random_labels(int64_t count, int64_t classes, uint64_t seed, uint64_t stream, int64_t first,
                     const Device& device) {
  if (count < 0 || classes < 1 || classes > std::numeric_limits<int32_t>::max())
    throw UsageError("random_labels: a count >= 0 and 1 to 2^31 - 1 classes, got " + std::to_string(count) + " and " +
                     std::to_string(classes));
  std::vector<float> u(static_cast<size_t>(count));
  cpu::uniform(u.data(), count, seed, stream, static_cast<uint64_t>(first), 0.0f, static_cast<float>(classes));
  std::vector<int32_t> labels;
  labels.reserve(u.size());
  // min: a float drawn just below `classes` may round up to it
  for (float v : u) labels.push_back(static_cast<int32_t>(std::min<int64_t>(static_cast<int64_t>(v), classes - 1)));
  return Tensor::from_host_i32(labels, {count}, device);
}

}  // namespace dpt::data
