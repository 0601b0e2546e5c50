// The CPU kernels: the oracle every CUDA kernel is tested against. Written for clarity;
// each function is the plain definition of the op. All matrices are row-major and
// contiguous. Scalars that the CUDA twins keep on the device (losses, norms) are plain
// floats in host memory here.
//
// The *_bf16 twins take bf16 tensors as uint16_t (kernels/bf16.hpp): they read every bf16
// value as the float it stands for, compute exactly as the fp32 kernel of the same name
// does, and round once, to nearest even, where they store a bf16 value.
#pragma once
#include <cstdint>

#include <dptrain/types.hpp>

#include "../attention.hpp"
#include "../decode.hpp"
#include "../mlp.hpp"

namespace dpt::cpu {

// gemm.cpp — C[m,n] = alpha * op(A)[m,k] * op(B)[k,n] + beta * C.
// A is stored k x m when ta, else m x k; B is stored n x k when tb, else k x n.
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* A, const float* B, float beta,
          float* C);
// The same with bf16 A and B: products summed in float as above; C in float, or in bf16
// (read as floats when beta != 0, rounded once when written).
void gemm_bf16(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* A, const uint16_t* B,
               float beta, float* C);
void gemm_bf16(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* A, const uint16_t* B,
               float beta, uint16_t* C);

// The run of Linear layers of ../mlp.hpp (x: [rows, layer 0's in]), layer after layer: the
// GEMM above, then bias_act_forward.
void mlp_forward(int64_t rows, const float* x, const MlpLayers& layers);
// Its backward as cuda::mlp_backward defines it: dx (may be null) and, for each block of
// kMlpBlockRows rows, every layer's weight and bias gradients over the block's rows (in
// row order) into `work` (mlp_backward_work floats); mlp_grad_sum adds the blocks' parts of
// layers [first, last) in block order into `out`.
void mlp_backward(int64_t rows, const float* x, const float* dy, float* dx, const MlpLayers& layers, float* work);
void mlp_grad_sum(int64_t rows, const MlpLayers& layers, const float* work, const MlpGrads& out, int first, int last);

// activation.cpp — y = act(x + bias) row by row (bias may be null; x may equal y).
// When z is not null it receives x + bias (the pre-activation that GELU's backward needs).
void bias_act_forward(const float* x, const float* bias, Act act, int64_t rows, int64_t cols, float* z, float* y);
// dx = dy * act'(.), where `saved` is the output y for relu/tanh/none and the
// pre-activation z for the GELUs (act_saves_input). dx may equal dy.
void act_backward(const float* dy, const float* saved, Act act, int64_t n, float* dx);
// The same over a rows x cols matrix, also writing dx transposed into dxt ([cols, rows]).
void act_backward_transposed(const float* dy, const float* saved, Act act, int64_t rows, int64_t cols, float* dx,
                             float* dxt);
// db = beta * db + sum over rows of dy.
void bias_grad(const float* dy, int64_t rows, int64_t cols, float beta, float* db);
// A Linear layer's backward over its output gradient: dz = dy * act'(saved) (dz may be dy;
// for Act::none dz is dy and is not written) and db = beta * db + column sums of dz.
void act_bias_backward(const float* dy, const float* saved, Act act, int64_t rows, int64_t cols, float* dz, float beta,
                       float* db);
// bf16: y (and z, may be null) = act(x + bias) from the fp32 GEMM result x and a bf16 bias
// (may be null); y = act(x) of a bf16 x (x may equal y); dx = dy * act'(saved), all bf16
// (dx may equal dy); act_bias_backward over bf16 dy, saved, dz (db fp32, the sums of the
// rounded dz).
void bias_act_forward_bf16(const float* x, const uint16_t* bias, Act act, int64_t rows, int64_t cols, uint16_t* z,
                           uint16_t* y);
void act_forward_bf16(const uint16_t* x, Act act, int64_t n, uint16_t* y);
void act_backward_bf16(const uint16_t* dy, const uint16_t* saved, Act act, int64_t n, uint16_t* dx);
void act_bias_backward_bf16(const uint16_t* dy, const uint16_t* saved, Act act, int64_t rows, int64_t cols,
                            uint16_t* dz, float beta, float* db);
// dW = beta_w dW + t[:, :in], db = beta_b db + t[:, in] from t [out, ld] (cuda.hpp's twin).
void ones_column_split(const float* t, int64_t out, int64_t in, int64_t ld, float beta_w, float* dW, float beta_b,
                       float* db);

// loss.cpp — mean squared error over n elements, and with dy not null its gradient for a
// seed of 1, 2 (y - t) / n; mse_backward scales that gradient by scale and by *dloss
// (dloss may be null).
void mse_forward(const float* y, const float* t, int64_t n, float* loss, float* dy);
void mse_backward(const float* y, const float* t, int64_t n, const float* dloss, float scale, float* dy);
// Softmax cross-entropy, mean over rows; labels in [0, cols).
void cross_entropy_forward(const float* logits, const int32_t* labels, int64_t rows, int64_t cols, float* loss);
void cross_entropy_backward(const float* logits, const int32_t* labels, int64_t rows, int64_t cols, const float* dloss,
                            float* dlogits);
// The share of rows whose largest logit (the first, when several are equal) is at the
// label; a row of NaNs has no largest logit and counts as wrong.
void accuracy(const float* logits, const int32_t* labels, int64_t rows, int64_t cols, float* out);
void accuracy_bf16(const uint16_t* logits, const int32_t* labels, int64_t rows, int64_t cols, float* out);
// bf16 predictions or logits: the loss in fp32, the gradient in bf16 (the target stays f32).
void mse_forward_bf16(const uint16_t* y, const float* t, int64_t n, float* loss, uint16_t* dy);
void mse_backward_bf16(const uint16_t* y, const float* t, int64_t n, const float* dloss, float scale, uint16_t* dy);
void cross_entropy_forward_bf16(const uint16_t* logits, const int32_t* labels, int64_t rows, int64_t cols, float* loss);
void cross_entropy_backward_bf16(const uint16_t* logits, const int32_t* labels, int64_t rows, int64_t cols,
                                 const float* dloss, uint16_t* dlogits);

// optim.cpp — fused updates over a flat buffer of n parameters. grad_scale (may be null)
// multiplies every gradient first (gradient clipping); when it is not finite the update
// is skipped altogether (the gradients were not finite). shadow (may be null) receives
// the updated parameters rounded to bf16: the bf16 copy that bf16 compute reads.
// step (may be null): the optimizer's counter, which gives the lr (and AdamW's bias
// corrections) of this step instead of a's, and moves on by one (StepCounterArgs), and
// how the shadow is rounded (to nearest without it); a skipped step rounded
// stochastically writes the shadow of the unchanged parameters again (kernels/shadow.hpp).
void sgd_step(float* p, const float* g, float* momentum_buf, int64_t n, const SgdArgs& a, const float* grad_scale,
              uint16_t* shadow, const StepCounterArgs* step = nullptr);
void adamw_step(float* p, const float* g, float* m, float* v, int64_t n, const AdamArgs& a, const float* grad_scale,
                uint16_t* shadow, const StepCounterArgs* step = nullptr);
// shadow = p rounded as the counter's last update rounded its shadow (step.rounding at
// step *t - 1; to nearest before the first step): parameters written from elsewhere (a
// resume, ZeRO's gather) in the bits that update would have given them. The counter stays.
void refresh_shadow(const float* p, uint16_t* shadow, int64_t n, const StepCounterArgs& step);
// The step's gradient scale from ||g||^2 (scale_from_norm_sq, kernels/grad_check.hpp).
void clip_coef(const float* norm_sq, float max_norm, float* out);
// The same from the gradients themselves, in one pass that also finds the first
// non-finite one; with a ring, the check's record goes to its next slot (CheckRingArgs).
void check_gradients(const float* g, int64_t n, float max_norm, float* scale, const CheckRingArgs* ring);
// ZeRO: a shard's part of the check (its squares' sum; base + the index of its first
// non-finite value, INT64_MAX for none), and the check from the parts summed (min'd).
void shard_check(const float* g, int64_t n, int64_t base, float* sum, int64_t* first);
void finish_check(const float* sum, const int64_t* first, float max_norm, float* scale, const CheckRingArgs* ring);

// elementwise.cpp
void fill(float* x, int64_t n, float value);
void axpy(int64_t n, float alpha, const float* x, float* y);  // y += alpha * x
void add_bf16(const uint16_t* x, float* y, int64_t n);        // y += float(x)
void sum_squares(const float* x, int64_t n, float* out);      // out = sum x^2
void cast_f32_bf16(const float* x, uint16_t* y, int64_t n);   // round to nearest even
void cast_bf16_f32(const uint16_t* x, float* y, int64_t n);
void argmax_rows(const float* x, int64_t rows, int64_t cols, int32_t* out);
void normal(float* out, int64_t n, uint64_t seed, uint64_t stream, uint64_t offset, float std);
// Rows of `width` values: row r gets the values of its sample (RowMap) in a contiguous
// fill, added to what it holds when `add`.
void normal_rows(float* out, int64_t rows, int64_t width, uint64_t seed, uint64_t stream, const RowMap& map, float std,
                 bool add);
void uniform(float* out, int64_t n, uint64_t seed, uint64_t stream, uint64_t offset, float lo, float hi);

// conv.cpp — convolution, pooling and batch norm over NCHW (shapes in types.hpp), written
// as direct loops. beta = 1 accumulates into existing gradients (the flat buffer), 0
// overwrites them; bias / db may be null (no bias).
void conv2d_forward(const ConvShape& s, const float* x, const float* w, const float* bias, float* y);
void conv2d_backward_data(const ConvShape& s, const float* dy, const float* w, float* dx);
void conv2d_backward_filter(const ConvShape& s, const float* x, const float* dy, float beta, float* dw, float* db);
void pool2d_forward(const PoolShape& s, Pool kind, const float* x, float* y);
// dx is overwritten; max pooling sends each dy to the first maximum of its window.
void pool2d_backward(const PoolShape& s, Pool kind, const float* x, const float* y, const float* dy, float* dx);
// x, y [n, c, hw]; gamma, beta, running statistics and saved statistics [c].
void batchnorm_forward_train(int64_t n, int64_t c, int64_t hw, const float* x, const float* gamma, const float* beta,
                             const BatchNormArgs& a, float* running_mean, float* running_var, float* y,
                             float* save_mean, float* save_invstd);
void batchnorm_forward_eval(int64_t n, int64_t c, int64_t hw, const float* x, const float* gamma, const float* beta,
                            const BatchNormArgs& a, const float* running_mean, const float* running_var, float* y);
// dx is overwritten; dgamma and dbeta get param_beta * old + the new gradient.
void batchnorm_backward(int64_t n, int64_t c, int64_t hw, const float* x, const float* dy, const float* gamma,
                        const float* save_mean, const float* save_invstd, float* dx, float param_beta, float* dgamma,
                        float* dbeta);

// ---- Transformer ops (embedding.cpp, layernorm.cpp) ----------------------------------
// Rows n = b * seq + t of [rows = batch * seq, C] activations; *_bf16: bf16 activations,
// the same fp32 math, each store rounded once; parameters and their gradients fp32.
// embedding.cpp — y[n, :] = wte[tokens[n], :] + wpe[n % seq, :] (wte [vocab, C], wpe
// [>= seq, C]); a token outside [0, vocab) throws dpt::Error naming it and its position.
void embedding_forward(const int32_t* tokens, int64_t rows, int64_t seq, const float* wte, int64_t vocab,
                       const float* wpe, int64_t C, float* y);
void embedding_forward_bf16(const int32_t* tokens, int64_t rows, int64_t seq, const float* wte, int64_t vocab,
                            const float* wpe, int64_t C, uint16_t* y);
// dwte[v] = beta_wte dwte[v] + the sum of dy over the positions holding v, in position
// order (a token held nowhere: 0, or unchanged when beta_wte is 1); dwpe [positions, C]
// = beta_wpe dwpe + for t < seq the sum of dy[b * seq + t] over b in order (0 beyond seq).
// beta 0 never reads the gradient; a null gradient is not wanted.
void embedding_backward(const int32_t* tokens, int64_t rows, int64_t seq, const float* dy, int64_t vocab,
                        int64_t positions, int64_t C, float beta_wte, float* dwte, float beta_wpe, float* dwpe);
void embedding_backward_bf16(const int32_t* tokens, int64_t rows, int64_t seq, const uint16_t* dy, int64_t vocab,
                             int64_t positions, int64_t C, float beta_wte, float* dwte, float beta_wpe, float* dwpe);
// layernorm.cpp — y = (x - mean) rstd gamma + beta over each row of x [rows, cols], the
// statistics in fp32 (biased variance, rstd = 1 / sqrt(var + eps)) and saved [rows]. The
// bf16 form writes y's rows ldy >= cols apart, with a ones column after the values where
// ldy > cols (1 at column cols, 0 to ldy: ops.hpp's ones_column_width).
void layer_norm_forward(const float* x, const float* gamma, const float* beta, int64_t rows, int64_t cols, float eps,
                        float* y, float* mean, float* rstd);
void layer_norm_forward_bf16(const uint16_t* x, const float* gamma, const float* beta, int64_t rows, int64_t cols,
                             float eps, uint16_t* y, int64_t ldy, float* mean, float* rstd);
// dx (null: not wanted) from dy and the saved statistics, added to what dx holds when
// dx_add (rounded once); dgamma = beta_gamma dgamma + sum over rows of dy xhat and dbeta =
// beta_beta dbeta + sum of dy (each null: not wanted).
// dx_sums (null, or cols floats, with dx): the column sums of the dx written, in row order
// (the CUDA kernel's partial sums over one chunk of all the rows).
void layer_norm_backward(const float* x, const float* dy, const float* gamma, const float* mean, const float* rstd,
                         int64_t rows, int64_t cols, float* dx, bool dx_add, float beta_gamma, float* dgamma,
                         float beta_beta, float* dbeta, float* dx_sums = nullptr);
void layer_norm_backward_bf16(const uint16_t* x, const uint16_t* dy, const float* gamma, const float* mean,
                              const float* rstd, int64_t rows, int64_t cols, uint16_t* dx, bool dx_add,
                              float beta_gamma, float* dgamma, float beta_beta, float* dbeta, float* dx_sums = nullptr);
// y = a + b (y may be a or b).
void residual_add(const float* a, const float* b, int64_t n, float* y);
void residual_add_bf16(const uint16_t* a, const uint16_t* b, int64_t n, uint16_t* y);

// ---- Transformer ops: attention and classifier -----------------------------------------
// attention.cpp — causal self-attention over qkv (../attention.hpp): y = softmax(q k^T /
// sqrt(hs), causal) v per sequence and head, and lse [batch, heads, T], the log-sum-exp of
// each softmax row (of the scaled scores). The backward takes y, its gradient dy and lse
// and writes the whole of dqkv (the same layout as qkv).
void attention_forward(const AttentionShape& s, const float* qkv, float* y, float* lse);
void attention_backward(const AttentionShape& s, const float* qkv, const float* y, const float* dy, const float* lse,
                        float* dqkv);
void attention_forward_bf16(const AttentionShape& s, const uint16_t* qkv, uint16_t* y, float* lse);
void attention_backward_bf16(const AttentionShape& s, const uint16_t* qkv, const uint16_t* y, const uint16_t* dy,
                             const float* lse, uint16_t* dqkv);
// classifier.cpp — softmax cross-entropy of each row of logits [rows, cols] over its first
// `vocab` columns, mean over the rows, into *loss; with write_grad, the gradient for a seed
// of 1, (softmax - onehot) / rows (0 in the padding columns), written over the logits.
void classifier_forward(float* logits, const int32_t* targets, int64_t rows, int64_t cols, int64_t vocab, float* loss,
                        bool write_grad);
void classifier_forward_bf16(uint16_t* logits, const int32_t* targets, int64_t rows, int64_t cols, int64_t vocab,
                             float* loss, bool write_grad);
// g *= scale * *dloss (dloss may be null) in place: the gradient above for another seed.
void classifier_grad_scale(float* g, int64_t n, const float* dloss, float scale);
void classifier_grad_scale_bf16(uint16_t* g, int64_t n, const float* dloss, float scale);

// elementwise.cpp — synthetic language-model data (data/synthetic.hpp): row r of x [rows,
// seq] is tokens row_sample(map, r) * seq .. + seq - 1 of the stream of tokens uniform in
// [0, vocab) (philox::uniform_token of (seed, stream)), row r of y the tokens one further
// (each input's next token).
void random_tokens(int32_t* x, int32_t* y, int64_t rows, int64_t seq, int64_t vocab, uint64_t seed, uint64_t stream,
                   const RowMap& map);

// ---- Decoding with a key-value cache (attention.cpp) -------------------------------------
// attention_decode: the keys and values of qkv's new rows (../decode.hpp) written into the
// caches at positions start .. start + n - 1, then y [batch * n, C] = each new query's
// attention over positions 0 .. start + i of its sequence (the cache), as attention_forward
// computes it (the same bits as the forward over the whole sequence). No log-sum-exp:
// decoding keeps no backward.
void attention_decode(const DecodeShape& s, const float* qkv, float* k_cache, float* v_cache, float* y);
void attention_decode_bf16(const DecodeShape& s, const uint16_t* qkv, uint16_t* k_cache, uint16_t* v_cache,
                           uint16_t* y);

}  // namespace dpt::cpu
