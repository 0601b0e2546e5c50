// The step as a CUDA graph (DataParallelOptions::cuda_graph): each replica's shard goes
// into fixed buffers that the replay reads; the step is recorded once for each parity of
// the optimizers' step counter (after one eager step) and replayed from then on.
#include <algorithm>
#include <exception>
#include <mutex>

#include <dptrain/error.hpp>
#include <dptrain/runtime/ops.hpp>
#include "data_parallel_impl.hpp"

namespace dpt {

// What a graph step knows of its inputs once the source has been asked: which replicas
// have rows, whose fixed buffers were made anew, and the next step's shards (for the
// graph's copy into the other recording's buffers).
struct DataParallel::Impl::GraphInputs {
  explicit GraphInputs(size_t n) : next(n), has_rows(n, 0), resized(n, 0), next_fits(n, 1) {}
  int parity = 0;                 // the recording this step replays
  bool in_micro_batches = false;  // copied in micro-batch by micro-batch, before the replay
  bool copied_in = false;         // the last replay copied this step's shards in already
  bool ask_next = false;          // the next step is named, and a replay follows
  bool next_known = false;        // every replica has the next step's shard, of the buffers' shapes
  std::vector<data::Batch> next;  // the next step's shards
  std::vector<char> has_rows, resized, next_fits;
  bool any_resized() const { return std::find(resized.begin(), resized.end(), 1) != resized.end(); }
};

int DataParallel::Impl::graph_parity() const {
  // The optimizers' step counter: with twin buffers the copies current at a step are
  // those of its parity, and a recording bakes in their addresses.
  const optim::Optimizer* o = replicas_[0].opt.get();
  return o ? static_cast<int>(o->steps_taken() & 1) : 0;
}

void DataParallel::Impl::drop_graphs() {
  for (Recording& g : rec_) {
    g.graph.reset();
    g.copy.clear();
    g.out = StepLoss();
  }
  graph_warm_ = false;
}

data::Batch DataParallel::Impl::next_step_inputs(size_t replica) const {
  return offered_ && replica < offered_->size() ? (*offered_)[replica] : data::Batch();
}

StepLoss DataParallel::Impl::graph_step(int64_t first, int64_t count, const ShardSource& source, const LossFn& loss,
                                        const LossFn& metric, int64_t next_first) {
  const ShardPlan& shares = plan(count);
  const size_t n = replicas_.size();
  if (graph_copy_ctx_.size() != n) {
    for (Recording& g : rec_) g.in.assign(n, data::Batch());
    for (size_t r = 0; r < n; ++r) {
      graph_inputs_ready_.push_back(std::make_unique<Event>(devices_[r]));
      graph_copy_ctx_.push_back(std::make_unique<Context>(devices_[r]));
    }
    graph_done_ = std::make_unique<Event>(devices_[0]);
  }
  GraphInputs in(n);
  in.parity = graph_parity();
  Recording& cur = rec_[in.parity];
  // Each replica's shard goes into the fixed buffers that its step reads. With one
  // micro-batch a replay copies the next step's shard in (next_first) on a stream of the
  // replica's own once its backward is queued, beside its update (a node whose sources
  // each replay moves), or the source made it there (next_step_inputs); a shard that is
  // in neither way (the first, or an unforeseen step) is copied before the replay. With
  // micro-batches the source is asked for each in turn, as in an eager step (a file's
  // loader serves one micro-batch at a time and reuses its buffer at the next request),
  // so each is copied in at once, before the replay.
  in.in_micro_batches = shares.micro_batches() > 1;
  // (The buffers keep what the last replay copied in when the graph is recorded anew.)
  in.copied_in = !in.in_micro_batches && graph_next_ == SampleRange{first, count} && graph_next_parity_ == in.parity;
  in.ask_next = !in.in_micro_batches && graph_warm_ && next_first >= 0;  // a replay follows
  graph_next_ = {};
  take_graph_inputs(in, first, count, source, next_first);
  if (in.any_resized()) drop_graphs();
  // The graph's copy of replica r into the other recording's buffers: from the next step's
  // shard; left out of the replay when no step is named or its shard does not fit. (As
  // recorded, before its first launch names its sources: onto themselves.)
  in.next_known =
      in.ask_next && graph_warm_ && std::find(in.next_fits.begin(), in.next_fits.end(), 0) == in.next_fits.end();
  // The step reads its micro-batches as views of the fixed buffers.
  const ShardSource fixed = [&](size_t r, int64_t f, int64_t count_r) {
    const int64_t at = f - first - shares.replica_part(r).first;
    return data::Batch{cur.in[r].x.rows(at, count_r), cur.in[r].y.rows(at, count_r)};
  };
  if (!graph_warm_) {  // an eager step first: cuBLAS and the allocator set up outside the graph
    graph_warm_ = true;
    return step_body(first, count, fixed, loss, metric);
  }
  const std::vector<optim::Optimizer*> opts = optimizers();
  if (!cur.graph) record_graph(in, first, count, fixed, loss, metric);
  replay_graph(in);
  if (in.next_known && !cur.copy.empty()) {
    graph_next_ = {next_first, count};
    graph_next_parity_ = 1 - in.parity;
  }
  for (optim::Optimizer* o : opts) o->set_host_steps(o->steps_taken() + 1);  // the replay moved the device's
  return cur.out;
}

void DataParallel::Impl::take_graph_inputs(GraphInputs& in, int64_t first, int64_t count, const ShardSource& source,
                                           int64_t next_first) {
  const ShardPlan& shares = plan(count);
  Recording& other = rec_[1 - in.parity];  // the next step's
  // Where the next step is not named, the source may make its shards in the buffers its
  // replay reads (where it is named, the replay's copy writes them).
  offered_ = !in.in_micro_batches && graph_warm_ && next_first < 0 ? &other.in : nullptr;
  std::vector<std::exception_ptr> source_errors(replicas_.size());
  try {
    run_on_all([&](size_t r) {
      const SampleRange part = shares.replica_part(r);
      if (part.count == 0) return;
      in.has_rows[r] = 1;
      // Nothing of this replica's stream may run beside a replay: the graph's kernels share
      // the context's cuBLAS workspace and reduction counter with what the source queues.
      // (Replica 0's stream is the replays' own. Before the first replay the event is
      // unrecorded, and waiting for it waits for nothing.)
      if (r > 0) graph_done_->wait_in(*replicas_[r].ctx);
      if (!take_replica_inputs(in, r, first, shares, source, next_first, source_errors[r])) return;
      if (r > 0) graph_inputs_ready_[r]->record(*replicas_[r].ctx);  // after what the source queued there
    });
    rethrow_first(source_errors);
  } catch (...) {
    offered_ = nullptr;
    // Buffers made anew for this step are not the recorded graphs' any more: a replay after
    // the program caught the error would read freed memory.
    if (in.any_resized()) drop_graphs();
    throw;
  }
  offered_ = nullptr;
}

bool DataParallel::Impl::take_replica_inputs(GraphInputs& in, size_t r, int64_t first, const ShardPlan& shares,
                                             const ShardSource& source, int64_t next_first,
                                             std::exception_ptr& source_error) {
  Replica& rep = replicas_[r];
  const SampleRange part = shares.replica_part(r);
  data::Batch& mine = rec_[in.parity].in[r];
  auto shape_of = [&](const data::Batch& b) {  // the fixed buffers hold the replica's part
    Shape x = b.x.shape(), y = b.y.shape();
    x[0] = y[0] = part.count;
    return std::pair{x, y};
  };
  auto fit = [&](const data::Batch& b) {  // both recordings' buffers
    const auto [x, y] = shape_of(b);
    if (mine.x.defined() && mine.x.shape() == x && mine.y.shape() == y) return;
    for (Recording& g : rec_)
      g.in[r] = {Tensor::empty(x, b.x.dtype(), rep.device), Tensor::empty(y, b.y.dtype(), rep.device)};
    in.resized[r] = 1;
  };
  auto take = [&](int64_t f, int64_t rows, data::Batch& b) {  // false: the source threw (kept)
    try {
      b = take_shard(source, r, f, rows);
      return true;
    } catch (...) {
      source_error = std::current_exception();
      return false;
    }
  };
  auto same_memory = [](const Tensor& a, const Tensor& b) {
    return a.data() == b.data() && a.shape() == b.shape() && a.dtype() == b.dtype();
  };
  if (in.in_micro_batches) {
    for (int k = 0; k < shares.micro_batches(); ++k) {
      const SampleRange m = shares.micro(r, k);
      if (m.count == 0) continue;
      data::Batch b;
      if (!take(first + m.first, m.count, b)) return false;
      fit(b);
      const int64_t at = m.first - part.first;
      copy_all({{mine.x.rows(at, m.count), b.x}, {mine.y.rows(at, m.count), b.y}});
    }
    return true;
  }
  if (!in.copied_in) {
    data::Batch b;
    if (!take(first + part.first, part.count, b)) return false;
    fit(b);
    if (!same_memory(mine.x, b.x) || !same_memory(mine.y, b.y)) copy_all({{mine.x, b.x}, {mine.y, b.y}});
  }
  if (in.ask_next) {
    // A bad row of the next step's is that step's error: its own request meets it again.
    try {
      in.next[r] = take_shard(source, r, next_first + part.first, part.count);
      in.next_fits[r] = shape_of(in.next[r]) == std::pair{mine.x.shape(), mine.y.shape()};
    } catch (const std::exception&) {
      in.next[r] = data::Batch();
      in.next_fits[r] = 0;
    }
  }
  return true;
}

std::vector<std::pair<Tensor, Tensor>> DataParallel::Impl::graph_copies(const GraphInputs& in, size_t r) const {
  const Recording& other = rec_[1 - in.parity];
  const data::Batch& from = in.next_known ? in.next[r] : other.in[r];
  return {{other.in[r].x, from.x}, {other.in[r].y, from.y}};
}

void DataParallel::Impl::record_graph(const GraphInputs& in, int64_t first, int64_t count, const ShardSource& fixed,
                                      const LossFn& loss, const LossFn& metric) {
  const size_t n = replicas_.size();
  Recording& cur = rec_[in.parity];
  Recording& other = rec_[1 - in.parity];
  const std::vector<optim::Optimizer*> opts = optimizers();
  // Recorded once for each parity: the schedule's learning rate (and AdamW's bias
  // corrections) are computed in the graph, from each optimizer's counter on the device.
  // The host's counts must not move while recording.
  std::vector<int64_t> taken;
  for (optim::Optimizer* o : opts) taken.push_back(o->steps_taken());
  cur.graph = std::make_unique<Graph>(*replicas_[0].ctx, other.graph.get());
  recording_ = true;
  std::mutex copy_m;  // the replicas' threads record their copies in turn (the hook below)
  try {
    Graph& graph = *cur.graph;
    graph.begin();
    for (size_t r = 1; r < n; ++r) graph.join(*replicas_[r].ctx);
    if (reducer_)
      for (Context* c : reducer_->contexts()) graph.join(*c);
    for (Replica& rep : replicas_)
      if (rep.update_ctx) graph.join(*rep.update_ctx);
    cur.copy.clear();
    if (!in.in_micro_batches) {
      cur.copy.assign(n, 0);
      for (size_t r = 0; r < n; ++r)
        if (in.has_rows[r]) graph.join(*graph_copy_ctx_[r]);
      // Backward has read the inputs for the last time: the copy goes beside the rest
      // (the update, the reduction). Replicas reach here in any order, the graph numbers
      // its copies in call order: each replica's index is kept.
      after_backward_ = [&](size_t r) {
        if (!in.has_rows[r]) return;
        Context& side = *graph_copy_ctx_[r];
        std::lock_guard<std::mutex> lk(copy_m);
        graph.fork(*replicas_[r].ctx, side);
        ContextGuard g(side);
        cur.copy[r] = graph.copy_in(graph_copies(in, r));
      };
    }
    cur.out = step_body(first, count, fixed, loss, metric);
    after_backward_ = nullptr;
    graph.end();
  } catch (...) {
    after_backward_ = nullptr;
    recording_ = false;
    cur.graph.reset();
    cur.copy.clear();
    for (size_t i = 0; i < opts.size(); ++i) opts[i]->set_host_steps(taken[i]);  // nothing was recorded
    throw;
  }
  recording_ = false;
  for (size_t i = 0; i < opts.size(); ++i) opts[i]->set_host_steps(taken[i]);
}

void DataParallel::Impl::replay_graph(const GraphInputs& in) {
  const size_t n = replicas_.size();
  Replica& master = replicas_[0];
  Recording& cur = rec_[in.parity];
  ContextGuard g(*master.ctx);
  if (!cur.copy.empty())
    for (size_t r = 0; r < n; ++r) {
      if (!in.has_rows[r]) continue;
      if (in.next_known) cur.graph->set_copy_sources(cur.copy[r], graph_copies(in, r));
      else cur.graph->skip_copy(cur.copy[r]);
    }
  for (size_t r = 1; r < n; ++r)
    if (in.has_rows[r]) graph_inputs_ready_[r]->wait_in(*master.ctx);
  // The whole replay counts as compute: the phases inside a graph are not timed apart.
  if (timing_) master.t_start->record(*master.ctx);
  cur.graph->launch();
  if (n > 1) graph_done_->record(*master.ctx);  // what the other replicas' next inputs wait for
  if (timing_)
    for (auto* e : {master.t_backward.get(), master.t_reduced.get(), master.t_updated.get()}) e->record(*master.ctx);
}

}  // namespace dpt
