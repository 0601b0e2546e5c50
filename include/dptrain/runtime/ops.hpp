// Ops on tensors: each checks shapes, picks the CPU or CUDA kernel by the tensors'
// device and, for the differentiable ones, records a Node so backward() reaches its
// inputs. Ops run on the stream of the device's current context and never wait for it.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include <dptrain/runtime/tensor.hpp>
#include <dptrain/types.hpp>

namespace dpt {

// ---- Differentiable ops ----------------------------------------------------------
// a [m, k] @ b [k, n] (with transposes: a stored [k, m] when ta, b stored [n, k] when tb).
Tensor matmul(const Tensor& a, const Tensor& b, bool ta = false, bool tb = false);
// y = act(x W^T + b): x [batch, in], W [out, in], b [out] (may be undefined). `out`, when
// given ([batch, out] f32 on x's device), is where y is written (the same bits).
Tensor linear(const Tensor& x, const Tensor& W, const Tensor& b, Act act = Act::none, const Tensor& out = {});
// The same with bf16 storage and fp32 master weights: y (bf16) = act(x W16^T + b16) with x
// bf16, where W16 and b16 (may be undefined) are the bf16 copies of the fp32 masters W and
// b. The GEMMs run on bf16 tensor cores with fp32 accumulation, the bias and activation are
// applied in fp32 and y is rounded once. The gradients go to the masters, in fp32 (straight
// into the flat gradient buffer); x's gradient is bf16.
Tensor linear_bf16(const Tensor& x, const Tensor& W, const Tensor& b, const Tensor& W16, const Tensor& b16,
                   Act act = Act::none);
// A run of f32 Linear layers, linear() after linear(), in a kernel forward and two backward
// where they are narrow and the batch small (kernels/mlp.hpp: at most 8 layers of widths
// up to 256 whose weights fit a GPU block's shared memory, at most 256 rows, fp32 compute,
// no parameter in two layers); an undefined tensor where that does not hold, and the
// caller runs linear() a layer at a time. Its gradients are linear()'s (within rounding).
// `before`, when given, is called once the run is known to be computed here, before
// anything is queued.
struct LinearLayer {
  Tensor W, b;
  Act act = Act::none;
};
Tensor linear_chain(const Tensor& x, const std::vector<LinearLayer>& layers, const std::function<void()>& before = {});
// The activations and losses take f32 or bf16 inputs: an activation's output and gradient
// have its input's type; a loss is fp32 and its gradient has the prediction's type.
Tensor activation(const Tensor& x, Act act);
// Mean squared error over all elements: a scalar tensor (shape [1]). The target is f32.
Tensor mse_loss(const Tensor& y, const Tensor& target);
// Softmax cross-entropy, mean over rows: logits [batch, classes], labels i32 [batch].
Tensor cross_entropy(const Tensor& logits, const Tensor& labels);
// f32 [1]: the share of rows whose largest logit is at the label (no gradient).
Tensor accuracy(const Tensor& logits, const Tensor& labels);
// f32 <-> bf16 (round to nearest even): differentiable, the gradient cast back to t's type.
// The same type gives t itself.
Tensor cast(const Tensor& t, DType to);

// ---- Plain ops (no autograd) -------------------------------------------------------
void zero_(const Tensor& t);
void fill_(const Tensor& t, float value);
// y += alpha * x; f32 or bf16 (computed in fp32, a bf16 y rounded once).
void axpy_(float alpha, const Tensor& x, const Tensor& y);
// y += x (f32 y; x f32, or bf16 widened) where x lies on another GPU that y's reads
// directly (peer_readable): one kernel on y's GPU reads x over NVLink or PCIe, with no
// staging copy; the same sums as copying x over and adding it with axpy_.
void add_peer_(const Tensor& x, const Tensor& y);
// C = alpha * op(A) op(B) + beta * C with the GEMM chosen by the device's context; A and B
// f32 (C f32), or both bf16 (C f32 or bf16: bf16 tensor cores, fp32 accumulation, through
// cuBLAS whatever the context's GEMM).
void gemm(bool ta, bool tb, float alpha, const Tensor& A, const Tensor& B, float beta, const Tensor& C);
// dst = src converted to dst's type (f32 <-> bf16, or a copy), on one device.
void copy_cast(const Tensor& dst, const Tensor& src);
Tensor sum_squares(const Tensor& x);  // scalar sum of x^2
Tensor argmax_rows(const Tensor& x);  // i32 [rows]
// Philox fills: element i gets the value of index offset + i of stream (seed, stream).
void normal_(const Tensor& t, uint64_t seed, uint64_t stream, uint64_t offset, float std = 1.0f);
void uniform_(const Tensor& t, uint64_t seed, uint64_t stream, uint64_t offset, float lo, float hi);
// The same over rows (t's first axis) that are samples of a RowMap: row r gets what a
// contiguous fill gives its sample, element c being index sample * width + c; added to
// what t holds when `add` (noise on targets, in one pass).
void normal_rows_(const Tensor& t, uint64_t seed, uint64_t stream, const RowMap& rows, float std = 1.0f,
                  bool add = false);
// The gradient-clipping coefficient min(1, max_norm / (||g|| + 1e-6)) from ||g||^2.
Tensor clip_coef(const Tensor& norm_sq, float max_norm);
// Where check_gradients records its checks for the host to read later (CheckRecord):
// `records` is host memory the device writes in place (a mapped PinnedBuffer's
// device_data()), `count` the device int64 (i32 [2]) of checks recorded so far.
struct CheckRing {
  CheckRecord* records = nullptr;
  int64_t slots = 0;
  Tensor count;
};
// A step's gradient scale (f32 [1]) from the gradients in one pass: clip_coef's, from
// ||grads||^2 (NaN when a gradient is not finite: the update is skipped). With a ring, the
// check's record (the scale and the first non-finite gradient's flat index) goes to its
// next slot, so the host learns of a bad step without waiting for it.
Tensor check_gradients(const Tensor& grads, float max_norm, const CheckRing& ring = {});
// The same in two halves, for gradients sharded over devices (ZeRO): a shard's gradients
// `grads`, whose first element is element `base` of the flat buffer, write their part into
// `sum` (f32 [1], their squares' sum) and `first_bad` (i32 [2], the int64 flat index of the
// first non-finite one, INT64_MAX for none), in place; once the parts are summed (and
// min'd) over the shards, finish_check gives the scale and writes the record.
void shard_check(const Tensor& grads, int64_t base, const Tensor& sum, const Tensor& first_bad);
Tensor finish_check(const Tensor& sum, const Tensor& first_bad, float max_norm, const CheckRing& ring = {});
// An optimizer's step counter on its device: `counter` an i32 [4] (the int64 count of
// steps taken, then the update kernel's block count, zero between steps, then a word the
// checked updates' blocks wait on), the schedule its lr follows and AdamW's betas
// (StepCounterArgs).
struct StepCounter {
  Tensor counter;
  ScheduleArgs schedule;
  float beta1 = 0.0f, beta2 = 0.0f;
  bool advance = true;  // false: the counter is read, not moved on (a part of a step's update)
  // How the update rounds its bf16 shadow: to nearest, or stochastically with random bits
  // of (rounding.seed, the counter's step, rounding.first + the element's index) (types.hpp).
  ShadowRounding rounding = {};
};
// Fused optimizer updates over flat buffers; grad_scale may be undefined. shadow (bf16,
// may be undefined) receives the updated parameters rounded to bf16, in the same pass:
// to nearest, or as step->rounding says (to nearest without a counter). A step skipped
// for non-finite gradients and rounded stochastically writes the shadow of the unchanged
// parameters again with that step's random bits, so that after the update of step s the
// shadow is always step s's rounding of the parameters (refresh_shadow makes it again).
// step (may be null): the update takes the lr (and AdamW's bias corrections) from the
// counter instead of a's, and moves it on by one, on the device, whether it applies the
// step or skips it; then p may be empty (an empty ZeRO shard still counts its step). A
// recorded CUDA graph replays it, so its steps follow the schedule without the host.
void sgd_step(const Tensor& p, const Tensor& g, const Tensor& momentum_buf, const SgdArgs& a, const Tensor& grad_scale,
              const Tensor& shadow = {}, const StepCounter* step = nullptr);
void adamw_step(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const AdamArgs& a,
                const Tensor& grad_scale, const Tensor& shadow = {}, const StepCounter* step = nullptr);
// shadow (bf16, p's size) = p rounded as the counter's last update rounded its shadow
// (step.rounding at the step before the counter's count, read on the device; to nearest
// before the first step), the counter left as it is: parameters written from elsewhere (a
// resume, ZeRO's gather of the other partitions) get the bits the update would have given.
void refresh_shadow(const Tensor& p, const Tensor& shadow, const StepCounter& step);
// check_gradients(g, max_norm, ring) and the update by the scale it gives, returned: on a
// GPU in one launch where it can be (a small model's step: one kernel less), else in two;
// the same parameters, state and record bit for bit either way. With a backup of
// checked_update_backup_size floats (p's buffers: the parameters and the optimizer's
// state, 1 for SGD, 2 with momentum, 3 for AdamW; the size is 0 where none serves: on the
// CPU, with clipping, above 4M elements) the update runs before the check's sum is known
// and puts the backup back where the norm is not finite (no wait for the whole grid).
// The backup must be the caller's own, 16-byte aligned, and made or last written by a plain
// operation (Tensor::zeros) before its first use: the update writes it before the kernel
// ahead of it is done. For the same reason the kernel just ahead of a GPU update on its
// stream must not write p, the state or the counter (it reads them before it waits): in a
// step the backward's or the reduction's is there, never another update.
int64_t checked_update_backup_size(const Tensor& p, int buffers, float max_norm);
Tensor checked_sgd_step(const Tensor& p, const Tensor& g, const Tensor& momentum_buf, const SgdArgs& a, float max_norm,
                        const CheckRing& ring, const Tensor& shadow, const StepCounter& step,
                        const Tensor& backup = {});
Tensor checked_adamw_step(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const AdamArgs& a,
                          float max_norm, const CheckRing& ring, const Tensor& shadow, const StepCounter& step,
                          const Tensor& backup = {});
// check_gradients(g, 0, ring) and the update by its scale (no clipping) from the current
// copy of the parameters and optimizer state (p, momentum_buf / m, v) into a second copy
// of each (next_*, the same sizes, other memory): on a GPU one pass reads the gradients
// once (the update adds the check's terms as it goes), where checked_*_step reads them
// twice. The same scale, record and state bit for bit as checked_*_step, but in the next
// copies: after the step, applied or skipped, those hold the state and the caller swaps
// the two (Tensor::swap_memory). `t`: the step counter's value at which the update reads
// the first copy; a CUDA graph's replays read the first at counts of t's parity and the
// next copies at the others, so they alternate as the host's swaps do.
Tensor alternating_sgd_step(const Tensor& p, const Tensor& g, const Tensor& momentum_buf, const Tensor& next_p,
                            const Tensor& next_buf, const SgdArgs& a, const CheckRing& ring, const Tensor& shadow,
                            const StepCounter& step, int64_t t);
Tensor alternating_adamw_step(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const Tensor& next_p,
                              const Tensor& next_m, const Tensor& next_v, const AdamArgs& a, const CheckRing& ring,
                              const Tensor& shadow, const StepCounter& step, int64_t t);

// ---- Convolutional networks (runtime/ops/conv.cpp): differentiable, over NCHW tensors ----
// y = x * w + b as torch.nn.functional.conv2d: x [n, c, h, w], w [k, c, r, s], b [k] (may
// be undefined) -> y [n, k, p, q]; stride, padding and dilation alike on both axes.
Tensor conv2d(const Tensor& x, const Tensor& w, const Tensor& b, int64_t stride = 1, int64_t pad = 0,
              int64_t dilation = 1);
// Max or average pooling with a kh x kw window (padding: -inf for max, zeros that count
// for avg; at most half the window, as torch). Global average pooling: kh = h, kw = w.
Tensor pool2d(const Tensor& x, Pool kind, int64_t kh, int64_t kw, int64_t stride, int64_t pad = 0);
// Batch norm over the channels of x [n, c, h, w], as torch.nn.functional.batch_norm.
// training: normalizes with the batch's statistics and moves running_mean / running_var
// [c] in place (no gradient). Evaluation: normalizes with the running statistics; its
// backward is an error (run evaluation under NoGradGuard).
Tensor batch_norm2d(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& running_mean,
                    const Tensor& running_var, bool training, const BatchNormArgs& a = {});
// x [n, ...] as [n, rest], sharing its data (torch.flatten(x, 1)).
Tensor flatten(const Tensor& x);

// y += x (f32 y; x f32, or bf16 widened) where x and y lie on CPU devices, one or two
// (virtual CPU devices share the host's memory, so no copy is needed): the same sums as
// axpy_ with alpha 1 on one device, for parallel/'s host reduction.
void add_host_(const Tensor& x, const Tensor& y);

// ---- Transformer ops (runtime/ops/embedding.cpp, layernorm.cpp): differentiable ----
// y[n, :] = wte[tokens[n], :] + wpe[n % T, :], tokens i32 [B, T] (n = b*T + t): y [B*T, C] of type `out`
// (f32 or bf16; the sum in fp32, rounded once). wte [V, C], wpe [>= T, C]: f32 masters, fp32 gradients, the
// backward deterministic (dwpe sums over b, dwte over the positions holding each token, in a fixed order).
// A token outside [0, V) is a dpt::Error on the CPU; on a GPU (where checking would wait for the device) its
// wte row is skipped, never read: the data loader checks tokens before they reach the model.
Tensor embedding(const Tensor& tokens, const Tensor& wte, const Tensor& wpe, DType out = DType::f32);
// LayerNorm over the last axis of x [N, C] (f32 or bf16) as torch.nn.functional.layer_norm: statistics in fp32
// (biased variance), gamma/beta f32 [C] masters with fp32 gradients; y has x's type. Saves mean and rstd [N].
// With ones_column (bf16 only), y is [N, ones_column_width(C)]: each row's C values, then a ones column (below).
Tensor layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps = 1e-5f,
                  bool ones_column = false);
// An input with a ones column: each row's C values, then 1, then 0s to ones_column_width(C) = C + 1 rounded up to
// a multiple of 8 (rows stay 16-byte aligned). A bf16 layer told its input has one (linear_bf16_pre and
// gelu_mlp_bf16 with ones_column, W [out, C]) makes its bias gradient in the weight gradient's GEMM, dz^T [x | 1]
// = [dW | db], instead of a pass of column sums over dz; it reads x's first C columns only, and hands back x's
// gradient [N, C], without the ones column, which the LayerNorm that made x takes (so x is no leaf).
int64_t ones_column_width(int64_t cols);
// a + b, the same shape and type (f32 or bf16): the residual connection, differentiable.
Tensor add(const Tensor& a, const Tensor& b);
// The residual add and the LayerNorm that reads its sum: sum = add(a, b) and normed =
// layer_norm(sum, gamma, beta, eps), the same bits and the same graph (an add, then a
// layer_norm of the sum); the one place where a GPU may make both in one pass.
struct AddNorm {
  Tensor sum, normed;
};
AddNorm add_layer_norm(const Tensor& a, const Tensor& b, const Tensor& gamma, const Tensor& beta, float eps = 1e-5f,
                       bool ones_column = false);

// ---- Transformer ops: attention and classifier ---------------------------------------
// Causal multi-head self-attention as nanoGPT's CausalSelfAttention after c_attn: qkv [B*T, 3C] holds q, k, v side by
// side (columns [0, C), [C, 2C), [2C, 3C)), head h at columns h*hs .. h*hs+hs-1 of each (hs = C / heads); y [B*T, C]
// = softmax(q k^T / sqrt(hs), causal) v for each (b, h), head h written at columns h*hs of y (torch's
// y.transpose(1, 2).view(B, T, C)). f32 or bf16 in and out (fp32 math); saves the softmax statistics (log-sum-exp,
// fp32 [B, heads, T]) and recomputes the probabilities in backward: never holds a [T, T] matrix per head.
// Head sizes up to 128 (a larger one is an error). deterministic: the backward gives the same bits every run; false
// lets cuDNN's backward (bf16 on a GPU) add dQ's parts in the order its blocks finish, which is faster and varies
// from run to run within rounding (every other attention kernel is deterministic either way).
Tensor causal_attention(const Tensor& qkv, int64_t T, int64_t heads, bool deterministic = true);
// Softmax cross-entropy of each row of logits [N, Vp] (f32 or bf16) over its first `vocab` columns (columns from
// vocab on are padding: masked, gradient 0), mean over the N rows: f32 [1]; targets i32 [N] in [0, vocab).
// The language model's classifier in one pass: the forward writes the gradient (softmax - onehot) / N into the
// logits' own memory (so no second [N, Vp] buffer exists; the caller must not read the logits afterwards), and the
// backward hands it over, scaled in place for a seed other than 1 (as MseNode in runtime/ops/loss.cpp does).
// Without autograd (no gradient wanted) the logits are left as they are. A bf16 gradient scaled for another seed
// is rounded twice.
Tensor classifier_loss(const Tensor& logits, const Tensor& targets, int64_t vocab);

// ---- Decoding with a key-value cache (runtime/ops/attention.cpp, embedding.cpp): inference only ----
// Both refuse to run where a gradient is wanted (decoding runs under NoGradGuard).
// causal_attention for n new positions of each of B sequences whose first `start` positions' keys and values are in
// the caches already: qkv [B*n, 3C] laid out as causal_attention's (row b*n + i is position start + i of sequence b);
// k_cache and v_cache [B, heads, capacity, hs] (capacity >= start + n) of qkv's type, on its device. Writes the new
// positions' keys and values into the caches and returns y [B*n, C]: each new query's attention over positions
// 0 .. start + i of its sequence, the rows causal_attention gives them over the whole sequence (on the CPU the same
// bits; on a GPU within fp32 rounding). The prompt and each new token go through it alike.
Tensor attention_decode(const Tensor& qkv, const Tensor& k_cache, const Tensor& v_cache, int64_t start);
// embedding for tokens i32 [B, T] at positions first_position .. first_position + T - 1 (within wpe's rows):
// y[b*T + t] = wte[tokens[b, t]] + wpe[first_position + t], as embedding computes it.
Tensor embedding_at(const Tensor& tokens, const Tensor& wte, const Tensor& wpe, int64_t first_position,
                    DType out = DType::f32);

// ---- Activation recomputation (runtime/ops/linear.cpp) ---------------------------------
// A linear layer's node keeps its input x for the weight gradient. A SavedInput names instead
// what another node of the graph keeps anyway, from which the backward rebuilds x into a
// temporary with the forward's own kernels: the same bits, so the gradients do not change,
// and x is freed once the forward is past it (nn::GPT::set_recompute, llm.c's -r):
//   act_of(z, act)                      x = activation(z, act), z a pre-activation that linear_pre gave
//   layer_norm_of(h, gamma, beta, eps, ones_column)
//                                       x = layer_norm(h, gamma, beta, eps, ones_column), h a LayerNorm's input
// The default keeps x itself. The op checks that the rebuild has x's shape, type and device;
// that it makes x's values is the caller's word (the statistics are computed again, by the
// same kernel, rather than read from the LayerNorm's node).
struct SavedInput {
  enum class Kind { input, act_of, layer_norm_of };
  Kind kind = Kind::input;
  Tensor from;  // act_of: z; layer_norm_of: h
  Act act = Act::none;
  Tensor gamma, beta;
  float eps = 1e-5f;
  bool ones_column = false;
};
SavedInput act_of(const Tensor& z, Act act);
SavedInput layer_norm_of(const Tensor& h, const Tensor& gamma, const Tensor& beta, float eps = 1e-5f,
                         bool ones_column = false);
// linear / linear_bf16 whose node keeps `saved` for x, and which give the pre-activation z
// beside y for an activation whose backward keeps it (the GELUs; else z is undefined). y is
// exactly activation(z, act), so that act_of(z, act) rebuilds it: in bf16 the GELU reads the
// rounded z, as PyTorch's F.gelu after a bf16 nn.Linear does, where linear_bf16 applies it
// to the fp32 sum and rounds once (and on a GPU cuBLASLt's GELU epilogue is not used: the
// GEMM writes z with the bias, a pass makes y; a GPT without recomputation keeps
// linear_bf16). Otherwise the same GEMMs and kernels as linear / linear_bf16: the same bits.
struct LinearOut {
  Tensor y, z;
};
LinearOut linear_pre(const Tensor& x, const Tensor& W, const Tensor& b, Act act, const SavedInput& saved = {});
LinearOut linear_bf16_pre(const Tensor& x, const Tensor& W, const Tensor& b, const Tensor& W16, const Tensor& b16,
                          Act act, const SavedInput& saved = {}, bool ones_column = false);

// A transformer block's MLP in bf16, y = proj(gelu_tanh(fc(x))) (x bf16; each layer's fp32
// weight and bias, the leaves, beside their bf16 copies; both with a bias), as one op, so
// that its backward can make the GELU's derivative in the epilogue of the GEMM that makes
// proj's input gradient (on a GPU, cuBLASLt's DGELU reading the pre-activation): the GELU
// output's gradient is never written. Values and gradients are those of linear_bf16(fc,
// gelu_tanh) then linear_bf16(proj) (keep_h: the node keeps the GELU's output), or, not
// keep_h, of linear_bf16_pre with proj keeping act_of(z) (the node keeps the pre-activation
// alone and rebuilds the GELU's output for proj's weight gradient); on a CPU the same bits,
// on a GPU within bf16 rounding (the epilogue rounds dz once). x_saved and ones_column: as
// linear_bf16_pre's.
struct Bf16Layer {
  Tensor W, b, W16, b16;
};
Tensor gelu_mlp_bf16(const Tensor& x, const Bf16Layer& fc, const Bf16Layer& proj, bool keep_h,
                     const SavedInput& x_saved = {}, bool ones_column = false);
}  // namespace dpt
