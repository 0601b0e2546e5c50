// Every check of DataParallelOptions: check() for what the fields alone decide, check_fit()
// for what depends on the devices too. Each throws UsageError naming the field.
#include <cmath>
#include <string>

#include <dptrain/error.hpp>
#include <dptrain/runtime/memory.hpp>
#include "data_parallel_impl.hpp"

namespace dpt {

const char* reduce_name(Reduce r) {
  switch (r) {
    case Reduce::nccl:
      return "nccl";
    case Reduce::p2p:
      return "p2p";
    case Reduce::host:
      return "host";
    case Reduce::automatic:
      break;
  }
  return "auto";
}

Reduce parse_reduce(const std::string& name) {
  for (Reduce r : {Reduce::automatic, Reduce::nccl, Reduce::p2p, Reduce::host})
    if (name == reduce_name(r)) return r;
  throw UsageError("unknown reduction '" + name + "': expected auto, nccl, p2p or host");
}

namespace {
// An enum cast from any integer ran as its first value (fp32, cublas) in silence.
template <class Enum>
void check_enum(Enum v, Enum last, const char* field) {
  const int i = static_cast<int>(v);
  if (i < 0 || i > static_cast<int>(last))
    throw UsageError(std::string("DataParallelOptions::") + field + " holds no value of its enum (" +
                     std::to_string(i) + ")");
}
}  // namespace

void check(const DataParallelOptions& o) {
  check_enum(o.precision, Precision::bf16, "precision");
  check_enum(o.gemm, GemmImpl::native, "gemm");
  check_enum(o.reduce, Reduce::host, "reduce");
  check_enum(o.twin_buffers, TwinBuffers::off, "twin_buffers");
  if (o.grad_accum < 1)
    throw UsageError("DataParallelOptions::grad_accum must be >= 1, got " + std::to_string(o.grad_accum));
  if (o.group && o.reduce == Reduce::p2p)
    throw UsageError(
        "DataParallelOptions::group reduces with NCCL (GPUs) or MPI (CPUs); DataParallelOptions::reduce "
        "p2p is for one process");
  if (!(o.clip >= 0.0f && std::isfinite(o.clip)))  // NaN or below 0 was clipping off, in silence
    throw UsageError("DataParallelOptions::clip must be a finite number >= 0 (0 = off), got " + std::to_string(o.clip));
  if (o.grad_comm != DType::f32 && o.grad_comm != DType::bf16)
    throw UsageError(std::string("DataParallelOptions::grad_comm must be f32 or bf16, got ") + dtype_name(o.grad_comm));
  if (o.zero < 0 || o.zero > 2)
    throw UsageError("DataParallelOptions::zero must be 0, 1 or 2, got " + std::to_string(o.zero));
  if (o.comm_ctas < 0 || o.comm_ctas > kMaxCommCtas)
    throw UsageError("DataParallelOptions::comm_ctas must be in [0, " + std::to_string(kMaxCommCtas) + "], got " +
                     std::to_string(o.comm_ctas));
  // More than a TiB a bucket is no bucket at all (and its float count would not fit).
  for (auto [name, mb] :
       {std::pair<const char*, double>{"bucket_mb", o.bucket_mb}, {"first_bucket_mb", o.first_bucket_mb}})
    if (!(mb > 0.0) || mb > 1048576.0)
      throw UsageError(std::string("DataParallelOptions::") + name + " must be in (0, 1048576] MiB, got " +
                       format_float(static_cast<float>(mb)));
  if (o.update_per_bucket && (o.clip > 0.0f || o.check_finite || o.zero > 0))
    throw UsageError(
        "DataParallelOptions::update_per_bucket updates a bucket before the next is reduced: not with clip or "
        "check_finite (which need the norm over every bucket first), nor with zero");
  if (o.zero == 2 && o.cuda_graph)
    throw UsageError(
        "DataParallelOptions::zero 2 is not recorded in a CUDA graph yet (its buckets take turns in two "
        "slots); use DataParallelOptions::zero 1 with the graph");
}

bool reduces(const DataParallelOptions& o, const std::vector<Device>& devices) {
  // ZeRO on one device: the same code, one partition.
  return devices.size() > 1 || o.reduce != Reduce::automatic || o.group || o.zero > 0;
}

Reduce check_fit(const DataParallelOptions& o, const std::vector<Device>& devices) {
  if (o.group && devices.size() != 1)
    throw UsageError("DataParallelOptions::group: each process trains on one device, got " +
                     std::to_string(devices.size()));
  const Device& first = devices.front();
  const Reduce path = o.group ? (first.is_cuda() ? Reduce::nccl : Reduce::host) : resolve_reduce(o.reduce, devices);
  // Across processes (one GPU each, as NCCL supports in graphs) every rank records its
  // step, collectives included, and the replays meet in them.
  if (o.cuda_graph && !first.is_cuda())
    throw UsageError("DataParallelOptions::cuda_graph records steps on GPUs, not on " + first.str());
  if (o.zero > 0 && path == Reduce::p2p)
    throw UsageError(
        "DataParallelOptions::zero shards the optimizer state over replicas that each update; the p2p "
        "reduction updates on the master alone (use nccl on GPUs, host on CPU devices)");
  if (o.zero == 2 && path == Reduce::host && !o.group && o.grad_comm != DType::f32)
    throw UsageError(
        "DataParallelOptions::zero 2 between CPU devices sums fp32 (no DataParallelOptions::grad_comm bf16); "
        "use DataParallelOptions::zero 1 for bf16 on the wire");
  if (o.group && path != Reduce::nccl && o.grad_comm != DType::f32)
    throw UsageError(
        "DataParallelOptions::grad_comm bf16 is for NCCL, p2p and host reductions; the MPI reduction of CPU ranks "
        "sums fp32");
  // NCCL's own guidance: several GPUs of one process inside one CUDA graph may deadlock
  // (cudaGraphLaunch can block on the collectives); one GPU a process is what it supports.
  if (o.cuda_graph && path == Reduce::nccl && devices.size() > 1)
    throw UsageError(
        "DataParallelOptions::cuda_graph does not record NCCL over several GPUs of one process (NCCL may "
        "deadlock there); use DataParallelOptions::reduce p2p, or no graph");
  if (!reduces(o, devices)) return path;  // one device: nothing to tune or overlap
  if (o.tune_buckets && (o.zero == 2 || o.cuda_graph))
    throw UsageError(
        "DataParallelOptions::tune_buckets changes the buckets between eager steps: not with zero 2 (whose "
        "gradient slots are laid out by them) nor cuda_graph (which records one layout)");
  // Per-bucket updates where a reduction tells when each bucket's sum is queued: not the
  // MPI reduction of CPU ranks (ZeRO's are refused above).
  if (o.update_per_bucket && o.group && !first.is_cuda())
    throw UsageError("DataParallelOptions::update_per_bucket is for the nccl, p2p and host reductions, not mpi");
  return path;
}

}  // namespace dpt
