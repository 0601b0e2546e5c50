// The processes of a multi-process run (DDP): rank and size from MPI_COMM_WORLD, the
// local rank (which picks the GPU) from the ranks sharing this node. MPI (Open MPI) is
// the launcher and bootstrap: it carries host buffers (CPU training, the NCCL unique
// id, losses, hashes); NCCL carries GPU gradients (parallel/reducer_nccl.cpp). Every wait is
// bounded by the communication timeout: a rank that dies or stops answering makes the
// others end with a clear message instead of hanging.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace dpt {

bool built_with_mpi();

class ProcessGroup {
 public:
  // Initializes MPI once per process (later calls return the same group). Throws
  // UsageError when this build has no MPI.
  static ProcessGroup& world();
  // The world group if world() has made it (MPI is running), else nullptr.
  static ProcessGroup* world_if_made();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int local_rank() const { return local_rank_; }  // among the ranks of this machine
  int local_size() const { return local_size_; }  // the ranks of this machine
  int machine() const { return machine_; }        // this machine's lowest rank: its name among the ranks
  // Seconds any wait for the other ranks may take before the job is aborted: a finite
  // number >= 0.1 (UsageError otherwise).
  void set_timeout(double seconds);
  double timeout() const { return timeout_s_; }

  // Host-memory collectives, all bounded by the timeout.
  void broadcast(void* data, size_t bytes, int root);
  double sum(double v);
  std::vector<uint64_t> gather_all(uint64_t v);
  void barrier();
  // Starts an in-place sum of host floats over every rank; returns its ticket (the
  // collectives started so far, this one included). wait_through(ticket) or wait_all()
  // completes it.
  uint64_t start_sum(float* data, int64_t n);
  // The same summed into rank `root`'s floats alone (the others' stay as they are).
  uint64_t start_reduce(float* data, int64_t n, int root);
  // In place: rank k's floats [firsts[k], firsts[k] + counts[k]) of `data` reach every rank.
  void all_gather(float* data, const std::vector<int64_t>& firsts, const std::vector<int64_t>& counts);
  // Completes the started collectives up to `ticket` (in the order they were started), or all.
  void wait_through(uint64_t ticket);
  void wait_all();

  // Ends every rank of the job: reports `why` (Severity::error, with this rank's number;
  // see set_message_handler) and aborts.
  [[noreturn]] void abort(const std::string& why, int status = 1);
  // Ends every rank of the job with `status`, reporting nothing (the caller has).
  [[noreturn]] void end_job(int status);

 private:
  ProcessGroup();
  ~ProcessGroup();
  // Waits for request handles (MPI_Request) until done or the timeout.
  void wait(void* requests, int count, const char* what);
  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1, machine_ = 0;
  double timeout_s_ = 300.0;
  std::vector<uint64_t> pending_;  // MPI_Request handles of the started collectives not yet completed
  uint64_t started_ = 0;           // collectives started, ever; pending_ holds the last pending_.size()
};

}  // namespace dpt
