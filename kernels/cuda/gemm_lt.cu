// gemm_lt.cu — the GEMM through cuBLASLt with the bias and ReLU (or tanh-GELU) fused into
// its epilogue, so a Linear layer's forward is one kernel instead of a GEMM and an
// elementwise pass. cuBLASLt's GELU is the tanh form (Act::gelu_tanh; Act::gelu, the
// exact one, never fuses); its GELU_AUX epilogues also write the pre-activation, which
// the backward reads.
//
// Same row-major contract as gemm_cublas (and the same operand swap: the row-major
// C = op(A) op(B) is the column-major C^T = op(B)^T op(A)^T). The column-major D is
// n x m, so cuBLASLt's bias, whose length is D's row count, is our bias over columns.
//
// A plan (descriptors, layouts and the algorithm, see make_plan and tune) costs longer to
// make than a small GEMM takes to run, so plans are made once per
// (stream, shape, precision, element types, epilogue, operand alignment, whether C is read)
// and cached for the process. A plan's first call, outside a CUDA graph's recording and
// with beta 0, tunes it: the fastest candidate with the heuristic choice's bits.
//
// Element types: A/B f32 with C/D f32 (compute per the precision), or A/B bf16 with C/D
// bf16 or f32 (CUBLAS_COMPUTE_32F, fp32 scale): combinations cuBLASLt's table lists. The
// bias follows D's type unless told otherwise (CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE); the
// header documents the bias as D's type outside IMMA and fp8 kernels, so bf16 training
// hands a bf16 D a bf16 bias, and a combination without a kernel is reported, not guessed.
// Keying by stream also keeps two threads from ever setting the same descriptor's bias
// pointer at once: a stream is driven by one thread. Plans are never destroyed (the
// handful that a run makes are freed with the process).
#include <cublasLt.h>

#include <atomic>
#include <climits>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "check.hpp"
#include "cuda.hpp"

#define DPT_CUBLASLT_CHECK(call) DPT_CUBLAS_CHECK(call)

namespace dpt::cuda {
namespace {

// The largest power of two (up to 256) that divides the address: cuBLASLt's heuristic
// must only offer kernels whose vector loads the operands allow.
uint32_t alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && a % al != 0) al /= 2;
  return al;
}

// The device too: a stream's address can come back for a new stream on another GPU.
// Whether C is read (beta not 0) too: such a call is never tuned (tune() writes C), so it
// keeps the heuristic's choice in a plan of its own.
using PlanKey = std::tuple<int, cudaStream_t, bool, bool, int64_t, int64_t, int64_t, int, int, int, int, int, uint32_t,
                           uint32_t, uint32_t, uint32_t, uint32_t, size_t, bool>;

constexpr int kCandidates = 16;  // algorithms asked of the heuristic

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  std::vector<cublasLtMatmulAlgo_t> others;  // candidates tune() may take instead (then cleared)
  bool supported = true;                     // false: cuBLASLt has no kernel for it (remembered, never launched)
};

// Kept beside compute_type(Precision) (gemm_cublas.cu), alike only in shape: another enum, another mapping.
cudaDataType_t data_type(DType t) {
  switch (t) {
    case DType::f32:
      return CUDA_R_32F;
    case DType::bf16:
      return CUDA_R_16BF;
    case DType::i32:
      break;
  }
  throw ::dpt::Error("gemm_lt: unsupported element type");
}

// bf16 operands are already rounded: plain fp32 accumulation. fp32 operands per precision.
cublasComputeType_t compute_type(Precision p, DType ab) {
  return ab == DType::bf16 ? CUBLAS_COMPUTE_32F : cuda::compute_type(p);
}

cublasLtEpilogue_t epilogue(bool bias, Act act, bool aux) {
  if (act == Act::relu) return bias ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_RELU;
  if (act == Act::gelu_tanh && aux) return bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
  if (act == Act::gelu_tanh) return bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
  return bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
}

Plan make_plan(cublasLtHandle_t lt, Precision precision, LtTypes types, bool ta, bool tb, uint64_t M, uint64_t N,
               uint64_t K, cublasLtEpilogue_t epi, const void* bias, const void* aux, const uint32_t align[4],
               size_t workspace_bytes) {
  Plan p;
  DPT_CUBLASLT_CHECK(cublasLtMatmulDescCreate(&p.desc, compute_type(precision, types.ab), CUDA_R_32F));
  // cuBLASLt's "A" is our B and its "B" is our A (see the top of the file).
  const cublasOperation_t op_a = tb ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  DPT_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  DPT_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  DPT_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
  // The heuristic reads the bias pointer's alignment (the plan key has it too).
  if (bias)
    DPT_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  if (aux) {  // D's shape (n x m column-major) and type (the default); the heuristic reads its alignment
    const int64_t ld = static_cast<int64_t>(N);
    DPT_CUBLASLT_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)));
    DPT_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof(ld)));
  }
  if (bias && types.bias != types.c) {  // the default bias type is D's
    const int32_t bias_type = static_cast<int32_t>(data_type(types.bias));
    DPT_CUBLASLT_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
  }
  // Stored shapes, column-major: our B is k x n row-major (n x k when tb), our A m x k.
  const cudaDataType_t ab = data_type(types.ab), c = data_type(types.c);
  DPT_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&p.a, ab, tb ? K : N, tb ? N : K, tb ? K : N));
  DPT_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&p.b, ab, ta ? M : K, ta ? K : M, ta ? M : K));
  DPT_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&p.c, c, N, M, N));

  cublasLtMatmulPreference_t pref = nullptr;
  DPT_CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  DPT_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                          &workspace_bytes, sizeof(workspace_bytes)));
  const cublasLtMatmulPreferenceAttributes_t attrs[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i)
    DPT_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attrs[i], &align[i], sizeof(align[i])));
  cublasLtMatmulHeuristicResult_t results[kCandidates]{};
  int found = 0;
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(lt, p.desc, p.a, p.b, p.c, p.c, pref, kCandidates, results, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  // A type combination this cuBLASLt has no kernel for is reported as NOT_SUPPORTED or as no
  // candidate; a bias whose type differs from D's (a bf16 D with an fp32 bias, cuBLAS 12.9
  // on an H200) as INVALID_VALUE. Each means "no fused kernel". Any other INVALID_VALUE is
  // a bug of ours and throws.
  const bool bias_type_refused = st == CUBLAS_STATUS_INVALID_VALUE && bias && types.bias != types.c;
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || bias_type_refused || (st == CUBLAS_STATUS_SUCCESS && found == 0)) {
    p.supported = false;  // the caller takes its unfused path
    return p;
  }
  DPT_CUBLASLT_CHECK(st);
  // The heuristic's first choice can split K and add a reduction kernel and a separate
  // epilogue kernel (three kernels, and slow, for a 64 x 1000 x 1000 GEMM with a bias).
  // The rule: the first candidate that does not split K, whose epilogue stays fused; the
  // others that do not split K are kept for tune() to try.
  p.algo = results[0].algo;
  bool chosen = false;
  for (int i = 0; i < found; ++i) {
    int32_t split = 1;
    size_t written = 0;
    DPT_CUBLASLT_CHECK(cublasLtMatmulAlgoConfigGetAttribute(&results[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split,
                                                            sizeof(split), &written));
    if (split > 1) continue;
    if (!chosen) p.algo = results[i].algo;
    else p.others.push_back(results[i].algo);
    chosen = true;
  }
  return p;
}

std::atomic<bool> tuning{true};  // set_lt_tuning

// A 64-bit digest of `bytes` bytes (a multiple of 4) at p, added into *out: equal outputs,
// equal digests (integer adds, so in any order the same).
__global__ void digest_kernel(const uint32_t* p, size_t words, unsigned long long* out) {
  unsigned long long h = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < words;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    h += (static_cast<unsigned long long>(p[i]) * 0x9E3779B97F4A7C15ull) ^ (i * 0xC2B2AE3D27D4EB4Full);
  atomicAdd(out, h);
}

// One candidate's run of the call (alpha op(A) op(B) into C; the plan's descriptor holds the
// bias and aux pointers).
struct Call {
  cublasLtHandle_t lt;
  const Plan* plan;
  float alpha;
  const void *A, *B;
  void* C;
  void* workspace;
  size_t workspace_bytes;
  cudaStream_t stream;
  cublasStatus_t run(const cublasLtMatmulAlgo_t& algo) const {
    const float beta = 0.0f;
    return cublasLtMatmul(lt, plan->desc, &alpha, B, plan->a, A, plan->b, &beta, C, plan->c, C, plan->c, &algo,
                          workspace, workspace_bytes, stream);
  }
};

// The digest of what a run wrote (C, and aux where the epilogue writes it), after the run.
unsigned long long output_digest(const Call& call, size_t c_bytes, const void* aux_out, size_t aux_bytes,
                                 unsigned long long* d_digest) {
  DPT_CUDA_CHECK(cudaMemsetAsync(d_digest, 0, sizeof(*d_digest), call.stream));
  digest_kernel<<<264, 256, 0, call.stream>>>(static_cast<const uint32_t*>(call.C), c_bytes / 4, d_digest);
  if (aux_out)
    digest_kernel<<<264, 256, 0, call.stream>>>(static_cast<const uint32_t*>(aux_out), aux_bytes / 4, d_digest);
  DPT_CUDA_CHECK(cudaGetLastError());
  unsigned long long h = 0;
  DPT_CUDA_CHECK(cudaMemcpyAsync(&h, d_digest, sizeof(h), cudaMemcpyDeviceToHost, call.stream));
  DPT_CUDA_CHECK(cudaStreamSynchronize(call.stream));
  return h;
}

// Tuning a plan on its first call: the heuristic's choice and every other candidate that
// does not split K run once on the call's own operands; those that wrote the same bits as
// the heuristic's choice (C, and the pre-activation a GELU_AUX epilogue writes) are timed
// (kTimedRuns each) and the fastest is kept. A candidate with other bits sums in another
// order and is never taken, so the plan's results are the heuristic choice's bits on every
// run (a resumed run repeats an uninterrupted one); only its speed is tuned. (cuBLASLt's
// first candidate left GPT-2's GELU GEMMs at about 450 TFLOPS against 700 for the same
// shapes without the epilogue: docs/performance-log.md.) The call's output is written by
// every run and then by the real one after; the caller makes sure nothing reads C (beta 0).
constexpr int kTimedRuns = 3;
// The digest's device word and the two timing events, freed however tune() ends.
struct TuneScratch {
  unsigned long long* digest = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  TuneScratch() {
    DPT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&digest), sizeof(*digest)));
    DPT_CUDA_CHECK(cudaEventCreate(&start));
    DPT_CUDA_CHECK(cudaEventCreate(&stop));
  }
  ~TuneScratch() {
    if (start) DPT_CUDA_WARN(cudaEventDestroy(start));
    if (stop) DPT_CUDA_WARN(cudaEventDestroy(stop));
    if (digest) DPT_CUDA_WARN(cudaFree(digest));
  }
  TuneScratch(const TuneScratch&) = delete;
  TuneScratch& operator=(const TuneScratch&) = delete;
};

void tune(const Call& call, Plan& plan, size_t c_bytes, const void* aux_out, size_t aux_bytes) {
  if (plan.others.empty()) return;
  TuneScratch t;
  auto time_of = [&](const cublasLtMatmulAlgo_t& algo) {
    DPT_CUDA_CHECK(cudaEventRecord(t.start, call.stream));
    for (int r = 0; r < kTimedRuns; ++r) DPT_CUBLASLT_CHECK(call.run(algo));
    DPT_CUDA_CHECK(cudaEventRecord(t.stop, call.stream));
    DPT_CUDA_CHECK(cudaEventSynchronize(t.stop));
    float ms = 0;
    DPT_CUDA_CHECK(cudaEventElapsedTime(&ms, t.start, t.stop));
    return ms;
  };
  DPT_CUBLASLT_CHECK(call.run(plan.algo));
  const unsigned long long want = output_digest(call, c_bytes, aux_out, aux_bytes, t.digest);
  float best = time_of(plan.algo);
  for (const cublasLtMatmulAlgo_t& algo : plan.others) {
    if (call.run(algo) != CUBLAS_STATUS_SUCCESS) continue;  // a candidate that cannot run is passed over
    if (output_digest(call, c_bytes, aux_out, aux_bytes, t.digest) != want) continue;
    if (const float ms = time_of(algo); ms < best) {
      best = ms;
      plan.algo = algo;
    }
  }
}

}  // namespace

void set_lt_tuning(bool on) { tuning.store(on); }

bool gemm_lt(cublasHandle_t handle, cudaStream_t stream, Precision precision, bool ta, bool tb, int64_t m, int64_t n,
             int64_t k, float alpha, const float* A, const float* B, float beta, float* C, const float* bias, Act act,
             void* workspace, size_t workspace_bytes) {
  return gemm_lt(handle, stream, precision, LtTypes{}, ta, tb, m, n, k, alpha, A, B, beta, C, bias, act, workspace,
                 workspace_bytes);
}

bool gemm_lt(cublasHandle_t handle, cudaStream_t stream, Precision precision, LtTypes types, bool ta, bool tb,
             int64_t m, int64_t n, int64_t k, float alpha, const void* A, const void* B, float beta, void* C,
             const void* bias, Act act, void* workspace, size_t workspace_bytes, void* aux, bool act_grad) {
  DPT_CHECK(handle != nullptr, "gemm_lt: null cuBLAS handle");
  DPT_CHECK((types.ab == DType::f32 && types.c == DType::f32) ||
                (types.ab == DType::bf16 && (types.c == DType::bf16 || types.c == DType::f32)),
            std::string("gemm_lt: A/B ") + dtype_name(types.ab) + " with C/D " + dtype_name(types.c) +
                " is not supported (f32/f32, or bf16 with bf16 or f32)");
  DPT_CHECK(types.bias == DType::f32 || types.bias == DType::bf16, "gemm_lt: the bias must be f32 or bf16");
  DPT_CHECK(act == Act::none || act == Act::relu || act == Act::gelu_tanh,
            "gemm_lt: only ReLU and tanh-GELU fuse into the epilogue");
  DPT_CHECK(!aux || act == Act::gelu_tanh, "gemm_lt: only tanh-GELU writes a pre-activation");
  DPT_CHECK(!act_grad || (aux && !bias && beta == 0.0f),
            "gemm_lt: the GELU's gradient reads the pre-activation (aux), with no bias and beta 0");
  // The pre-activation's leading dimension (n) must be a multiple of 8: else unfused.
  if (aux && n % 8 != 0) return false;
  DPT_CHECK(m > 0 && n > 0 && k > 0 && m <= INT_MAX && n <= INT_MAX && k <= INT_MAX,
            "gemm_lt: sizes must be in [1, INT_MAX]");
  // DGELU: D = (alpha op(A) op(B)) gelu'(aux), aux the pre-activation GELU_AUX wrote.
  const cublasLtEpilogue_t epi = act_grad ? CUBLASLT_EPILOGUE_DGELU : epilogue(bias != nullptr, act, aux != nullptr);
  const uint32_t align[4] = {alignment(B), alignment(A), alignment(C), alignment(C)};
  int device = -1;
  DPT_CUDA_CHECK(cudaGetDevice(&device));
  const PlanKey key{device,
                    stream,
                    ta,
                    tb,
                    m,
                    n,
                    k,
                    static_cast<int>(precision),
                    static_cast<int>(types.ab),
                    static_cast<int>(types.c),
                    static_cast<int>(types.bias),
                    static_cast<int>(epi),
                    align[0],
                    align[1],
                    align[2],
                    alignment(bias),
                    alignment(aux),
                    workspace_bytes,
                    beta != 0.0f};
  static std::mutex mu;
  static std::map<PlanKey, Plan> plans;
  // A cuBLAS handle is a valid cuBLASLt handle (cuBLAS is built on cuBLASLt; PyTorch
  // relies on the same cast).
  const auto lt = reinterpret_cast<cublasLtHandle_t>(handle);
  Plan* plan = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = plans.find(key); it != plans.end()) plan = &it->second;  // map nodes stay put
  }
  if (!plan) {
    // Made and tuned outside the lock: tuning waits for this stream, whose work may wait
    // for another device's thread (a collective) that needs the lock for a plan of its own.
    // Only this stream's thread makes or uses this key's plan.
    Plan made = make_plan(lt, precision, types, ta, tb, static_cast<uint64_t>(m), static_cast<uint64_t>(n),
                          static_cast<uint64_t>(k), epi, bias, aux, align, workspace_bytes);
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    DPT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
    if (made.supported && beta == 0.0f && capturing == cudaStreamCaptureStatusNone && tuning.load()) {
      const size_t c_bytes = static_cast<size_t>(m) * static_cast<size_t>(n) * dtype_size(types.c);
      tune(Call{lt, &made, alpha, A, B, C, workspace, workspace_bytes, stream}, made, c_bytes, act_grad ? nullptr : aux,
           c_bytes);
    }
    made.others.clear();
    std::lock_guard<std::mutex> lock(mu);
    plan = &plans.emplace(key, std::move(made)).first->second;
  }
  if (!plan->supported) return false;
  if (bias)
    DPT_CUBLASLT_CHECK(
        cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  if (aux)
    DPT_CUBLASLT_CHECK(
        cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)));
  DPT_CUBLASLT_CHECK(cublasLtMatmul(lt, plan->desc, &alpha, B, plan->a, A, plan->b, &beta, C, plan->c, C, plan->c,
                                    &plan->algo, workspace, workspace_bytes, stream));
  return true;
}

}  // namespace dpt::cuda
