// The choice of reduction: which path serves the devices (resolve_reduce), and the reducer
// that the options and that path make.
#include <set>

#include <dptrain/error.hpp>
#include "data_parallel_impl.hpp"

namespace dpt {

namespace {
const FieldId kReduceField{"DataParallelOptions", "reduce"};
}  // namespace

Reduce resolve_reduce(Reduce asked, const std::vector<Device>& devices) {
  DPT_CHECK(!devices.empty(), "no devices");
  const bool cpu = devices.front().is_cpu();
  std::set<int> distinct;
  for (const Device& d : devices) distinct.insert(d.index);
  const bool shared = distinct.size() < devices.size();
  switch (asked) {
    case Reduce::automatic:
      if (cpu) return Reduce::host;
      return shared || !built_with_nccl() ? Reduce::p2p : Reduce::nccl;
    case Reduce::nccl:
      if (cpu) throw UsageError("{} nccl needs CUDA devices; use host on CPU devices", {kReduceField});
      if (shared)
        throw UsageError("{} nccl cannot put two replicas on one GPU (NCCL refuses two ranks on one device); use p2p",
                         {kReduceField});
      if (!built_with_nccl()) throw UsageError("{} nccl needs a build with NCCL; use p2p", {kReduceField});
      return asked;
    case Reduce::host:
      if (!cpu) throw UsageError("{} host is for CPU devices; use nccl or p2p on GPUs", {kReduceField});
      return asked;
    case Reduce::p2p:
      return asked;
  }
  return asked;
}

std::unique_ptr<Reducer> make_reducer(const DataParallelOptions& options, Reduce path,
                                      std::vector<ReplicaBuffers> replicas, const std::vector<Bucket>& buckets,
                                      const std::vector<SampleRange>& partitions, GradSlots slots) {
  const DType wire = options.grad_comm;
  if (options.group)  // one replica a rank
    return path == Reduce::nccl ? make_nccl_rank_reducer(*options.group, replicas[0], buckets, partitions, wire,
                                                         std::move(slots), options.comm_ctas)
                                : make_mpi_reducer(*options.group, replicas[0], buckets, partitions, std::move(slots));
  switch (path) {
    case Reduce::nccl:
      return make_nccl_reducer(std::move(replicas), buckets, partitions, wire, std::move(slots), options.comm_ctas);
    case Reduce::p2p:
      return make_p2p_reducer(std::move(replicas), buckets, wire);
    case Reduce::host:
      if (slots.defined()) return make_host_stage2_reducer(std::move(replicas), buckets, partitions, std::move(slots));
      return make_host_reducer(std::move(replicas), buckets, partitions, wire);
    case Reduce::automatic:
      break;
  }
  throw Error("make_reducer: the reduction path is chosen by check_fit first");
}

}  // namespace dpt
