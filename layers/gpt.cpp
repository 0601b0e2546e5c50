#include <dptrain/layers/gpt.hpp>

#include <charconv>
#include <cmath>
#include <utility>

#include <dptrain/error.hpp>
#include <dptrain/runtime/autograd.hpp>
#include <dptrain/runtime/ops.hpp>

namespace dpt::nn {

namespace {

constexpr float kInitStd = 0.02f;  // GPT-2's weights and embeddings
// The largest size a spec may give (a bound well past any GPT that fits a GPU, so that the
// products of sizes stay far from overflowing).
constexpr int64_t kMaxSize = int64_t{1} << 20;
constexpr int64_t kMaxHeadSize = 128;  // what causal_attention computes

struct Preset {
  const char* name;
  GptConfig config;
};
constexpr Preset kPresets[] = {
    {"gpt2", {12, 12, 768, 1024, 50257}},
    {"gpt2-medium", {24, 16, 1024, 1024, 50257}},
    {"gpt2-large", {36, 20, 1280, 1024, 50257}},
    {"gpt2-xl", {48, 25, 1600, 1024, 50257}},
};

[[noreturn]] void bad_spec(const std::string& spec, const std::string& why) {
  throw UsageError("model spec '" + spec + "': " + why +
                   " (a GPT is gpt2, gpt2-medium, gpt2-large, gpt2-xl or gpt:L<layers>-H<heads>-C<width>-T<context>-"
                   "V<vocabulary>, e.g. gpt:L4-H4-C128-T256-V512)");
}

// The spec's fields in order: "L4-H4-C128-T256-V512".
GptConfig parse_fields(const std::string& spec, std::string_view body) {
  GptConfig c;
  int64_t* fields[] = {&c.layers, &c.heads, &c.width, &c.context, &c.vocab};
  const char letters[] = {'L', 'H', 'C', 'T', 'V'};
  size_t at = 0;
  for (size_t f = 0; f < 5; ++f) {
    if (f > 0) {
      if (at >= body.size() || body[at] != '-') bad_spec(spec, "expected '-' before " + std::string(1, letters[f]));
      ++at;
    }
    if (at >= body.size() || body[at] != letters[f]) bad_spec(spec, "expected " + std::string(1, letters[f]));
    ++at;
    const auto [end, ec] = std::from_chars(body.data() + at, body.data() + body.size(), *fields[f]);
    if (ec != std::errc() || end == body.data() + at)
      bad_spec(spec, "expected a whole number after " + std::string(1, letters[f]));
    at = static_cast<size_t>(end - body.data());
  }
  if (at != body.size()) bad_spec(spec, "unexpected '" + std::string(body.substr(at)) + "' at the end");
  return c;
}

void check_sizes(const std::string& spec, const GptConfig& c) {
  const std::pair<const char*, int64_t> sizes[] = {
      {"layers", c.layers}, {"heads", c.heads}, {"width", c.width}, {"context", c.context}, {"vocabulary", c.vocab}};
  for (const auto& [what, v] : sizes)
    if (v < 1 || v > kMaxSize)
      bad_spec(spec, std::string(what) + " " + std::to_string(v) + " outside [1, " + std::to_string(kMaxSize) + "]");
  if (c.width % c.heads != 0)
    bad_spec(spec,
             "the width " + std::to_string(c.width) + " is not a multiple of the heads " + std::to_string(c.heads));
  if (c.width / c.heads > kMaxHeadSize)
    bad_spec(spec, "a head of " + std::to_string(c.width / c.heads) + " channels (width / heads); at most " +
                       std::to_string(kMaxHeadSize));
}

}  // namespace

bool is_gpt_spec(const std::string& spec) {
  for (const Preset& p : kPresets)
    if (spec == p.name) return true;
  return spec.rfind("gpt:", 0) == 0;
}

GptConfig parse_gpt_spec(const std::string& spec) {
  for (const Preset& p : kPresets)
    if (spec == p.name) return p.config;
  if (spec.rfind("gpt:", 0) != 0) bad_spec(spec, "not a GPT");
  GptConfig c = parse_fields(spec, std::string_view(spec).substr(4));
  check_sizes(spec, c);
  return c;
}

std::string gpt_spec_str(const GptConfig& c) {
  return "gpt:L" + std::to_string(c.layers) + "-H" + std::to_string(c.heads) + "-C" + std::to_string(c.width) + "-T" +
         std::to_string(c.context) + "-V" + std::to_string(c.vocab);
}

// ---- Embedding ------------------------------------------------------------------------

Embedding::Embedding(int64_t vocab_rows, int64_t context, int64_t width)
    : rows_(vocab_rows),
      context_(context),
      width_(width),
      wte_(register_parameter("wte.weight", {vocab_rows, width}, 0.0f)),
      wpe_(register_parameter("wpe.weight", {context, width}, 0.0f)) {
  wte_.init_std = kInitStd;
  wpe_.init_std = kInitStd;
}

Tensor Embedding::forward(const Tensor& tokens) { return embedding(tokens, wte_.value, wpe_.value, compute_dtype()); }

Tensor Embedding::forward_at(const Tensor& tokens, int64_t first_position) {
  return embedding_at(tokens, wte_.value, wpe_.value, first_position, compute_dtype());
}

std::shared_ptr<Module> Embedding::clone() const { return std::make_shared<Embedding>(rows_, context_, width_); }

std::string Embedding::describe() const {
  return "Embedding(" + std::to_string(rows_) + " + " + std::to_string(context_) + ", " + std::to_string(width_) + ")";
}

// ---- LayerNorm ------------------------------------------------------------------------

LayerNorm::LayerNorm(int64_t width)
    : width_(width),
      weight_(register_parameter("weight", {width}, 0.0f, 1.0f)),
      bias_(register_parameter("bias", {width}, 0.0f)) {}

Tensor LayerNorm::forward(const Tensor& x) { return layer_norm(x, weight_.value, bias_.value); }

AddNorm LayerNorm::forward(const Residual& stream, bool ones_column) {
  if (!stream.delta.defined()) return {stream.x, layer_norm(stream.x, weight_.value, bias_.value, 1e-5f, ones_column)};
  return add_layer_norm(stream.x, stream.delta, weight_.value, bias_.value, 1e-5f, ones_column);
}

std::shared_ptr<Module> LayerNorm::clone() const { return std::make_shared<LayerNorm>(width_); }

std::string LayerNorm::describe() const { return "LayerNorm(" + std::to_string(width_) + ")"; }

SavedInput LayerNorm::output_from(const Tensor& x, bool ones_column) const {
  return layer_norm_of(x, weight_.value, bias_.value, 1e-5f, ones_column);
}

// ---- Attention and blocks -----------------------------------------------------------

Tensor SequenceModule::forward(const Tensor&) {
  throw UsageError(describe() + " needs the sequence length beside its input: call forward(x, T)");
}

std::string SequenceModule::describe() const {
  return std::string(name_) + "(" + std::to_string(sizes_.width) + ", heads " + std::to_string(sizes_.heads) + ")";
}

namespace {
// Linear::forward through linear_pre / linear_bf16_pre: with what its node keeps for x, and
// the pre-activation beside the output (ones_column: x is bf16 with one).
LinearOut linear_forward(Linear& layer, const Tensor& x, const SavedInput& x_saved, bool ones_column = false) {
  if (!layer.computes_bf16()) return linear_pre(x, layer.weight(), layer.bias(), layer.act(), x_saved);
  return linear_bf16_pre(cast(x, DType::bf16), layer.weight(), layer.bias(), layer.weight_bf16(), layer.bias_bf16(),
                         layer.act(), x_saved, ones_column);
}

// The residual projections' std: GPT-2 scales them by 1/sqrt(2 L), one for each of the two
// residual adds a block makes.
float residual_std(int64_t layers) { return kInitStd / std::sqrt(2.0f * static_cast<float>(layers)); }
}  // namespace

CausalSelfAttention::CausalSelfAttention(const BlockSizes& s)
    : SequencePart("CausalSelfAttention", s),
      c_attn_(std::make_shared<Linear>(s.width, 3 * s.width)),
      c_proj_(std::make_shared<Linear>(s.width, s.width)) {
  c_attn_->init_normal(kInitStd);
  c_proj_->init_normal(residual_std(s.layers));
  register_module(c_attn_, "c_attn");
  register_module(c_proj_, "c_proj");
}

Tensor CausalSelfAttention::forward(const Tensor& x, int64_t T) { return forward(x, T, SavedInput{}); }

Tensor CausalSelfAttention::forward(const Tensor& x, int64_t T, const SavedInput& x_saved, bool ones_column) {
  const Tensor qkv = linear_forward(*c_attn_, x, x_saved, ones_column).y;
  return c_proj_->forward(
      causal_attention(qkv, T, sizes().heads, attention_backward_ == AttentionBackward::deterministic));
}

Tensor CausalSelfAttention::forward_cached(const Tensor& x, const Tensor& keys, const Tensor& values, int64_t start) {
  return c_proj_->forward(attention_decode(c_attn_->forward(x), keys, values, start));
}

Block::Block(const BlockSizes& s)
    : SequencePart("Block", s),
      ln_1_(std::make_shared<LayerNorm>(s.width)),
      ln_2_(std::make_shared<LayerNorm>(s.width)),
      attn_(std::make_shared<CausalSelfAttention>(s)),
      c_fc_(std::make_shared<Linear>(s.width, 4 * s.width, Act::gelu_tanh)),
      c_proj_(std::make_shared<Linear>(4 * s.width, s.width)) {
  c_fc_->init_normal(kInitStd);
  c_proj_->init_normal(residual_std(s.layers));
  register_module(ln_1_, "ln_1");
  register_module(attn_, "attn");
  register_module(ln_2_, "ln_2");
  register_module(c_fc_, "mlp.c_fc");
  register_module(c_proj_, "mlp.c_proj");
}

Tensor Block::forward(const Tensor& x, int64_t T) {
  const Residual out = forward(Residual{x, Tensor()}, T);
  return add(out.x, out.delta);
}

Residual Block::forward(const Residual& stream, int64_t T) {
  // Recomputing with gelu+ln, c_attn and c_fc keep their LayerNorm's input (which its own
  // node keeps) instead of its output; recomputing at all, c_proj keeps c_fc's pre-activation
  // instead of the GELU's output. The outputs are then freed as soon as their reader is done.
  const bool ln_inputs = recompute_ == Recompute::gelu_ln;
  // A bf16 stream's LayerNorms give c_attn and c_fc a ones column, from which their weight
  // gradients' GEMMs make the bias gradients too (ops.hpp's ones_column_width).
  const bool ones = stream.x.dtype() == DType::bf16 && c_fc_->computes_bf16();
  // Each LayerNorm's output and the attention's are let go once read (the nodes that save
  // them keep them), as the temporaries of nested calls would be.
  AddNorm x = ln_1_->forward(stream, ones);
  Tensor attn =
      attn_->forward(std::exchange(x.normed, {}), T, ln_inputs ? ln_1_->output_from(x.sum, ones) : SavedInput{}, ones);
  AddNorm h = ln_2_->forward(Residual{std::move(x.sum), std::move(attn)}, ones);
  const SavedInput saved = ln_inputs ? ln_2_->output_from(h.sum, ones) : SavedInput{};
  return {h.sum, mlp(std::exchange(h.normed, {}), saved, recompute_ == Recompute::none, ones)};
}

Tensor Block::forward_cached(const Tensor& x, const Tensor& keys, const Tensor& values, int64_t start) {
  const Tensor h = add(x, attn_->forward_cached(ln_1_->forward(x), keys, values, start));
  return add(h, mlp(ln_2_->forward(h), SavedInput{}, true));  // no backward: the GELU of the fp32 sum
}

Tensor Block::mlp(const Tensor& x, const SavedInput& x_saved, bool plain, bool ones_column) {
  if (c_fc_->computes_bf16())
    return gelu_mlp_bf16(cast(x, DType::bf16),
                         {c_fc_->weight(), c_fc_->bias(), c_fc_->weight_bf16(), c_fc_->bias_bf16()},
                         {c_proj_->weight(), c_proj_->bias(), c_proj_->weight_bf16(), c_proj_->bias_bf16()}, plain,
                         x_saved, ones_column);
  if (plain) return c_proj_->forward(c_fc_->forward(x));
  const LinearOut fc = linear_forward(*c_fc_, x, x_saved);
  return linear_forward(*c_proj_, fc.y, act_of(fc.z, c_fc_->act())).y;
}

// ---- GPT ------------------------------------------------------------------------------

GPT::GPT(const GptConfig& config)
    : config_(config),
      embed_(std::make_shared<Embedding>(config.padded_vocab(), config.context, config.width)),
      ln_f_(std::make_shared<LayerNorm>(config.width)) {
  check_sizes(gpt_spec_str(config), config);
  embed_->wte().uses = 2;  // the token embedding is the output projection too
  register_module(embed_, "transformer");
  for (int64_t l = 0; l < config.layers; ++l) {
    blocks_.push_back(std::make_shared<Block>(BlockSizes{config.width, config.heads, config.layers}));
    register_module(blocks_.back(), "transformer.h." + std::to_string(l));
  }
  register_module(ln_f_, "transformer.ln_f");
  // Weight decay on matrices and embeddings only, as nanoGPT and llm.c group them.
  for (Parameter* p : parameters()) p->decay = p->shape.size() >= 2;
}

Tensor GPT::forward(const Tensor& tokens) {
  DPT_REQUIRE(tokens.defined() && tokens.dim() == 2 && tokens.dtype() == DType::i32,
              "GPT: expected tokens i32 [batch, sequence], got " +
                  (tokens.defined() ? std::string(dtype_name(tokens.dtype())) + " " + shape_str(tokens.shape())
                                    : std::string("none")));
  const int64_t T = tokens.size(1);
  if (T < 1 || T > config_.context)
    throw UsageError("GPT: a sequence of " + std::to_string(T) + " tokens; the model's context is " +
                     std::to_string(config_.context));
  Residual stream{embed_->forward(tokens), Tensor()};
  for (const auto& b : blocks_) stream = b->forward(stream, T);
  return output_logits(ln_f_->forward(stream).normed);
}

// ---- Decoding with a key-value cache ---------------------------------------------------

KvCache GPT::kv_cache(int64_t batch) const {
  const Tensor& wte = embed_->wte().value;
  DPT_REQUIRE(wte.defined(), "GPT: place the model on a device (to) before making its key-value cache");
  DPT_REQUIRE(batch >= 1, "GPT: a key-value cache for " + std::to_string(batch) + " sequences; at least 1");
  KvCache cache;
  const Shape shape{batch, config_.heads, config_.context, config_.width / config_.heads};
  for (int64_t l = 0; l < config_.layers; ++l) {
    cache.keys.push_back(Tensor::zeros(shape, compute_dtype(), wte.device()));
    cache.values.push_back(Tensor::zeros(shape, compute_dtype(), wte.device()));
  }
  return cache;
}

Tensor GPT::forward_cached(const Tensor& tokens, KvCache& cache, bool last_only) {
  DPT_REQUIRE(tokens.defined() && tokens.dim() == 2 && tokens.dtype() == DType::i32,
              "GPT: expected tokens i32 [batch, new positions]");
  const auto layers = static_cast<size_t>(config_.layers);
  DPT_REQUIRE(cache.keys.size() == layers && cache.values.size() == layers && cache.keys[0].dim() == 4 &&
                  cache.keys[0].size(0) == tokens.size(0) && cache.keys[0].size(2) == config_.context,
              "GPT: the key-value cache was not made for this model and " + std::to_string(tokens.size(0)) +
                  " sequences (GPT::kv_cache)");
  const int64_t batch = tokens.size(0), n = tokens.size(1), start = cache.length;
  if (n < 1 || start + n > config_.context)
    throw UsageError("GPT: " + std::to_string(n) + " new tokens after the " + std::to_string(start) +
                     " in the key-value cache; the model's context is " + std::to_string(config_.context));
  NoGradGuard no_grad;
  Tensor x = embed_->forward_at(tokens, start);
  for (size_t l = 0; l < layers; ++l) x = blocks_[l]->forward_cached(x, cache.keys[l], cache.values[l], start);
  cache.length = start + n;
  if (last_only) {  // each sequence's row n - 1
    Tensor last = Tensor::empty({batch, config_.width}, x.dtype(), x.device());
    for (int64_t b = 0; b < batch; ++b) copy_cast(last.rows(b, 1), x.rows(b * n + n - 1, 1));
    x = last;
  }
  return output_logits(ln_f_->forward(x));
}

Tensor GPT::output_logits(const Tensor& h) {
  // The output projection is the token embedding (tied): logits = h wte^T.
  const Parameter& wte = embed_->wte();
  if (wte.shadow.defined()) return linear_bf16(cast(h, DType::bf16), wte.value, Tensor(), wte.shadow, Tensor());
  return linear(h, wte.value, Tensor());
}

void GPT::set_recompute(Recompute r) {
  recompute_ = r;
  for (const auto& b : blocks_) b->set_recompute(r);
}

void GPT::set_attention_backward(AttentionBackward a) {
  attention_backward_ = a;
  for (const auto& b : blocks_) b->set_attention_backward(a);
}

std::shared_ptr<Module> GPT::clone() const {
  auto copy = std::make_shared<GPT>(config_);
  copy->set_recompute(recompute_);
  copy->set_attention_backward(attention_backward_);
  return copy;
}

std::string GPT::describe() const { return "GPT(" + gpt_spec_str(config_) + ")"; }

Tensor lm_loss(const Tensor& logits, const Tensor& targets, int64_t vocab) {
  return classifier_loss(logits, targets.reshape({targets.numel()}), vocab);
}

std::shared_ptr<GPT> gpt(const GptConfig& config) { return std::make_shared<GPT>(config); }

}  // namespace dpt::nn
