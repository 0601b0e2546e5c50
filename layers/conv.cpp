#include <dptrain/layers/conv.hpp>

#include <charconv>
#include <cmath>
#include <string_view>

#include <dptrain/error.hpp>
#include <dptrain/runtime/ops.hpp>

namespace dpt::nn {

Conv2d::Conv2d(int64_t in, int64_t out, int64_t kernel, int64_t stride, int64_t pad, int64_t dilation, Act act,
               bool bias)
    : in_(in),
      out_(out),
      kernel_(kernel),
      stride_(stride),
      pad_(pad),
      dilation_(dilation),
      act_(act),
      W_(register_parameter("weight", {out, in, kernel, kernel},
                            1.0f / std::sqrt(static_cast<float>(in * kernel * kernel)))) {
  DPT_REQUIRE(in > 0 && out > 0 && kernel > 0 && stride > 0 && pad >= 0 && dilation > 0,
              "Conv2d needs positive sizes, stride and dilation");
  if (bias) b_ = &register_parameter("bias", {out}, 1.0f / std::sqrt(static_cast<float>(in * kernel * kernel)));
}

Tensor Conv2d::forward(const Tensor& x) {
  Tensor y = conv2d(x, W_.value, b_ ? b_->value : Tensor(), stride_, pad_, dilation_);
  return act_ == Act::none ? y : activation(y, act_);
}

std::shared_ptr<Module> Conv2d::clone() const {
  return std::make_shared<Conv2d>(in_, out_, kernel_, stride_, pad_, dilation_, act_, b_ != nullptr);
}

std::string Conv2d::describe() const {
  std::string s = "Conv2d(" + std::to_string(in_) + ", " + std::to_string(out_) + ", " + std::to_string(kernel_);
  if (stride_ != 1) s += ", stride " + std::to_string(stride_);
  if (pad_ != 0) s += ", padding " + std::to_string(pad_);
  if (dilation_ != 1) s += ", dilation " + std::to_string(dilation_);
  return s + (act_ != Act::none ? std::string(", ") + act_name(act_) : "") + ")";
}

Pool2d::Pool2d(Pool kind, int64_t kernel, int64_t stride, int64_t pad)
    : kind_(kind), kernel_(kernel), stride_(stride), pad_(pad) {
  DPT_REQUIRE(kernel >= 0 && stride > 0 && pad >= 0 && (kernel > 0 || kind == Pool::avg),
              "Pool2d needs a positive window and stride");
}

std::shared_ptr<Pool2d> Pool2d::global_avg() { return std::make_shared<Pool2d>(Pool::avg, 0, 1); }

Tensor Pool2d::forward(const Tensor& x) {
  if (kernel_ == 0) {
    DPT_REQUIRE(x.dim() == 4, "global average pooling: expected [n, c, h, w], got " + shape_str(x.shape()));
    return pool2d(x, Pool::avg, x.size(2), x.size(3), 1);
  }
  return pool2d(x, kind_, kernel_, kernel_, stride_, pad_);
}

std::shared_ptr<Module> Pool2d::clone() const { return std::make_shared<Pool2d>(kind_, kernel_, stride_, pad_); }

std::string Pool2d::describe() const {
  if (kernel_ == 0) return "AdaptiveAvgPool2d(1)";
  // torch's default stride is the window.
  return std::string(kind_ == Pool::max ? "MaxPool2d(" : "AvgPool2d(") + std::to_string(kernel_) +
         (stride_ != kernel_ ? ", stride " + std::to_string(stride_) : "") +
         (pad_ != 0 ? ", padding " + std::to_string(pad_) : "") + ")";
}

BatchNorm2d::BatchNorm2d(int64_t channels, Act act, BatchNormArgs args)
    : channels_(channels),
      act_(act),
      args_(args),
      gamma_(register_parameter("weight", {channels}, 0.0f, 1.0f)),
      beta_(register_parameter("bias", {channels}, 0.0f)),
      mean_(register_buffer("running_mean", {channels}, 0.0f)),
      var_(register_buffer("running_var", {channels}, 1.0f)) {
  DPT_REQUIRE(channels > 0, "BatchNorm2d needs a positive channel count");
  if (!(args.eps > 0.0f && std::isfinite(args.eps) && args.momentum >= 0.0f && args.momentum <= 1.0f))
    throw UsageError("BatchNormArgs: eps must be a positive number and momentum in [0, 1], got eps " +
                     std::to_string(args.eps) + " and momentum " + std::to_string(args.momentum));
}

Tensor BatchNorm2d::forward(const Tensor& x) {
  Tensor y = batch_norm2d(x, gamma_.value, beta_.value, mean_.value, var_.value, training(), args_);
  return act_ == Act::none ? y : activation(y, act_);
}

std::shared_ptr<Module> BatchNorm2d::clone() const { return std::make_shared<BatchNorm2d>(channels_, act_, args_); }

std::string BatchNorm2d::describe() const {
  return "BatchNorm2d(" + std::to_string(channels_) + (act_ != Act::none ? std::string(", ") + act_name(act_) : "") +
         ")";
}

// ---- CNN specs -------------------------------------------------------------------------

namespace {

constexpr const char* kCnnSmall = "cnn:3x16x16-c16k3-p2-c32k3-p2-f10";
// The benchmark workload (BENCHMARKS.md, batch 256): a small VGG-style network on 32x32
// colour images, about 0.15 GFLOP per image forward.
constexpr const char* kCnnBench = "cnn:3x32x32-c64k3-bn-p2-c128k3-bn-p2-c256k3-bn-p2-g-f10";
constexpr const char* kGrammar = "cNkK[sS][pP][dD], bn, pK[sS][pP], aK[sS][pP], g or fN";

std::string size_str(const Shape& s) {
  return s.size() == 3 ? std::to_string(s[0]) + "x" + std::to_string(s[1]) + "x" + std::to_string(s[2])
                       : std::to_string(s[0]) + " features";
}

class SpecParser {
 public:
  explicit SpecParser(const std::string& spec) : spec_(spec) {}

  CnnSpec parse() {
    const std::string text = spec_ == "cnn-small" ? kCnnSmall : spec_ == "cnn" ? kCnnBench : spec_;
    if (text.rfind("cnn:", 0) != 0)
      throw bad("unknown CNN preset (expected cnn-small, cnn, or cnn:CxHxW-LAYER-...-fN with layers " +
                std::string(kGrammar) + ")");
    std::vector<std::string_view> tokens;
    std::string_view rest = std::string_view(text).substr(4);
    for (size_t dash; (dash = rest.find('-')) != std::string_view::npos; rest = rest.substr(dash + 1))
      tokens.push_back(rest.substr(0, dash));
    tokens.push_back(rest);
    CnnSpec out;
    out.input = input(tokens[0]);
    where_.clear();
    if (tokens.size() < 2) throw bad("no layers after the input " + std::string(tokens[0]));
    shape_ = out.input;
    for (size_t i = 1; i < tokens.size(); ++i) {
      token_ = tokens[i];
      where_ = "layer " + std::to_string(i) + " " + quote_value(token_) + ": ";
      out.layers.push_back(layer());
      out.layers.back().out = shape_;
    }
    if (out.layers.back().kind != CnnSpec::Kind::linear)
      throw bad("the last layer must be fN, the number of classes (got " + quote_value(token_) + ")");
    out.classes = out.layers.back().width;
    return out;
  }

 private:
  UsageError bad(const std::string& why) const {
    return UsageError("invalid model spec " + quote_value(spec_) + ": " + where_ + why);
  }

  // A whole decimal number in [lo, hi], read from the front of s (which moves past it).
  int64_t number(std::string_view& s, const char* what, int64_t lo, int64_t hi) const {
    int64_t v = 0;
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (end == s.data()) throw bad(std::string("expected a number for the ") + what + " in " + quote_value(token_));
    if (ec != std::errc() || v < lo || v > hi)
      throw bad(std::string("the ") + what + " must be " + std::to_string(lo) + ".." + std::to_string(hi));
    s.remove_prefix(static_cast<size_t>(end - s.data()));
    return v;
  }

  Shape input(std::string_view tok) {
    token_ = tok;
    where_ = "input " + quote_value(tok) + ": ";
    Shape s;
    for (const char* what : {"channels", "height", "width"}) {
      if (!s.empty()) {
        if (tok.empty() || tok[0] != 'x') throw bad("expected CxHxW, e.g. 3x32x32");
        tok.remove_prefix(1);
      }
      s.push_back(number(tok, what, 1, 65536));
    }
    if (!tok.empty()) throw bad("expected CxHxW, e.g. 3x32x32");
    return s;
  }

  // Reads the options that follow a layer's first number: letters from `allowed`, each
  // at most once, each with its number.
  void read_options(std::string_view s, const std::string& allowed, CnnSpec::Layer& l, bool* has_pad,
                    bool* has_kernel) {
    std::string seen;
    while (!s.empty()) {
      const char o = s[0];
      if (allowed.find(o) == std::string::npos || seen.find(o) != std::string::npos)
        throw bad(quote_value(token_) + " is not a layer (expected " + kGrammar + ")");
      seen += o;
      s.remove_prefix(1);
      for (const LayerOption& option : kLayerOptions)
        if (option.letter == o) l.*option.field = number(s, option.what, option.lowest, 1024);
      if (o == 'k') *has_kernel = true;
      if (o == 'p') *has_pad = true;
    }
  }

  // A layer's options: the letter, the field it sets, its name in errors and its least value.
  struct LayerOption {
    char letter;
    int64_t CnnSpec::Layer::*field;
    const char* what;
    int64_t lowest;
  };
  static constexpr LayerOption kLayerOptions[] = {{'k', &CnnSpec::Layer::kernel, "kernel size", 1},
                                                  {'s', &CnnSpec::Layer::stride, "stride", 1},
                                                  {'p', &CnnSpec::Layer::pad, "padding", 0},
                                                  {'d', &CnnSpec::Layer::dilation, "dilation", 1}};

  bool image() const { return shape_.size() == 3; }
  void need_image(const char* layer) const {
    if (!image())
      throw bad(std::string(layer) + " needs an image [C, H, W], but after a linear layer the input is " +
                size_str(shape_));
  }

  CnnSpec::Layer layer() {
    using Kind = CnnSpec::Kind;
    CnnSpec::Layer l{};
    l.stride = 1, l.dilation = 1;
    std::string_view s = token_;
    if (s == "bn") {
      need_image("batch norm");
      l.kind = Kind::batch_norm;
      return l;
    }
    if (s == "g") {
      need_image("global pooling");
      l.kind = Kind::global_pool;
      shape_ = {shape_[0], 1, 1};
      return l;
    }
    if (s.empty() || std::string_view("cpaf").find(s[0]) == std::string_view::npos)
      throw bad(quote_value(token_) + " is not a layer (expected " + kGrammar + ")");
    const char kind = s[0];
    s.remove_prefix(1);
    bool has_pad = false, has_kernel = false;
    if (kind == 'f') {
      l.kind = Kind::linear;
      l.width = number(s, "number of features", 1, 1 << 20);
      read_options(s, "", l, &has_pad, &has_kernel);
      shape_ = {l.width};
      return l;
    }
    if (kind == 'c') {
      need_image("a convolution");
      l.kind = Kind::conv;
      l.width = number(s, "number of channels", 1, 65536);
      read_options(s, "kspd", l, &has_pad, &has_kernel);
      if (!has_kernel) throw bad("a convolution needs its kernel size: cNkK, e.g. c32k3");
      if (!has_pad) l.pad = l.dilation * (l.kernel - 1) / 2;  // "same" at stride 1 for odd kernels
      fit(l, l.dilation * (l.kernel - 1) + 1,
          "kernel " + std::to_string(l.kernel) +
              (l.dilation > 1 ? " (dilation " + std::to_string(l.dilation) + ")" : ""));
      shape_ = {l.width, out_size(shape_[1], l), out_size(shape_[2], l)};
      return l;
    }
    need_image(kind == 'p' ? "max pooling" : "average pooling");
    l.kind = kind == 'p' ? Kind::max_pool : Kind::avg_pool;
    l.kernel = number(s, "window size", 1, 1024);
    l.stride = l.kernel;
    read_options(s, "sp", l, &has_pad, &has_kernel);
    if (2 * l.pad > l.kernel)
      throw bad("padding " + std::to_string(l.pad) + " is more than half the window " + std::to_string(l.kernel));
    fit(l, l.kernel, "window " + std::to_string(l.kernel));
    shape_ = {shape_[0], out_size(shape_[1], l), out_size(shape_[2], l)};
    return l;
  }

  // Refuses a window of `extent` (what it is: `what`) larger than the padded image.
  void fit(const CnnSpec::Layer& l, int64_t extent, const std::string& what) const {
    if (extent > shape_[1] + 2 * l.pad || extent > shape_[2] + 2 * l.pad)
      throw bad(what + " does not fit the input " + size_str(shape_) + " with padding " + std::to_string(l.pad) +
                " (the padded image must be at least " + std::to_string(extent) + "x" + std::to_string(extent) + ")");
  }

  static int64_t out_size(int64_t in, const CnnSpec::Layer& l) {
    const int64_t extent = l.kind == CnnSpec::Kind::conv ? l.dilation * (l.kernel - 1) + 1 : l.kernel;
    return (in + 2 * l.pad - extent) / l.stride + 1;
  }

  const std::string& spec_;
  std::string_view token_;
  std::string where_;
  Shape shape_;  // what reaches the next layer: [C, H, W], or [N] after a linear layer
};

}  // namespace

bool is_cnn_spec(const std::string& spec) { return spec.rfind("cnn", 0) == 0; }

CnnSpec parse_cnn_spec(const std::string& spec) { return SpecParser(spec).parse(); }

std::shared_ptr<Sequential> cnn(const std::string& spec, Act act) { return cnn(parse_cnn_spec(spec), act); }

std::shared_ptr<Sequential> cnn(const CnnSpec& s, Act act) {
  // A spec a program built by hand (parse_cnn_spec's are so already): what the loop below
  // relies on. Each layer checks its own sizes.
  if (s.input.size() != 3 || s.layers.empty() || s.layers.back().kind != CnnSpec::Kind::linear)
    throw UsageError("CnnSpec: an input [C, H, W] and layers that end in a linear one, got input " +
                     shape_str(s.input) + " and " + std::to_string(s.layers.size()) + " layer(s)");
  for (const CnnSpec::Layer& l : s.layers)
    if (l.out.empty() || (l.kind != CnnSpec::Kind::linear && l.out.size() != 3))
      throw UsageError("CnnSpec: each layer's out is its output's shape, [C, H, W] before the linear layers, got " +
                       shape_str(l.out));
  auto seq = std::make_shared<Sequential>();
  for (size_t i = 0; i < s.layers.size(); ++i) {
    const CnnSpec::Layer& l = s.layers[i];
    const Shape& in = i == 0 ? s.input : s.layers[i - 1].out;
    const bool last = i + 1 == s.layers.size();
    switch (l.kind) {
      case CnnSpec::Kind::conv: {
        // Followed by batch norm, the activation moves after it: conv -> bn -> act.
        const bool bn_next = !last && s.layers[i + 1].kind == CnnSpec::Kind::batch_norm;
        seq->add(
            std::make_shared<Conv2d>(in[0], l.width, l.kernel, l.stride, l.pad, l.dilation, bn_next ? Act::none : act));
        break;
      }
      case CnnSpec::Kind::batch_norm: {
        const bool after_conv = i > 0 && s.layers[i - 1].kind == CnnSpec::Kind::conv;
        seq->add(std::make_shared<BatchNorm2d>(in[0], after_conv ? act : Act::none));
        break;
      }
      case CnnSpec::Kind::max_pool:
      case CnnSpec::Kind::avg_pool:
        seq->add(std::make_shared<Pool2d>(l.kind == CnnSpec::Kind::max_pool ? Pool::max : Pool::avg, l.kernel, l.stride,
                                          l.pad));
        break;
      case CnnSpec::Kind::global_pool:
        seq->add(Pool2d::global_avg());
        break;
      case CnnSpec::Kind::linear:
        if (in.size() == 3) seq->add(std::make_shared<Flatten>());  // the first linear layer
        seq->add(std::make_shared<Linear>(numel(in), l.width, last ? Act::none : act));
        break;
    }
  }
  return seq;
}

}  // namespace dpt::nn
