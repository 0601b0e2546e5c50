#include <dptrain/layers/layers.hpp>

#include <algorithm>
#include <charconv>
#include <cmath>

#include <dptrain/error.hpp>
#include <dptrain/runtime/ops.hpp>

namespace dpt::nn {

const char* act_name(Act act) { return kActNames.name(act); }
Act parse_act(const std::string& name) { return kActNames.parse(name); }

Linear::Linear(int64_t in, int64_t out, Act act, bool bias)
    : in_(in),
      out_(out),
      act_(act),
      W_(register_parameter("weight", {out, in}, 1.0f / std::sqrt(static_cast<float>(in)))) {
  DPT_REQUIRE(in > 0 && out > 0, "Linear needs positive sizes");
  if (bias) b_ = &register_parameter("bias", {out}, 1.0f / std::sqrt(static_cast<float>(in)));
}

Tensor Linear::forward(const Tensor& x) {
  if (!W_.shadow.defined()) return linear(x, W_.value, bias(), act_);
  // bf16 compute: an f32 input (the data, or a CNN's Flatten) is rounded to bf16 first
  // (differentiably: its gradient returns as f32).
  return linear_bf16(cast(x, DType::bf16), W_.value, bias(), W_.shadow, bias_bf16(), act_);
}

Linear& Linear::init_normal(float std) {
  W_.init_std = std;
  if (b_) b_->init_bound = 0.0f;
  return *this;
}

std::shared_ptr<Module> Linear::clone() const { return std::make_shared<Linear>(in_, out_, act_, b_ != nullptr); }

std::string Linear::describe() const {
  return "Linear(" + std::to_string(in_) + ", " + std::to_string(out_) +
         (act_ != Act::none ? std::string(", ") + act_name(act_) : "") + ")";
}

Tensor Activation::forward(const Tensor& x) { return activation(x, act_); }
std::string Activation::describe() const { return act_name(act_); }

Sequential& Sequential::add(std::shared_ptr<Module> m) {
  register_module(std::move(m));
  return *this;
}

Tensor Sequential::forward(const Tensor& x) {
  const auto& ch = children();
  Tensor h = x;
  for (size_t i = 0; i < ch.size();) {
    // Two or more fp32 Linear children in a row, as one op where it fits (a tiny MLP's
    // layers in one kernel: linear_chain), after the hook of each of them.
    size_t end = i;
    std::vector<LinearLayer> run;
    for (; end < ch.size(); ++end) {
      const auto* lin = dynamic_cast<const Linear*>(ch[end].get());
      if (!lin || lin->computes_bf16()) break;
      run.push_back({lin->weight(), lin->bias(), lin->act()});
    }
    const auto hooks = [&] {
      for (size_t k = i; k < end; ++k) before_child(k);
    };
    if (run.size() >= 2)
      if (Tensor y = linear_chain(h, run, hooks); y.defined()) {
        h = y;
        i = end;
        continue;
      }
    for (end = std::max(end, i + 1); i < end; ++i) {
      before_child(i);
      h = ch[i]->forward(h);
    }
  }
  return h;
}

std::shared_ptr<Module> Sequential::clone() const {
  auto s = std::make_shared<Sequential>();
  for (auto& m : children()) s->add(m->clone());
  return s;
}

std::vector<std::pair<std::string, Parameter*>> Sequential::named_parameters(const std::string& prefix) {
  std::vector<std::pair<std::string, Parameter*>> out;
  int index = 0;  // numbered like torch.nn.Sequential, fused activations counted
  for (auto& m : children()) {
    for (auto& np : m->named_parameters(prefix + std::to_string(index) + ".")) out.push_back(np);
    index += m->torch_modules();
  }
  return out;
}

std::vector<std::pair<std::string, Buffer*>> Sequential::named_buffers(const std::string& prefix) {
  std::vector<std::pair<std::string, Buffer*>> out;
  int index = 0;  // numbered as named_parameters() numbers them
  for (auto& m : children()) {
    for (auto& nb : m->named_buffers(prefix + std::to_string(index) + ".")) out.push_back(nb);
    index += m->torch_modules();
  }
  return out;
}

int Sequential::torch_modules() const { return 1; }

std::string Sequential::describe() const {
  std::string s = "Sequential(";
  for (size_t i = 0; i < children().size(); ++i) s += (i ? ", " : "") + children()[i]->describe();
  return s + ")";
}

std::vector<int64_t> parse_mlp_spec(const std::string& spec_in) {
  const std::string spec = spec_in == "seed" ? "1000-1000" : spec_in == "mlp" ? "1024-4096x3-1024" : spec_in;
  auto bad = [&](const std::string& why) {
    return UsageError("invalid model spec " + quote_value(spec_in) + ": " + why +
                      " (expected widths like 1024-4096x3-1024, or seed, mlp)");
  };
  auto number = [&](std::string_view s, const char* what) {
    int64_t v = 0;
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (s.empty() || ec != std::errc() || end != s.data() + s.size()) throw bad(quote_value(s) + " is not a " + what);
    return v;
  };
  std::vector<int64_t> widths;
  std::string_view rest = spec;
  while (true) {
    const size_t dash = rest.find('-');
    std::string_view tok = rest.substr(0, dash);
    int64_t repeat = 1;
    if (const size_t x = tok.find('x'); x != std::string_view::npos) {
      repeat = number(tok.substr(x + 1), "repeat count");
      tok = tok.substr(0, x);
      if (repeat < 1 || repeat > 1000) throw bad("a repeat count must be 1..1000");
    }
    const int64_t w = number(tok, "width");
    if (w < 1 || w > (int64_t(1) << 20)) throw bad("a width must be 1..1048576");
    for (int64_t i = 0; i < repeat; ++i) widths.push_back(w);
    if (dash == std::string_view::npos) break;
    rest = rest.substr(dash + 1);
  }
  if (widths.size() < 2) throw bad("it needs at least an input and an output width");
  return widths;
}

std::shared_ptr<Sequential> mlp(const std::string& spec, Act act) { return mlp(parse_mlp_spec(spec), act); }

std::shared_ptr<Sequential> mlp(const std::vector<int64_t>& w, Act act) {
  DPT_REQUIRE(w.size() >= 2, "mlp: it needs at least an input and an output width");
  auto seq = std::make_shared<Sequential>();
  for (size_t i = 0; i + 1 < w.size(); ++i)
    seq->add(std::make_shared<Linear>(w[i], w[i + 1], i + 2 < w.size() ? act : Act::none));
  return seq;
}

}  // namespace dpt::nn
