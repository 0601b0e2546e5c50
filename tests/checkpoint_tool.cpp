// The helper of tests/safetensors_interop.py: `write PATH` saves the fixed checkpoint
// that the script expects Python's safetensors to read back; `dump PATH` loads any
// checkpoint and prints it as one JSON object (metadata, then each tensor's name, dtype,
// shape and bytes in hex) for the script to compare with what it wrote.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <cstring>

#include <dptrain/error.hpp>
#include <dptrain/layers/conv.hpp>
#include <dptrain/layers/layers.hpp>
#include <dptrain/runtime/autograd.hpp>
#include <dptrain/runtime/ops.hpp>
#include <dptrain/train/checkpoint.hpp>

#include "common/text.hpp"

namespace {

using dpt::ckpt::DType;

dpt::ckpt::Checkpoint fixed() {
  dpt::ckpt::Checkpoint c;
  c.metadata = {{"step", "10"}, {"model", "16-128x2-4"}, {"note", "\xc3\xa9 \"quoted\"\n"}};
  const std::vector<float> w = {-0.5f, -0.25f, 0.0f, 0.25f, 0.5f, 0.75f};
  const std::vector<uint16_t> b = {0x3f80, 0xc000, 0x3f00, 0x4040};  // bf16 1, -2, 0.5, 3
  const std::vector<int32_t> idx = {-1, 0, 2147483647};
  const int32_t step = 7;
  c.tensors.emplace_back("layers.0.weight", dpt::ckpt::make_tensor(DType::f32, {2, 3}, w.data()));
  c.tensors.emplace_back("layers.0.bias", dpt::ckpt::make_tensor(DType::bf16, {4}, b.data()));
  c.tensors.emplace_back("idx", dpt::ckpt::make_tensor(DType::i32, {3}, idx.data()));
  c.tensors.emplace_back("step", dpt::ckpt::make_tensor(DType::i32, {}, &step));
  c.tensors.emplace_back("empty", dpt::ckpt::make_tensor(DType::f32, {0, 4}, nullptr));
  return c;
}

void dump(const dpt::ckpt::Checkpoint& c) {
  std::string out = "{\"metadata\":{";
  for (const auto& [k, v] : c.metadata)
    out += (out.back() == '{' ? "" : ",") + dpt::json_quote(k) + ":" + dpt::json_quote(v);
  out += "},\"tensors\":[";
  for (const auto& [name, t] : c.tensors) {
    if (out.back() != '[') out += ',';
    out += "{\"name\":" + dpt::json_quote(name) + ",\"dtype\":\"" + dpt::ckpt::safetensors_name(t.dtype) +
           "\",\"shape\":[";
    for (size_t i = 0; i < t.shape.size(); ++i) out += (i ? "," : "") + std::to_string(t.shape[i]);
    out += "],\"hex\":\"";
    for (uint8_t byte : t.data) {
      char buf[3];
      std::snprintf(buf, sizeof buf, "%02x", byte);
      out += buf;
    }
    out += "\"}";
  }
  std::printf("%s]}\n", out.c_str());
}

}  // namespace

// `forward CKPT OUT`: the model a dptrain checkpoint describes (its metadata's model
// and act), with the checkpoint's weights and buffers, applied in evaluation mode on the
// CPU to a fixed input; writes {"x", "y"} to OUT for tests/torch_interop.py to compare
// with PyTorch.
void forward(const std::string& path, const std::string& out) {
  const dpt::ckpt::Checkpoint c = dpt::ckpt::load(path);
  const auto spec = c.metadata.at("model");
  const auto act = dpt::nn::parse_act(c.metadata.at("act"));
  const bool image = dpt::nn::is_cnn_spec(spec);
  std::shared_ptr<dpt::nn::Module> model = image ? dpt::nn::cnn(spec, act) : dpt::nn::mlp(spec, act);
  const dpt::Device cpu{dpt::DeviceType::cpu, 0};
  model->to(cpu, 0);
  model->eval();
  auto fetch = [&](const std::string& name, const dpt::Tensor& into) {
    const dpt::ckpt::HostTensor* t = c.find(name);
    if (!t) throw dpt::Error("no tensor " + name);
    std::vector<float> v(static_cast<size_t>(into.numel()));
    std::memcpy(v.data(), t->data.data(), v.size() * sizeof(float));
    dpt::copy(into, dpt::Tensor::from_host(v, into.shape(), cpu));
  };
  for (auto& [name, p] : model->named_parameters()) fetch(name, p->value);
  for (auto& [name, b] : model->named_buffers()) fetch(name, b->value);
  dpt::Shape in{8};
  if (image) {
    const auto input = dpt::nn::parse_cnn_spec(spec).input;
    for (int64_t d : input) in.push_back(d);
  } else {
    in.push_back(dpt::nn::parse_mlp_spec(spec).front());
  }
  dpt::Tensor x = dpt::Tensor::empty(in, dpt::DType::f32, cpu);
  dpt::normal_(x, 123, 0, 0);
  dpt::NoGradGuard g;
  const dpt::Tensor y = model->forward(x);
  dpt::ckpt::Checkpoint o;
  const auto xs = x.to_host(), ys = y.to_host();
  o.tensors.emplace_back("x", dpt::ckpt::make_tensor(DType::f32, x.shape().vec(), xs.data()));
  o.tensors.emplace_back("y", dpt::ckpt::make_tensor(DType::f32, y.shape().vec(), ys.data()));
  dpt::ckpt::save(out, o);
}

int main(int argc, char** argv) {
  const std::string verb = argc >= 3 ? argv[1] : "";
  if (!((verb == "write" || verb == "dump") && argc == 3) && !(verb == "forward" && argc == 4)) {
    std::fprintf(stderr, "usage: checkpoint_tool write|dump PATH | forward CKPT OUT\n");
    return 2;
  }
  try {
    if (verb == "write") dpt::ckpt::save(argv[2], fixed());
    else if (verb == "forward") forward(argv[2], argv[3]);
    else dump(dpt::ckpt::load(argv[2]));
  } catch (const dpt::Error& e) {
    std::fprintf(stderr, "checkpoint_tool: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
