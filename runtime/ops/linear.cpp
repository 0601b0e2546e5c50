// The GEMM and the layers built on it: gemm, matmul, linear (fp32, tf32 and bf16 compute),
// and linear_chain, a stack of small layers in one launch each way. (The bf16 MLP as one
// op: gelu_mlp.cpp.)
#include <algorithm>
#include <cstring>

#include <dptrain/error.hpp>
#include <dptrain/runtime/autograd.hpp>
#include <dptrain/runtime/context.hpp>
#include <dptrain/runtime/ops.hpp>
#include "internal.hpp"
#include "kernels/cpu/cpu.hpp"
#include "linear_internal.hpp"

#if DPT_WITH_CUDA
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/cuda.hpp"
#endif

namespace dpt {

using namespace detail;

namespace {

#if DPT_WITH_CUDA
// A cuBLASLt GEMM on ctx's stream (gemm_lt), its workspace from the caching allocator;
// false when cuBLASLt has no kernel for it (then nothing ran).
bool lt_gemm(Context& ctx, const Device& d, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
             const float* A, const float* B, float beta, float* C, const float* bias, Act act) {
  Tensor ws = Tensor::empty({static_cast<int64_t>(cuda::kLtWorkspaceBytes / sizeof(float))}, DType::f32, d);
  return cuda::gemm_lt(static_cast<cublasHandle_t>(ctx.blas_lt()), stream_of(d), ctx.precision, ta, tb, m, n, k, alpha,
                       A, B, beta, C, bias, act, ws.data(), cuda::kLtWorkspaceBytes);
}
// gemm_skinny's partial products, for the call it is made for: none where k is not split
// (data null), so that the one-kernel form allocates nothing.
struct SkinnyWork {
  Tensor t;
  float* data = nullptr;
  SkinnyWork(int64_t m, int64_t n, int64_t k, const Device& d) {
    if (const int64_t floats = cuda::gemm_skinny_work(m, n, k); floats > 0) {
      t = Tensor::empty({floats}, DType::f32, d);
      data = t.f32();
    }
  }
};
#endif

#if DPT_WITH_CUDA
// Strict fp32 GEMMs of a Linear layer at a small batch take our own kernels (gemm_small.cu):
// the forward (A B^T) with at most 64 rows and the weight gradient (A^T B) over at most 64
// rows of batch. cuBLAS's general kernels leave most of the GPU idle there (the seed
// workload's forward took two of them; README, "Measurements behind the code"). Up to 256
// rows when the whole GEMM is tiny (kTinyMultiplyAdds), where cuBLAS runs split-k GEMMs of
// two or three kernels (the default job's layers, batch 256) and launches, not arithmetic,
// are the time. The input gradient (A B) of such a tiny layer with k <= 128 (its outputs)
// takes the skinny kernel's one-kernel form, where cuBLAS ran one or two kernels (the
// default job's output layer: 4.3 us against 5.9) and each call cost the host more than a
// launch. That kernel computes whole 64 x 64 x 64 tiles, so "tiny" counts its padded
// work there (a product with k = 1 and a huge n is cuBLAS's, at memory speed).
constexpr double kTinyMultiplyAdds = 1 << 25;
enum class SmallGemm { none, skinny, skinny_nn, short_k };
SmallGemm small_gemm(const Context& ctx, bool ta, bool tb, int64_t m, int64_t n, int64_t k) {
  if (ctx.gemm != GemmImpl::native && ctx.precision != Precision::fp32) return SmallGemm::none;
  const bool tiny = static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) <= kTinyMultiplyAdds;
  if (!ta && tb && (m <= 64 || (tiny && m <= cuda::kSkinnyRows))) return SmallGemm::skinny;
  if (ta && !tb && (k <= 64 || (tiny && k <= cuda::kShortK)) && m <= cuda::kShortKMaxRows) return SmallGemm::short_k;
  const auto padded = [](int64_t d) { return static_cast<double>((std::max<int64_t>(d, 1) + 63) / 64 * 64); };
  if (!ta && !tb && m <= cuda::kSkinnyRows && k <= cuda::kSkinnyNnK &&
      padded(m) * padded(n) * padded(k) <= kTinyMultiplyAdds)
    return SmallGemm::skinny_nn;
  return SmallGemm::none;
}
#endif

}  // namespace

namespace detail {

#if DPT_WITH_CUDA
bool lt_gemm(Context& ctx, const Device& d, cuda::LtTypes types, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
             float alpha, const void* A, const void* B, float beta, void* C, const void* bias, Act act, void* aux,
             bool act_grad, int64_t lda) {
  Tensor ws = Tensor::empty({static_cast<int64_t>(cuda::kLtWorkspaceBytes / sizeof(float))}, DType::f32, d);
  return cuda::gemm_lt(static_cast<cublasHandle_t>(ctx.blas_lt()), stream_of(d), ctx.precision, types, ta, tb, m, n, k,
                       alpha, A, B, beta, C, bias, act, ws.data(), cuda::kLtWorkspaceBytes, aux, act_grad, lda);
}

Tensor bias_work(const Device& d, int64_t floats) {
  return Tensor::empty({std::max<int64_t>(1, floats)}, DType::f32, d);
}
#endif

void check_saved(const SavedInput& s, const Tensor& x, const char* op, int64_t in) {
  if (s.kind == SavedInput::Kind::input) return;
  const Tensor& f = s.from;
  const bool ln = s.kind == SavedInput::Kind::layer_norm_of;
  Shape rebuilt = f.defined() ? f.shape() : Shape{};
  if (ln && s.ones_column && f.defined() && f.dim() == 2) rebuilt = {f.size(0), ones_column_width(f.size(1))};
  DPT_REQUIRE(f.defined() && rebuilt == x.shape() && f.dtype() == x.dtype() && f.device() == x.device() &&
                  (!ln || f.size(1) == in),
              std::string(op) + ": the saved input (" +
                  (f.defined() ? shape_str(f.shape()) + " " + dtype_name(f.dtype()) : std::string("none")) +
                  (ln && s.ones_column ? ", with a ones column" : "") + ") does not rebuild x " + shape_str(x.shape()) +
                  " " + dtype_name(x.dtype()) + " of " + std::to_string(in) + " values");
  if (ln)
    DPT_REQUIRE(
        s.gamma.defined() && s.beta.defined() && s.gamma.shape() == Shape{in} && s.beta.shape() == s.gamma.shape(),
        std::string(op) + ": the saved LayerNorm's gamma and beta are not [" + std::to_string(in) + "]");
}

void check_linear_bf16(const Tensor& x, const Tensor& W, const Tensor& b, const Tensor& W16, const Tensor& b16,
                       bool ones_column) {
  need_bf16(x, "linear_bf16");
  need_f32(W, "linear_bf16");
  need_bf16(W16, "linear_bf16 (weight copy)");
  same_device(x, W, "linear_bf16");
  same_device(W, W16, "linear_bf16");
  DPT_REQUIRE(x.dim() == 2 && W.dim() == 2 && x.size(1) == (ones_column ? ones_column_width(W.size(1)) : W.size(1)) &&
                  W16.shape() == W.shape(),
              "linear_bf16: input " + shape_str(x.shape()) + (ones_column ? " with a ones column" : "") +
                  " does not fit weight " + shape_str(W.shape()) + " (bf16 copy " + shape_str(W16.shape()) + ")");
  DPT_REQUIRE(!ones_column || !(x.is_leaf() && x.requires_grad()),
              "linear_bf16: an input with a ones column is a LayerNorm's output, not a leaf (its gradient has no ones "
              "column)");
  DPT_REQUIRE(b.defined() == b16.defined(), "linear_bf16: a bias needs its bf16 copy, and only a bias has one");
  if (b.defined()) {
    need_f32(b, "linear_bf16");
    need_bf16(b16, "linear_bf16 (bias copy)");
    DPT_REQUIRE(b.dim() == 1 && b.size(0) == W.size(0) && b16.shape() == b.shape(),
                "linear_bf16: bias " + shape_str(b.shape()) + " does not fit weight " + shape_str(W.shape()));
  }
}

}  // namespace detail

void gemm(bool ta, bool tb, float alpha, const Tensor& A, const Tensor& B, float beta, const Tensor& C) {
  const bool bf16 = is_bf16(A);
  if (bf16) {
    need_bf16(B, "gemm (bf16 A)");
    need_float(C, "gemm");
  } else {
    need_f32(A, "gemm");
    need_f32(B, "gemm");
    need_f32(C, "gemm");
  }
  same_device(A, B, "gemm");
  same_device(A, C, "gemm");
  DPT_REQUIRE(A.dim() == 2 && B.dim() == 2 && C.dim() == 2, "gemm: operands must be matrices");
  const int64_t m = ta ? A.size(1) : A.size(0), k = ta ? A.size(0) : A.size(1);
  const int64_t kb = tb ? B.size(1) : B.size(0), n = tb ? B.size(0) : B.size(1);
  DPT_REQUIRE(k == kb && C.size(0) == m && C.size(1) == n, "gemm: shapes " + shape_str(A.shape()) + (ta ? "^T" : "") +
                                                               " x " + shape_str(B.shape()) + (tb ? "^T" : "") +
                                                               " -> " + shape_str(C.shape()) + " do not match");
  if (m == 0 || n == 0) return;
  if (bf16) {
#if DPT_WITH_CUDA
    if (const Device d = C.device(); d.is_cuda()) {
      // Large ones through cuBLASLt, whose plans are tuned on their first call (gemm_lt.cu).
      if (static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) >= kLtMinMultiplyAdds &&
          lt_gemm(context(d), d, cuda::LtTypes{DType::bf16, C.dtype(), DType::bf16}, ta, tb, m, n, k, alpha, A.data(),
                  B.data(), beta, C.data(), nullptr, Act::none))
        return;
      const auto h = static_cast<cublasHandle_t>(context(d).blas());
      (void)stream_of(d);  // the device made current; the handle is bound to the stream
      if (is_bf16(C)) cuda::gemm_bf16(h, ta, tb, m, n, k, alpha, A.bf16(), B.bf16(), beta, C.bf16());
      else cuda::gemm_bf16(h, ta, tb, m, n, k, alpha, A.bf16(), B.bf16(), beta, C.f32());
      return;
    }
#endif
    if (is_bf16(C)) cpu::gemm_bf16(ta, tb, m, n, k, alpha, A.bf16(), B.bf16(), beta, C.bf16());
    else cpu::gemm_bf16(ta, tb, m, n, k, alpha, A.bf16(), B.bf16(), beta, C.f32());
    return;
  }
#if DPT_WITH_CUDA
  if (const Device d = C.device(); d.is_cuda()) {
    Context& ctx = context(d);
    cudaStream_t s = stream_of(d);
    if (const SmallGemm small = small_gemm(ctx, ta, tb, m, n, k); small == SmallGemm::skinny)
      cuda::gemm_skinny(m, n, k, alpha, A.f32(), B.f32(), beta, C.f32(), nullptr, Act::none, nullptr,
                        SkinnyWork(m, n, k, d).data, s);
    else if (small == SmallGemm::short_k) cuda::gemm_short_k(m, n, k, alpha, A.f32(), B.f32(), beta, C.f32(), s);
    else if (small == SmallGemm::skinny_nn) cuda::gemm_skinny_nn(m, n, k, alpha, A.f32(), B.f32(), beta, C.f32(), s);
    else if (ctx.gemm == GemmImpl::native)
      cuda::gemm_native(ta, tb, m, n, k, alpha, A.f32(), B.f32(), beta, C.f32(), s);
    else
      cuda::gemm_cublas(static_cast<cublasHandle_t>(ctx.blas()), ctx.precision, ta, tb, m, n, k, alpha, A.f32(),
                        B.f32(), beta, C.f32());
    return;
  }
#endif
  cpu::gemm(ta, tb, m, n, k, alpha, A.f32(), B.f32(), beta, C.f32());
}

namespace {

class MatmulNode : public Node {
 public:
  MatmulNode(Tensor a, Tensor b, bool ta, bool tb) : a_(a.untracked()), b_(b.untracked()), ta_(ta), tb_(tb) {}
  const char* name() const override { return "matmul"; }
  void backward(Tensor& dc, Grads& grads) override {
    // C = op(A) op(B): dop(A) = dC op(B)^T, dop(B) = op(A)^T dC, then undo each op.
    if (grads.needed(0)) {
      Tensor acc = grads.accumulator(0);
      const float beta0 = acc.defined() ? grads.take_beta(0) : 0.0f;
      Tensor da = acc.defined() ? acc : Tensor::empty(a_.shape(), DType::f32, a_.device());
      if (ta_) gemm(tb_, true, 1.0f, b_, dc, beta0, da);  // dA = op(B) dC^T
      else gemm(false, !tb_, 1.0f, dc, b_, beta0, da);    // dA = dC op(B)^T
      if (!acc.defined()) grads.put(0, da);
    }
    if (grads.needed(1)) {
      Tensor acc = grads.accumulator(1);
      const float beta1 = acc.defined() ? grads.take_beta(1) : 0.0f;
      Tensor db = acc.defined() ? acc : Tensor::empty(b_.shape(), DType::f32, b_.device());
      if (tb_) gemm(true, ta_, 1.0f, dc, a_, beta1, db);  // dB = dC^T op(A)
      else gemm(!ta_, false, 1.0f, a_, dc, beta1, db);    // dB = op(A)^T dC
      if (!acc.defined()) grads.put(1, db);
    }
  }

 private:
  Tensor a_, b_;
  bool ta_, tb_;
};

class LinearNode : public Node {
 public:
  LinearNode(NodeInput x, Tensor W, Tensor saved, Act act)
      : x_(std::move(x)), W_(W.untracked()), saved_(saved.untracked()), act_(act) {}
  const char* name() const override { return "linear"; }
  void backward(Tensor& dy, Grads& grads) override {
    const int64_t rows = x_.size(0), out = W_.size(0);
    const Device d = dy.device();
    // One pass over dy: dz = dy * act'(.) in place (dy is ours to overwrite) and, when the
    // bias needs it, db from the same reads.
    const bool want_db = inputs.size() > 2 && grads.needed(2);
    GradSlot db;
    if (want_db) db = grad_slot(grads, 2, {out}, d);
    Tensor dzt;  // dz transposed, when the weight gradient reads it (see below)
    bool dz_done = false;
#if DPT_WITH_CUDA
    // TF32 tensor cores want operands whose K dimension is contiguous. The weight
    // gradient's K is the batch, along which neither dz nor x is contiguous, and cuBLAS
    // then runs it far slower than the forward GEMMs (README, "Measurements behind the
    // code"). With dz transposed, written by the activation's backward
    // in the same pass, one operand is K-major, as in the input-gradient GEMM, which runs
    // at forward speed. Only for large GEMMs (as the fused forward epilogue). dz itself is
    // written only when the input-gradient GEMM reads it and differs from dy.
    if (Context& ctx = context(d);
        d.is_cuda() && ctx.gemm == GemmImpl::cublas && ctx.precision == Precision::tf32 && grads.needed(1) &&
        (rows + 31) / 32 <= 65535 &&
        static_cast<double>(rows) * static_cast<double>(out) * static_cast<double>(x_.size(1)) >= kLtMinMultiplyAdds) {
      dzt = Tensor::empty({out, rows}, DType::f32, d);
      float* dz = grads.needed(0) && act_ != Act::none ? dy.f32() : nullptr;
      cuda::act_backward_transposed(
          dy.f32(), saved_.f32(), act_, rows, out, dz, dzt.f32(), db.beta, want_db ? db.t.f32() : nullptr,
          bias_work(d, want_db ? cuda::act_backward_transposed_work(rows, out) : 0).f32(), stream_of(d));
      dz_done = true;
    }
    // A small layer whose weight gradient takes the short-k kernel (a small batch) gets its
    // bias gradient from that kernel too, and where its input gradient takes the skinny A B
    // kernel (or is not wanted), both kernels make dz = dy act'(saved) as they load dy: no
    // pass of its own over dy (the default job's two hidden layers: a kernel less each).
    // Not without inputs: a weight gradient with no columns launches nothing.
    const int64_t in = x_.size(1);
    const bool dW_short_k = !dz_done && grads.needed(1) && d.is_cuda() && in > 0 &&
                            small_gemm(context(d), true, false, out, in, rows) == SmallGemm::short_k;
    const bool deriv_on_load =
        dW_short_k && act_ != Act::none &&
        (!grads.needed(0) || small_gemm(context(d), false, false, rows, in, out) == SmallGemm::skinny_nn);
    const bool db_with_dW = want_db && dW_short_k && (act_ == Act::none || deriv_on_load);
#else
    const bool db_with_dW = false, deriv_on_load = false;
#endif
    if (!dz_done && want_db && !db_with_dW) {
      DPT_CUDA_OR_CPU(
          d,
          cuda::act_bias_backward(dy.f32(), saved_.f32(), act_, rows, out, dy.f32(), db.beta, db.t.f32(),
                                  bias_work(d, cuda::act_bias_backward_work(rows, out)).f32(), stream_of(d)),
          cpu::act_bias_backward(dy.f32(), saved_.f32(), act_, rows, out, dy.f32(), db.beta, db.t.f32()));
    } else if (!dz_done && act_ != Act::none && !deriv_on_load) {
      DPT_CUDA_OR_CPU(d, cuda::act_backward(dy.f32(), saved_.f32(), act_, dy.numel(), dy.f32(), stream_of(d)),
                      cpu::act_backward(dy.f32(), saved_.f32(), act_, dy.numel(), dy.f32()));
    }
    if (dzt.defined()) {  // dW (+)= dz^T x from the transposed copy, which then goes
      GradSlot dW = grad_slot(grads, 1, W_.shape(), d);
      gemm(false, false, 1.0f, dzt, x_.values(), dW.beta, dW.t);
      put_slot(grads, 1, dW);
      dzt = Tensor();  // freed before dx is made: the step's peak memory does not grow
    }
    if (grads.needed(0)) {  // dx = dz W
      Tensor dx = Tensor::empty(x_.shape(), DType::f32, d);
#if DPT_WITH_CUDA
      if (deriv_on_load)
        cuda::gemm_skinny_nn(rows, in, out, 1.0f, dy.f32(), W_.f32(), 0.0f, dx.f32(), stream_of(d), saved_.f32(), act_);
      else
#endif
        gemm(false, false, 1.0f, dy, W_, 0.0f, dx);
      give(grads, 0, dx);
    }
    if (grads.needed(1) && !dz_done) {  // dW (+)= dz^T x, straight into the flat gradient buffer
      GradSlot dW = grad_slot(grads, 1, W_.shape(), d);
      const Tensor x = x_.values();
#if DPT_WITH_CUDA
      if (db_with_dW || deriv_on_load)
        cuda::gemm_short_k(out, in, rows, 1.0f, dy.f32(), x.f32(), dW.beta, dW.t.f32(), stream_of(d),
                           db_with_dW ? db.t.f32() : nullptr, db.beta, deriv_on_load ? saved_.f32() : nullptr, act_);
      else
#endif
        gemm(true, false, 1.0f, dy, x, dW.beta, dW.t);
      put_slot(grads, 1, dW);
    }
    if (want_db) put_slot(grads, 2, db);
  }

 private:
  NodeInput x_;
  Tensor W_, saved_;
  Act act_;
};

#if DPT_WITH_CUDA
// linear_chain's backward: one kernel for every layer's input gradient and each block's
// part of the weight and bias gradients (kernels/cuda/mlp.cu), one that adds the parts.
// Each layer's parameters are handed to the leaf hooks as a layer's own node would hand
// them, last layer first; where the hooks wait before each write (ZeRO stage 2), the parts
// are added a layer at a time (the same bits). Inputs: x, then each layer's W and (if any) b.
class LinearChainNode : public Node {
 public:
  // `run`: the forward's layers; `keep`: the tensors its pointers point into.
  LinearChainNode(Tensor x, const MlpLayers& run, std::vector<Tensor> keep)
      : x_(x.untracked()), run_(run), keep_(std::move(keep)) {}
  const char* name() const override { return "linear_chain"; }
  bool hands_over_in_turn() const override { return true; }
  void backward(Tensor& dy, Grads& grads) override {
    const Device d = dy.device();
    const int64_t rows = x_.size(0);
    const auto layers = static_cast<size_t>(run_.count);
    std::vector<size_t> first_input(layers);  // where layer l's W is among the inputs
    for (size_t l = 0, i = 1; l < layers; ++l) {
      first_input[l] = i;
      i += run_.layer[l].b ? 2 : 1;
    }
    Tensor dx = grads.needed(0) ? Tensor::empty(x_.shape(), DType::f32, d) : Tensor();
    Tensor work = Tensor::empty({mlp_backward_work(rows, run_)}, DType::f32, d);
    cuda::mlp_backward(rows, x_.f32(), dy.f32(), dx.defined() ? dx.f32() : nullptr, run_, work.f32(), stream_of(d));
    MlpGrads out;
    std::vector<GradSlot> dW(layers), db(layers);
    auto prepare = [&](size_t l) {
      const size_t w = first_input[l];
      const MlpLayer& L = run_.layer[l];
      grads.before_write(w);
      if (L.b) grads.before_write(w + 1);
      if (grads.needed(w)) {
        dW[l] = grad_slot(grads, w, {L.out, L.in}, d);
        out.dW[l] = dW[l].t.f32();
        out.beta_W[l] = dW[l].beta;
      }
      if (L.b && grads.needed(w + 1)) {
        db[l] = grad_slot(grads, w + 1, {L.out}, d);
        out.db[l] = db[l].t.f32();
        out.beta_b[l] = db[l].beta;
      }
    };
    auto finish = [&](size_t l) {
      const size_t w = first_input[l];
      if (out.dW[l]) put_slot(grads, w, dW[l]);
      grads.handed(w);
      if (run_.layer[l].b) {
        if (out.db[l]) put_slot(grads, w + 1, db[l]);
        grads.handed(w + 1);
      }
    };
    const int count = run_.count;
    if (grads.watches_writes()) {
      for (int l = count - 1; l >= 0; --l) {
        prepare(static_cast<size_t>(l));
        cuda::mlp_grad_sum(rows, run_, work.f32(), out, l, l + 1, stream_of(d));
        finish(static_cast<size_t>(l));
      }
    } else {
      for (int l = count - 1; l >= 0; --l) prepare(static_cast<size_t>(l));
      cuda::mlp_grad_sum(rows, run_, work.f32(), out, 0, count, stream_of(d));
      for (int l = count - 1; l >= 0; --l) finish(static_cast<size_t>(l));
    }
    if (dx.defined()) {  // announced last, as a layer-by-layer backward reaches x last
      grads.before_write(0);
      give(grads, 0, dx);
      grads.handed(0);
    }
  }

 private:
  Tensor x_;
  MlpLayers run_;
  std::vector<Tensor> keep_;
};
#endif

// Saves the bf16 input and weight copy (the masters are its inputs, for their gradients)
// and the bf16 output, or the pre-activation for GELU; nothing without an activation (its
// backward reads neither, and the output is freed once the forward is past it).
class LinearBf16Node : public Node {
 public:
  LinearBf16Node(NodeInput x, Tensor W16, Tensor saved, Act act)
      : x_(std::move(x)), W16_(W16.untracked()), saved_(act == Act::none ? Tensor() : saved.untracked()), act_(act) {}
  const char* name() const override { return "linear_bf16"; }
  bool overwrites_grad() const override { return act_ != Act::none; }  // dz = dy act'(.) in place
  // Without an activation the bias gradient is dy's column sums.
  bool takes_output_sums() const override {
    return act_ == Act::none && x_.size(1) == W16_.size(1) && inputs.size() > 2 && inputs[2].requires_grad();
  }
  void backward(Tensor& dy_in, Grads& grads) override {
    const int64_t rows = x_.size(0), out = W16_.size(0), in = W16_.size(1);
    const Device d = dy_in.device();
    Tensor dy = is_bf16(dy_in) ? dy_in : cast(dy_in, DType::bf16);
    // With an activation, dz = dy * act'(.) in bf16, in place (dy is ours to overwrite), and db
    // (fp32) from the same pass unless x's ones column makes it in dW's GEMM. Without one,
    // bf16_param_grads makes db (from the ones column, dy's column sums, or a pass of its own).
    const uint16_t* saved = saved_.defined() ? saved_.bf16() : nullptr;  // none without an activation
    const bool ones_column = x_.size(1) != in, want_b = inputs.size() > 2 && grads.needed(2);
    const bool db_with_act = want_b && act_ != Act::none && !ones_column;
    if (db_with_act) {
      GradSlot db = grad_slot(grads, 2, {out}, d);
      DPT_CUDA_OR_CPU(
          d,
          cuda::act_bias_backward_bf16(dy.bf16(), saved, act_, rows, out, dy.bf16(), db.beta, db.t.f32(),
                                       bias_work(d, cuda::act_bias_backward_work(rows, out)).f32(), stream_of(d)),
          cpu::act_bias_backward_bf16(dy.bf16(), saved, act_, rows, out, dy.bf16(), db.beta, db.t.f32()));
      put_slot(grads, 2, db);
    } else if (act_ != Act::none) {
      DPT_CUDA_OR_CPU(d, cuda::act_backward_bf16(dy.bf16(), saved_.bf16(), act_, dy.numel(), dy.bf16(), stream_of(d)),
                      cpu::act_backward_bf16(dy.bf16(), saved_.bf16(), act_, dy.numel(), dy.bf16()));
    }
    if (grads.needed(0)) {  // dx (bf16) = dz W16, without x's ones column
      Tensor dx = Tensor::empty({rows, in}, DType::bf16, d);
      gemm(false, false, 1.0f, dy, W16_, 0.0f, dx);
      give(grads, 0, dx);
    }
    // dW (fp32, +=) = dz^T x, straight into the flat gradient buffer (and db where not made above)
    const size_t b = want_b && !db_with_act ? 2 : kNoInput;
    if (grads.needed(1) || b != kNoInput)
      bf16_param_grads(dy, x_.values(), in, grads, 1, b, act_ == Act::none ? grads.output_sums() : ColumnSums{});
  }

 private:
  NodeInput x_;
  Tensor W16_, saved_;
  Act act_;
};

}  // namespace

namespace {
// The bias and activation after a GEMM that did not fuse them: y = act(acc + bias), and z
// (when defined) the pre-activation that GELU's backward keeps. acc [rows, out] is f32; y
// is acc itself (f32) or bf16, rounded once, and then bias and z are bf16 too.
void bias_act(const Tensor& acc, const Tensor& bias, Act act, const Tensor& z, const Tensor& y) {
  const Device d = acc.device();
  const int64_t rows = acc.size(0), out = acc.size(1);
  if (y.dtype() == DType::bf16) {
    const uint16_t* b = bias.defined() ? bias.bf16() : nullptr;
    uint16_t* zp = z.defined() ? z.bf16() : nullptr;
    DPT_CUDA_OR_CPU(d, cuda::bias_act_forward_bf16(acc.f32(), b, act, rows, out, zp, y.bf16(), stream_of(d)),
                    cpu::bias_act_forward_bf16(acc.f32(), b, act, rows, out, zp, y.bf16()));
  } else {
    const float* b = bias.defined() ? bias.f32() : nullptr;
    float* zp = z.defined() ? z.f32() : nullptr;
    DPT_CUDA_OR_CPU(d, cuda::bias_act_forward(acc.f32(), b, act, rows, out, zp, y.f32(), stream_of(d)),
                    cpu::bias_act_forward(acc.f32(), b, act, rows, out, zp, y.f32()));
  }
}
}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  need_f32(a, "matmul");
  need_f32(b, "matmul");
  DPT_REQUIRE(a.dim() == 2 && b.dim() == 2, "matmul: operands must be matrices");
  Tensor c = Tensor::empty({ta ? a.size(1) : a.size(0), tb ? b.size(0) : b.size(1)}, DType::f32, a.device());
  gemm(ta, tb, 1.0f, a, b, 0.0f, c);
  if (any_requires_grad({&a, &b})) record(c, std::make_shared<MatmulNode>(a, b, ta, tb), {a, b});
  return c;
}

namespace {

void check_linear(const Tensor& x, const Tensor& W, const Tensor& b) {
  need_f32(x, "linear");
  need_f32(W, "linear");
  same_device(x, W, "linear");
  if (b.defined()) same_device(x, b, "linear");
  DPT_REQUIRE(x.dim() == 2 && W.dim() == 2 && x.size(1) == W.size(1),
              "linear: input " + shape_str(x.shape()) + " does not fit weight " + shape_str(W.shape()));
  DPT_REQUIRE(!b.defined() || (b.dim() == 1 && b.size(0) == W.size(0)),
              "linear: bias " + shape_str(b.shape()) + " does not fit weight " + shape_str(W.shape()));
}

// linear's forward without autograd: y = act(x W^T + b), and z (when defined) GELU's pre-activation.
void linear_values(const Tensor& x, const Tensor& W, const Tensor& b, Act act, const Tensor& y, const Tensor& z) {
  bool fused = false;  // bias and activation done in the GEMM's epilogue
#if DPT_WITH_CUDA
  const Device d = x.device();
  const int64_t rows = x.size(0), out = W.size(0);
  // cuBLASLt's epilogue for large GEMMs only (kLtMinMultiplyAdds).
  const double multiply_adds = static_cast<double>(rows) * static_cast<double>(out) * static_cast<double>(x.size(1));
  if (Context& ctx = context(d);
      d.is_cuda() && rows > 0 && out > 0 && small_gemm(ctx, false, true, rows, out, x.size(1)) == SmallGemm::skinny) {
    // A small batch: our skinny GEMM, the bias and activation in its second pass.
    cuda::gemm_skinny(rows, out, x.size(1), 1.0f, x.f32(), W.f32(), 0.0f, y.f32(), b.defined() ? b.f32() : nullptr, act,
                      z.defined() ? z.f32() : nullptr, SkinnyWork(rows, out, x.size(1), d).data, stream_of(d));
    fused = true;
  } else if (d.is_cuda() && ctx.gemm == GemmImpl::cublas && multiply_adds >= kLtMinMultiplyAdds &&
             (act == Act::none || act == Act::relu)) {
    fused = lt_gemm(ctx, d, false, true, rows, out, x.size(1), 1.0f, x.f32(), W.f32(), 0.0f, y.f32(),
                    b.defined() ? b.f32() : nullptr, act);
  }
#endif
  if (!fused) gemm(false, true, 1.0f, x, W, 0.0f, y);
  if (!fused && (b.defined() || act != Act::none)) bias_act(y, b, act, z, y);
}

// linear_pre's and linear_bf16_pre's forward, `values(act, y)` computing the layer into y of
// `type`: a GELU's pre-activation z first, then y = activation(z), the op its rebuild
// (act_of) runs; their node (LinearNode or LinearBf16Node) keeps W_kept and `saved`.
template <class NodeType, class Values>
LinearOut pre_activated(const char* op, const Tensor& x, const Tensor& W, const Tensor& b, const Tensor& W_kept,
                        DType type, Act act, const SavedInput& saved, const Values& values) {
  const bool grad = any_requires_grad({&x, &W, &b});
  if (grad) check_saved(saved, x, op, W.size(1));
  const Shape shape{x.size(0), W.size(0)};
  LinearOut r;
  if (act_saves_input(act)) {
    r.z = Tensor::empty(shape, type, x.device());
    values(Act::none, r.z);
    r.y = activation(r.z, act);
  } else {
    r.y = Tensor::empty(shape, type, x.device());
    values(act, r.y);
  }
  if (grad) {
    record(r.y, std::make_shared<NodeType>(NodeInput(x, saved), W_kept, r.z.defined() ? r.z : r.y, act),
           layer_inputs(x, W, b));
  }
  return r;
}

}  // namespace

Tensor linear(const Tensor& x, const Tensor& W, const Tensor& b, Act act, const Tensor& out_into) {
  check_linear(x, W, b);
  const Device d = x.device();
  const int64_t rows = x.size(0), out = W.size(0);
  DPT_REQUIRE(
      !out_into.defined() ||
          (out_into.dtype() == DType::f32 && out_into.device() == d && out_into.shape() == Shape{rows, out}),
      "linear: the output tensor is not [" + std::to_string(rows) + ", " + std::to_string(out) + "] f32 on " + d.str());
  const bool grad = any_requires_grad({&x, &W, &b});
  DPT_REQUIRE(!out_into.defined() || !grad, "linear: an output tensor is for no-grad use (backward would save it)");
  Tensor y = out_into.defined() ? out_into : Tensor::empty({rows, out}, DType::f32, d);
  // GELU's backward needs the pre-activation; the others can work from the output.
  Tensor z = (grad && act_saves_input(act)) ? Tensor::empty({rows, out}, DType::f32, d) : Tensor();
  linear_values(x, W, b, act, y, z);
  if (grad) {
    record(y, std::make_shared<LinearNode>(NodeInput(x), W, act_saves_input(act) ? z : y, act), layer_inputs(x, W, b));
  }
  return y;
}

LinearOut linear_pre(const Tensor& x, const Tensor& W, const Tensor& b, Act act, const SavedInput& saved) {
  check_linear(x, W, b);
  return pre_activated<LinearNode>("linear_pre", x, W, b, W, DType::f32, act, saved,
                                   [&](Act a, const Tensor& y) { linear_values(x, W, b, a, y, Tensor()); });
}

Tensor linear_chain(const Tensor& x, const std::vector<LinearLayer>& layers, const std::function<void()>& before) {
#if DPT_WITH_CUDA
  const Device d = x.device();
  if (!d.is_cuda() || layers.empty() || layers.size() > static_cast<size_t>(kMlpMaxLayers) || x.dim() != 2 ||
      x.dtype() != DType::f32 || x.size(0) < 1 || x.size(0) > cuda::kSkinnyRows)
    return Tensor();
  // Only where each layer alone would take our fp32 skinny GEMM: no tf32 or bf16 compute.
  const Context& ctx = context(d);
  MlpLayers run;
  run.count = static_cast<int>(layers.size());
  int64_t in = x.size(1);
  for (size_t l = 0; l < layers.size(); ++l) {
    const LinearLayer& L = layers[l];
    if (!L.W.defined() || L.W.dtype() != DType::f32 || L.W.dim() != 2 || L.W.device() != d || L.W.size(1) != in ||
        small_gemm(ctx, false, true, x.size(0), L.W.size(0), in) != SmallGemm::skinny)
      return Tensor();
    if (L.b.defined() && (L.b.dtype() != DType::f32 || L.b.device() != d || L.b.shape() != Shape{L.W.size(0)}))
      return Tensor();
    if (L.W.size(0) > kMlpMaxWidth || in > kMlpMaxWidth) return Tensor();  // also keeps the casts exact
    run.layer[l].in = static_cast<int>(in);
    run.layer[l].out = static_cast<int>(L.W.size(0));
    in = L.W.size(0);
  }
  if (!cuda::mlp_fits(run, d.index)) return Tensor();
  std::vector<Tensor> ins{x};
  for (const LinearLayer& L : layers) {
    ins.push_back(L.W);
    if (L.b.defined()) ins.push_back(L.b);
  }
  // A parameter used by two layers would have both layers' gradient sums written into it
  // by one launch: layer by layer instead.
  for (size_t i = 1; i < ins.size(); ++i)
    for (size_t j = 1; j < i; ++j)
      if (ins[i].data() == ins[j].data()) return Tensor();
  if (before) before();
  bool grad = false;
  for (const Tensor& t : ins) grad = grad || any_requires_grad({&t});
  const int64_t rows = x.size(0);
  std::vector<Tensor> keep;  // what the node's pointers point into (detached: never its output's history)
  Tensor out;
  for (size_t l = 0; l < layers.size(); ++l) {
    const LinearLayer& L = layers[l];
    MlpLayer& m = run.layer[l];
    Tensor y = Tensor::empty({rows, L.W.size(0)}, DType::f32, d);
    Tensor z = grad && act_saves_input(L.act) ? Tensor::empty({rows, L.W.size(0)}, DType::f32, d) : Tensor();
    m.W = L.W.f32();
    m.b = L.b.defined() ? L.b.f32() : nullptr;
    m.y = y.f32();
    m.z = z.defined() ? z.f32() : nullptr;
    m.act = L.act;
    for (const Tensor& t : {L.W, y, z})
      if (t.defined()) keep.push_back(t.untracked());
    out = y;
  }
  cuda::mlp_forward(rows, x.f32(), run, stream_of(d));
  if (grad) record(out, std::make_shared<LinearChainNode>(x, run, std::move(keep)), std::move(ins));
  return out;
#else
  (void)x;
  (void)layers;
  (void)before;
  return Tensor();
#endif
}

namespace {
// x's first k columns, packed (x [rows, >= k], bf16): for a kernel that takes no leading dimension.
Tensor leading_columns(const Tensor& x, int64_t k) {
  const Device d = x.device();
  const int64_t rows = x.size(0), width = x.size(1);
  Tensor packed = Tensor::empty({rows, k}, x.dtype(), d);
  const size_t bytes = dtype_size(x.dtype());
#if DPT_WITH_CUDA
  if (d.is_cuda()) {
    if (rows > 0)
      DPT_CUDA_CHECK(cudaMemcpy2DAsync(packed.data(), k * bytes, x.data(), width * bytes, k * bytes, rows,
                                       cudaMemcpyDeviceToDevice, stream_of(d)));
    return packed;
  }
#endif
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(static_cast<char*>(packed.data()) + r * k * bytes,
                static_cast<const char*>(x.data()) + r * width * bytes, k * bytes);
  return packed;
}
}  // namespace

namespace detail {

// linear_bf16's forward without autograd: y = act(x W16^T + b16) rounded once, and z (when
// defined) GELU's pre-activation. x may have a ones column (its first `in` columns are read).
void linear_bf16_values(const Tensor& x, const Tensor& W16, const Tensor& b16, Act act, const Tensor& y,
                        const Tensor& z) {
  const Device d = x.device();
  const int64_t rows = x.size(0), out = W16.size(0), in = W16.size(1);
  bool fused = false;  // bias and activation done in the GEMM's epilogue, y rounded once there
#if DPT_WITH_CUDA
  const double multiply_adds = static_cast<double>(rows) * static_cast<double>(out) * static_cast<double>(in);
  // cuBLASLt's GELU epilogue is the tanh form: gelu_tanh fuses (writing z as its aux output), the exact gelu not.
  if (d.is_cuda() && rows > 0 && multiply_adds >= kLtMinMultiplyAdds &&
      (act == Act::none || act == Act::relu || act == Act::gelu_tanh)) {
    fused = lt_gemm(context(d), d, cuda::LtTypes{DType::bf16, DType::bf16, DType::bf16}, false, true, rows, out, in,
                    1.0f, x.bf16(), W16.bf16(), 0.0f, y.bf16(), b16.defined() ? b16.bf16() : nullptr, act,
                    z.defined() ? z.bf16() : nullptr, false, x.size(1));
  }
#endif
  if (!fused && rows > 0) {  // the GEMM in fp32, then bias and activation rounded once into y
    Tensor acc = Tensor::empty({rows, out}, DType::f32, d);
    gemm(false, true, 1.0f, x.size(1) == in ? x : leading_columns(x, in), W16, 0.0f, acc);
    bias_act(acc, b16, act, z, y);
  }
}

void bf16_param_grads(const Tensor& dz, const Tensor& x, int64_t in, Grads& grads, size_t w, size_t b,
                      const ColumnSums& dz_sums) {
  const Device d = dz.device();
  const int64_t rows = dz.size(0), out = dz.size(1);
  const bool want_b = b != kNoInput && grads.needed(b);
  if (x.size(1) != in && (grads.needed(w) || want_b)) {  // [dW | db | 0s] = dz^T x, then split
    Tensor t = Tensor::empty({out, x.size(1)}, DType::f32, d);
    gemm(true, false, 1.0f, dz, x, 0.0f, t);
    GradSlot dW = needed_slot(grads, w, {out, in}, d), db = want_b ? grad_slot(grads, b, {out}, d) : GradSlot{};
    DPT_CUDA_OR_CPU(
        d,
        cuda::ones_column_split(t.f32(), out, in, x.size(1), dW.beta, dW.f32_or_null(), db.beta, db.f32_or_null(),
                                stream_of(d)),
        cpu::ones_column_split(t.f32(), out, in, x.size(1), dW.beta, dW.f32_or_null(), db.beta, db.f32_or_null()));
    put_slot(grads, w, dW);
    if (want_b) put_slot(grads, b, db);
    return;
  }
  if (grads.needed(w)) {
    GradSlot dW = grad_slot(grads, w, {out, in}, d);
    gemm(true, false, 1.0f, dz, x, dW.beta, dW.t);
    put_slot(grads, w, dW);
  }
  if (want_b && dz_sums.defined()) {
    GradSlot db = grad_slot(grads, b, {out}, d);
    finish_column_sums(dz_sums, db.beta, db.t);
    put_slot(grads, b, db);
  } else if (want_b) {  // (cuBLASLt's BGRADB epilogue took 1.41 ms of a GPT-2 step against
                        // about 1.0 for these passes: docs/performance-log.md)
    GradSlot db = grad_slot(grads, b, {out}, d);
    DPT_CUDA_OR_CPU(
        d,
        cuda::act_bias_backward_bf16(dz.bf16(), nullptr, Act::none, rows, out, dz.bf16(), db.beta, db.t.f32(),
                                     bias_work(d, cuda::act_bias_backward_work(rows, out)).f32(), stream_of(d)),
        cpu::act_bias_backward_bf16(dz.bf16(), nullptr, Act::none, rows, out, dz.bf16(), db.beta, db.t.f32()));
    put_slot(grads, b, db);
  }
}

}  // namespace detail

Tensor linear_bf16(const Tensor& x, const Tensor& W, const Tensor& b, const Tensor& W16, const Tensor& b16, Act act) {
  check_linear_bf16(x, W, b, W16, b16);
  const Device d = x.device();
  const int64_t rows = x.size(0), out = W.size(0);
  Tensor y = Tensor::empty({rows, out}, DType::bf16, d);
  const bool grad = any_requires_grad({&x, &W, &b});
  // GELU's backward needs the pre-activation; the others can work from the output.
  Tensor z = (grad && act_saves_input(act)) ? Tensor::empty({rows, out}, DType::bf16, d) : Tensor();
  linear_bf16_values(x, W16, b16, act, y, z);
  if (grad) {
    record(y, std::make_shared<LinearBf16Node>(NodeInput(x), W16, act_saves_input(act) ? z : y, act),
           layer_inputs(x, W, b));
  }
  return y;
}

LinearOut linear_bf16_pre(const Tensor& x, const Tensor& W, const Tensor& b, const Tensor& W16, const Tensor& b16,
                          Act act, const SavedInput& saved, bool ones_column) {
  check_linear_bf16(x, W, b, W16, b16, ones_column);
  return pre_activated<LinearBf16Node>(
      "linear_bf16_pre", x, W, b, W16, DType::bf16, act, saved,
      [&](Act a, const Tensor& y) { linear_bf16_values(x, W16, b16, a, y, Tensor()); });
}

SavedInput act_of(const Tensor& z, Act act) {
  SavedInput s;
  s.kind = SavedInput::Kind::act_of;
  s.from = z;
  s.act = act;
  return s;
}

SavedInput layer_norm_of(const Tensor& h, const Tensor& gamma, const Tensor& beta, float eps, bool ones_column) {
  SavedInput s;
  s.kind = SavedInput::Kind::layer_norm_of;
  s.from = h;
  s.gamma = gamma;
  s.beta = beta;
  s.eps = eps;
  s.ones_column = ones_column;
  return s;
}

}  // namespace dpt
