#include <dptrain/parallel/process_group.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include <dptrain/error.hpp>

#if DPT_WITH_MPI
#include <mpi.h>
#endif

namespace dpt {

void ProcessGroup::set_timeout(double seconds) {
  // Bounded above too: the wait converts it to a clock's duration, which 1e300 s overflows.
  if (!(seconds >= 0.1 && seconds <= 1e9))
    throw UsageError("ProcessGroup::set_timeout: seconds must be in [0.1, 1e9], got " + std::to_string(seconds));
  timeout_s_ = seconds;
}

#if !DPT_WITH_MPI

bool built_with_mpi() { return false; }
ProcessGroup& ProcessGroup::world() {
  throw UsageError("ProcessGroup::world needs a build with MPI (install libopenmpi-dev and rebuild)");
}
ProcessGroup* ProcessGroup::world_if_made() { return nullptr; }
ProcessGroup::ProcessGroup() = default;
ProcessGroup::~ProcessGroup() = default;
void ProcessGroup::broadcast(void*, size_t, int) {}
double ProcessGroup::sum(double v) { return v; }
std::vector<uint64_t> ProcessGroup::gather_all(uint64_t v) { return {v}; }
void ProcessGroup::barrier() {}
uint64_t ProcessGroup::start_sum(float*, int64_t) { return ++started_; }
uint64_t ProcessGroup::start_reduce(float*, int64_t, int) { return ++started_; }
void ProcessGroup::all_gather(float*, const std::vector<int64_t>&, const std::vector<int64_t>&) {}
void ProcessGroup::wait_through(uint64_t) {}
void ProcessGroup::wait_all() {}
void ProcessGroup::wait(void*, int, const char*) {}
void ProcessGroup::abort(const std::string& why, int status) {
  report(Severity::error, why);
  std::_Exit(status);
}
void ProcessGroup::end_job(int status) { std::_Exit(status); }

#else

static_assert(sizeof(MPI_Request) <= sizeof(uint64_t), "MPI_Request must fit the handle slots");

bool built_with_mpi() { return true; }

namespace {
void check(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  throw Error(std::string("MPI failed: ") + call + ": " + std::string(text, static_cast<size_t>(len)));
}
#define DPT_MPI_CHECK(call) check((call), #call)
}  // namespace

namespace {
std::atomic<ProcessGroup*> g_world{nullptr};
}  // namespace

ProcessGroup& ProcessGroup::world() {
  static ProcessGroup* pg = new ProcessGroup();  // finalized by the atexit handler below
  g_world = pg;
  return *pg;
}

ProcessGroup* ProcessGroup::world_if_made() { return g_world; }

ProcessGroup::ProcessGroup() {
  int ready = 0;
  MPI_Initialized(&ready);
  if (!ready) {
    int provided = 0;
    // Every MPI call comes from the thread that drives training.
    DPT_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided));
    std::atexit([] {
      int done = 0;
      MPI_Finalized(&done);
      if (!done) MPI_Finalize();
    });
  }
  // Errors come back as codes (and become exceptions) instead of killing the process
  // without a word.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  DPT_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
  DPT_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size_));
  MPI_Comm node;
  DPT_MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node));
  DPT_MPI_CHECK(MPI_Comm_rank(node, &local_rank_));
  DPT_MPI_CHECK(MPI_Comm_size(node, &local_size_));
  DPT_MPI_CHECK(MPI_Allreduce(&rank_, &machine_, 1, MPI_INT, MPI_MIN, node));
  MPI_Comm_free(&node);
}

ProcessGroup::~ProcessGroup() = default;

void ProcessGroup::wait(void* requests, int count, const char* what) {
  // Poll rather than block: a blocking MPI call cannot be given a deadline.
  auto* reqs = static_cast<MPI_Request*>(requests);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_);
  auto nap = std::chrono::microseconds(1);
  while (true) {
    int done = 0;
    DPT_MPI_CHECK(MPI_Testall(count, reqs, &done, MPI_STATUSES_IGNORE));
    if (done) return;
    if (std::chrono::steady_clock::now() > deadline) {
      char msg[256];
      std::snprintf(
          msg, sizeof msg,
          "%s did not complete within %g s (ProcessGroup::set_timeout): another rank died or stopped answering", what,
          timeout_s_);
      abort(msg);
    }
    std::this_thread::sleep_for(nap);
    if (nap < std::chrono::microseconds(1000)) nap *= 2;
  }
}

void ProcessGroup::broadcast(void* data, size_t bytes, int root) {
  DPT_CHECK(bytes <= static_cast<size_t>(INT32_MAX), "broadcast larger than 2 GiB");
  MPI_Request r;
  DPT_MPI_CHECK(MPI_Ibcast(data, static_cast<int>(bytes), MPI_BYTE, root, MPI_COMM_WORLD, &r));
  wait(&r, 1, "a broadcast");
}

double ProcessGroup::sum(double v) {
  double out = 0;
  MPI_Request r;
  DPT_MPI_CHECK(MPI_Iallreduce(&v, &out, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD, &r));
  wait(&r, 1, "a loss all-reduce");
  return out;
}

std::vector<uint64_t> ProcessGroup::gather_all(uint64_t v) {
  std::vector<uint64_t> out(static_cast<size_t>(size_));
  MPI_Request r;
  DPT_MPI_CHECK(MPI_Iallgather(&v, 1, MPI_UINT64_T, out.data(), 1, MPI_UINT64_T, MPI_COMM_WORLD, &r));
  wait(&r, 1, "an all-gather");
  return out;
}

void ProcessGroup::barrier() {
  MPI_Request r;
  DPT_MPI_CHECK(MPI_Ibarrier(MPI_COMM_WORLD, &r));
  wait(&r, 1, "a barrier");
}

uint64_t ProcessGroup::start_sum(float* data, int64_t n) {
  DPT_CHECK(n <= INT32_MAX, "all-reduce of more than 2^31 floats in one bucket");
  MPI_Request r;
  DPT_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, data, static_cast<int>(n), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &r));
  uint64_t slot = 0;
  std::memcpy(&slot, &r, sizeof r);
  pending_.push_back(slot);
  return ++started_;
}

uint64_t ProcessGroup::start_reduce(float* data, int64_t n, int root) {
  DPT_CHECK(n <= INT32_MAX, "a reduction of more than 2^31 floats in one piece");
  MPI_Request r;
  DPT_MPI_CHECK(MPI_Ireduce(rank_ == root ? MPI_IN_PLACE : data, data, static_cast<int>(n), MPI_FLOAT, MPI_SUM, root,
                            MPI_COMM_WORLD, &r));
  uint64_t slot = 0;
  std::memcpy(&slot, &r, sizeof r);
  pending_.push_back(slot);
  return ++started_;
}

void ProcessGroup::all_gather(float* data, const std::vector<int64_t>& firsts, const std::vector<int64_t>& counts) {
  DPT_CHECK(firsts.size() == static_cast<size_t>(size_) && counts.size() == firsts.size(),
            "all_gather: a part for every rank");
  std::vector<int> displs(firsts.size()), sizes(counts.size());
  for (size_t k = 0; k < firsts.size(); ++k) {
    DPT_CHECK(firsts[k] + counts[k] <= INT32_MAX, "all_gather: more than 2^31 floats");
    displs[k] = static_cast<int>(firsts[k]);
    sizes[k] = static_cast<int>(counts[k]);
  }
  MPI_Request r;
  DPT_MPI_CHECK(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, data, sizes.data(), displs.data(), MPI_FLOAT,
                                MPI_COMM_WORLD, &r));
  wait(&r, 1, "a parameter all-gather");
}

void ProcessGroup::wait_through(uint64_t ticket) {
  const uint64_t first = started_ - pending_.size() + 1;  // the oldest pending collective's ticket
  if (ticket < first) return;
  const auto n = static_cast<size_t>(std::min(ticket, started_) - first + 1);
  std::vector<MPI_Request> reqs(n);
  for (size_t i = 0; i < n; ++i) std::memcpy(&reqs[i], &pending_[i], sizeof(MPI_Request));
  pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(n));
  wait(reqs.data(), static_cast<int>(n), "a gradient reduction");
}

void ProcessGroup::wait_all() { wait_through(started_); }

void ProcessGroup::abort(const std::string& why, int status) {
  report(Severity::error, "rank " + std::to_string(rank_) + ": " + why);
  end_job(status);
}

void ProcessGroup::end_job(int status) {
  std::fflush(stderr);
  std::fflush(stdout);
  MPI_Abort(MPI_COMM_WORLD, status);
  std::_Exit(status);
}

#endif

}  // namespace dpt
