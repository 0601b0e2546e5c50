#include "reducer.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>

#include <dptrain/error.hpp>
#include <dptrain/parallel/data_parallel.hpp>
#include <dptrain/parallel/process_group.hpp>
#include <dptrain/runtime/ops.hpp>
#include "kernels/cpu/cpu.hpp"

namespace dpt {

std::vector<Bucket> make_buckets(int64_t total, double bucket_bytes, double first_bytes) {
  DPT_CHECK(bucket_bytes > 0 && first_bytes > 0, "bucket sizes must be positive");
  const int64_t align = 64;  // 256-byte boundaries keep vector loads aligned
  auto floats = [&](double bytes) {
    return std::max<int64_t>(align, static_cast<int64_t>(bytes / sizeof(float)) / align * align);
  };
  const int64_t size = floats(bucket_bytes), first = std::min(size, floats(first_bytes));
  std::vector<Bucket> out;
  for (int64_t end = total; end > 0;) {
    const int64_t begin = std::max<int64_t>(0, end - (out.empty() ? first : size));
    out.push_back({begin, end - begin});
    end = begin;
  }
  return out;
}

std::vector<Bucket> make_copy_chunks(const std::vector<int64_t>& child_end, int64_t total, int64_t min_floats,
                                     std::vector<int>& chunk_of) {
  chunk_of.assign(child_end.size(), -1);
  size_t last = child_end.size();  // the last child with parameters
  for (size_t c = 0; c < child_end.size(); ++c)
    if (child_end[c] >= 0) last = c;
  std::vector<Bucket> out;
  int64_t begin = 0;
  for (size_t c = 0; c < child_end.size(); ++c) {
    if (child_end[c] < 0) continue;
    chunk_of[c] = static_cast<int>(out.size());
    const int64_t end = c == last ? total : child_end[c];
    if (c == last || end - begin >= min_floats) {
      out.push_back({begin, end - begin});
      begin = end;
    }
  }
  return out;
}

std::vector<Bucket> make_param_buckets(const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes,
                                       double bucket_bytes, double first_bytes) {
  DPT_CHECK(bucket_bytes > 0 && first_bytes > 0 && offsets.size() == sizes.size(),
            "make_param_buckets: an offset and a size a parameter, positive bucket sizes");
  const auto size = static_cast<int64_t>(bucket_bytes / sizeof(float));
  const int64_t first = std::min(size, static_cast<int64_t>(first_bytes / sizeof(float)));
  std::vector<Bucket> out;
  if (offsets.empty()) return out;
  int64_t end = offsets.back() + sizes.back(), begin = offsets.back();  // the bucket being filled
  for (size_t k = offsets.size() - 1; k-- > 0;) {
    if (end - offsets[k] > (out.empty() ? first : size)) {  // parameter k would overfill it: it starts the next
      out.push_back({begin, end - begin});
      end = offsets[k] + sizes[k];
    }
    begin = offsets[k];
  }
  out.push_back({begin, end - begin});
  return out;
}

void Reducer::sum_partials(std::vector<Tensor>&, std::vector<Tensor>&) {
  throw UsageError(std::string("DataParallelOptions::zero is not available with the ") + name() + " reduction");
}

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

void refresh_shadow_of_others(const ReplicaBuffers& r, const std::vector<SampleRange>& shards, size_t own) {
  if (!r.shadow.defined()) return;
  ContextGuard g(*r.ctx);
  for (size_t k = 0; k < shards.size(); ++k)
    if (k != own && shards[k].count > 0)
      copy_cast(r.shadow.view(shards[k].first, {shards[k].count}), r.params.view(shards[k].first, {shards[k].count}));
}

void Reducer::set_buckets(std::vector<Bucket>) {
  throw UsageError(std::string("the ") + name() + " reduction cannot change its buckets");
}

void Reducer::gather_params() {
  throw UsageError(std::string("DataParallelOptions::zero is not available with the ") + name() + " reduction");
}

void Reducer::broadcast_buffers(const Tensor&) {
  throw Error(std::string("the ") + name() + " reduction is within one process: it has no ranks to broadcast to");
}

namespace {

// ZeRO between CPU devices (host memory, complete when queued): every replica's partial
// sum and first bad index become the sum and the least over the replicas.
void host_sum_partials(std::vector<Tensor>& partial, std::vector<Tensor>& first_bad) {
  float total = 0.0f;
  int64_t first = INT64_MAX;
  for (size_t i = 0; i < partial.size(); ++i) {
    total += *partial[i].f32();
    first = std::min(first, *reinterpret_cast<const int64_t*>(first_bad[i].i32()));
  }
  for (size_t i = 0; i < partial.size(); ++i) {
    *partial[i].f32() = total;
    *reinterpret_cast<int64_t*>(first_bad[i].i32()) = first;
  }
}

// And every replica gets every shard's parameters from its owner.
void host_gather_params(const std::vector<ReplicaBuffers>& r, const std::vector<SampleRange>& shards) {
  for (size_t k = 0; k < r.size(); ++k) {
    const SampleRange& s = shards[k];
    for (size_t i = 0; i < r.size(); ++i)
      if (i != k && s.count > 0)
        std::memcpy(r[i].params.f32() + s.first, r[k].params.f32() + s.first,
                    sizeof(float) * static_cast<size_t>(s.count));
  }
  for (size_t i = 0; i < r.size(); ++i) refresh_shadow_of_others(r[i], shards, i);
}

class MasterReducer : public Reducer {
 public:
  MasterReducer(std::vector<ReplicaBuffers> replicas, std::vector<Bucket> buckets, bool master_updates,
                std::vector<SampleRange> shards, DType wire)
      : r_(std::move(replicas)),
        buckets_(std::move(buckets)),
        master_updates_(master_updates),
        shards_(std::move(shards)),
        wire_(r_.size() > 1 ? wire : DType::f32),  // one replica sends nothing: nothing is rounded
        comm_(r_[0].ctx->device(), StreamPriority::high),
        done_(r_[0].ctx->device()),
        params_ready_(r_[0].ctx->device()) {
    const Device master = r_[0].ctx->device();
    // p2p: the master's sum kernel reads a peer's buckets in place where it reads that
    // GPU's memory directly over NVLink; the others' go through one staging bucket on the master,
    // reused for every replica and bucket (one bucket of extra memory, never N-1 copies).
    for (auto& rep : r_) {
      const Device d = rep.ctx->device();
      const bool remote = master_updates_ && !(d == master);
      read_direct_.push_back(remote && peer_over_nvlink(master, d));
      staged_ |= remote && !read_direct_.back();
    }
    make_bucket_state();
    // bf16 on the wire: each other replica rounds its buckets into a bf16 copy of its
    // gradients, on its own device, as backward hands them over.
    if (wire_ == DType::bf16)
      for (size_t i = 1; i < r_.size(); ++i) {
        ContextGuard g(*r_[i].ctx);
        sent_.push_back(Tensor::empty(r_[i].grads.shape(), DType::bf16, r_[i].ctx->device()));
      }
    DPT_CHECK(master_updates_ || master.is_cpu(), "the host reduction is for CPU devices");
    DPT_CHECK(shards_.empty() || (!master_updates_ && shards_.size() == r_.size()),
              "ZeRO shards are for the host reduction, one a replica");
  }

  // An event a replica a bucket, and the staging bucket where one is needed.
  void make_bucket_state() {
    ready_.clear();
    for (size_t i = 0; i < r_.size(); ++i) {
      ready_.emplace_back();
      for (size_t b = 0; b < buckets_.size(); ++b) ready_[i].push_back(std::make_unique<Event>(r_[i].ctx->device()));
    }
    if (!staged_) return;
    int64_t largest = 0;
    for (auto& b : buckets_) largest = std::max(largest, b.count);
    ContextGuard g(comm_);
    staging_ = Tensor();  // its memory serves the new one
    staging_ = Tensor::empty({largest}, wire_, r_[0].ctx->device());
  }

  void set_buckets(std::vector<Bucket> buckets) override {
    buckets_ = std::move(buckets);
    make_bucket_state();
  }

  const char* name() const override { return master_updates_ ? "p2p" : "host"; }
  bool every_replica_updates() const override { return !master_updates_; }
  bool tells_bucket_done() const override { return shards_.empty(); }
  bool sharded() const override { return !shards_.empty(); }

  void bucket_ready(size_t r, size_t b) override {
    if (r > 0 && wire_ == DType::bf16)  // on r's stream, r's context current
      copy_cast(sent_[r - 1].view(buckets_[b].offset, {buckets_[b].count}),
                r_[r].grads.view(buckets_[b].offset, {buckets_[b].count}));
    ready_[r][b]->record(*r_[r].ctx);
  }

  void reduce() override {
    ContextGuard g(comm_);
    const Tensor& sum = r_[0].grads;
    for (size_t b = 0; b < buckets_.size(); ++b) {
      const Bucket& k = buckets_[b];
      Tensor into = sum.view(k.offset, {k.count});
      ready_[0][b]->wait_in(comm_);
      for (size_t i = 1; i < r_.size(); ++i) {  // a fixed order: the sum is reproducible
        ready_[i][b]->wait_in(comm_);
        const Tensor from = (wire_ == DType::bf16 ? sent_[i - 1] : r_[i].grads).view(k.offset, {k.count});
        if (from.device() == into.device()) {
          axpy_(1.0f, from, into);
        } else if (!master_updates_) {  // host: virtual CPU devices share memory
          if (wire_ == DType::bf16) cpu::add_bf16(from.bf16(), into.f32(), k.count);
          else cpu::axpy(k.count, 1.0f, from.f32(), into.f32());
        } else if (read_direct_[i]) {
          add_peer_(from, into);
        } else {
          Tensor stage = staging_.view(0, {k.count});
          copy(stage, from);
          axpy_(1.0f, stage, into);
        }
      }
      if (master_updates_) {
        reduced(0, b, comm_);
        continue;
      }
      // host: every replica takes the sum as it would come over a bf16 wire, and gets the
      // sum, or (ZeRO) its shard of it (CPU work is done when queued).
      if (wire_ == DType::bf16) {
        rounded_.resize(static_cast<size_t>(k.count));
        cpu::cast_f32_bf16(into.f32(), rounded_.data(), k.count);
        cpu::cast_bf16_f32(rounded_.data(), into.f32(), k.count);
      }
      for (size_t i = 1; i < r_.size(); ++i) {
        if (shards_.empty()) {
          copy(r_[i].grads.view(k.offset, {k.count}), into);
        } else if (const SampleRange& o = shards_[i]; o.count > 0) {
          const int64_t begin = std::max(k.offset, o.first), end = std::min(k.offset + k.count, o.first + o.count);
          if (begin < end)
            std::memcpy(r_[i].grads.f32() + begin, sum.f32() + begin, sizeof(float) * static_cast<size_t>(end - begin));
        }
      }
      for (size_t i = 0; i < r_.size(); ++i) reduced(i, b, *r_[i].ctx);
    }
    done_.record(comm_);
  }

  void sum_partials(std::vector<Tensor>& partial, std::vector<Tensor>& first_bad) override {
    DPT_CHECK(sharded() && partial.size() == r_.size() && first_bad.size() == r_.size(),
              "sum_partials: one partial sum a replica, ZeRO");
    host_sum_partials(partial, first_bad);
  }

  void gather_params() override {
    DPT_CHECK(sharded(), "gather_params: ZeRO");
    host_gather_params(r_, shards_);
  }

  void wait(size_t r) override { done_.wait_in(*r_[r].ctx); }
  std::vector<Context*> contexts() override { return {&comm_}; }

  void broadcast_params() override {
    params_ready_.record(*r_[0].ctx);
    for (size_t i = 1; i < r_.size(); ++i) {
      ContextGuard g(*r_[i].ctx);
      params_ready_.wait_in(*r_[i].ctx);
      copy(r_[i].params, r_[0].params);
      if (r_[i].shadow.defined()) copy_cast(r_[i].shadow, r_[i].params);  // on the replica's own stream
    }
  }

 private:
  std::vector<ReplicaBuffers> r_;
  std::vector<Bucket> buckets_;
  bool master_updates_;
  std::vector<SampleRange> shards_;  // ZeRO: replica r's shard of the flat buffers
  DType wire_;                       // the type the other replicas' gradients travel in
  Context comm_;                     // the master's communication stream (high priority: beside backward)
  Event done_, params_ready_;
  std::vector<std::vector<std::unique_ptr<Event>>> ready_;  // [replica][bucket]
  std::vector<char> read_direct_;  // p2p, per replica: the master's kernels read its buckets in place
  bool staged_ = false;            // p2p: some replica's buckets go through the staging bucket
  Tensor staging_;                 // p2p: a bucket on the master, in the wire's type (when one is not read in place)
  std::vector<Tensor> sent_;       // bf16 wire: replica i's gradients as sent, [i - 1]
  std::vector<uint16_t> rounded_;  // host, bf16 wire: the sum rounded to bf16
};

class HostStage2Reducer : public Reducer {
 public:
  HostStage2Reducer(std::vector<ReplicaBuffers> replicas, std::vector<Bucket> buckets, std::vector<SampleRange> shards,
                    GradSlots slots)
      : r_(std::move(replicas)),
        buckets_(std::move(buckets)),
        shards_(std::move(shards)),
        grad_shards_(std::move(slots.shard_sums)),
        slot_size_(slots.slot_size),
        slots_(slots.slots),
        arrivals_(buckets_.size(), 0),
        handed_(r_.size(), std::vector<int64_t>(slots_, 0)),
        reduced_(slots_, 0) {
    DPT_CHECK(shards_.size() == r_.size() && grad_shards_.size() == r_.size() && slots_ > 0,
              "ZeRO stage 2: a shard and its gradients a replica, and slots");
    for (const ReplicaBuffers& b : r_)
      DPT_CHECK(b.ctx->device().is_cpu() && b.grads.numel() == slot_size_ * static_cast<int64_t>(slots_),
                "ZeRO stage 2's host reduction: CPU devices, and slots as their gradients");
  }
  const char* name() const override { return "host"; }
  bool every_replica_updates() const override { return true; }
  bool sharded() const override { return true; }

  void begin_step() override {
    std::lock_guard<std::mutex> lock(mu_);
    std::fill(arrivals_.begin(), arrivals_.end(), 0);
  }
  void before_write(size_t r, size_t b) override {
    const size_t s = b % slots_;
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return reduced_[s] >= handed_[r][s]; });
  }
  void bucket_ready(size_t r, size_t b) override {
    const size_t s = b % slots_;
    std::lock_guard<std::mutex> lock(mu_);  // one sum at a time: CPU devices share the host
    handed_[r][s] += 1;
    const int64_t n = static_cast<int64_t>(r_.size());
    if (++arrivals_[b] % n != 0) return;
    const bool first_micro = arrivals_[b] == n;  // later micro-batches add to the step's sum
    const Bucket& k = buckets_[b];
    for (size_t owner = 0; owner < shards_.size(); ++owner) {
      const SampleRange& o = shards_[owner];
      const int64_t begin = std::max(k.offset, o.first), end = std::min(k.offset + k.count, o.first + o.count);
      if (begin >= end) continue;
      float* into = grad_shards_[owner].f32() + (begin - o.first);
      for (size_t i = 0; i < r_.size(); ++i) {  // replica order: the sum is the host reduction's
        const float* from = r_[i].grads.f32() + static_cast<int64_t>(s) * slot_size_ + (begin - k.offset);
        if (i == 0 && first_micro) std::memcpy(into, from, sizeof(float) * static_cast<size_t>(end - begin));
        else cpu::axpy(end - begin, 1.0f, from, into);
      }
    }
    reduced_[s] += 1;
    done_.notify_all();
  }
  void reduce() override {}
  void wait(size_t) override {}  // every bucket was summed when the last replica handed it over
  void sum_partials(std::vector<Tensor>& partial, std::vector<Tensor>& first_bad) override {
    host_sum_partials(partial, first_bad);
  }
  void gather_params() override { host_gather_params(r_, shards_); }

 private:
  std::vector<ReplicaBuffers> r_;
  std::vector<Bucket> buckets_;
  std::vector<SampleRange> shards_;
  std::vector<Tensor> grad_shards_;
  int64_t slot_size_;
  size_t slots_;
  std::mutex mu_;
  std::condition_variable done_;
  std::vector<int64_t> arrivals_;             // per bucket: hand-overs this step, over the replicas
  std::vector<std::vector<int64_t>> handed_;  // [replica][slot]: buckets handed over through it
  std::vector<int64_t> reduced_;              // per slot: buckets summed out of it
};

// CPU processes: each bucket is summed over every rank by MPI as soon as backward has
// produced it (CPU work is complete when queued, so the sum can start at once).
class MpiReducer : public Reducer {
 public:
  MpiReducer(ProcessGroup& g, ReplicaBuffers r, std::vector<Bucket> buckets, std::vector<SampleRange> shards,
             GradSlots slots)
      : g_(g),
        r_(std::move(r)),
        buckets_(std::move(buckets)),
        shards_(std::move(shards)),
        slots_(std::move(slots)),
        arrivals_(buckets_.size(), 0),
        slot_ticket_(slots_.slots, 0),
        finishes_(slots_.slots) {
    DPT_CHECK(r_.ctx->device().is_cpu(), "the MPI reduction is for CPU tensors");
    DPT_CHECK(shards_.empty() || shards_.size() == static_cast<size_t>(g_.size()), "ZeRO shards: one a rank");
    DPT_CHECK(!slots_.defined() || (!shards_.empty() && slots_.shard_sums.size() == 1 &&
                                    r_.grads.numel() == slots_.slot_size * static_cast<int64_t>(slots_.slots)),
              "ZeRO stage 2 over MPI: shards, one shard sum a rank, and slots as its gradients");
  }
  const char* name() const override { return "mpi"; }
  void set_buckets(std::vector<Bucket> buckets) override {
    if (slots_.defined()) Reducer::set_buckets(std::move(buckets));  // refused: the slots are the buckets'
    buckets_ = std::move(buckets);
    arrivals_.assign(buckets_.size(), 0);
  }
  bool every_replica_updates() const override { return true; }
  bool sharded() const override { return !shards_.empty(); }
  void begin_step() override { std::fill(arrivals_.begin(), arrivals_.end(), 0); }
  void bucket_ready(size_t, size_t b) override {
    const Bucket& k = buckets_[b];
    if (shards_.empty()) {
      g_.start_sum(r_.grads.f32() + k.offset, k.count);
      return;
    }
    // ZeRO: each rank's piece of the bucket is summed into that rank alone, in the same
    // order on every rank; stage 2 from the bucket's slot, and the owner then moves its
    // piece into its shard's sum (finish_slot).
    const size_t s = slots_.defined() ? b % slots_.slots : 0;
    float* bucket =
        slots_.defined() ? r_.grads.f32() + static_cast<int64_t>(s) * slots_.slot_size : r_.grads.f32() + k.offset;
    const bool first_micro = slots_.defined() && ++arrivals_[b] == 1;
    const auto me = static_cast<size_t>(g_.rank());
    for (size_t owner = 0; owner < shards_.size(); ++owner) {
      const SampleRange& o = shards_[owner];
      const int64_t begin = std::max(k.offset, o.first), end = std::min(k.offset + k.count, o.first + o.count);
      if (begin >= end) continue;
      float* piece = bucket + (begin - k.offset);
      const uint64_t ticket = g_.start_reduce(piece, end - begin, static_cast<int>(owner));
      if (!slots_.defined()) continue;
      slot_ticket_[s] = ticket;
      if (owner == me)
        finishes_[s].push_back({piece, slots_.shard_sums[0].f32() + (begin - o.first), end - begin, first_micro});
    }
  }
  // Stage 2, from the driving thread before backward writes bucket b's slot: the sums of
  // the slot's buckets are done (MPI has read the slot) and in the shard's sum.
  void before_write(size_t, size_t b) override { finish_slot(b % slots_.slots); }
  void reduce() override {}
  void wait(size_t) override {
    g_.wait_all();
    for (size_t s = 0; s < slots_.slots; ++s) finish_slot(s);
  }
  void sum_partials(std::vector<Tensor>& partial, std::vector<Tensor>& first_bad) override {
    DPT_CHECK(sharded() && partial.size() == 1 && first_bad.size() == 1, "sum_partials: one partial sum a rank, ZeRO");
    *partial[0].f32() = static_cast<float>(g_.sum(static_cast<double>(*partial[0].f32())));
    auto* first = reinterpret_cast<int64_t*>(first_bad[0].i32());
    for (uint64_t v : g_.gather_all(static_cast<uint64_t>(*first))) *first = std::min(*first, static_cast<int64_t>(v));
  }
  void broadcast_buffers(const Tensor& buffers) override { g_.broadcast(buffers.f32(), buffers.nbytes(), 0); }
  void gather_params() override {
    DPT_CHECK(sharded(), "gather_params: ZeRO");
    std::vector<int64_t> firsts, counts;
    for (const SampleRange& s : shards_) {
      firsts.push_back(s.first);
      counts.push_back(s.count);
    }
    g_.all_gather(r_.params.f32(), firsts, counts);
    refresh_shadow_of_others(r_, shards_, static_cast<size_t>(g_.rank()));
  }

 private:
  struct Finish {  // stage 2: the owner's reduced piece of a slot, and where it goes
    const float* from;
    float* into;
    int64_t count;
    bool copy;  // the step's first micro-batch: the sum starts here
  };
  void finish_slot(size_t s) {
    if (slot_ticket_[s] == 0) return;
    g_.wait_through(slot_ticket_[s]);
    slot_ticket_[s] = 0;
    for (const Finish& f : finishes_[s]) {
      if (f.copy) std::memcpy(f.into, f.from, sizeof(float) * static_cast<size_t>(f.count));
      else cpu::axpy(f.count, 1.0f, f.from, f.into);
    }
    finishes_[s].clear();
  }

  ProcessGroup& g_;
  ReplicaBuffers r_;
  std::vector<Bucket> buckets_;
  std::vector<SampleRange> shards_;
  GradSlots slots_;                            // stage 2; else none
  std::vector<int64_t> arrivals_;              // stage 2, per bucket: hand-overs this step
  std::vector<uint64_t> slot_ticket_;          // per slot: its last bucket's last collective (0: none)
  std::vector<std::vector<Finish>> finishes_;  // per slot
};

}  // namespace

std::unique_ptr<Reducer> make_mpi_reducer(ProcessGroup& group, ReplicaBuffers replica, std::vector<Bucket> buckets,
                                          std::vector<SampleRange> shards, GradSlots slots) {
  return std::make_unique<MpiReducer>(group, std::move(replica), std::move(buckets), std::move(shards),
                                      std::move(slots));
}

std::unique_ptr<Reducer> make_host_stage2_reducer(std::vector<ReplicaBuffers> replicas, std::vector<Bucket> buckets,
                                                  std::vector<SampleRange> shards, GradSlots slots) {
  return std::make_unique<HostStage2Reducer>(std::move(replicas), std::move(buckets), std::move(shards),
                                             std::move(slots));
}

std::unique_ptr<Reducer> make_master_reducer(std::vector<ReplicaBuffers> replicas, std::vector<Bucket> buckets,
                                             bool master_updates, std::vector<SampleRange> shards, DType wire) {
  DPT_CHECK(!replicas.empty(), "a reducer needs at least one replica");
  return std::make_unique<MasterReducer>(std::move(replicas), std::move(buckets), master_updates, std::move(shards),
                                         wire);
}

#if !DPT_WITH_NCCL
bool built_with_nccl() { return false; }
BareNcclTimes time_bare_nccl(const std::vector<Device>&, int64_t, int) {
  throw UsageError("bare NCCL needs a build with NCCL; this one has none");
}
std::unique_ptr<Reducer> make_nccl_reducer(std::vector<ReplicaBuffers>, std::vector<Bucket>, std::vector<SampleRange>,
                                           DType, GradSlots, int) {
  throw UsageError("DataParallelOptions::reduce nccl needs a build with NCCL; this one has none (use p2p)");
}
std::unique_ptr<Reducer> make_nccl_rank_reducer(ProcessGroup&, ReplicaBuffers, std::vector<Bucket>,
                                                std::vector<SampleRange>, DType, GradSlots, int) {
  throw UsageError("DataParallelOptions::group on GPUs needs a build with NCCL; this one has none");
}
#endif

}  // namespace dpt
