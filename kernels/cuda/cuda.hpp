// The CUDA kernels: each one is the twin of the CPU kernel of the same name
// (kernels/cpu/cpu.hpp) and is tested against it. Every launcher takes the stream it runs
// on, checks its launch, and never synchronizes. Pointers are device pointers; scalars
// such as losses and norms stay on the device (only scalars cross to the host, and
// only when the caller reads them). bf16 tensors are uint16_t pointers (kernels/bf16.hpp);
// a *_bf16 kernel computes as its fp32 namesake and rounds each bf16 store to nearest
// even, as its CPU twin does.
#pragma once
#include <cstdint>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <dptrain/types.hpp>

#include "../attention.hpp"
#include "../decode.hpp"
#include "../mlp.hpp"

namespace dpt::cuda {

// Scalar reductions are deterministic (no float atomics): a fixed grid writes partial
// sums into `work`, then one block adds them in order. `work` is device memory of at
// least kReduceWork floats (cross_entropy_forward: at least max(rows, kReduceWork)).
constexpr int64_t kReduceWork = 1024;

// gemm_native.cu — hand-written tiled SGEMM (shared-memory tiles, register blocking,
// vectorized loads); strict fp32. Same contract as cpu::gemm.
void gemm_native(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* A, const float* B,
                 float beta, float* C, cudaStream_t stream);
// gemm_small.cu — strict fp32 kernels for a Linear layer's shapes at small batches:
// gemm_skinny: C = act(alpha A B^T + beta C + bias) (row-major A [m, k], B [n, k]; bias [n]
// and z, the pre-activation, may be null) for m <= kSkinnyRows, through `work`
// (gemm_skinny_work floats, 0 where k is not split; a split of k writes its partial
// products there);
// gemm_short_k: C = alpha A^T B + beta C (A [k, m], B [k, n]), for small k, and when
// colsum_A is given also colsum_A = alpha * (A's column sums) + colsum_beta * colsum_A (a
// Linear layer's bias gradient beside its weight gradient). beta == 0 never reads C (nor
// colsum_beta == 0 colsum_A). Deterministic.
// gemm_skinny_nn and gemm_short_k with deriv_of (A's layout) and an activation read A as
// A * act'(deriv_of), element by element (a Linear layer's dz = dy act'(saved), made as
// each GEMM loads dy: no pass of its own, the same products as act_bias_backward's).
// Up to 256 rows (a batch of 256, the default job's) and k (the weight gradient's batch;
// runtime/ops/linear.cpp takes them past 64 for tiny GEMMs only, where cuBLAS picks split-k GEMMs).
constexpr int64_t kSkinnyRows = 256;
constexpr int64_t kShortK = 256;
constexpr int64_t kShortKMaxRows = int64_t(65535) * 64;  // gemm_short_k's m: tiles of 64 on the grid's y
int64_t gemm_skinny_work(int64_t m, int64_t n, int64_t k);
void gemm_skinny(int64_t m, int64_t n, int64_t k, float alpha, const float* A, const float* B, float beta, float* C,
                 const float* bias, Act act, float* z, float* work, cudaStream_t stream);
// mlp.cu — a run of narrow Linear layers at a small batch in one kernel (../mlp.hpp): x is
// [rows, layer 0's in], contiguous. mlp_fits: whether the layers chain, are at most
// kMlpMaxLayers of widths up to kMlpMaxWidth, and their weights fit a block's shared
// memory on `device` (forward and backward).
bool mlp_fits(const MlpLayers& layers, int device);
void mlp_forward(int64_t rows, const float* x, const MlpLayers& layers, cudaStream_t stream);
// Its backward, from dy (the last layer's output gradient) and the outputs (and GELU's
// pre-activations) that the forward saved: the input's gradient dx (null: not wanted) and
// each block's part of every layer's weight and bias gradients, into `work`
// (dpt::mlp_backward_work floats); mlp_grad_sum then adds the parts of layers [first, last)
// into their gradients (MlpGrads), in a fixed order, so a range at a time or all at once
// gives the same bits.
void mlp_backward(int64_t rows, const float* x, const float* dy, float* dx, const MlpLayers& layers, float* work,
                  cudaStream_t stream);
void mlp_grad_sum(int64_t rows, const MlpLayers& layers, const float* work, const MlpGrads& out, int first, int last,
                  cudaStream_t stream);
// gemm_skinny_nn: C = alpha A B + beta C (A [m, k], B [k, n]) for m <= kSkinnyRows and
// k <= kSkinnyNnK, in one kernel (a small Linear layer's input gradient dz W at a small
// batch).
constexpr int64_t kSkinnyNnK = 128;
void gemm_skinny_nn(int64_t m, int64_t n, int64_t k, float alpha, const float* A, const float* B, float beta, float* C,
                    cudaStream_t stream, const float* deriv_of = nullptr, Act act = Act::none);
void gemm_short_k(int64_t m, int64_t n, int64_t k, float alpha, const float* A, const float* B, float beta, float* C,
                  cudaStream_t stream, float* colsum_A = nullptr, float colsum_beta = 0.0f,
                  const float* deriv_of = nullptr, Act act = Act::none);
// gemm_cublas.cu — the same through cuBLAS; `precision` picks fp32, TF32 or bf16 tensor
// cores (fp32 storage and accumulation). The handle must already be bound to its stream.
void gemm_cublas(cublasHandle_t handle, Precision precision, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                 float alpha, const float* A, const float* B, float beta, float* C);
// bf16 A and B on bf16 tensor cores, fp32 accumulation (CUBLAS_COMPUTE_32F); C in fp32
// or in bf16. Whatever the precision setting: the operands are bf16 already.
void gemm_bf16(cublasHandle_t handle, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* A,
               const uint16_t* B, float beta, float* C);
void gemm_bf16(cublasHandle_t handle, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* A,
               const uint16_t* B, float beta, uint16_t* C);

// The same for `batch` independent products C_i = alpha op(A_i) op(B_i) + beta C_i, the
// operands `stride_*` floats apart (fp32 storage; fp32 or TF32 math by precision).
void gemm_cublas_strided_batched(cublasHandle_t handle, Precision precision, bool ta, bool tb, int64_t m, int64_t n,
                                 int64_t k, float alpha, const float* A, int64_t stride_a, const float* B,
                                 int64_t stride_b, float beta, float* C, int64_t stride_c, int64_t batch);
// The compute type of `precision`'s fp32 GEMMs (gemm_cublas, gemm_lt): fp32, TF32 or bf16
// tensor cores, accumulating in fp32.
cublasComputeType_t compute_type(Precision precision);
// gemm_lt.cu — C = act(alpha op(A) op(B) + beta C + bias) through cuBLASLt, the bias [n]
// (may be null) and the activation (none or relu) fused into the GEMM's epilogue. Same
// layout contract as gemm_cublas; m, n, k >= 1. `workspace` is device memory of
// `workspace_bytes` (kLtWorkspaceBytes is enough) that no other stream uses meanwhile.
// False when cuBLASLt has no kernel for the call (nothing launched): the caller takes an
// unfused path.
constexpr size_t kLtWorkspaceBytes = size_t(4) << 20;
bool gemm_lt(cublasHandle_t handle, cudaStream_t stream, Precision precision, bool ta, bool tb, int64_t m, int64_t n,
             int64_t k, float alpha, const float* A, const float* B, float beta, float* C, const float* bias, Act act,
             void* workspace, size_t workspace_bytes);
// The same over other element types: A and B both f32 or both bf16, C (= D) f32 or bf16,
// the bias f32 or bf16 (cuBLASLt's default is D's type; another is asked for through
// CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE). bf16 operands compute in CUBLAS_COMPUTE_32F
// whatever the precision. A combination cuBLASLt has no kernel for returns false.
struct LtTypes {
  DType ab = DType::f32;
  DType c = DType::f32;
  DType bias = DType::f32;
};
// Act::gelu_tanh fuses too (cuBLASLt's GELU epilogue is the tanh form), and with `aux`
// (D's shape and type, n a multiple of 8, else false) writes the pre-activation there.
// With `act_grad`
// (Act::gelu_tanh, `aux` the pre-activation a GELU_AUX epilogue wrote, no bias, beta 0)
// D = (alpha op(A) op(B)) gelu'(aux): the GELU's backward in the epilogue (DGELU). lda: A's
// leading dimension where its rows are not packed (0: packed), as for the first columns of
// an input with a ones column (ops.hpp's ones_column_width).
bool gemm_lt(cublasHandle_t handle, cudaStream_t stream, Precision precision, LtTypes types, bool ta, bool tb,
             int64_t m, int64_t n, int64_t k, float alpha, const void* A, const void* B, float beta, void* C,
             const void* bias, Act act, void* workspace, size_t workspace_bytes, void* aux = nullptr,
             bool act_grad = false, int64_t lda = 0);
// Whether plans made from now on are tuned on their first call (on by default; tests turn it
// off to get the heuristic's choice to compare with), and the process's tuning so far.
void set_lt_tuning(bool on);
struct LtTuningStats {
  int64_t plans = 0;      // plans tuned
  int64_t tried = 0;      // candidates run besides the heuristic's choice
  int64_t same_bits = 0;  // of those, the ones with its bits (timed)
};
LtTuningStats lt_tuning_stats();

// activation.cu
void bias_act_forward(const float* x, const float* bias, Act act, int64_t rows, int64_t cols, float* z, float* y,
                      cudaStream_t stream);
void act_backward(const float* dy, const float* saved, Act act, int64_t n, float* dx, cudaStream_t stream);
// act_backward over a rows x cols matrix that also writes dx transposed into dxt
// ([cols, rows]): the weight gradient's GEMM then reads a K-major operand (see runtime/ops/linear.cpp).
// dx may be null (only dxt is written). With db (may be null), also db = beta db + the
// column sums of dx, deterministically, through `work` (act_backward_transposed_work floats).
void act_backward_transposed(const float* dy, const float* saved, Act act, int64_t rows, int64_t cols, float* dx,
                             float* dxt, float beta, float* db, float* work, cudaStream_t stream);
int64_t act_backward_transposed_work(int64_t rows, int64_t cols);
// The bias gradient db = beta db + column sums of dy over rows (deterministic); used by
// the convolutions (kernels of their own shape).
void bias_grad(const float* dy, int64_t rows, int64_t cols, float beta, float* db, cudaStream_t stream);
// A Linear layer's backward pass over its output gradient in one read: dz = dy * act'(saved)
// (dz may be dy; Act::none: dz = dy, saved and dz unused and may be null) and db = beta db +
// the column sums of dz, deterministically: the same bits every run. `work` holds
// act_bias_backward_work(rows, cols) floats (none for up to 256 rows).
int64_t act_bias_backward_work(int64_t rows, int64_t cols);
void act_bias_backward(const float* dy, const float* saved, Act act, int64_t rows, int64_t cols, float* dz, float beta,
                       float* db, float* work, cudaStream_t stream);
void bias_act_forward_bf16(const float* x, const uint16_t* bias, Act act, int64_t rows, int64_t cols, uint16_t* z,
                           uint16_t* y, cudaStream_t stream);
void act_forward_bf16(const uint16_t* x, Act act, int64_t n, uint16_t* y, cudaStream_t stream);
void act_backward_bf16(const uint16_t* dy, const uint16_t* saved, Act act, int64_t n, uint16_t* dx,
                       cudaStream_t stream);
// The bf16 twin: dy, saved and dz bf16 (each dz rounded once), db fp32, summing the rounded dz.
void act_bias_backward_bf16(const uint16_t* dy, const uint16_t* saved, Act act, int64_t rows, int64_t cols,
                            uint16_t* dz, float beta, float* db, float* work, cudaStream_t stream);
// A layer's parameter gradients from t = dz^T [x | ones column] ([out, ld], ld > in): dW =
// beta_w dW + t's first `in` columns ([out, in]), db = beta_b db + t's column `in`. A null
// dW or db is not wanted; beta 0 never reads it.
void ones_column_split(const float* t, int64_t out, int64_t in, int64_t ld, float beta_w, float* dW, float beta_b,
                       float* db, cudaStream_t stream);

// loss.cu — mse_forward also writes dy = 2 (y - t) / n when dy is not null, and finishes
// its reduction in one kernel through `counter`: device memory holding 0 that the kernel
// leaves at 0 (Context::counter()), used by one stream. mse_backward's dloss (device, may
// be null) and scale (host) multiply the gradient.
void mse_forward(const float* y, const float* t, int64_t n, float* loss, float* dy, float* work, unsigned* counter,
                 cudaStream_t stream);
void mse_backward(const float* y, const float* t, int64_t n, const float* dloss, float scale, float* dy,
                  cudaStream_t stream);
void cross_entropy_forward(const float* logits, const int32_t* labels, int64_t rows, int64_t cols, float* loss,
                           float* work, cudaStream_t stream);
void cross_entropy_backward(const float* logits, const int32_t* labels, int64_t rows, int64_t cols, const float* dloss,
                            float* dlogits, cudaStream_t stream);
// The share of rows whose largest logit (the first of equal ones) is at the label, into
// *out; `work` holds at least max(rows, kReduceWork) floats (as cross_entropy_forward).
void accuracy(const float* logits, const int32_t* labels, int64_t rows, int64_t cols, float* out, float* work,
              cudaStream_t stream);
void accuracy_bf16(const uint16_t* logits, const int32_t* labels, int64_t rows, int64_t cols, float* out, float* work,
                   cudaStream_t stream);
// bf16 predictions or logits (the target stays f32): loss in fp32, gradient in bf16.
void mse_forward_bf16(const uint16_t* y, const float* t, int64_t n, float* loss, uint16_t* dy, float* work,
                      unsigned* counter, cudaStream_t stream);
void mse_backward_bf16(const uint16_t* y, const float* t, int64_t n, const float* dloss, float scale, uint16_t* dy,
                       cudaStream_t stream);
void cross_entropy_forward_bf16(const uint16_t* logits, const int32_t* labels, int64_t rows, int64_t cols, float* loss,
                                float* work, cudaStream_t stream);
void cross_entropy_backward_bf16(const uint16_t* logits, const int32_t* labels, int64_t rows, int64_t cols,
                                 const float* dloss, uint16_t* dlogits, cudaStream_t stream);

// optim.cu — shadow (may be null) receives the updated parameters rounded to bf16; with
// a step counter (step.t set) the update takes its lr (and AdamW's corrections) from it
// and moves it on by one (StepCounterArgs), and rounds the shadow as step.rounding says
// (to nearest without a counter; as the CPU twins, kernels/cpu/cpu.hpp, bit for bit).
void sgd_step(float* p, const float* g, float* momentum_buf, int64_t n, const SgdArgs& a, const float* grad_scale,
              uint16_t* shadow, const StepCounterArgs& step, cudaStream_t stream);
void adamw_step(float* p, const float* g, float* m, float* v, int64_t n, const AdamArgs& a, const float* grad_scale,
                uint16_t* shadow, const StepCounterArgs& step, cudaStream_t stream);
// shadow = p rounded as the counter's last update rounded it (the CPU twin's; step.t needed).
void refresh_shadow(const float* p, uint16_t* shadow, int64_t n, const StepCounterArgs& step, cudaStream_t stream);
void clip_coef(const float* norm_sq, float max_norm, float* out, cudaStream_t stream);
// The gradient scale from the gradients in one kernel, and the check's record (CheckRingArgs;
// ring.records may be null); work holds 3 * kReduceWork floats, counter is the context's.
void check_gradients(const float* g, int64_t n, float max_norm, float* scale, float* work, unsigned* counter,
                     const CheckRingArgs& ring, cudaStream_t stream);
// check_gradients then sgd_step / adamw_step by its scale, in one launch where it can be
// (two launches otherwise): the same results bit for bit. Without clipping and with a
// backup (speculative_backup_floats of them; null: none) the launch updates before the
// check's sum is known and puts the backup back on a non-finite norm; else one launch
// needs the step counter (step.t), whose spare word is the blocks' barrier, and a grid
// that fits on the device at once.
int64_t speculative_backup_floats(int64_t n, int buffers, float max_norm);  // 0: no speculative update
void checked_sgd_step(float* p, const float* g, float* momentum_buf, int64_t n, const SgdArgs& a, uint16_t* shadow,
                      const StepCounterArgs& step, float max_norm, float* scale, float* work, unsigned* counter,
                      const CheckRingArgs& ring, float* backup, cudaStream_t stream);
void checked_adamw_step(float* p, const float* g, float* m, float* v, int64_t n, const AdamArgs& a, uint16_t* shadow,
                        const StepCounterArgs& step, float max_norm, float* scale, float* work, unsigned* counter,
                        const CheckRingArgs& ring, float* backup, cudaStream_t stream);
// check_gradients and the update without clipping in one pass over the gradients, from
// one copy of the parameters and optimizer state into the other (p[0]/p[1], and the
// state's two copies alike), the same bits as the two launches; copy 0 is read at a step
// counter of first_parity's parity (step.t is needed), copy 1 at the other. Whether the
// step is applied or skipped, the copy not read holds the state after it. 16-byte
// aligned buffers.
void alternating_sgd_step(const float* g, int64_t n, float* const p[2], float* const momentum_buf[2], const SgdArgs& a,
                          uint16_t* shadow, const StepCounterArgs& step, int64_t first_parity, float* scale,
                          float* work, unsigned* counter, const CheckRingArgs& ring, cudaStream_t stream);
void alternating_adamw_step(const float* g, int64_t n, float* const p[2], float* const m[2], float* const v[2],
                            const AdamArgs& a, uint16_t* shadow, const StepCounterArgs& step, int64_t first_parity,
                            float* scale, float* work, unsigned* counter, const CheckRingArgs& ring,
                            cudaStream_t stream);
// ZeRO: a shard's part of the check (its squares' sum, and base + the index of its first
// non-finite value, INT64_MAX for none), and the check from the parts summed (min'd).
void shard_check(const float* g, int64_t n, int64_t base, float* sum, int64_t* first, float* work, unsigned* counter,
                 cudaStream_t stream);
void finish_check(const float* sum, const int64_t* first, float max_norm, float* scale, const CheckRingArgs& ring,
                  cudaStream_t stream);

// elementwise.cu
void fill(float* x, int64_t n, float value, cudaStream_t stream);
void axpy(int64_t n, float alpha, const float* x, float* y, cudaStream_t stream);
// y += float(x); x may lie on a peer GPU that this one reads directly.
void add_bf16(const uint16_t* x, float* y, int64_t n, cudaStream_t stream);
void sum_squares(const float* x, int64_t n, float* out, float* work, cudaStream_t stream);
void cast_f32_bf16(const float* x, uint16_t* y, int64_t n, cudaStream_t stream);
void cast_bf16_f32(const uint16_t* x, float* y, int64_t n, cudaStream_t stream);
// Copies on the current device (the pieces do not overlap), in one kernel launch.
struct CopyPiece {
  void* dst;
  const void* src;
  int64_t bytes;
};
constexpr int kMaxCopyPieces = 4;
struct CopyPieces {
  CopyPiece piece[kMaxCopyPieces];
  int count = 0;
};
void copy_device(const CopyPieces& pieces, cudaStream_t stream);
// A copy inside a CUDA graph whose sources change between replays (a step's inputs, from a
// new buffer every step): the kernel node that copy_device(pieces) just recorded on
// `stream` (being captured; an error if that is not the last work recorded there), and
// new pieces for it in the graph's instance `exec` (cudaGraphExec_t; the destinations and
// sizes as recorded, the sources anywhere on the device): the launches after it copy
// those.
void* recorded_copy_node(const CopyPieces& pieces, cudaStream_t stream);
void set_copy_node_sources(void* exec, void* node, const CopyPieces& pieces);
void set_copy_node_enabled(void* exec, void* node, bool enabled);  // a disabled node does nothing
// A recorded graph (cudaGraph_t) before it is instantiated: each memset node of at most
// 4 KiB becomes a kernel node that writes the same bytes, with the same edges.
// cuBLASLt and cuDNN zero a 4-byte counter before most of their kernels (123 in a GPT-2
// step), and a memset node between two kernels leaves the H100 idle about 3 us, a kernel
// node less (0.1 ms a B 16 step: docs/performance-log.md). Returns how many it replaced.
int replace_small_memset_nodes(void* graph);
void argmax_rows(const float* x, int64_t rows, int64_t cols, int32_t* out, cudaStream_t stream);
void normal(float* out, int64_t n, uint64_t seed, uint64_t stream_id, uint64_t offset, float std, cudaStream_t stream);
void normal_rows(float* out, int64_t rows, int64_t width, uint64_t seed, uint64_t stream_id, const RowMap& map,
                 float std, bool add, cudaStream_t stream);
void uniform(float* out, int64_t n, uint64_t seed, uint64_t stream_id, uint64_t offset, float lo, float hi,
             cudaStream_t stream);

// conv.cu — NCHW convolution pieces done here rather than through cuDNN (see conv.cu).
// y[n][c][.] += b[c] over images of hw values.
void channel_bias_add(float* y, const float* b, int64_t n, int64_t c, int64_t hw, cudaStream_t stream);
// db[c] = beta db[c] + sum of dy[.][c][.], deterministic; work holds n * c floats.
void channel_bias_grad(const float* dy, int64_t n, int64_t c, int64_t hw, float beta, float* db, float* work,
                       cudaStream_t stream);
// The weight gradient as im2col and one GEMM per image (handle bound to `stream`), for
// convolutions with few inputs per output, where cuDNN's deterministic algorithms are slow.
inline bool conv_wgrad_by_gemm(const ConvShape& s) { return s.c * s.r * s.s <= 32; }
size_t conv_wgrad_gemm_work_bytes(const ConvShape& s);
void conv_wgrad_gemm(cublasHandle_t handle, Precision precision, const ConvShape& s, const float* x, const float* dy,
                     float beta, float* dw, float* work, cudaStream_t stream);

// ---- Transformer ops (embedding.cu, layernorm.cu): the CPU twins' contracts (cpu.hpp) ----
// A token outside [0, vocab) is not refused here (that would wait for the device): the
// forward skips its wte row and the backward gives it no gradient, so nothing is read or
// written outside wte. The backward sorts the positions by token (CUB, stable) through
// `work`, embedding_backward_work_bytes(rows, vocab) bytes (0 for no rows), no float atomics.
size_t embedding_backward_work_bytes(int64_t rows, int64_t vocab);
void embedding_forward(const int32_t* tokens, int64_t rows, int64_t seq, const float* wte, int64_t vocab,
                       const float* wpe, int64_t C, float* y, cudaStream_t stream);
void embedding_forward_bf16(const int32_t* tokens, int64_t rows, int64_t seq, const float* wte, int64_t vocab,
                            const float* wpe, int64_t C, uint16_t* y, cudaStream_t stream);
void embedding_backward(const int32_t* tokens, int64_t rows, int64_t seq, const float* dy, int64_t vocab,
                        int64_t positions, int64_t C, float beta_wte, float* dwte, float beta_wpe, float* dwpe,
                        void* work, cudaStream_t stream);
void embedding_backward_bf16(const int32_t* tokens, int64_t rows, int64_t seq, const uint16_t* dy, int64_t vocab,
                             int64_t positions, int64_t C, float beta_wte, float* dwte, float beta_wpe, float* dwpe,
                             void* work, cudaStream_t stream);
// Stage two of a deterministic column sum: out[c] = beta out[c] + the sum over k < chunks of
// part[k][c], in a fixed order (the bias gradients' and LayerNorm's; beta 0 never reads out).
// column_sums_finish does two such sums of one shape in one launch (LayerNorm's gamma and
// beta); one whose out is null is not wanted.
struct ColumnSum {
  const float* part = nullptr;
  float beta = 0.f;
  float* out = nullptr;
};
void column_sums_finish(ColumnSum first, ColumnSum second, int64_t chunks, int64_t cols, cudaStream_t stream);
// LayerNorm: the backward's parameter gradients go through `work`
// (layer_norm_backward_work(rows, cols) floats) in two deterministic stages.
int64_t layer_norm_backward_work(int64_t rows, int64_t cols);
void layer_norm_forward(const float* x, const float* gamma, const float* beta, int64_t rows, int64_t cols, float eps,
                        float* y, float* mean, float* rstd, cudaStream_t stream);
// The bf16 forms write y's rows ldy >= cols apart, with the ones column after the values
// where ldy > cols (as cpu::layer_norm_forward_bf16).
void layer_norm_forward_bf16(const uint16_t* x, const float* gamma, const float* beta, int64_t rows, int64_t cols,
                             float eps, uint16_t* y, int64_t ldy, float* mean, float* rstd, cudaStream_t stream);
// h = a + b (residual_add's bits) and y = LayerNorm(h) (layer_norm_forward's bits), in one
// pass where the row fits a warp's registers.
void add_layer_norm_forward(const float* a, const float* b, const float* gamma, const float* beta, int64_t rows,
                            int64_t cols, float eps, float* h, float* y, float* mean, float* rstd, cudaStream_t stream);
void add_layer_norm_forward_bf16(const uint16_t* a, const uint16_t* b, const float* gamma, const float* beta,
                                 int64_t rows, int64_t cols, float eps, uint16_t* h, uint16_t* y, int64_t ldy,
                                 float* mean, float* rstd, cudaStream_t stream);
// dx_add: dx holds a gradient to add to (rounded once), not to overwrite. dx_part (null, or
// layer_norm_backward_chunks(rows) x cols floats): stage one of dx's column sums, a row of
// each chunk's, summed in row order from the dx written (finished by column_sums_finish);
// made by the fused kernel only, and the return says whether it was.
int64_t layer_norm_backward_chunks(int64_t rows);
bool layer_norm_backward(const float* x, const float* dy, const float* gamma, const float* mean, const float* rstd,
                         int64_t rows, int64_t cols, float* dx, bool dx_add, float beta_gamma, float* dgamma,
                         float beta_beta, float* dbeta, float* work, float* dx_part, cudaStream_t stream);
bool layer_norm_backward_bf16(const uint16_t* x, const uint16_t* dy, const float* gamma, const float* mean,
                              const float* rstd, int64_t rows, int64_t cols, uint16_t* dx, bool dx_add,
                              float beta_gamma, float* dgamma, float beta_beta, float* dbeta, float* work,
                              float* dx_part, cudaStream_t stream);
void residual_add(const float* a, const float* b, int64_t n, float* y, cudaStream_t stream);
void residual_add_bf16(const uint16_t* a, const uint16_t* b, int64_t n, uint16_t* y, cudaStream_t stream);

// ---- Transformer ops: attention and classifier -----------------------------------------
// attention.cu — causal self-attention (../attention.hpp), head sizes up to
// kAttentionMaxHeadSize: y and lse as cpu::attention_forward; the backward writes the whole
// of dqkv through `work` (s.softmax_rows() floats). Deterministic.
void attention_forward(const AttentionShape& s, const float* qkv, float* y, float* lse, cudaStream_t stream);
void attention_forward_bf16(const AttentionShape& s, const uint16_t* qkv, uint16_t* y, float* lse, cudaStream_t stream);
void attention_backward(const AttentionShape& s, const float* qkv, const float* y, const float* dy, const float* lse,
                        float* dqkv, float* work, cudaStream_t stream);
void attention_backward_bf16(const AttentionShape& s, const uint16_t* qkv, const uint16_t* y, const uint16_t* dy,
                             const float* lse, uint16_t* dqkv, float* work, cudaStream_t stream);
// classifier.cu — the loss (and with write_grad the gradient over the logits) as
// cpu::classifier_forward, through `work` (at least max(rows, kReduceWork) floats);
// classifier_grad_scale as cpu::classifier_grad_scale (dloss on the device, may be null).
void classifier_forward(float* logits, const int32_t* targets, int64_t rows, int64_t cols, int64_t vocab, float* loss,
                        bool write_grad, float* work, cudaStream_t stream);
void classifier_forward_bf16(uint16_t* logits, const int32_t* targets, int64_t rows, int64_t cols, int64_t vocab,
                             float* loss, bool write_grad, float* work, cudaStream_t stream);
void classifier_grad_scale(float* g, int64_t n, const float* dloss, float scale, cudaStream_t stream);
void classifier_grad_scale_bf16(uint16_t* g, int64_t n, const float* dloss, float scale, cudaStream_t stream);

// elementwise.cu — synthetic language-model data as cpu::random_tokens (the same tokens).
void random_tokens(int32_t* x, int32_t* y, int64_t rows, int64_t seq, int64_t vocab, uint64_t seed, uint64_t stream_id,
                   const RowMap& map, cudaStream_t stream);

// ---- Decoding with a key-value cache (decode.cu) -----------------------------------------
// cpu::attention_decode's contract (fp32 math, the sums in another order: equal within
// fp32 rounding, not in bits). Deterministic.
void attention_decode(const DecodeShape& s, const float* qkv, float* k_cache, float* v_cache, float* y,
                      cudaStream_t stream);
void attention_decode_bf16(const DecodeShape& s, const uint16_t* qkv, uint16_t* k_cache, uint16_t* v_cache, uint16_t* y,
                           cudaStream_t stream);

}  // namespace dpt::cuda
