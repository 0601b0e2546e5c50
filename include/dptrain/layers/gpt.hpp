// GPT-2 as nanoGPT's model.py and llm.c build it: token and position embeddings, pre-LayerNorm
// blocks of causal self-attention and a tanh-GELU MLP, a final LayerNorm and an output
// projection tied to the token embedding. Activations flow as 2-D [B*T, C] tensors (row
// b*T + t), so the blocks take the sequence length T beside them.
//
// Specs (--model):
//   gpt2                       12 layers, 12 heads, width 768, context 1024, vocabulary 50257 (124M)
//   gpt2-medium                24 layers, 16 heads, width 1024, context 1024, vocabulary 50257 (350M)
//   gpt:L4-H4-C128-T256-V512   any size: L layers, H heads, C width, T context, V vocabulary
//
// Parameters are named as nanoGPT names them ("transformer.h.0.attn.c_attn.weight", Linear
// weights [out, in]); GPT-2's initialization: weights normal(0, 0.02), the residual
// projections' normal(0, 0.02 / sqrt(2 L)), biases 0, LayerNorms 1 and 0; AdamW's weight
// decay on the matrices and embeddings alone (Parameter::decay). The vocabulary is
// padded to a multiple of 64 inside the model (50257 -> 50304, as llm.c): the token
// embedding has padded_vocab() rows, and the logits' padding columns are masked by the loss.
//
// Decoding (GPT::forward_cached, for generating text) keeps each layer's keys and values in
// a KvCache, so that a new token costs one position, not the whole sequence again.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <dptrain/enum_names.hpp>
#include <dptrain/layers/layers.hpp>
#include <dptrain/layers/module.hpp>
#include <dptrain/runtime/ops.hpp>

namespace dpt::nn {

struct GptConfig {
  int64_t layers = 12, heads = 12, width = 768, context = 1024, vocab = 50257;
  int64_t padded_vocab() const { return (vocab + 63) / 64 * 64; }
  bool operator==(const GptConfig&) const = default;
};

// Activation recomputation (llm.c's -r): what a block's backward rebuilds instead of keeping
// it from the forward, for memory. none keeps every activation; gelu keeps c_fc's
// pre-activation for the MLP's c_proj instead of the GELU's output ([B*T, 4C] a layer less);
// gelu+ln also keeps the LayerNorms' inputs for c_attn and c_fc instead of their outputs
// (2 x [B*T, C] a layer less). Rebuilt by the forward's own kernels: the same bits
// (SavedInput, <dptrain/runtime/ops.hpp>), at the cost of a GELU, and two LayerNorms, more a
// layer in backward.
enum class Recompute { none, gelu, gelu_ln };
inline constexpr auto kRecomputeNames = enum_names<Recompute>(
    "recomputation", {{Recompute::none, "none"}, {Recompute::gelu, "gelu"}, {Recompute::gelu_ln, "gelu+ln"}});

// How the attention's backward adds up dQ (causal_attention's `deterministic`): deterministic
// gives the same bits every run; fast lets cuDNN's backward (bf16 on a GPU) add the parts as
// its blocks finish, as PyTorch's cuDNN attention does: faster, the bits varying from run to
// run within rounding. Elsewhere the attention is deterministic.
enum class AttentionBackward { deterministic, fast };
inline constexpr auto kAttentionBackwardNames = enum_names<AttentionBackward>(
    "attention backward", {{AttentionBackward::deterministic, "deterministic"}, {AttentionBackward::fast, "fast"}});

// Whether `spec` names a GPT (gpt2, gpt2-medium, gpt:...), and its sizes; UsageError naming
// the problem for a spec that does not parse or sizes that do not fit (heads must divide the
// width).
bool is_gpt_spec(const std::string& spec);
GptConfig parse_gpt_spec(const std::string& spec);
std::string gpt_spec_str(const GptConfig& c);  // "gpt:L12-H12-C768-T1024-V50257"

// wte [padded vocab, C] and wpe [context, C], normal(0, 0.02): tokens i32 [B, T] -> [B*T, C]
// (bf16 in bf16 compute), token and position embedding summed.
class Embedding : public Module {
 public:
  Embedding(int64_t vocab_rows, int64_t context, int64_t width);
  Tensor forward(const Tensor& tokens) override;
  std::shared_ptr<Module> clone() const override;
  std::string describe() const override;
  Parameter& wte() { return wte_; }
  // forward's rows for tokens at positions first_position .. (decoding; no gradient).
  Tensor forward_at(const Tensor& tokens, int64_t first_position);

 private:
  int64_t rows_, context_, width_;
  Parameter& wte_;
  Parameter& wpe_;
};

// The residual stream as x + delta, the add not yet made (delta undefined: x alone), so
// that the LayerNorm that reads the sum makes the add in its own pass (add_layer_norm).
struct Residual {
  Tensor x, delta;
};

// torch.nn.LayerNorm(C) over the rows of x [N, C] (statistics in fp32 in every precision).
class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t width);
  Tensor forward(const Tensor& x) override;
  // The stream's sum and this LayerNorm of it (the add fused in where there is one), with a
  // ones column for a bf16 layer to read (ops.hpp's ones_column_width) where asked.
  AddNorm forward(const Residual& stream, bool ones_column = false);
  std::shared_ptr<Module> clone() const override;
  std::string describe() const override;
  // What rebuilds forward(stream, ones_column).normed in a backward from the sum x.
  SavedInput output_from(const Tensor& x, bool ones_column = false) const;

 private:
  int64_t width_;
  Parameter& weight_;
  Parameter& bias_;
};

// A block's sizes: its width, its heads, and the layers of the model (which scale the
// residual projections' initialization).
struct BlockSizes {
  int64_t width = 0, heads = 0, layers = 0;
};

// The parts of a block: they take the sequence length beside their [B*T, C] input
// (forward(x) alone is refused).
class SequenceModule : public Module {
 public:
  SequenceModule(const char* name, const BlockSizes& sizes) : name_(name), sizes_(sizes) {}
  Tensor forward(const Tensor& x) override;
  virtual Tensor forward(const Tensor& x, int64_t T) = 0;
  std::string describe() const override;  // "Block(768, heads 12)"
  const BlockSizes& sizes() const { return sizes_; }

 private:
  const char* name_;
  BlockSizes sizes_;
};
template <class Part>
class SequencePart : public SequenceModule {
 public:
  using SequenceModule::SequenceModule;
  std::shared_ptr<Module> clone() const override { return std::make_shared<Part>(sizes()); }
};

// c_attn (C -> 3C), causal multi-head attention, c_proj (C -> C).
class CausalSelfAttention : public SequencePart<CausalSelfAttention> {
 public:
  explicit CausalSelfAttention(const BlockSizes& sizes);
  using SequenceModule::forward;
  Tensor forward(const Tensor& x, int64_t T) override;
  // forward's rows for x's new positions start .. of each sequence, attending over the
  // earlier ones through the cache (keys, values: this layer's, KvCache's layout), which
  // takes the new positions' keys and values (decoding; no gradient).
  Tensor forward_cached(const Tensor& x, const Tensor& keys, const Tensor& values, int64_t start);
  // The same with c_attn's node keeping `x_saved` instead of x, and x (bf16) with a ones column
  // where said (ops.hpp's ones_column_width).
  Tensor forward(const Tensor& x, int64_t T, const SavedInput& x_saved, bool ones_column = false);
  void set_attention_backward(AttentionBackward a) { attention_backward_ = a; }

 private:
  std::shared_ptr<Linear> c_attn_, c_proj_;
  AttentionBackward attention_backward_ = AttentionBackward::deterministic;
};

// x + attn(ln_1(x)), then x + mlp(ln_2(x)) with mlp = c_fc (C -> 4C, tanh-GELU), c_proj (4C -> C).
// In bf16 the MLP is one op (gelu_mlp_bf16: on a GPU the GELU's backward in the epilogue of
// c_proj's input gradient); in fp32 two Linears. Without recomputation the GELU is applied to
// the fp32 sum (in bf16 on a GPU in cuBLASLt's epilogue). With it, the GELU reads c_fc's
// pre-activation rounded to bf16 (linear_bf16_pre), as PyTorch's bf16 F.gelu after nn.Linear
// does, so that rebuilding it gives the same bits: gelu and gelu+ln agree to the bit, and
// with none within bf16 rounding.
class Block : public SequencePart<Block> {
 public:
  explicit Block(const BlockSizes& sizes);
  using SequenceModule::forward;
  Tensor forward(const Tensor& x, int64_t T) override;
  // forward on the stream x + delta, giving the stream after the block with its last add
  // not yet made (the next LayerNorm makes it): the same values and graph as forward.
  Residual forward(const Residual& stream, int64_t T);
  // forward through CausalSelfAttention::forward_cached (decoding; no gradient).
  Tensor forward_cached(const Tensor& x, const Tensor& keys, const Tensor& values, int64_t start);
  void set_recompute(Recompute r) { recompute_ = r; }
  void set_attention_backward(AttentionBackward a) { attn_->set_attention_backward(a); }

 private:
  std::shared_ptr<LayerNorm> ln_1_, ln_2_;
  std::shared_ptr<CausalSelfAttention> attn_;
  std::shared_ptr<Linear> c_fc_, c_proj_;
  Recompute recompute_ = Recompute::none;
  // c_proj(c_fc(x)) for x = ln_2(h), its node keeping x_saved for x. plain: the layers as
  // without recomputation (the GELU of the fp32 sum; decoding always); else c_proj keeps
  // c_fc's pre-activation, whose rounded value the GELU reads. ones_column: x (bf16) has one.
  Tensor mlp(const Tensor& x, const SavedInput& x_saved, bool plain, bool ones_column = false);
};

// What a GPT has computed of the sequences it decodes (GPT::kv_cache, forward_cached): for
// each layer, the keys and the values [batch, heads, context, head size] of positions
// [0, length) of each sequence, in the model's compute type on its device.
struct KvCache {
  std::vector<Tensor> keys, values;  // one of each a layer
  int64_t length = 0;                // positions held: the next new token's position
};

// The whole model: tokens i32 [B, T] (T <= context) -> logits [B*T, padded vocab] (f32, or
// bf16 in bf16 compute); lm_loss gives the next-token loss from them.
class GPT : public Module {
 public:
  explicit GPT(const GptConfig& config);
  Tensor forward(const Tensor& tokens) override;
  // An empty cache for `batch` sequences, on the model's device in its compute type (sized
  // for the whole context: 2 x layers x batch x context x width elements).
  KvCache kv_cache(int64_t batch = 1) const;
  // Decoding: tokens i32 [B, n], the next n positions of the cache's B sequences, at
  // positions cache.length .. cache.length + n - 1 (at most the context: a full cache is
  // emptied, cache.length = 0, and given the last tokens again by the caller). Returns the
  // logits forward gives those positions over the whole sequences (within fp32 rounding):
  // [B*n, padded vocab], or with last_only [B, padded vocab], each sequence's last new
  // position; cache.length grows by n. Inference only: no gradient is recorded.
  Tensor forward_cached(const Tensor& tokens, KvCache& cache, bool last_only = false);
  std::shared_ptr<Module> clone() const override;
  std::string describe() const override;
  const GptConfig& config() const { return config_; }
  // What the blocks rebuild in backward instead of keeping (Recompute); a clone (a
  // DataParallel replica) recomputes alike. Not part of the spec: it changes memory, not results.
  void set_recompute(Recompute r);
  Recompute recompute() const { return recompute_; }
  // How the attention's backward adds up dQ (AttentionBackward); a clone does alike. Not
  // part of the spec: it changes the last bits of a run, not what the model is.
  void set_attention_backward(AttentionBackward a);
  AttentionBackward attention_backward() const { return attention_backward_; }

 private:
  GptConfig config_;
  Recompute recompute_ = Recompute::none;
  AttentionBackward attention_backward_ = AttentionBackward::deterministic;
  std::shared_ptr<Embedding> embed_;
  std::vector<std::shared_ptr<Block>> blocks_;
  std::shared_ptr<LayerNorm> ln_f_;
  // The output projection tied to wte, of ln_f's output: forward's last step, and forward_cached's.
  Tensor output_logits(const Tensor& normed);
};

// The mean next-token cross-entropy of logits [N, padded vocab] against targets i32 (N of
// them, any shape), over the first `vocab` columns (classifier_loss: the gradient is made
// in the same pass, in the logits' memory).
Tensor lm_loss(const Tensor& logits, const Tensor& targets, int64_t vocab);

std::shared_ptr<GPT> gpt(const GptConfig& config);

}  // namespace dpt::nn
