// What the reducers share: the parameters' shadows after a gather, the partitions'
// ranges, the timing of dpbench --comm, and the NCCL entry points of a build without it.
#include "reducer.hpp"

#include <algorithm>
#include <chrono>

#include <dptrain/error.hpp>
#include <dptrain/parallel/data_parallel.hpp>
#include <dptrain/runtime/ops.hpp>

namespace dpt {

double median_ms_of(int iters, const std::function<void()>& f) {
  DPT_CHECK(iters >= 1, "median_ms_of: at least one timed call");
  f();
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void refresh_shadow_of_others(const ReplicaBuffers& r, const std::vector<SampleRange>& partitions, size_t own) {
  if (!r.shadow.defined()) return;
  ContextGuard g(*r.ctx);
  for (size_t k = 0; k < partitions.size(); ++k)
    if (k != own && partitions[k].count > 0)
      copy_cast(r.shadow.view(partitions[k].first, {partitions[k].count}),
                r.params.view(partitions[k].first, {partitions[k].count}));
}

void firsts_and_counts(const std::vector<SampleRange>& partitions, std::vector<int64_t>& firsts,
                       std::vector<int64_t>& counts) {
  firsts.clear();
  counts.clear();
  for (const SampleRange& k : partitions) {
    firsts.push_back(k.first);
    counts.push_back(k.count);
  }
}

#if !DPT_WITH_NCCL
bool built_with_nccl() { return false; }
BareNcclTimes time_bare_nccl(const std::vector<Device>&, int64_t, int) {
  throw UsageError("bare NCCL needs a build with NCCL; this one has none");
}
std::unique_ptr<Reducer> make_nccl_reducer(std::vector<ReplicaBuffers>, std::vector<Bucket>, std::vector<SampleRange>,
                                           DType, GradSlots, int) {
  throw UsageError("{} nccl needs a build with NCCL; this one has none (use p2p)", {{"DataParallelOptions", "reduce"}});
}
std::unique_ptr<Reducer> make_nccl_rank_reducer(ProcessGroup&, ReplicaBuffers, std::vector<Bucket>,
                                                std::vector<SampleRange>, DType, GradSlots, int) {
  throw UsageError("{} on GPUs needs a build with NCCL; this one has none", {{"DataParallelOptions", "group"}});
}
#endif

}  // namespace dpt
