// Execution context: where a thread's ops run on a device. For a GPU that is a stream
// and the cuBLAS and cuDNN handles bound to it, plus the GEMM settings (precision,
// cuBLAS or the hand-written kernel). Each device has a default context; a thread can
// make its own current (data parallelism gives each replica its own stream).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <dptrain/enum_names.hpp>
#include <dptrain/runtime/device.hpp>
#include <dptrain/types.hpp>

namespace dpt {

class Tensor;

enum class GemmImpl { cublas, native };

inline constexpr auto kPrecisionNames = enum_names<Precision>(
    "precision", {{Precision::fp32, "fp32"}, {Precision::tf32, "tf32"}, {Precision::bf16, "bf16"}});
inline constexpr auto kGemmNames =
    enum_names<GemmImpl>("GEMM", {{GemmImpl::cublas, "cublas"}, {GemmImpl::native, "native"}});

const char* precision_name(Precision p);             // "fp32", "tf32", "bf16"
Precision parse_precision(const std::string& name);  // UsageError when unknown
const char* gemm_name(GemmImpl g);                   // "cublas", "native"
GemmImpl parse_gemm(const std::string& name);        // UsageError when unknown

// A GPU stream's scheduling priority: the blocks of a high-priority stream's kernels are
// placed before those of normal streams wherever an SM frees up (gradient communication
// beside backward's GEMMs, which would otherwise hold every SM until they end).
enum class StreamPriority { normal, high };

class Context {
 public:
  // Makes a stream (of that priority) and a cuBLAS handle on a GPU.
  explicit Context(Device device, StreamPriority priority = StreamPriority::normal);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  Device device() const { return device_; }
  void* stream() const { return stream_; }  // cudaStream_t; nullptr on the CPU
  // The stream's CUDA priority (lower numbers run first; 0 is normal); 0 on the CPU.
  int priority() const;
  // What the caching allocator keys its pools by: the stream on a GPU (work on it is
  // ordered, so its freed blocks can be reused at once); the context itself on the CPU,
  // so that replicas sharing a CPU device, which run in threads at once, never hand
  // blocks to each other.
  void* pool() const { return stream_ ? stream_ : const_cast<Context*>(this); }
  // cublasHandle_t for cuBLAS calls; nullptr on the CPU. On first use it gets a workspace
  // of its own (32 MiB from compute capability 9, 4 MiB before: cuBLAS's recommendation),
  // kept for the context's life. Without one, cuBLAS allocates its workspace on the stream
  // (cudaMallocAsync) at each call, which in a CUDA graph becomes allocation nodes: replicas
  // recording into one graph from their threads at once then corrupted the graph (a
  // segfault in the driver, illegal addresses, other bits; H200, 2026-12-05). A training
  // step makes its first cuBLAS call eagerly, before any recording. Not thread-safe (a
  // context is used by one thread at a time). The handle keeps the stream it was made
  // with: cublasSetStream would reset its workspace.
  void* blas() const;
  // The same handle for cuBLASLt calls, which take their workspace as an argument: no
  // workspace is made for it.
  void* blas_lt() const { return blas_; }
  // A device counter that holds 0 and that every kernel using it leaves at 0: it lets a
  // reduction finish in one kernel (the last block to finish adds the partials). Work on
  // one stream never overlaps, so one counter per context is enough. nullptr on the CPU.
  unsigned* counter() const { return counter_; }
  // cudnnHandle_t, made on first use (only convolutional models need one) and bound to
  // the stream; nullptr on the CPU and in builds without cuDNN. Not thread-safe: a
  // context is used by one thread at a time.
  void* dnn() const;
  // Waits until every op queued in this context has finished.
  void synchronize() const;
  // Whether it has (without waiting; a failed op throws).
  bool idle() const;

  Precision precision = Precision::fp32;
  GemmImpl gemm = GemmImpl::cublas;

 private:
  Device device_;
  void* stream_ = nullptr;
  void* blas_ = nullptr;
  mutable void* blas_workspace_ = nullptr;
  unsigned* counter_ = nullptr;
  mutable void* dnn_ = nullptr;
};

// A point in a context's queue of work: a CUDA event on a GPU, a host timestamp on the
// CPU (where work is done by the time it is queued). Made once and recorded again and
// again, so a training step creates none.
class Event {
 public:
  explicit Event(Device device);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  // Marks the current end of ctx's queue.
  void record(const Context& ctx);
  // Makes ctx's later work wait until this event has happened (no host wait).
  void wait_in(const Context& ctx) const;
  // Blocks the host until the event has happened.
  void synchronize() const;
  // Whether it has happened, without waiting (always on the CPU).
  bool ready() const;
  // Milliseconds from `start` to this event; both must have happened.
  double ms_since(const Event& start) const;

 private:
  Device device_;
  void* event_ = nullptr;  // cudaEvent_t
  double host_ms_ = 0.0;   // CPU: when it was recorded
};

// How many times the host has waited for a device: every Context and Event
// synchronize, every read of a tensor to the host (on the CPU too, where they cost
// nothing, so that tests there see where a GPU would wait). The training loop's tests
// assert that its steady state makes none. A thread that waits off the loop, beside the
// steps (the input pipeline's loader), leaves its waits out with count_host_waits(false).
int64_t host_waits();
void count_host_waits(bool on);  // for the calling thread
void note_host_wait();           // the runtime's waits call it

// A CUDA graph: the work queued on a GPU context between begin() and end(), and on the
// contexts that join() it (other replicas' streams, on any GPU, queued from any thread),
// recorded once and replayed by launch() with a single launch on the first context, so a
// step of many small kernels costs one launch of host time. A joined stream's work starts
// after what the first context queued before join() and ends before end(). Temporaries
// freed while recording stay with the graph (every replay writes them again) until it is
// destroyed. A graph made to share another's temporaries (`shares_with`, which must
// outlive it) takes the blocks that the other's recording freed for its own temporaries:
// for two graphs that are only ever replayed in turn on one stream (never at once), so
// they hold one step's temporaries, not two. What such a graph returns may then lie in
// the other's temporaries: read it before the other replays.
class Graph {
 public:
  explicit Graph(Context& ctx, const Graph* shares_with = nullptr);
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  void begin();
  void join(Context& other);
  // While recording: `to`'s work from now on starts after what `from` has queued so far
  // (both this graph's streams): a branch that runs beside the rest of the graph.
  void fork(Context& from, Context& to);
  void end();
  void launch();
  bool ready() const { return exec_ != nullptr; }
  // A copy recorded like any work (between begin() and end(), on the current context of
  // this thread: the first or a joined one) whose sources set_copy_sources() moves between
  // launches: a step's inputs, which come from a new buffer every step, copied by a node
  // of the graph, not by a launch of their own beside it. Every pair on the
  // context's GPU, at most four; the destinations and sizes stay as recorded. Returns the
  // copy's index. skip_copy() makes the launches after it leave the copy out, until the
  // next set_copy_sources().
  size_t copy_in(const std::vector<std::pair<Tensor, Tensor>>& dst_src);
  void set_copy_sources(size_t copy, const std::vector<std::pair<Tensor, Tensor>>& dst_src);
  void skip_copy(size_t copy);

 private:
  using Temporaries = std::map<void*, std::map<size_t, std::vector<void*>>>;  // CachingAllocator::Temporaries
  void end_captures();
  Temporaries shared_temporaries(const Device& d) const;  // shares_with's on `d`
  bool records(const Context& c) const;                   // the first context or a joined one
  Context& ctx_;
  void* graph_ = nullptr;   // cudaGraph_t
  void* exec_ = nullptr;    // cudaGraphExec_t
  bool recording_ = false;  // between begin() and end()
  std::vector<Context*> joined_;
  std::vector<void*> events_;    // cudaEvent_t: the forks and joins
  std::vector<Device> devices_;  // whose allocators record
  std::vector<std::pair<Device, std::vector<void*>>> held_;
  std::vector<std::pair<Device, Temporaries>> temporaries_;
  const Graph* shares_with_ = nullptr;
  std::vector<void*> copies_;       // cudaGraphNode_t: copy_in's
  std::vector<char> copy_skipped_;  // a copy's node disabled by skip_copy()
  std::vector<int> copy_device_;    // a copy's GPU
};

// The context ops on `device` use in this thread: the thread's current one when it is
// on that device, else the device's default context.
Context& context(const Device& device);

// Makes `ctx` the current context of this thread until the guard ends.
class ContextGuard {
 public:
  explicit ContextGuard(Context& ctx);
  ~ContextGuard();
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;

 private:
  Context* prev_;
};

// Applies GEMM settings to the default context of every device used from now on and
// to those made already.
void set_default_gemm(Precision precision, GemmImpl impl);

}  // namespace dpt
