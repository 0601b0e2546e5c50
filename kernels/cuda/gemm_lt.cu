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
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
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
// keeps the heuristic's choice, in a plan of its own. Last, A's leading dimension.
using PlanKey = std::tuple<int, cudaStream_t, bool, bool, int64_t, int64_t, int64_t, int, int, int, int, int, uint32_t,
                           uint32_t, uint32_t, uint32_t, uint32_t, size_t, bool, int64_t>;

// Algorithms asked of the heuristic: its first choice and the others tune() may try.
constexpr int kCandidates = 16;

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool supported = true;  // false: cuBLASLt has no kernel for it (remembered, never launched)
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

// (others: the other candidates that do not split K, for tune().)
Plan make_plan(cublasLtHandle_t lt, Precision precision, LtTypes types, bool ta, bool tb, uint64_t M, uint64_t N,
               uint64_t K, uint64_t lda, cublasLtEpilogue_t epi, const void* bias, const void* aux,
               const uint32_t align[4], size_t workspace_bytes, std::vector<cublasLtMatmulAlgo_t>& others) {
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
  // Stored shapes, column-major: our B is k x n row-major (n x k when tb), our A m x k (its
  // rows lda apart).
  const cudaDataType_t ab = data_type(types.ab), c = data_type(types.c);
  DPT_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&p.a, ab, tb ? K : N, tb ? N : K, tb ? K : N));
  DPT_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&p.b, ab, ta ? M : K, ta ? K : M, lda));
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
    else others.push_back(results[i].algo);
    chosen = true;
  }
  return p;
}

std::atomic<bool> tuning{true};                                                   // set_lt_tuning
std::atomic<int64_t> tuned_plans{0}, candidates_tried{0}, candidates_matched{0};  // lt_tuning_stats

// A digest of n 16-bit words at p (any output is 2-byte aligned): words[0] += a hash (integer
// adds, so the same in any order), words[1] += the count of words that are not 0.
__global__ void digest_kernel(const uint16_t* p, size_t n, unsigned long long* words) {
  unsigned long long h = 0, nonzero = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    h += (static_cast<unsigned long long>(p[i]) + 1) * 0x9E3779B97F4A7C15ull ^ (i * 0xC2B2AE3D27D4EB4Full);
    nonzero += p[i] != 0;
  }
  atomicAdd(&words[0], h);
  atomicAdd(&words[1], nonzero);
}

// The digest's two device words, made once a stream (two threads tuning on one device at
// once must not add into the same words) and kept, as the plans are: a cudaFree would wait
// for the whole device, other threads' collectives included.
unsigned long long* digest_words(int device, cudaStream_t stream) {
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, unsigned long long*> words;
  std::lock_guard<std::mutex> lock(mu);
  unsigned long long*& w = words[{device, stream}];
  if (!w) DPT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&w), 2 * sizeof(*w)));
  return w;
}

// A GEMM call as gemm_lt was given it, with its plan's key parts: what make_plan, tune and
// the launch read.
struct LtCall {
  cublasLtHandle_t lt;
  cudaStream_t stream;
  int device;
  float alpha, beta;
  const void *A, *B;
  void* C;
  void* aux;  // written by a GELU_AUX epilogue, read by DGELU (act_grad)
  bool act_grad;
  size_t out_words;  // C's size in 16-bit words
  int64_t m, n, k, lda;
  void* workspace;
  size_t workspace_bytes;
  cublasStatus_t run(const Plan& plan, const cublasLtMatmulAlgo_t& algo) const {
    return cublasLtMatmul(lt, plan.desc, &alpha, B, plan.a, A, plan.b, &beta, C, plan.c, C, plan.c, &algo, workspace,
                          workspace_bytes, stream);
  }
};

struct Digest {
  unsigned long long hash = 0, nonzero = 0;
  bool operator==(const Digest& o) const { return hash == o.hash && nonzero == o.nonzero; }
};

// The digest of what a run wrote: C, and the pre-activation where a GELU_AUX epilogue wrote it.
Digest output_digest(const LtCall& call) {
  unsigned long long* words = digest_words(call.device, call.stream);
  DPT_CUDA_CHECK(cudaMemsetAsync(words, 0, 2 * sizeof(*words), call.stream));
  constexpr unsigned kBlocks = 256, kThreads = 256;  // a few loads in flight a thread at GPT-2's sizes
  digest_kernel<<<kBlocks, kThreads, 0, call.stream>>>(static_cast<const uint16_t*>(call.C), call.out_words, words);
  if (call.aux && !call.act_grad)
    digest_kernel<<<kBlocks, kThreads, 0, call.stream>>>(static_cast<const uint16_t*>(call.aux), call.out_words, words);
  DPT_CUDA_CHECK(cudaGetLastError());
  Digest d;
  DPT_CUDA_CHECK(cudaMemcpyAsync(&d, words, sizeof(d), cudaMemcpyDeviceToHost, call.stream));
  DPT_CUDA_CHECK(cudaStreamSynchronize(call.stream));
  return d;
}

// The fastest of kTimings single runs (ms): a minimum, so a late run of another stream's
// work does not make a fast kernel look slow.
constexpr int kTimings = 3;
float run_time(const LtCall& call, const Plan& plan, const cublasLtMatmulAlgo_t& algo) {
  struct Events {
    cudaEvent_t start = nullptr, stop = nullptr;
    ~Events() {
      if (start) DPT_CUDA_WARN(cudaEventDestroy(start));
      if (stop) DPT_CUDA_WARN(cudaEventDestroy(stop));
    }
  } e;
  DPT_CUDA_CHECK(cudaEventCreate(&e.start));
  DPT_CUDA_CHECK(cudaEventCreate(&e.stop));
  float best = 0;
  for (int t = 0; t < kTimings; ++t) {
    DPT_CUDA_CHECK(cudaEventRecord(e.start, call.stream));
    DPT_CUBLASLT_CHECK(call.run(plan, algo));
    DPT_CUDA_CHECK(cudaEventRecord(e.stop, call.stream));
    DPT_CUDA_CHECK(cudaEventSynchronize(e.stop));
    float ms = 0;
    DPT_CUDA_CHECK(cudaEventElapsedTime(&ms, e.start, e.stop));
    if (t == 0 || ms < best) best = ms;
  }
  return best;
}

// DPT_LT_REPORT in the environment (a diagnosis, read once): tune() times every candidate,
// those with other bits too, and prints a line for each to stderr. Taking a kernel with other
// bits changes a run's numbers, so that is a decision for a person, made from these lines.
bool report_candidates() {
  static const bool on = std::getenv("DPT_LT_REPORT") != nullptr;
  return on;
}

void report_candidate(const LtCall& call, int index, const cublasLtMatmulAlgo_t& algo, float ms, bool same_bits) {
  const cublasLtMatmulAlgoConfigAttributes_t attrs[3] = {CUBLASLT_ALGO_CONFIG_ID, CUBLASLT_ALGO_CONFIG_TILE_ID,
                                                         CUBLASLT_ALGO_CONFIG_STAGES_ID};
  int32_t value[3] = {-1, -1, -1};
  for (int i = 0; i < 3; ++i) {
    size_t written = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attrs[i], &value[i], sizeof(value[i]), &written) !=
        CUBLAS_STATUS_SUCCESS)
      value[i] = -1;
  }
  std::fprintf(stderr, "dpt lt candidate %lld x %lld x %lld%s #%d (algo %d tile %d stages %d): %.1f us, %s\n",
               static_cast<long long>(call.m), static_cast<long long>(call.n), static_cast<long long>(call.k),
               call.act_grad ? " dgelu"
               : call.aux    ? " gelu-aux"
                             : "",
               index, value[0], value[1], value[2], static_cast<double>(ms) * 1000.0,
               index == 0  ? "the heuristic's choice"
               : same_bits ? "same bits"
                           : "other bits");
}

// Tuning a plan on its first call: the heuristic's choice and the other candidates that do
// not split K run on the call's own operands; those that wrote the same bits as the
// heuristic's choice (C, and a GELU_AUX epilogue's pre-activation) are timed and the fastest
// is kept. Outputs with other bits sum in another order; outputs with the same bits over
// millions of values sum in the same one, so the plan gives the heuristic choice's bits
// whatever the data (a resumed run repeats an uninterrupted one) and only its speed is
// tuned. Where most of the output is 0 (a layer started at zero) the bits say nothing and
// the heuristic's choice stays. The call's C is written by every run, and by its real run
// after: only calls that do not read C (beta 0) are tuned.
void tune(const LtCall& call, Plan& plan, const std::vector<cublasLtMatmulAlgo_t>& others) {
  DPT_CUBLASLT_CHECK(call.run(plan, plan.algo));
  const Digest want = output_digest(call);
  if (2 * want.nonzero < call.out_words * (call.aux && !call.act_grad ? 2 : 1)) return;
  float best = run_time(call, plan, plan.algo);
  const bool report = report_candidates();
  if (report) report_candidate(call, 0, plan.algo, best, true);
  cublasLtMatmulAlgo_t fastest = plan.algo;
  int index = 0;
  for (const cublasLtMatmulAlgo_t& algo : others) {
    ++candidates_tried;
    ++index;
    if (call.run(plan, algo) != CUBLAS_STATUS_SUCCESS) {  // passed over (a refused launch leaves no error)
      (void)cudaGetLastError();
      continue;
    }
    const bool same_bits = output_digest(call) == want;
    if (!same_bits && !report) continue;
    const float ms = run_time(call, plan, algo);
    if (report) report_candidate(call, index, algo, ms, same_bits);
    if (!same_bits) continue;
    ++candidates_matched;
    if (ms < best) {
      best = ms;
      fastest = algo;
    }
  }
  plan.algo = fastest;
  ++tuned_plans;
}

// GEMMs smaller than this keep the heuristic's choice: their kernels take microseconds and
// their outputs are too small to tell a summation order by.
constexpr double kTuneMinMultiplyAdds = 1 << 30;

// The key's plan: found, or made (and tuned where the call allows) outside the lock and kept.
// Tuning waits for the stream, whose work may wait for another device's thread (a
// collective) that needs the lock for a plan of its own. A key's stream is driven by one
// thread, so no other thread makes the same key meanwhile.
Plan& plan_for(const PlanKey& key, const LtCall& call, Precision precision, LtTypes types, bool ta, bool tb,
               cublasLtEpilogue_t epi, const void* bias, const uint32_t align[4]) {
  static std::mutex mu;
  static std::map<PlanKey, Plan> plans;  // never freed: the handful a run makes go with the process
  {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = plans.find(key); it != plans.end()) return it->second;  // map nodes stay put
  }
  std::vector<cublasLtMatmulAlgo_t> others;
  Plan made = make_plan(call.lt, precision, types, ta, tb, static_cast<uint64_t>(call.m), static_cast<uint64_t>(call.n),
                        static_cast<uint64_t>(call.k), static_cast<uint64_t>(call.lda), epi, bias, call.aux, align,
                        call.workspace_bytes, others);
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  DPT_CUDA_CHECK(cudaStreamIsCapturing(call.stream, &capturing));
  const double multiply_adds = static_cast<double>(call.m) * static_cast<double>(call.n) * static_cast<double>(call.k);
  if (made.supported && !others.empty() && call.beta == 0.0f && capturing == cudaStreamCaptureStatusNone &&
      multiply_adds >= kTuneMinMultiplyAdds && tuning.load())
    tune(call, made, others);
  std::lock_guard<std::mutex> lock(mu);
  return plans.try_emplace(key, made).first->second;
}

}  // namespace

void set_lt_tuning(bool on) { tuning.store(on); }

LtTuningStats lt_tuning_stats() { return {tuned_plans.load(), candidates_tried.load(), candidates_matched.load()}; }

bool gemm_lt(cublasHandle_t handle, cudaStream_t stream, Precision precision, bool ta, bool tb, int64_t m, int64_t n,
             int64_t k, float alpha, const float* A, const float* B, float beta, float* C, const float* bias, Act act,
             void* workspace, size_t workspace_bytes) {
  return gemm_lt(handle, stream, precision, LtTypes{}, ta, tb, m, n, k, alpha, A, B, beta, C, bias, act, workspace,
                 workspace_bytes);
}

bool gemm_lt(cublasHandle_t handle, cudaStream_t stream, Precision precision, LtTypes types, bool ta, bool tb,
             int64_t m, int64_t n, int64_t k, float alpha, const void* A, const void* B, float beta, void* C,
             const void* bias, Act act, void* workspace, size_t workspace_bytes, void* aux, bool act_grad,
             int64_t lda) {
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
  if (lda == 0) lda = ta ? m : k;
  DPT_CHECK(lda >= (ta ? m : k) && lda <= INT_MAX, "gemm_lt: A's leading dimension is shorter than its rows");
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
                    beta != 0.0f,
                    lda};
  // A cuBLAS handle is a valid cuBLASLt handle (cuBLAS is built on cuBLASLt; PyTorch
  // relies on the same cast).
  const LtCall call{reinterpret_cast<cublasLtHandle_t>(handle),
                    stream,
                    device,
                    alpha,
                    beta,
                    A,
                    B,
                    C,
                    aux,
                    act_grad,
                    static_cast<size_t>(m) * static_cast<size_t>(n) * dtype_size(types.c) / 2,
                    m,
                    n,
                    k,
                    lda,
                    workspace,
                    workspace_bytes};
  Plan* plan = &plan_for(key, call, precision, types, ta, tb, epi, bias, align);
  if (!plan->supported) return false;
  if (bias)
    DPT_CUBLASLT_CHECK(
        cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  if (aux)
    DPT_CUBLASLT_CHECK(
        cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)));
  DPT_CUBLASLT_CHECK(call.run(*plan, plan->algo));
  return true;
}

}  // namespace dpt::cuda
