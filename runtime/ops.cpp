#include <dptrain/runtime/ops.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>

#include <dptrain/error.hpp>
#include <dptrain/runtime/autograd.hpp>
#include <dptrain/runtime/context.hpp>
#include "../kernels/cpu/cpu.hpp"
#include "ops_internal.hpp"

#if DPT_WITH_CUDA
#include "../kernels/cuda/check.hpp"
#include "../kernels/cuda/cuda.hpp"
#endif

namespace dpt {

namespace {

#if DPT_WITH_CUDA
// The stream of the device's current context, with the device made current.
cudaStream_t stream_of(const Device& d) {
  cuda::set_device(d.index);
  return static_cast<cudaStream_t>(context(d).stream());
}
// A cuBLASLt GEMM on ctx's stream (gemm_lt), its workspace from the caching allocator;
// false when cuBLASLt has no kernel for it (then nothing ran).
bool lt_gemm(Context& ctx, const Device& d, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
             const float* A, const float* B, float beta, float* C, const float* bias, Act act) {
  Tensor ws = Tensor::empty({static_cast<int64_t>(cuda::kLtWorkspaceBytes / sizeof(float))}, DType::f32, d);
  return cuda::gemm_lt(static_cast<cublasHandle_t>(ctx.blas_lt()), stream_of(d), ctx.precision, ta, tb, m, n, k, alpha,
                       A, B, beta, C, bias, act, ws.data(), cuda::kLtWorkspaceBytes);
}
// The same over other element types.
bool lt_gemm(Context& ctx, const Device& d, cuda::LtTypes types, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
             float alpha, const void* A, const void* B, float beta, void* C, const void* bias, Act act) {
  Tensor ws = Tensor::empty({static_cast<int64_t>(cuda::kLtWorkspaceBytes / sizeof(float))}, DType::f32, d);
  return cuda::gemm_lt(static_cast<cublasHandle_t>(ctx.blas_lt()), stream_of(d), ctx.precision, types, ta, tb, m, n, k,
                       alpha, A, B, beta, C, bias, act, ws.data(), cuda::kLtWorkspaceBytes);
}
// Scratch space for the deterministic two-stage reductions.
Tensor reduce_work(const Device& d, int64_t at_least) {
  return Tensor::empty({std::max<int64_t>(at_least, cuda::kReduceWork)}, DType::f32, d);
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

// Only large GEMMs take cuBLASLt's epilogue: for a short one cuBLAS's own kernel plus
// the separate bias pass is faster (measured on the seed workload's forward: README,
// "Measurements behind the code"), while for the mlp workload's layers the fused epilogue
// saves a pass over each activation. The same bound picks the TF32 backward that writes
// a transposed gradient (LinearNode).
[[maybe_unused]] constexpr double kLtMinMultiplyAdds = 1 << 30;

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

void need_bf16(const Tensor& t, const char* op) {
  DPT_REQUIRE(t.defined() && t.dtype() == DType::bf16, std::string(op) + ": expected a defined bf16 tensor");
}

void need_float(const Tensor& t, const char* op) {
  DPT_REQUIRE(t.defined() && (t.dtype() == DType::f32 || t.dtype() == DType::bf16),
              std::string(op) + ": expected a defined f32 or bf16 tensor");
}

bool is_bf16(const Tensor& t) { return t.defined() && t.dtype() == DType::bf16; }

}  // namespace

namespace detail {

void same_device(const Tensor& a, const Tensor& b, const char* op) {
  DPT_REQUIRE(a.device() == b.device(),
              std::string(op) + ": tensors on " + a.device().str() + " and " + b.device().str());
}

void need_f32(const Tensor& t, const char* op) {
  DPT_REQUIRE(t.defined() && t.dtype() == DType::f32, std::string(op) + ": expected a defined f32 tensor");
}

std::vector<Tensor> layer_inputs(const Tensor& x, const Tensor& w, const Tensor& b) {
  return b.defined() ? std::vector<Tensor>{x, w, b} : std::vector<Tensor>{x, w};
}

void record(Tensor& out, std::shared_ptr<Node> node, std::vector<Tensor> inputs) {
  node->inputs = std::move(inputs);
  out.set_grad_fn(std::move(node));
}

void give(Grads& grads, size_t i, Tensor g) {
  if (Tensor acc = grads.accumulator(i); acc.defined()) {
    if (grads.take_beta(i) == 0.0f) copy_cast(acc, g);
    else axpy_(1.0f, g, acc);
  } else grads.put(i, std::move(g));
}

}  // namespace detail

using namespace detail;

namespace {
// Where a backward writes input i's gradient: its accumulator, with the beta take_beta
// gives (writing it is then due), or a new tensor (beta 0) that put_slot hands over.
struct GradSlot {
  Tensor t;
  float beta = 0.0f;
  bool fresh = false;
};
GradSlot grad_slot(Grads& grads, size_t i, const Shape& shape, const Device& d) {
  if (Tensor acc = grads.accumulator(i); acc.defined()) return {acc, grads.take_beta(i), false};
  return {Tensor::empty(shape, DType::f32, d), 0.0f, true};
}
void put_slot(Grads& grads, size_t i, GradSlot& slot) {
  if (slot.fresh) grads.put(i, std::move(slot.t));
}
#if DPT_WITH_CUDA
// Scratch for the two-stage bias gradients (at least one float: a tensor is never empty here).
Tensor bias_work(const Device& d, int64_t floats) {
  return Tensor::empty({std::max<int64_t>(1, floats)}, DType::f32, d);
}
#endif
}  // namespace

// ---- Plain ops -----------------------------------------------------------------------

void zero_(const Tensor& t) {
  if (t.numel() == 0) return;
  DPT_CUDA_OR_CPU(t.device(), DPT_CUDA_CHECK(cudaMemsetAsync(t.data(), 0, t.nbytes(), stream_of(t.device()))),
                  std::memset(t.data(), 0, t.nbytes()));
}

void fill_(const Tensor& t, float value) {
  need_f32(t, "fill_");
  DPT_CUDA_OR_CPU(t.device(), cuda::fill(t.f32(), t.numel(), value, stream_of(t.device())),
                  cpu::fill(t.f32(), t.numel(), value));
}

void add_peer_(const Tensor& x, const Tensor& y) {
  need_f32(y, "add_peer_");
  DPT_REQUIRE(x.dtype() == DType::f32 || x.dtype() == DType::bf16, "add_peer_: x must be f32 or bf16");
  DPT_REQUIRE(x.numel() == y.numel(), "add_peer_: " + shape_str(x.shape()) + " and " + shape_str(y.shape()));
  DPT_REQUIRE(peer_readable(y.device(), x.device()),
              "add_peer_: " + y.device().str() + " cannot read " + x.device().str() + "'s memory directly");
#if DPT_WITH_CUDA
  if (x.dtype() == DType::bf16) cuda::add_bf16(x.bf16(), y.f32(), x.numel(), stream_of(y.device()));
  else cuda::axpy(x.numel(), 1.0f, x.f32(), y.f32(), stream_of(y.device()));
#endif
}

void axpy_(float alpha, const Tensor& x, const Tensor& y) {
  if (is_bf16(x) || is_bf16(y)) {  // in fp32, y rounded once (autograd adds bf16 gradients so)
    need_float(x, "axpy_");
    need_float(y, "axpy_");
    DPT_REQUIRE(x.numel() == y.numel(), "axpy_: " + shape_str(x.shape()) + " and " + shape_str(y.shape()));
    const Tensor xf = cast(x.untracked(), DType::f32);
    if (!is_bf16(y)) {
      axpy_(alpha, xf, y);
      return;
    }
    Tensor yf = cast(y.untracked(), DType::f32);
    axpy_(alpha, xf, yf);
    copy_cast(y, yf);
    return;
  }
  need_f32(x, "axpy_");
  need_f32(y, "axpy_");
  same_device(x, y, "axpy_");
  DPT_REQUIRE(x.numel() == y.numel(), "axpy_: " + shape_str(x.shape()) + " and " + shape_str(y.shape()));
  DPT_CUDA_OR_CPU(y.device(), cuda::axpy(x.numel(), alpha, x.f32(), y.f32(), stream_of(y.device())),
                  cpu::axpy(x.numel(), alpha, x.f32(), y.f32()));
}

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

void copy_cast(const Tensor& dst, const Tensor& t) {
  DPT_REQUIRE(dst.defined() && t.defined() && dst.numel() == t.numel(),
              "copy_cast: " + shape_str(t.shape()) + " into " + shape_str(dst.shape()));
  same_device(dst, t, "copy_cast");
  if (t.dtype() == dst.dtype()) {
    copy(dst, t);
  } else if (t.dtype() == DType::f32 && dst.dtype() == DType::bf16) {
    DPT_CUDA_OR_CPU(t.device(), cuda::cast_f32_bf16(t.f32(), dst.bf16(), t.numel(), stream_of(t.device())),
                    cpu::cast_f32_bf16(t.f32(), dst.bf16(), t.numel()));
  } else if (t.dtype() == DType::bf16 && dst.dtype() == DType::f32) {
    DPT_CUDA_OR_CPU(t.device(), cuda::cast_bf16_f32(t.bf16(), dst.f32(), t.numel(), stream_of(t.device())),
                    cpu::cast_bf16_f32(t.bf16(), dst.f32(), t.numel()));
  } else {
    throw Error(std::string("cast from ") + dtype_name(t.dtype()) + " to " + dtype_name(dst.dtype()) +
                " is not supported");
  }
}

Tensor sum_squares(const Tensor& x) {
  need_f32(x, "sum_squares");
  Tensor out = Tensor::empty({1}, DType::f32, x.device());
  DPT_CUDA_OR_CPU(
      x.device(),
      cuda::sum_squares(x.f32(), x.numel(), out.f32(), reduce_work(x.device(), 0).f32(), stream_of(x.device())),
      cpu::sum_squares(x.f32(), x.numel(), out.f32()));
  return out;
}

Tensor argmax_rows(const Tensor& x) {
  need_f32(x, "argmax_rows");
  DPT_REQUIRE(x.dim() == 2 && x.size(1) > 0, "argmax_rows: expected a matrix, got " + shape_str(x.shape()));
  Tensor out = Tensor::empty({x.size(0)}, DType::i32, x.device());
  DPT_CUDA_OR_CPU(x.device(), cuda::argmax_rows(x.f32(), x.size(0), x.size(1), out.i32(), stream_of(x.device())),
                  cpu::argmax_rows(x.f32(), x.size(0), x.size(1), out.i32()));
  return out;
}

void normal_(const Tensor& t, uint64_t seed, uint64_t stream, uint64_t offset, float std) {
  need_f32(t, "normal_");
  DPT_CUDA_OR_CPU(t.device(), cuda::normal(t.f32(), t.numel(), seed, stream, offset, std, stream_of(t.device())),
                  cpu::normal(t.f32(), t.numel(), seed, stream, offset, std));
}

void normal_rows_(const Tensor& t, uint64_t seed, uint64_t stream, const RowMap& rows, float std, bool add) {
  need_f32(t, "normal_rows_");
  DPT_CHECK(t.dim() >= 1 && rows.per_group > 0, "normal_rows_: rows of a tensor, groups of at least one row");
  if (t.numel() == 0) return;
  const int64_t n = t.size(0), width = t.numel() / n;
  DPT_CUDA_OR_CPU(t.device(), cuda::normal_rows(t.f32(), n, width, seed, stream, rows, std, add, stream_of(t.device())),
                  cpu::normal_rows(t.f32(), n, width, seed, stream, rows, std, add));
}

void uniform_(const Tensor& t, uint64_t seed, uint64_t stream, uint64_t offset, float lo, float hi) {
  need_f32(t, "uniform_");
  DPT_CUDA_OR_CPU(t.device(), cuda::uniform(t.f32(), t.numel(), seed, stream, offset, lo, hi, stream_of(t.device())),
                  cpu::uniform(t.f32(), t.numel(), seed, stream, offset, lo, hi));
}

Tensor clip_coef(const Tensor& norm_sq, float max_norm) {
  need_f32(norm_sq, "clip_coef");
  Tensor out = Tensor::empty({1}, DType::f32, norm_sq.device());
  DPT_CUDA_OR_CPU(norm_sq.device(), cuda::clip_coef(norm_sq.f32(), max_norm, out.f32(), stream_of(norm_sq.device())),
                  cpu::clip_coef(norm_sq.f32(), max_norm, out.f32()));
  return out;
}

namespace {
CheckRingArgs ring_args(const CheckRing& ring, const Tensor& on, const char* op) {
  if (!ring.records) return {};
  DPT_CHECK(ring.slots > 0 && ring.count.defined() && ring.count.dtype() == DType::i32 && ring.count.numel() == 2,
            std::string(op) + ": a ring has slots and an int64 count");
  same_device(on, ring.count, op);
  return {ring.records, ring.slots, reinterpret_cast<int64_t*>(ring.count.i32())};
}
int64_t* int64_of(const Tensor& t, const char* op) {
  DPT_CHECK(t.defined() && t.dtype() == DType::i32 && t.numel() == 2, std::string(op) + ": an int64 is i32 [2]");
  return reinterpret_cast<int64_t*>(t.i32());
}
}  // namespace

void shard_check(const Tensor& grads, int64_t base, const Tensor& sum, const Tensor& first_bad) {
  need_f32(grads, "shard_check");
  need_f32(sum, "shard_check");
  DPT_CHECK(base >= 0 && sum.numel() == 1, "shard_check: a negative base or a sum of more than one element");
  same_device(grads, sum, "shard_check");
  same_device(grads, first_bad, "shard_check");
  const Device& d = grads.device();
  const float* g = grads.numel() > 0 ? grads.f32() : nullptr;
  const int64_t count = grads.numel();
  DPT_CUDA_OR_CPU(d,
                  cuda::shard_check(g, count, base, sum.f32(), int64_of(first_bad, "shard_check"),
                                    reduce_work(d, 3 * cuda::kReduceWork).f32(), context(d).counter(), stream_of(d)),
                  cpu::shard_check(g, count, base, sum.f32(), int64_of(first_bad, "shard_check")));
}

Tensor finish_check(const Tensor& sum, const Tensor& first_bad, float max_norm, const CheckRing& ring) {
  need_f32(sum, "finish_check");
  same_device(sum, first_bad, "finish_check");
  const Device& d = sum.device();
  const CheckRingArgs args = ring_args(ring, sum, "finish_check");
  Tensor out = Tensor::empty({1}, DType::f32, d);
  DPT_CUDA_OR_CPU(
      d, cuda::finish_check(sum.f32(), int64_of(first_bad, "finish_check"), max_norm, out.f32(), args, stream_of(d)),
      cpu::finish_check(sum.f32(), int64_of(first_bad, "finish_check"), max_norm, out.f32(),
                        ring.records ? &args : nullptr));
  return out;
}

Tensor check_gradients(const Tensor& grads, float max_norm, const CheckRing& ring) {
  need_f32(grads, "check_gradients");
  const Device& d = grads.device();
  const CheckRingArgs args = ring_args(ring, grads, "check_gradients");
  Tensor out = Tensor::empty({1}, DType::f32, d);
  DPT_CUDA_OR_CPU(
      d,
      cuda::check_gradients(grads.f32(), grads.numel(), max_norm, out.f32(),
                            reduce_work(d, 3 * cuda::kReduceWork).f32(), context(d).counter(), args, stream_of(d)),
      cpu::check_gradients(grads.f32(), grads.numel(), max_norm, out.f32(), ring.records ? &args : nullptr));
  return out;
}

namespace {
// The shadow's pointer (null when undefined), checked against the parameters.
uint16_t* shadow_of(const Tensor& shadow, const Tensor& p, const char* op) {
  if (!shadow.defined()) return nullptr;
  need_bf16(shadow, op);
  same_device(shadow, p, op);
  DPT_CHECK(shadow.numel() == p.numel(), std::string(op) + ": the bf16 shadow's size differs from the parameters'");
  return shadow.bf16();
}
}  // namespace

namespace {
StepCounterArgs counter_args(const StepCounter* step, const Tensor& p, const char* op) {
  if (!step) return {};
  DPT_CHECK(step->counter.dtype() == DType::i32 && step->counter.numel() == 4,
            std::string(op) + ": a step counter is an i32 [4]");
  same_device(step->counter, p, op);
  int32_t* c = step->counter.i32();
  return {reinterpret_cast<int64_t*>(c),
          reinterpret_cast<unsigned*>(c + 2),
          step->schedule,
          step->beta1,
          step->beta2,
          step->advance};
}
}  // namespace

namespace {
// An update's grad_scale: one f32 on the parameters' device, or none (undefined).
const float* scale_of(const Tensor& grad_scale, const Tensor& p, const char* op) {
  if (!grad_scale.defined()) return nullptr;
  if (grad_scale.numel() != 1 || grad_scale.dtype() != DType::f32 || grad_scale.device() != p.device())
    throw UsageError(std::string(op) + ": grad_scale must be one f32 on " + p.device().str() + ", got " +
                     dtype_name(grad_scale.dtype()) + shape_str(grad_scale.shape()) + " on " +
                     grad_scale.device().str());
  return grad_scale.f32();
}
}  // namespace

void sgd_step(const Tensor& p, const Tensor& g, const Tensor& buf, const SgdArgs& a, const Tensor& grad_scale,
              const Tensor& shadow, const StepCounter* step) {
  need_f32(p, "sgd_step");
  need_f32(g, "sgd_step");
  DPT_CHECK(p.numel() == g.numel() && (!buf.defined() || buf.numel() == p.numel()), "sgd_step: buffer sizes differ");
  DPT_CHECK(a.momentum == 0.0f || buf.defined() || p.numel() == 0, "sgd_step: momentum needs a momentum buffer");
  float* b = buf.defined() ? buf.f32() : nullptr;
  const float* sc = scale_of(grad_scale, p, "sgd_step");
  uint16_t* sh = shadow_of(shadow, p, "sgd_step");
  const StepCounterArgs st = counter_args(step, p, "sgd_step");
  DPT_CUDA_OR_CPU(p.device(), cuda::sgd_step(p.f32(), g.f32(), b, p.numel(), a, sc, sh, st, stream_of(p.device())),
                  cpu::sgd_step(p.f32(), g.f32(), b, p.numel(), a, sc, sh, step ? &st : nullptr));
}

void adamw_step(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const AdamArgs& a,
                const Tensor& grad_scale, const Tensor& shadow, const StepCounter* step) {
  need_f32(p, "adamw_step");
  need_f32(g, "adamw_step");
  DPT_CHECK(p.numel() == g.numel() && (p.numel() == 0 || (m.numel() == p.numel() && v.numel() == p.numel())),
            "adamw_step: buffer sizes differ");
  const float* sc = scale_of(grad_scale, p, "adamw_step");
  uint16_t* sh = shadow_of(shadow, p, "adamw_step");
  const StepCounterArgs st = counter_args(step, p, "adamw_step");
  float* mp = m.defined() ? m.f32() : nullptr;
  float* vp = v.defined() ? v.f32() : nullptr;
  DPT_CUDA_OR_CPU(p.device(),
                  cuda::adamw_step(p.f32(), g.f32(), mp, vp, p.numel(), a, sc, sh, st, stream_of(p.device())),
                  cpu::adamw_step(p.f32(), g.f32(), mp, vp, p.numel(), a, sc, sh, step ? &st : nullptr));
}

int64_t checked_update_backup_size(const Tensor& p, int buffers, float max_norm) {
#if DPT_WITH_CUDA
  if (p.device().is_cuda()) return cuda::speculative_backup_floats(p.numel(), buffers, max_norm);
#endif
  (void)p, (void)buffers, (void)max_norm;
  return 0;
}

namespace {
// The speculative update's backup: null where there is none (the two-launch or barrier
// form runs).
[[maybe_unused]] float* backup_of(const Tensor& backup, const Tensor& p, int buffers, float max_norm, const char* op) {
  const int64_t need = checked_update_backup_size(p, buffers, max_norm);
  if (!backup.defined() || need == 0) return nullptr;
  need_f32(backup, op);
  DPT_CHECK(
      backup.numel() >= need && backup.device() == p.device() && reinterpret_cast<uintptr_t>(backup.f32()) % 16 == 0,
      std::string(op) + ": the backup holds " + std::to_string(backup.numel()) + " floats, the update needs " +
          std::to_string(need) + ", 16-byte aligned, on " + p.device().str());
  return backup.f32();
}
}  // namespace

Tensor checked_sgd_step(const Tensor& p, const Tensor& g, const Tensor& buf, const SgdArgs& a, float max_norm,
                        const CheckRing& ring, const Tensor& shadow, const StepCounter& step,
                        [[maybe_unused]] const Tensor& backup) {
  need_f32(p, "checked_sgd_step");
  need_f32(g, "checked_sgd_step");
  DPT_CHECK(p.numel() == g.numel() && (!buf.defined() || buf.numel() == p.numel()),
            "checked_sgd_step: buffer sizes differ");
  DPT_CHECK(a.momentum == 0.0f || buf.defined() || p.numel() == 0,
            "checked_sgd_step: momentum needs a momentum buffer");
  const Device& d = p.device();
  const CheckRingArgs r = ring_args(ring, g, "checked_sgd_step");
  const StepCounterArgs st = counter_args(&step, p, "checked_sgd_step");
  float* b = buf.defined() ? buf.f32() : nullptr;
  uint16_t* sh = shadow_of(shadow, p, "checked_sgd_step");
  Tensor scale = Tensor::empty({1}, DType::f32, d);
  DPT_CUDA_OR_CPU(d,
                  cuda::checked_sgd_step(p.f32(), g.f32(), b, p.numel(), a, sh, st, max_norm, scale.f32(),
                                         reduce_work(d, 3 * cuda::kReduceWork).f32(), context(d).counter(), r,
                                         backup_of(backup, p, a.momentum != 0.0f ? 2 : 1, max_norm, "checked_sgd_step"),
                                         stream_of(d)),
                  [&] {  // the CPU has no launches to save
                    cpu::check_gradients(g.f32(), g.numel(), max_norm, scale.f32(), ring.records ? &r : nullptr);
                    cpu::sgd_step(p.f32(), g.f32(), b, p.numel(), a, scale.f32(), sh, &st);
                  }());
  return scale;
}

Tensor checked_adamw_step(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const AdamArgs& a,
                          float max_norm, const CheckRing& ring, const Tensor& shadow, const StepCounter& step,
                          [[maybe_unused]] const Tensor& backup) {
  need_f32(p, "checked_adamw_step");
  need_f32(g, "checked_adamw_step");
  DPT_CHECK(p.numel() == g.numel() && (p.numel() == 0 || (m.numel() == p.numel() && v.numel() == p.numel())),
            "checked_adamw_step: buffer sizes differ");
  const Device& d = p.device();
  const CheckRingArgs r = ring_args(ring, g, "checked_adamw_step");
  const StepCounterArgs st = counter_args(&step, p, "checked_adamw_step");
  float* mp = m.defined() ? m.f32() : nullptr;
  float* vp = v.defined() ? v.f32() : nullptr;
  uint16_t* sh = shadow_of(shadow, p, "checked_adamw_step");
  Tensor scale = Tensor::empty({1}, DType::f32, d);
  DPT_CUDA_OR_CPU(d,
                  cuda::checked_adamw_step(p.f32(), g.f32(), mp, vp, p.numel(), a, sh, st, max_norm, scale.f32(),
                                           reduce_work(d, 3 * cuda::kReduceWork).f32(), context(d).counter(), r,
                                           backup_of(backup, p, 3, max_norm, "checked_adamw_step"), stream_of(d)),
                  [&] {  // the CPU has no launches to save
                    cpu::check_gradients(g.f32(), g.numel(), max_norm, scale.f32(), ring.records ? &r : nullptr);
                    cpu::adamw_step(p.f32(), g.f32(), mp, vp, p.numel(), a, scale.f32(), sh, &st);
                  }());
  return scale;
}

namespace {
// What both alternating updates check and pass: the gradients, f32 and of p's size; the
// buffers, each of `now` and `next` the same size, f32, on p's device, not the same memory;
// the ring, step counter and shadow as the kernels take them; and the scale to return.
struct AlternatingCall {
  CheckRingArgs ring;
  StepCounterArgs step;
  uint16_t* shadow;
  Tensor scale;
};
using TwinPair = std::pair<const Tensor*, const Tensor*>;
AlternatingCall alternating_call(const Tensor& g, std::span<const TwinPair> now_next, const Tensor& p,
                                 const CheckRing& ring, const Tensor& shadow, const StepCounter& step, const char* op) {
  need_f32(g, op);
  DPT_CHECK(g.numel() == p.numel() && p.numel() > 0, std::string(op) + ": gradients of another size, or none");
  for (const auto& [now, next] : now_next) {
    need_f32(*now, op);
    need_f32(*next, op);
    same_device(*now, p, op);
    same_device(*next, p, op);
    DPT_CHECK(now->numel() == p.numel() && next->numel() == p.numel(),
              std::string(op) + ": the two copies' sizes differ from the parameters'");
    DPT_CHECK(now->data() != next->data(), std::string(op) + ": a buffer and its next copy are the same memory");
  }
  return {ring_args(ring, g, op), counter_args(&step, p, op), shadow_of(shadow, p, op),
          Tensor::empty({1}, DType::f32, p.device())};
}

// The CPU's form: the check, the current copy copied into the next, the update there in
// place (the GPU's bits: the same expressions; a skipped step leaves the copy as it is).
bool cpu_reads_first(const StepCounterArgs& st, int64_t t) { return (*st.t & 1) == (t & 1); }
}  // namespace

Tensor alternating_sgd_step(const Tensor& p, const Tensor& g, const Tensor& momentum_buf, const Tensor& next_p,
                            const Tensor& next_buf, const SgdArgs& a, const CheckRing& ring, const Tensor& shadow,
                            const StepCounter& step, int64_t t) {
  const char* op = "alternating_sgd_step";
  const bool mom = a.momentum != 0.0f;
  DPT_CHECK(mom == momentum_buf.defined() && mom == next_buf.defined(),
            std::string(op) + ": momentum needs both copies of the momentum buffer, and only momentum has them");
  const TwinPair twins[] = {{&p, &next_p}, {&momentum_buf, &next_buf}};  // no vector: a step allocates nothing
  const auto [r, st, sh, scale] = alternating_call(g, std::span(twins, mom ? 2 : 1), p, ring, shadow, step, op);
  const Device& d = p.device();
  float* const params[2] = {p.f32(), next_p.f32()};
  float* const bufs[2] = {mom ? momentum_buf.f32() : nullptr, mom ? next_buf.f32() : nullptr};
  const auto on_cpu = [&] {
    const int c = cpu_reads_first(st, t) ? 0 : 1;
    std::memcpy(params[1 - c], params[c], p.nbytes());
    if (mom) std::memcpy(bufs[1 - c], bufs[c], p.nbytes());
    cpu::check_gradients(g.f32(), g.numel(), 0.0f, scale.f32(), ring.records ? &r : nullptr);
    cpu::sgd_step(params[1 - c], g.f32(), bufs[1 - c], p.numel(), a, scale.f32(), sh, &st);
  };
  DPT_CUDA_OR_CPU(
      d,
      cuda::alternating_sgd_step(g.f32(), g.numel(), params, bufs, a, sh, st, t & 1, scale.f32(),
                                 reduce_work(d, 3 * cuda::kReduceWork).f32(), context(d).counter(), r, stream_of(d)),
      on_cpu());
  return scale;
}

Tensor alternating_adamw_step(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const Tensor& next_p,
                              const Tensor& next_m, const Tensor& next_v, const AdamArgs& a, const CheckRing& ring,
                              const Tensor& shadow, const StepCounter& step, int64_t t) {
  const TwinPair twins[] = {{&p, &next_p}, {&m, &next_m}, {&v, &next_v}};
  const auto [r, st, sh, scale] = alternating_call(g, twins, p, ring, shadow, step, "alternating_adamw_step");
  const Device& d = p.device();
  float* const params[2] = {p.f32(), next_p.f32()};
  float* const ms[2] = {m.f32(), next_m.f32()};
  float* const vs[2] = {v.f32(), next_v.f32()};
  const auto on_cpu = [&] {
    const int c = cpu_reads_first(st, t) ? 0 : 1;
    for (float* const* b : {params, ms, vs}) std::memcpy(b[1 - c], b[c], p.nbytes());
    cpu::check_gradients(g.f32(), g.numel(), 0.0f, scale.f32(), ring.records ? &r : nullptr);
    cpu::adamw_step(params[1 - c], g.f32(), ms[1 - c], vs[1 - c], p.numel(), a, scale.f32(), sh, &st);
  };
  DPT_CUDA_OR_CPU(
      d,
      cuda::alternating_adamw_step(g.f32(), g.numel(), params, ms, vs, a, sh, st, t & 1, scale.f32(),
                                   reduce_work(d, 3 * cuda::kReduceWork).f32(), context(d).counter(), r, stream_of(d)),
      on_cpu());
  return scale;
}

// ---- Differentiable ops ----------------------------------------------------------

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
  LinearNode(Tensor x, Tensor W, Tensor saved, Act act)
      : x_(x.untracked()), W_(W.untracked()), saved_(saved.untracked()), act_(act) {}
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
      gemm(false, false, 1.0f, dzt, x_, dW.beta, dW.t);
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
#if DPT_WITH_CUDA
      if (db_with_dW || deriv_on_load)
        cuda::gemm_short_k(out, in, rows, 1.0f, dy.f32(), x_.f32(), dW.beta, dW.t.f32(), stream_of(d),
                           db_with_dW ? db.t.f32() : nullptr, db.beta, deriv_on_load ? saved_.f32() : nullptr, act_);
      else
#endif
        gemm(true, false, 1.0f, dy, x_, dW.beta, dW.t);
      put_slot(grads, 1, dW);
    }
    if (want_db) put_slot(grads, 2, db);
  }

 private:
  Tensor x_, W_, saved_;
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

class ActivationNode : public Node {
 public:
  ActivationNode(Tensor saved, Act act) : saved_(saved.untracked()), act_(act) {}
  const char* name() const override { return "activation"; }
  void backward(Tensor& dy, Grads& grads) override {
    const Device d = dy.device();
    if (is_bf16(saved_)) {  // the gradient has the input's type
      Tensor g = is_bf16(dy) ? dy : cast(dy, DType::bf16);
      DPT_CUDA_OR_CPU(d, cuda::act_backward_bf16(g.bf16(), saved_.bf16(), act_, g.numel(), g.bf16(), stream_of(d)),
                      cpu::act_backward_bf16(g.bf16(), saved_.bf16(), act_, g.numel(), g.bf16()));
      give(grads, 0, g);
      return;
    }
    DPT_CUDA_OR_CPU(d, cuda::act_backward(dy.f32(), saved_.f32(), act_, dy.numel(), dy.f32(), stream_of(d)),
                    cpu::act_backward(dy.f32(), saved_.f32(), act_, dy.numel(), dy.f32()));
    give(grads, 0, dy);
  }

 private:
  Tensor saved_;
  Act act_;
};

class MseNode : public Node {
 public:
  // dy_unit: the gradient for a seed of 1, which the forward kernel wrote alongside the loss.
  MseNode(Tensor y, Tensor t, Tensor dy_unit) : y_(y.untracked()), t_(t.untracked()), dy_unit_(std::move(dy_unit)) {}
  const char* name() const override { return "mse_loss"; }
  void backward(Tensor& dloss, Grads& grads) override { give(grads, 0, gradient(dloss.f32(), 1.0f)); }
  // (The gradient has y's type: f32 or bf16.)
  bool backward_scalar(float seed, Grads& grads) override {
    // The precomputed gradient is handed over (the next node may overwrite it), once,
    // scaled in place for a seed other than 1 (a replica's share of the batch): one pass
    // over it instead of recomputing it from y and t.
    // A bf16 gradient is recomputed instead: scaling the rounded one would round twice,
    // and a replica's share of the batch would no longer give exactly one device's values.
    Tensor g = std::move(dy_unit_);
    dy_unit_ = Tensor();
    if (!g.defined() || (seed != 1.0f && g.dtype() == DType::bf16)) g = gradient(nullptr, seed);
    else if (seed != 1.0f) axpy_(seed - 1.0f, g, g);  // g += (seed - 1) g
    give(grads, 0, std::move(g));
    return true;
  }

 private:
  Tensor gradient(const float* dloss, float scale) const {
    const Device d = y_.device();
    Tensor dy = Tensor::empty(y_.shape(), y_.dtype(), d);
    if (is_bf16(y_)) {
      DPT_CUDA_OR_CPU(d,
                      cuda::mse_backward_bf16(y_.bf16(), t_.f32(), y_.numel(), dloss, scale, dy.bf16(), stream_of(d)),
                      cpu::mse_backward_bf16(y_.bf16(), t_.f32(), y_.numel(), dloss, scale, dy.bf16()));
      return dy;
    }
    DPT_CUDA_OR_CPU(d, cuda::mse_backward(y_.f32(), t_.f32(), y_.numel(), dloss, scale, dy.f32(), stream_of(d)),
                    cpu::mse_backward(y_.f32(), t_.f32(), y_.numel(), dloss, scale, dy.f32()));
    return dy;
  }
  Tensor y_, t_, dy_unit_;
};

class CrossEntropyNode : public Node {
 public:
  CrossEntropyNode(Tensor logits, Tensor labels) : logits_(logits.untracked()), labels_(labels.untracked()) {}
  const char* name() const override { return "cross_entropy"; }
  void backward(Tensor& dloss, Grads& grads) override {
    const Device d = logits_.device();
    const int64_t rows = logits_.size(0), cols = logits_.size(1);
    Tensor dl = Tensor::empty(logits_.shape(), logits_.dtype(), d);
    if (is_bf16(logits_)) {
      DPT_CUDA_OR_CPU(
          d,
          cuda::cross_entropy_backward_bf16(logits_.bf16(), labels_.i32(), rows, cols, dloss.f32(), dl.bf16(),
                                            stream_of(d)),
          cpu::cross_entropy_backward_bf16(logits_.bf16(), labels_.i32(), rows, cols, dloss.f32(), dl.bf16()));
      give(grads, 0, dl);
      return;
    }
    DPT_CUDA_OR_CPU(
        d, cuda::cross_entropy_backward(logits_.f32(), labels_.i32(), rows, cols, dloss.f32(), dl.f32(), stream_of(d)),
        cpu::cross_entropy_backward(logits_.f32(), labels_.i32(), rows, cols, dloss.f32(), dl.f32()));
    give(grads, 0, dl);
  }

 private:
  Tensor logits_, labels_;
};

class CastNode : public Node {
 public:
  explicit CastNode(DType from) : from_(from) {}
  const char* name() const override { return "cast"; }
  void backward(Tensor& dy, Grads& grads) override { give(grads, 0, cast(dy, from_)); }

 private:
  DType from_;
};

// Saves the bf16 input and weight copy (the masters are its inputs, for their gradients)
// and the bf16 output, or the pre-activation for GELU.
class LinearBf16Node : public Node {
 public:
  LinearBf16Node(Tensor x, Tensor W16, Tensor saved, Act act)
      : x_(x.untracked()), W16_(W16.untracked()), saved_(saved.untracked()), act_(act) {}
  const char* name() const override { return "linear_bf16"; }
  void backward(Tensor& dy_in, Grads& grads) override {
    const int64_t rows = x_.size(0), out = W16_.size(0);
    const Device d = dy_in.device();
    Tensor dy = is_bf16(dy_in) ? dy_in : cast(dy_in, DType::bf16);
    // dz = dy * act'(.) in bf16, in place (dy is ours to overwrite), and db (fp32) from the
    // same pass when the bias needs it.
    if (inputs.size() > 2 && grads.needed(2)) {
      GradSlot db = grad_slot(grads, 2, {out}, d);
      DPT_CUDA_OR_CPU(
          d,
          cuda::act_bias_backward_bf16(dy.bf16(), saved_.bf16(), act_, rows, out, dy.bf16(), db.beta, db.t.f32(),
                                       bias_work(d, cuda::act_bias_backward_work(rows, out)).f32(), stream_of(d)),
          cpu::act_bias_backward_bf16(dy.bf16(), saved_.bf16(), act_, rows, out, dy.bf16(), db.beta, db.t.f32()));
      put_slot(grads, 2, db);
    } else if (act_ != Act::none) {
      DPT_CUDA_OR_CPU(d, cuda::act_backward_bf16(dy.bf16(), saved_.bf16(), act_, dy.numel(), dy.bf16(), stream_of(d)),
                      cpu::act_backward_bf16(dy.bf16(), saved_.bf16(), act_, dy.numel(), dy.bf16()));
    }
    if (grads.needed(0)) {  // dx (bf16) = dz W16
      Tensor dx = Tensor::empty(x_.shape(), DType::bf16, d);
      gemm(false, false, 1.0f, dy, W16_, 0.0f, dx);
      give(grads, 0, dx);
    }
    if (grads.needed(1)) {  // dW (fp32, +=) = dz^T x, straight into the flat gradient buffer
      GradSlot dW = grad_slot(grads, 1, W16_.shape(), d);
      gemm(true, false, 1.0f, dy, x_, dW.beta, dW.t);
      put_slot(grads, 1, dW);
    }
  }

 private:
  Tensor x_, W16_, saved_;
  Act act_;
};

}  // namespace

Tensor cast(const Tensor& t, DType to) {
  DPT_REQUIRE(t.defined(), "cast of an undefined tensor");
  if (t.dtype() == to) return t;
  Tensor out = Tensor::empty(t.shape(), to, t.device());
  copy_cast(out, t);
  if (any_requires_grad({&t})) record(out, std::make_shared<CastNode>(t.dtype()), {t});
  return out;
}

Tensor matmul(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  need_f32(a, "matmul");
  need_f32(b, "matmul");
  DPT_REQUIRE(a.dim() == 2 && b.dim() == 2, "matmul: operands must be matrices");
  Tensor c = Tensor::empty({ta ? a.size(1) : a.size(0), tb ? b.size(0) : b.size(1)}, DType::f32, a.device());
  gemm(ta, tb, 1.0f, a, b, 0.0f, c);
  if (any_requires_grad({&a, &b})) record(c, std::make_shared<MatmulNode>(a, b, ta, tb), {a, b});
  return c;
}

Tensor linear(const Tensor& x, const Tensor& W, const Tensor& b, Act act, const Tensor& out_into) {
  need_f32(x, "linear");
  need_f32(W, "linear");
  same_device(x, W, "linear");
  if (b.defined()) same_device(x, b, "linear");
  DPT_REQUIRE(x.dim() == 2 && W.dim() == 2 && x.size(1) == W.size(1),
              "linear: input " + shape_str(x.shape()) + " does not fit weight " + shape_str(W.shape()));
  DPT_REQUIRE(!b.defined() || (b.dim() == 1 && b.size(0) == W.size(0)),
              "linear: bias " + shape_str(b.shape()) + " does not fit weight " + shape_str(W.shape()));
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
  Tensor z = (grad && act == Act::gelu) ? Tensor::empty({rows, out}, DType::f32, d) : Tensor();
  bool fused = false;  // bias and activation done in the GEMM's epilogue
#if DPT_WITH_CUDA
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
  if (!fused && (b.defined() || act != Act::none)) {
    const float* bias = b.defined() ? b.f32() : nullptr;
    float* zp = z.defined() ? z.f32() : nullptr;
    DPT_CUDA_OR_CPU(d, cuda::bias_act_forward(y.f32(), bias, act, rows, out, zp, y.f32(), stream_of(d)),
                    cpu::bias_act_forward(y.f32(), bias, act, rows, out, zp, y.f32()));
  }
  if (grad) {
    record(y, std::make_shared<LinearNode>(x, W, act == Act::gelu ? z : y, act), layer_inputs(x, W, b));
  }
  return y;
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
    Tensor z = grad && L.act == Act::gelu ? Tensor::empty({rows, L.W.size(0)}, DType::f32, d) : Tensor();
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

Tensor linear_bf16(const Tensor& x, const Tensor& W, const Tensor& b, const Tensor& W16, const Tensor& b16, Act act) {
  need_bf16(x, "linear_bf16");
  need_f32(W, "linear_bf16");
  need_bf16(W16, "linear_bf16 (weight copy)");
  same_device(x, W, "linear_bf16");
  same_device(W, W16, "linear_bf16");
  DPT_REQUIRE(x.dim() == 2 && W.dim() == 2 && x.size(1) == W.size(1) && W16.shape() == W.shape(),
              "linear_bf16: input " + shape_str(x.shape()) + " does not fit weight " + shape_str(W.shape()) +
                  " (bf16 copy " + shape_str(W16.shape()) + ")");
  DPT_REQUIRE(b.defined() == b16.defined(), "linear_bf16: a bias needs its bf16 copy, and only a bias has one");
  if (b.defined()) {
    need_f32(b, "linear_bf16");
    need_bf16(b16, "linear_bf16 (bias copy)");
    DPT_REQUIRE(b.dim() == 1 && b.size(0) == W.size(0) && b16.shape() == b.shape(),
                "linear_bf16: bias " + shape_str(b.shape()) + " does not fit weight " + shape_str(W.shape()));
  }
  const Device d = x.device();
  const int64_t rows = x.size(0), out = W.size(0);
  Tensor y = Tensor::empty({rows, out}, DType::bf16, d);
  const bool grad = any_requires_grad({&x, &W, &b});
  // GELU's backward needs the pre-activation; the others can work from the output.
  Tensor z = (grad && act == Act::gelu) ? Tensor::empty({rows, out}, DType::bf16, d) : Tensor();
  bool fused = false;  // bias and activation done in the GEMM's epilogue, y rounded once there
#if DPT_WITH_CUDA
  const double multiply_adds = static_cast<double>(rows) * static_cast<double>(out) * static_cast<double>(x.size(1));
  if (d.is_cuda() && rows > 0 && multiply_adds >= kLtMinMultiplyAdds && (act == Act::none || act == Act::relu)) {
    fused = lt_gemm(context(d), d, cuda::LtTypes{DType::bf16, DType::bf16, DType::bf16}, false, true, rows, out,
                    x.size(1), 1.0f, x.bf16(), W16.bf16(), 0.0f, y.bf16(), b16.defined() ? b16.bf16() : nullptr, act);
  }
#endif
  if (!fused && rows > 0) {  // the GEMM in fp32, then bias and activation rounded once into y
    Tensor acc = Tensor::empty({rows, out}, DType::f32, d);
    gemm(false, true, 1.0f, x, W16, 0.0f, acc);
    const uint16_t* bias = b16.defined() ? b16.bf16() : nullptr;
    uint16_t* zp = z.defined() ? z.bf16() : nullptr;
    DPT_CUDA_OR_CPU(d, cuda::bias_act_forward_bf16(acc.f32(), bias, act, rows, out, zp, y.bf16(), stream_of(d)),
                    cpu::bias_act_forward_bf16(acc.f32(), bias, act, rows, out, zp, y.bf16()));
  }
  if (grad) {
    record(y, std::make_shared<LinearBf16Node>(x, W16, act == Act::gelu ? z : y, act), layer_inputs(x, W, b));
  }
  return y;
}

Tensor activation(const Tensor& x, Act act) {
  if (is_bf16(x)) {
    const Device d = x.device();
    Tensor y = Tensor::empty(x.shape(), DType::bf16, d);
    const bool grad = any_requires_grad({&x});
    DPT_CUDA_OR_CPU(d, cuda::act_forward_bf16(x.bf16(), act, x.numel(), y.bf16(), stream_of(d)),
                    cpu::act_forward_bf16(x.bf16(), act, x.numel(), y.bf16()));
    if (grad) record(y, std::make_shared<ActivationNode>(act == Act::gelu ? x.untracked() : y, act), {x});
    return y;
  }
  need_f32(x, "activation");
  const Device d = x.device();
  Tensor y = Tensor::empty(x.shape(), DType::f32, d);
  const bool grad = any_requires_grad({&x});
  Tensor z = (grad && act == Act::gelu) ? x.untracked() : Tensor();
  DPT_CUDA_OR_CPU(d, cuda::bias_act_forward(x.f32(), nullptr, act, 1, x.numel(), nullptr, y.f32(), stream_of(d)),
                  cpu::bias_act_forward(x.f32(), nullptr, act, 1, x.numel(), nullptr, y.f32()));
  if (grad) record(y, std::make_shared<ActivationNode>(act == Act::gelu ? z : y, act), {x});
  return y;
}

Tensor mse_loss(const Tensor& y, const Tensor& target) {
  need_float(y, "mse_loss");
  need_f32(target, "mse_loss");
  same_device(y, target, "mse_loss");
  DPT_REQUIRE(y.shape() == target.shape(),
              "mse_loss: prediction " + shape_str(y.shape()) + " and target " + shape_str(target.shape()));
  DPT_REQUIRE(y.numel() > 0, "mse_loss of an empty tensor");
  const Device d = y.device();
  Tensor loss = Tensor::empty({1}, DType::f32, d);
  const bool grad = any_requires_grad({&y});
  Tensor dy = grad ? Tensor::empty(y.shape(), y.dtype(), d) : Tensor();
  if (is_bf16(y)) {
    uint16_t* dyp = grad ? dy.bf16() : nullptr;
    DPT_CUDA_OR_CPU(d,
                    cuda::mse_forward_bf16(y.bf16(), target.f32(), y.numel(), loss.f32(), dyp, reduce_work(d, 0).f32(),
                                           context(d).counter(), stream_of(d)),
                    cpu::mse_forward_bf16(y.bf16(), target.f32(), y.numel(), loss.f32(), dyp));
    if (grad) record(loss, std::make_shared<MseNode>(y, target, dy), {y});
    return loss;
  }
  float* dyp = grad ? dy.f32() : nullptr;
  DPT_CUDA_OR_CPU(d,
                  cuda::mse_forward(y.f32(), target.f32(), y.numel(), loss.f32(), dyp, reduce_work(d, 0).f32(),
                                    context(d).counter(), stream_of(d)),
                  cpu::mse_forward(y.f32(), target.f32(), y.numel(), loss.f32(), dyp));
  if (grad) record(loss, std::make_shared<MseNode>(y, target, dy), {y});
  return loss;
}

Tensor accuracy(const Tensor& logits, const Tensor& labels) {
  need_float(logits, "accuracy");
  DPT_REQUIRE(labels.defined() && labels.dtype() == DType::i32, "accuracy: labels must be i32");
  same_device(logits, labels, "accuracy");
  DPT_REQUIRE(logits.dim() == 2 && labels.dim() == 1 && labels.size(0) == logits.size(0) && logits.size(0) > 0 &&
                  logits.size(1) > 0,
              "accuracy: logits " + shape_str(logits.shape()) + " and labels " + shape_str(labels.shape()));
  const Device d = logits.device();
  const int64_t rows = logits.size(0), cols = logits.size(1);
  Tensor out = Tensor::empty({1}, DType::f32, d);
  if (is_bf16(logits)) {
    DPT_CUDA_OR_CPU(d,
                    cuda::accuracy_bf16(logits.bf16(), labels.i32(), rows, cols, out.f32(), reduce_work(d, rows).f32(),
                                        stream_of(d)),
                    cpu::accuracy_bf16(logits.bf16(), labels.i32(), rows, cols, out.f32()));
  } else {
    DPT_CUDA_OR_CPU(
        d, cuda::accuracy(logits.f32(), labels.i32(), rows, cols, out.f32(), reduce_work(d, rows).f32(), stream_of(d)),
        cpu::accuracy(logits.f32(), labels.i32(), rows, cols, out.f32()));
  }
  return out;
}

Tensor cross_entropy(const Tensor& logits, const Tensor& labels) {
  need_float(logits, "cross_entropy");
  DPT_REQUIRE(labels.defined() && labels.dtype() == DType::i32, "cross_entropy: labels must be i32");
  same_device(logits, labels, "cross_entropy");
  DPT_REQUIRE(logits.dim() == 2 && labels.dim() == 1 && labels.size(0) == logits.size(0) && logits.size(0) > 0 &&
                  logits.size(1) > 0,
              "cross_entropy: logits " + shape_str(logits.shape()) + " and labels " + shape_str(labels.shape()));
  const Device d = logits.device();
  const int64_t rows = logits.size(0), cols = logits.size(1);
  Tensor loss = Tensor::empty({1}, DType::f32, d);
  if (is_bf16(logits)) {
    DPT_CUDA_OR_CPU(d,
                    cuda::cross_entropy_forward_bf16(logits.bf16(), labels.i32(), rows, cols, loss.f32(),
                                                     reduce_work(d, rows).f32(), stream_of(d)),
                    cpu::cross_entropy_forward_bf16(logits.bf16(), labels.i32(), rows, cols, loss.f32()));
    if (any_requires_grad({&logits})) record(loss, std::make_shared<CrossEntropyNode>(logits, labels), {logits});
    return loss;
  }
  DPT_CUDA_OR_CPU(d,
                  cuda::cross_entropy_forward(logits.f32(), labels.i32(), rows, cols, loss.f32(),
                                              reduce_work(d, rows).f32(), stream_of(d)),
                  cpu::cross_entropy_forward(logits.f32(), labels.i32(), rows, cols, loss.f32()));
  if (any_requires_grad({&logits})) record(loss, std::make_shared<CrossEntropyNode>(logits, labels), {logits});
  return loss;
}

// ---- Sums between CPU devices (parallel/'s host reduction) ----------------------------

void add_host_(const Tensor& x, const Tensor& y) {
  detail::need_f32(y, "add_host_");
  DPT_REQUIRE(x.dtype() == DType::f32 || x.dtype() == DType::bf16, "add_host_: x must be f32 or bf16");
  DPT_REQUIRE(x.numel() == y.numel(), "add_host_: " + shape_str(x.shape()) + " and " + shape_str(y.shape()));
  DPT_REQUIRE(x.device().is_cpu() && y.device().is_cpu(),
              "add_host_: CPU devices, got " + x.device().str() + " and " + y.device().str());
  if (x.dtype() == DType::bf16) cpu::add_bf16(x.bf16(), y.f32(), x.numel());
  else cpu::axpy(x.numel(), 1.0f, x.f32(), y.f32());
}

}  // namespace dpt
