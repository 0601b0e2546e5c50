#include <dptrain/runtime/context.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>

#include <dptrain/error.hpp>
#include <dptrain/runtime/tensor.hpp>
#include "allocator.hpp"

#if DPT_WITH_CUDA
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/cuda.hpp"
#endif

namespace dpt {

const char* precision_name(Precision p) { return kPrecisionNames.name(p); }
Precision parse_precision(const std::string& name) { return kPrecisionNames.parse(name); }
const char* gemm_name(GemmImpl g) { return kGemmNames.name(g); }
GemmImpl parse_gemm(const std::string& name) { return kGemmNames.parse(name); }

namespace {
thread_local Context* t_current = nullptr;

struct Defaults {
  std::mutex mu;
  std::map<std::pair<int, int>, std::unique_ptr<Context>> table;
  Precision precision = Precision::fp32;
  GemmImpl gemm = GemmImpl::cublas;
};
Defaults& defaults() {
  static auto* d = new Defaults();  // never destroyed: contexts outlive static tensors
  return *d;
}
}  // namespace

Context::Context(Device device, [[maybe_unused]] StreamPriority priority) : device_(device) {
#if DPT_WITH_CUDA
  if (device.is_cuda()) {
    cuda::set_device(device.index);
    int least = 0, greatest = 0;
    DPT_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    cudaStream_t s = nullptr;
    DPT_CUDA_CHECK(
        cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, priority == StreamPriority::high ? greatest : least));
    stream_ = s;
    cublasHandle_t h = nullptr;
    DPT_CUBLAS_CHECK(cublasCreate(&h));
    DPT_CUBLAS_CHECK(cublasSetStream(h, s));
    blas_ = h;
    DPT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&counter_), sizeof(unsigned)));
    DPT_CUDA_CHECK(cudaMemsetAsync(counter_, 0, sizeof(unsigned), s));  // ordered before the stream's kernels
  }
#endif
}

int Context::priority() const {
  int p = 0;
#if DPT_WITH_CUDA
  if (stream_) DPT_CUDA_CHECK(cudaStreamGetPriority(static_cast<cudaStream_t>(stream_), &p));
#endif
  return p;
}

Context::~Context() {
#if DPT_WITH_CUDNN
  if (dnn_) DPT_CUDNN_WARN(cudnnDestroy(static_cast<cudnnHandle_t>(dnn_)));
#endif
#if DPT_WITH_CUDA
  if (blas_) cublasDestroy(static_cast<cublasHandle_t>(blas_));
  if (blas_workspace_) DPT_CUDA_WARN(cudaFree(blas_workspace_));
  if (counter_) DPT_CUDA_WARN(cudaFree(counter_));
  if (stream_) DPT_CUDA_WARN(cudaStreamDestroy(static_cast<cudaStream_t>(stream_)));
#endif
}

void* Context::blas() const {
#if DPT_WITH_CUDA
  if (blas_ && !blas_workspace_) {
    cuda::set_device(device_.index);
    int major = 0;
    DPT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_.index));
    const size_t bytes = (major >= 9 ? size_t{32} : size_t{4}) << 20;
    auto try_malloc = [bytes] {
      void* p = nullptr;
      if (cudaMalloc(&p, bytes) == cudaSuccess) return p;
      (void)cudaGetLastError();  // running out is not a sticky error
      return static_cast<void*>(nullptr);
    };
    void* w = try_malloc();
    if (!w) {
      CachingAllocator& cache = allocator(device_);
      if (!cache.recording()) {  // emptying the cache waits for the device: not while recording
        cache.empty_cache();
        w = try_malloc();
      }
      if (!w) {
        const AllocatorStats st = cache.stats();
        throw OutOfMemory("out of memory on " + device_.str() + ": cuBLAS's workspace of " + format_bytes(bytes) +
                          " for a stream, with " + format_bytes(st.allocated) + " allocated and " +
                          format_bytes(st.reserved) + " reserved; use a smaller batch, more devices, or bf16 compute");
      }
    }
    if (const cublasStatus_t st = cublasSetWorkspace(static_cast<cublasHandle_t>(blas_), w, bytes);
        st != CUBLAS_STATUS_SUCCESS) {
      DPT_CUDA_WARN(cudaFree(w));
      DPT_CUBLAS_CHECK(st);
    }
    blas_workspace_ = w;
  }
#endif
  return blas_;
}

void* Context::dnn() const {
#if DPT_WITH_CUDNN
  if (!dnn_ && stream_) {
    cuda::set_device(device_.index);  // the handle belongs to the current device
    cudnnHandle_t h = nullptr;
    DPT_CUDNN_CHECK(cudnnCreate(&h));
    try {
      DPT_CUDNN_CHECK(cudnnSetStream(h, static_cast<cudaStream_t>(stream_)));
    } catch (...) {
      DPT_CUDNN_WARN(cudnnDestroy(h));  // a handle on the wrong stream must not be kept
      throw;
    }
    dnn_ = h;
  }
#endif
  return dnn_;
}

namespace {
std::atomic<int64_t> g_host_waits{0};
thread_local bool t_count_host_waits = true;
}  // namespace

int64_t host_waits() { return g_host_waits.load(std::memory_order_relaxed); }
void count_host_waits(bool on) { t_count_host_waits = on; }
void note_host_wait() {
  if (t_count_host_waits) g_host_waits.fetch_add(1, std::memory_order_relaxed);
}

bool Context::idle() const {
#if DPT_WITH_CUDA
  if (stream_) {
    cuda::set_device(device_.index);
    const cudaError_t e = cudaStreamQuery(static_cast<cudaStream_t>(stream_));
    if (e == cudaErrorNotReady) return false;
    DPT_CUDA_CHECK(e);
  }
#endif
  return true;
}

void Context::synchronize() const {
  note_host_wait();
#if DPT_WITH_CUDA
  if (stream_) {
    cuda::set_device(device_.index);
    DPT_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)));
  }
#endif
}

Event::Event(Device device) : device_(device) {
#if DPT_WITH_CUDA
  if (device.is_cuda()) {
    cuda::set_device(device.index);
    cudaEvent_t e = nullptr;
    DPT_CUDA_CHECK(cudaEventCreate(&e));
    event_ = e;
  }
#endif
}

Event::~Event() {
#if DPT_WITH_CUDA
  if (event_) DPT_CUDA_WARN(cudaEventDestroy(static_cast<cudaEvent_t>(event_)));
#endif
}

void Event::record(const Context& ctx) {
#if DPT_WITH_CUDA
  if (event_) {
    cuda::set_device(ctx.device().index);
    DPT_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event_), static_cast<cudaStream_t>(ctx.stream())));
    return;
  }
#endif
  (void)ctx;
  host_ms_ = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void Event::wait_in(const Context& ctx) const {
#if DPT_WITH_CUDA
  if (event_ && ctx.stream()) {
    cuda::set_device(ctx.device().index);
    DPT_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(ctx.stream()), static_cast<cudaEvent_t>(event_), 0));
  }
#endif
  (void)ctx;
}

void Event::synchronize() const {
  note_host_wait();
#if DPT_WITH_CUDA
  if (event_) DPT_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event_)));
#endif
}

bool Event::ready() const {
#if DPT_WITH_CUDA
  if (event_) {
    const cudaError_t q = cudaEventQuery(static_cast<cudaEvent_t>(event_));
    if (q == cudaErrorNotReady) return false;
    DPT_CUDA_CHECK(q);
  }
#endif
  return true;
}

double Event::ms_since(const Event& start) const {
#if DPT_WITH_CUDA
  if (event_ && start.event_) {
    float ms = 0.0f;
    DPT_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start.event_), static_cast<cudaEvent_t>(event_)));
    return ms;
  }
#endif
  return host_ms_ - start.host_ms_;
}

Graph::Graph(Context& ctx, const Graph* shares_with) : ctx_(ctx), shares_with_(shares_with) {
  if (!ctx.device().is_cuda()) throw UsageError("CUDA graphs need a CUDA device, not " + ctx.device().str());
}

Graph::~Graph() {
#if DPT_WITH_CUDA
  const auto stream = static_cast<cudaStream_t>(ctx_.stream());
  if (recording_) {  // an error ended the recording early: end it and drop what it recorded
    cudaGraph_t g = nullptr;
    DPT_CUDA_WARN(cudaStreamEndCapture(stream, &g));
    if (g) DPT_CUDA_WARN(cudaGraphDestroy(g));
    end_captures();
  }
  if (exec_) DPT_CUDA_WARN(cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_)));
  if (graph_) DPT_CUDA_WARN(cudaGraphDestroy(static_cast<cudaGraph_t>(graph_)));
  for (void* e : events_) DPT_CUDA_WARN(cudaEventDestroy(static_cast<cudaEvent_t>(e)));
  if (!held_.empty()) {
    // No replay may still run when its blocks go back (a replay's work on other streams
    // joins this one before it ends); a stream being recorded cannot be synchronized, but
    // work queued on it is ordered before any use of the pool anyway.
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    DPT_CUDA_WARN(cudaStreamIsCapturing(stream, &status));
    if (status == cudaStreamCaptureStatusNone) DPT_CUDA_WARN(cudaStreamSynchronize(stream));
    for (auto& [device, blocks] : held_) allocator(device).release(blocks);
  }
#endif
}

void Graph::end_captures() {
  for (const Device& d : devices_) {
    CachingAllocator::Capture c = allocator(d).end_capture();
    held_.push_back({d, std::move(c.blocks)});
    temporaries_.push_back({d, std::move(c.temporaries)});
  }
  devices_.clear();
}

Graph::Temporaries Graph::shared_temporaries(const Device& d) const {
  if (shares_with_)
    for (const auto& [device, t] : shares_with_->temporaries_)
      if (device == d) return t;
  return {};
}

void Graph::begin() {
#if DPT_WITH_CUDA
  DPT_CHECK(!graph_ && !recording_, "Graph::begin() on a graph already recorded");
  cuda::set_device(ctx_.device().index);
  allocator(ctx_.device()).begin_capture(ctx_.pool(), shared_temporaries(ctx_.device()));
  devices_ = {ctx_.device()};
  // Relaxed: the allocator may still need a new block (cudaMalloc) while recording, and
  // other threads queue the work of the streams that join.
  const cudaError_t e = cudaStreamBeginCapture(static_cast<cudaStream_t>(ctx_.stream()), cudaStreamCaptureModeRelaxed);
  if (e != cudaSuccess) end_captures();  // nothing was recorded
  DPT_CUDA_CHECK(e);
  recording_ = true;
#endif
}

#if DPT_WITH_CUDA
namespace {
// A fresh event recorded on `from` and waited for by `to` (both may be recording).
cudaEvent_t link(const Context& from, const Context& to) {
  cuda::set_device(from.device().index);
  cudaEvent_t e = nullptr;
  DPT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  DPT_CUDA_CHECK(cudaEventRecord(e, static_cast<cudaStream_t>(from.stream())));
  cuda::set_device(to.device().index);
  DPT_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(to.stream()), e, 0));
  return e;
}
}  // namespace
#endif

void Graph::join(Context& other) {
#if DPT_WITH_CUDA
  DPT_CHECK(recording_, "Graph::join() outside begin() and end()");
  if (records(other)) return;
  DPT_CHECK(other.device().is_cuda(), "a CUDA graph joins CUDA streams only");
  if (std::find(devices_.begin(), devices_.end(), other.device()) == devices_.end()) {
    allocator(other.device()).begin_capture(other.pool(), shared_temporaries(other.device()));
    devices_.push_back(other.device());
  } else {
    allocator(other.device()).add_capture_stream(other.pool());
  }
  events_.push_back(link(ctx_, other));
  joined_.push_back(&other);
#else
  (void)other;
#endif
}

bool Graph::records(const Context& c) const {
  return &c == &ctx_ || std::find(joined_.begin(), joined_.end(), &c) != joined_.end();
}

void Graph::fork(Context& from, Context& to) {
#if DPT_WITH_CUDA
  DPT_CHECK(recording_, "Graph::fork() outside begin() and end()");
  DPT_CHECK(records(from) && records(to), "Graph::fork() between streams that the graph does not record");
  events_.push_back(link(from, to));
#else
  (void)from;
  (void)to;
#endif
}

void Graph::end() {
#if DPT_WITH_CUDA
  DPT_CHECK(recording_, "Graph::end() without begin()");
  for (Context* other : joined_) events_.push_back(link(*other, ctx_));  // every stream's work ends here
  recording_ = false;
  cudaGraph_t g = nullptr;
  cuda::set_device(ctx_.device().index);
  const cudaError_t e = cudaStreamEndCapture(static_cast<cudaStream_t>(ctx_.stream()), &g);
  end_captures();
  DPT_CUDA_CHECK(e);
  graph_ = g;
  cuda::replace_small_memset_nodes(g);
  cudaGraphExec_t exec = nullptr;
  DPT_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
  exec_ = exec;
#endif
}

void Graph::launch() {
#if DPT_WITH_CUDA
  DPT_CHECK(exec_, "Graph::launch() before end()");
  cuda::set_device(ctx_.device().index);
  DPT_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), static_cast<cudaStream_t>(ctx_.stream())));
#endif
}

#if DPT_WITH_CUDA
namespace {
// copy_in's pieces: every pair on `device`, the same type and size both sides.
cuda::CopyPieces graph_copy_pieces(const std::vector<std::pair<Tensor, Tensor>>& dst_src, const Device& device) {
  DPT_CHECK(!dst_src.empty() && dst_src.size() <= static_cast<size_t>(cuda::kMaxCopyPieces),
            "Graph: a copy of 1 to " + std::to_string(cuda::kMaxCopyPieces) + " tensors");
  cuda::CopyPieces pieces;
  for (const auto& [dst, src] : dst_src) {
    DPT_CHECK(dst.device() == device && src.device() == device,
              "Graph: a copy within " + device.str() + ", the context's GPU");
    DPT_CHECK(dst.dtype() == src.dtype() && dst.numel() == src.numel(), "Graph: a copy between unlike tensors");
    pieces.piece[pieces.count++] = {dst.data(), src.data(), static_cast<int64_t>(src.nbytes())};
  }
  return pieces;
}
}  // namespace
#endif

size_t Graph::copy_in(const std::vector<std::pair<Tensor, Tensor>>& dst_src) {
#if DPT_WITH_CUDA
  DPT_CHECK(recording_, "Graph::copy_in() outside begin() and end()");
  const Device device = dst_src.empty() ? ctx_.device() : dst_src[0].first.device();
  const cuda::CopyPieces pieces = graph_copy_pieces(dst_src, device);
  const Context& ctx = context(device);
  DPT_CHECK(records(ctx), "Graph::copy_in() on a context that the graph does not record");
  cuda::set_device(device.index);
  const auto stream = static_cast<cudaStream_t>(ctx.stream());
  cuda::copy_device(pieces, stream);
  copies_.push_back(cuda::recorded_copy_node(pieces, stream));
  copy_skipped_.push_back(0);
  copy_device_.push_back(device.index);
  return copies_.size() - 1;
#else
  (void)dst_src;
  return 0;
#endif
}

void Graph::set_copy_sources(size_t copy, const std::vector<std::pair<Tensor, Tensor>>& dst_src) {
#if DPT_WITH_CUDA
  DPT_CHECK(exec_ && copy < copies_.size(), "Graph::set_copy_sources() of a copy not recorded");
  const Device device = dst_src.empty() ? ctx_.device() : dst_src[0].first.device();
  cuda::set_device(device.index);
  cuda::set_copy_node_sources(exec_, copies_[copy], graph_copy_pieces(dst_src, device));
  if (copy_skipped_[copy]) cuda::set_copy_node_enabled(exec_, copies_[copy], true);
  copy_skipped_[copy] = 0;
#else
  (void)copy;
  (void)dst_src;
#endif
}

void Graph::skip_copy(size_t copy) {
#if DPT_WITH_CUDA
  DPT_CHECK(exec_ && copy < copies_.size(), "Graph::skip_copy() of a copy not recorded");
  if (copy_skipped_[copy]) return;
  cuda::set_device(copy_device_[copy]);
  cuda::set_copy_node_enabled(exec_, copies_[copy], false);
  copy_skipped_[copy] = 1;
#else
  (void)copy;
#endif
}

Context& context(const Device& device) {
  if (t_current && t_current->device() == device) return *t_current;
  auto& d = defaults();
  std::lock_guard<std::mutex> lock(d.mu);
  auto& slot = d.table[{static_cast<int>(device.type), device.index}];
  if (!slot) {
    slot = std::make_unique<Context>(device);
    slot->precision = d.precision;
    slot->gemm = d.gemm;
  }
  return *slot;
}

ContextGuard::ContextGuard(Context& ctx) : prev_(t_current) { t_current = &ctx; }
ContextGuard::~ContextGuard() { t_current = prev_; }

void set_default_gemm(Precision precision, GemmImpl impl) {
  auto& d = defaults();
  std::lock_guard<std::mutex> lock(d.mu);
  d.precision = precision;
  d.gemm = impl;
  for (auto& [key, ctx] : d.table) {
    ctx->precision = precision;
    ctx->gemm = impl;
  }
}

}  // namespace dpt
