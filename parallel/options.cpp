// Every check of DataParallelOptions: check() for what the fields alone decide, check_fit()
// for what depends on the devices too. Each throws UsageError naming the field.
#include <cmath>
#include <string>

#include <dptrain/error.hpp>
#include "data_parallel_impl.hpp"

namespace dpt {

const char* reduce_name(Reduce r) { return kReduceNames.name(r); }
Reduce parse_reduce(const std::string& name) { return kReduceNames.parse(name); }

namespace {
FieldId field(const char* name) { return {"DataParallelOptions", name}; }

// An enum cast from any integer ran as its first value (fp32, cublas) in silence.
template <class Enum>
void check_enum(Enum v, Enum last, const char* field) {
  const int i = static_cast<int>(v);
  if (i < 0 || i > static_cast<int>(last))
    throw UsageError("{} holds no value of its enum (" + std::to_string(i) + ")", {dpt::field(field)});
}
}  // namespace

void check(const DataParallelOptions& o) {
  check_enum(o.precision, Precision::bf16, "precision");
  check_enum(o.gemm, GemmImpl::native, "gemm");
  check_enum(o.reduce, Reduce::host, "reduce");
  check_enum(o.twin_buffers, TwinBuffers::off, "twin_buffers");
  if (o.grad_comm != DType::f32 && o.grad_comm != DType::bf16)
    throw UsageError(std::string("{} must be f32 or bf16, got ") + dtype_name(o.grad_comm), {field("grad_comm")});
  check_fields(data_parallel_schema(), o);  // each field's own range
  if (o.group && o.reduce == Reduce::p2p)
    throw UsageError("{} reduces with NCCL (GPUs) or MPI (CPUs); {} p2p is for one process",
                     {field("group"), field("reduce")});
  if (o.update_per_bucket && (o.clip > 0.0f || o.check_finite || o.zero > 0))
    throw UsageError(
        "{} updates a bucket before the next is reduced: not with clip or check_finite (which need the norm over "
        "every bucket first), nor with zero",
        {field("update_per_bucket")});
  if (o.zero == 2 && o.cuda_graph)
    throw UsageError(
        "{} 2 is not recorded in a CUDA graph yet (its buckets take turns in two slots); use {} 1 with the graph",
        {field("zero"), field("zero")});
}

bool reduces(const DataParallelOptions& o, const std::vector<Device>& devices) {
  // ZeRO on one device: the same code, one partition.
  return devices.size() > 1 || o.reduce != Reduce::automatic || o.group || o.zero > 0;
}

Reduce check_fit(const DataParallelOptions& o, const std::vector<Device>& devices) {
  if (o.group && devices.size() != 1)
    throw UsageError("{}: each process trains on one device, got " + std::to_string(devices.size()), {field("group")});
  const Device& first = devices.front();
  const Reduce path = o.group ? (first.is_cuda() ? Reduce::nccl : Reduce::host) : resolve_reduce(o.reduce, devices);
  // Across processes (one GPU each, as NCCL supports in graphs) every rank records its
  // step, collectives included, and the replays meet in them.
  if (o.cuda_graph && !first.is_cuda())
    throw UsageError("{} records steps on GPUs: not on CPU devices (no CUDA there)", {field("cuda_graph")});
  if (o.zero > 0 && path == Reduce::p2p)
    throw UsageError(
        "{} shards the optimizer state over replicas that each update; the p2p reduction updates on the master "
        "alone (use nccl on GPUs, host on CPU devices)",
        {field("zero")});
  if (o.zero == 2 && path == Reduce::host && !o.group && o.grad_comm != DType::f32)
    throw UsageError("{} 2 between CPU devices sums fp32 (no {} bf16); use {} 1 for bf16 on the wire",
                     {field("zero"), field("grad_comm"), field("zero")});
  if (o.comm_ctas > 0 && !first.is_cuda())  // (on one GPU, or over p2p, it is a setting for other counts)
    throw UsageError("{} limits NCCL's thread blocks; CPU devices reduce without NCCL", {field("comm_ctas")});
  if (o.group && path != Reduce::nccl && o.grad_comm != DType::f32)
    throw UsageError("{} bf16 is for NCCL, p2p and host reductions; the MPI reduction of CPU ranks sums fp32",
                     {field("grad_comm")});
  // NCCL's own guidance: several GPUs of one process inside one CUDA graph may deadlock
  // (cudaGraphLaunch can block on the collectives); one GPU a process is what it supports.
  if (o.cuda_graph && path == Reduce::nccl && devices.size() > 1)
    throw UsageError(
        "{} does not record NCCL over several GPUs of one process (NCCL may deadlock there); use {} p2p, or no graph",
        {field("cuda_graph"), field("reduce")});
  if (!reduces(o, devices)) return path;  // one device: nothing to tune or overlap
  if (o.tune_buckets && (o.zero == 2 || o.cuda_graph))
    throw UsageError(
        "{} changes the buckets between eager steps: not with {} (which records one layout) nor {} 2 (whose "
        "gradient slots are laid out by them)",
        {field("tune_buckets"), field("cuda_graph"), field("zero")});
  // Per-bucket updates where a reduction tells when each bucket's sum is queued: not the
  // MPI reduction of CPU ranks (ZeRO's are refused above).
  if (o.update_per_bucket && o.group && !first.is_cuda())
    throw UsageError("{} is for the nccl, p2p and host reductions, not mpi", {field("update_per_bucket")});
  return path;
}

void check_options(const DataParallelOptions& options, const std::vector<Device>& devices) {
  check(options);
  (void)check_fit(options, devices);
}

}  // namespace dpt
