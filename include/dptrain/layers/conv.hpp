// Convolutional layers over NCHW tensors (Conv2d, pooling, BatchNorm2d, Flatten), each
// the twin of its torch.nn namesake, and CNNs built from a spec string:
//
//   cnn:CxHxW-LAYER-LAYER-...-fN        e.g. cnn:3x32x32-c32k3-p2-c64k3-p2-f10
//
//   CxHxW           the input image: channels, height, width
//   cNkK[sS][pP][dD] Conv2d to N channels, KxK kernel, stride S (1), padding P
//                   (default D*(K-1)/2: "same" size at stride 1 for odd K), dilation D
//                   (1); followed by the activation
//   bn              BatchNorm2d; right after a convolution it goes between the
//                   convolution and its activation
//   pK[sS][pP]      MaxPool2d, KxK window, stride S (default K), padding P (0, at most K/2)
//   aK[sS][pP]      AvgPool2d, the same (padding counts as zeros: count_include_pad)
//   g               global average pooling to [C, 1, 1] (AdaptiveAvgPool2d(1))
//   fN              Linear to N features, a Flatten inserted before the first; followed
//                   by the activation, except the last layer: the spec ends with fN, the
//                   number of classes
//
// Presets: cnn-small = cnn:3x16x16-c16k3-p2-c32k3-p2-f10.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include <dptrain/layers/layers.hpp>
#include <dptrain/layers/module.hpp>
#include <dptrain/runtime/ops.hpp>
#include <dptrain/types.hpp>

namespace dpt::nn {

// torch.nn.Conv2d with a KxK kernel (+ a fused activation): weight [out, in, K, K] and
// bias [out], initialized as torch does: uniform in +-1/sqrt(in * K * K).
class Conv2d : public Module {
 public:
  Conv2d(int64_t in, int64_t out, int64_t kernel, int64_t stride = 1, int64_t pad = 0, int64_t dilation = 1,
         Act act = Act::none, bool bias = true);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<Module> clone() const override;
  std::string describe() const override;
  int torch_modules() const override { return act_ == Act::none ? 1 : 2; }
  const Tensor& weight() const { return W_.value; }

 private:
  int64_t in_, out_, kernel_, stride_, pad_, dilation_;
  Act act_;
  Parameter& W_;
  Parameter* b_ = nullptr;
};

// torch.nn.MaxPool2d / AvgPool2d (count_include_pad=True) with a KxK window, or, made
// by global_avg(), average pooling over the whole image to [n, c, 1, 1]
// (torch.nn.AdaptiveAvgPool2d(1)).
class Pool2d : public Module {
 public:
  Pool2d(Pool kind, int64_t kernel, int64_t stride, int64_t pad = 0);
  static std::shared_ptr<Pool2d> global_avg();
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<Module> clone() const override;
  std::string describe() const override;

 private:
  Pool kind_;
  int64_t kernel_, stride_, pad_;  // kernel 0: the whole image
};

// torch.nn.BatchNorm2d (+ a fused activation): weight (ones) and bias (zeros) [c];
// buffers running_mean (zeros) and running_var (ones) [c]. Training normalizes with
// the batch's statistics and updates the running ones; evaluation uses the running ones.
// torch's num_batches_tracked is not kept: the momentum is fixed, and torch fills it in
// when a checkpoint lacks it.
class BatchNorm2d : public Module {
 public:
  explicit BatchNorm2d(int64_t channels, Act act = Act::none, BatchNormArgs args = {});
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<Module> clone() const override;
  std::string describe() const override;
  int torch_modules() const override { return act_ == Act::none ? 1 : 2; }
  const Tensor& running_mean() const { return mean_.value; }
  const Tensor& running_var() const { return var_.value; }

 private:
  int64_t channels_;
  Act act_;
  BatchNormArgs args_;
  Parameter &gamma_, &beta_;
  Buffer &mean_, &var_;
};

// torch.nn.Flatten: [n, ...] -> [n, rest].
class Flatten : public Module {
 public:
  Tensor forward(const Tensor& x) override { return flatten(x); }
  std::shared_ptr<Module> clone() const override { return std::make_shared<Flatten>(); }
  std::string describe() const override { return "Flatten"; }
};

// A CNN spec parsed and checked against its input: every layer fits the shape that
// reaches it.
struct CnnSpec {
  enum class Kind { conv, batch_norm, max_pool, avg_pool, global_pool, linear };
  struct Layer {
    Kind kind;
    int64_t width = 0;  // output channels (conv) or features (linear)
    int64_t kernel = 0, stride = 1, pad = 0, dilation = 1;
    Shape out;  // the shape after it: [C, H, W], or [N] after a linear layer
  };
  Shape input;  // [C, H, W]
  std::vector<Layer> layers;
  int64_t classes = 0;  // the last layer's features
};

// Whether a model spec names a CNN (cnn:... or a CNN preset) rather than an MLP.
bool is_cnn_spec(const std::string& spec);

// Throws UsageError with one line naming the layer (its place and text) and the shapes
// when the spec is malformed or a layer does not fit its input.
CnnSpec parse_cnn_spec(const std::string& spec);

// The CNN of a spec, `act` after every convolution and hidden linear layer.
std::shared_ptr<Sequential> cnn(const std::string& spec, Act act = Act::relu);
std::shared_ptr<Sequential> cnn(const CnnSpec& spec, Act act = Act::relu);

}  // namespace dpt::nn
