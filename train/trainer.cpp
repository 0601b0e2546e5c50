#include <dptrain/train/trainer.hpp>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>
#include <thread>

#include <dptrain/error.hpp>
#include <dptrain/layers/conv.hpp>
#include <dptrain/layers/gpt.hpp>
#include <dptrain/layers/loss.hpp>
#include <dptrain/runtime/memory.hpp>
#include <dptrain/runtime/ops.hpp>
#include <dptrain/train/checkpoint.hpp>
#include <dptrain/train/hf.hpp>

#include "common/atomic_file.hpp"
#include "common/fnv1a.hpp"
#include "data/feeder.hpp"
#include "field_error.hpp"
#include "input_pipeline.hpp"
#include "model_state.hpp"
#include "nonfinite_watch.hpp"
#include "run_settings.hpp"

namespace dpt {

namespace {

// Under --ddp every rank must run one configuration: ranks whose models differ in size
// reduce buffers of other lengths (heap corruption, found by a hostile pass), and ranks
// whose batches, steps or log points differ meet in other collectives, or in none, and
// wait out the timeout. One collective of a hash over every field; where the hashes
// differ, one a field, to name the first that does (every rank finds the same, and
// rank 0 reports it). The data's contents are not compared (its rows and headers are).
void check_ranks_agree(ProcessGroup& group, const std::vector<std::pair<FieldId, std::string>>& fields) {
  auto fnv = [](uint64_t h, const std::string& s) {
    constexpr unsigned char kSeparator = 0xff;  // ("ab", "c") is not ("a", "bc")
    return fnv1a(&kSeparator, 1, fnv1a(s, h));
  };
  auto differs = [&](uint64_t h) {
    const std::vector<uint64_t> all = group.gather_all(h);
    for (size_t r = 1; r < all.size(); ++r)
      if (all[r] != all[0]) return static_cast<int>(r);
    return 0;
  };
  uint64_t h = kFnv1aOffset;
  for (const auto& [id, value] : fields) h = fnv(fnv(h, id.name), value);
  if (differs(h) == 0) return;
  for (const auto& [id, value] : fields)
    if (const int r = differs(fnv(kFnv1aOffset, value)); r != 0)
      throw UsageError("{} differs between rank 0 and rank " + std::to_string(r) +
                           ": every rank of a job must run one configuration",
                       {id});
  throw UsageError("the ranks' configurations differ: every rank of a job must run one configuration");
}

}  // namespace

Trainer::Trainer(TrainConfig cfg, std::shared_ptr<const data::Dataset> train, std::shared_ptr<const data::Dataset> val)
    : cfg_(std::move(cfg)), train_data_(std::move(train)), val_data_(std::move(val)) {
  if (!cfg_.data.empty() && (train_data_ || val_data_)) bad("data", "and data sets of the program's: give one");
  find_field(train_schema(), "val_fraction")->check(cfg_);  // before the files are split by it
  if (!cfg_.data.empty()) std::tie(train_data_, val_data_) = load_files(cfg_);
  if (val_data_ && !train_data_) bad("data", "is needed for validation rows");
  // A data set of the program's that reports no rows (0 is an endless stream for synthetic
  // data, which the trainer makes itself) has nothing to train or validate on.
  for (const auto* d : {train_data_.get(), val_data_.get()})
    if (d && d->rows() < 1)
      throw UsageError(d->inputs_name() + " has " + std::to_string(d->rows()) + " rows: a data set needs at least one");
  if (train_data_) {
    // The file is the data set: its size, and its targets say the task.
    if (cfg_.samples != 0) bad("samples", "is the data file's own size; leave it out with {}", {"data"});
    if (!train_data_->has_targets()) bad("data", "(" + train_data_->inputs_name() + ") has no targets to train on");
    cfg_.samples = train_data_->rows();
    cfg_.task = train_data_->task();
  }
  const nn::ModelSpec spec = validate(cfg_);
  // The scores a step's loss reads: the classes, or a language model's vocabulary.
  classes_ = cfg_.task == data::Task::regression ? 0 : spec.outputs();
  // A language model's rows are sequences of cfg_.seq tokens, not its whole context.
  const Shape input = spec.is_gpt ? Shape{cfg_.seq} : spec.input_shape();
  if (train_data_) {
    try {
      train_data_->check_model(input, cfg_.task, spec.outputs());
    } catch (const UsageError& e) {
      // One float a row for a model of several outputs: most likely class labels written as floats.
      if (cfg_.task == data::Task::regression && numel(train_data_->target_shape()) == 1 && spec.outputs() >= 2)
        throw UsageError(e.line() +
                         " (class labels are integers: an integer .npy, int32 or int64, trains a classifier)");
      throw;
    }
    if (val_data_) {
      val_data_->check_model(input, cfg_.task, spec.outputs());
      val_data_->check_every_row();  // every evaluation reads it whole: its faults are refused now
    }
    eval_every_ = val_data_ ? cfg_.eval_every : 0;  // 0: at the end of every epoch
  }
  if (cfg_.eval_every > 0 && !val_data_)
    bad("eval_every", "needs validation rows ({}, {} or a file's x_val)", {"val_data", "val_fraction"});
  if (cfg_.ddp) {
    // One device per process: the local rank picks it from the node's device list.
    group_ = &ProcessGroup::world();
    group_->set_timeout(cfg_.comm_timeout);
    const Device mine = cfg_.devices[static_cast<size_t>(group_->local_rank()) % cfg_.devices.size()];
    // A list longer than this machine's ranks leaves devices idle: said, not silently done.
    // (One shorter may be right: a launcher may give each process its own GPU, each
    // then its cuda:0. Ranks that do share a GPU are refused where NCCL is set up.)
    const auto listed = static_cast<int>(cfg_.devices.size()), local = group_->local_size();
    if (group_->rank() == 0 && listed > local)
      report(Severity::note, Message(std::to_string(listed) + " devices ({}) for the " + std::to_string(local) +
                                         " process(es) of this machine, each of which trains on one: " +
                                         std::to_string(listed - local) + " of them idle; start a process a device",
                                     {{"TrainConfig", "devices"}}));
    cfg_.devices = {mine};
  }
  if (cfg_.warmup >= cfg_.steps && (!group_ || group_->rank() == 0))
    report(Severity::warning, Message("{} of " + std::to_string(cfg_.warmup) + " steps is not shorter than the run's " +
                                          std::to_string(cfg_.steps) + ": the learning rate never reaches {}",
                                      {{"TrainConfig", "warmup"}, {"TrainConfig", "lr"}}));
  if (!cfg_.val_data.empty() && (!group_ || group_->rank() == 0))
    if (const std::string both = file_in_both(cfg_); !both.empty())
      report(Severity::warning,
             Message("{} '" + both + "' is in {} too: the validation loss is measured on rows the model trains on",
                     {field("val_data"), field("data")}));
  const Device master = cfg_.devices.front();
  model_ = nn::make_model(spec, cfg_.act);
  if (spec.is_gpt) {  // replicas (clones) follow these
    auto& gpt = static_cast<nn::GPT&>(*model_);
    gpt.set_recompute(cfg_.recompute);
    gpt.set_attention_backward(cfg_.attention_backward);
  }
  model_->to(master, cfg_.seed);
  if (!cfg_.init_from.empty()) hf::load_gpt2(static_cast<nn::GPT&>(*model_), cfg_.init_from);  // validate(): a GPT
  if (group_) check_ranks_agree(*group_, shared_settings());
  data::SyntheticConfig dc;  // without file or program data
  if (!train_data_) {
    if (spec.is_gpt) {
      dc.in = cfg_.seq;  // random tokens, for measuring
    } else if (spec.is_cnn) {
      dc.image = spec.cnn.input;
      dc.teacher_hidden = 16;  // teacher channels: labelling stays cheap next to the student's step
    } else {
      dc.in = spec.widths.front();
    }
    dc.out = spec.outputs();
    dc.task = cfg_.task;
    dc.seed = cfg_.seed;
    dc.samples = cfg_.samples;
  }
  OptimizerFactory make_opt = [this](nn::Module& m) -> std::unique_ptr<optim::Optimizer> {
    if (cfg_.optimizer == "sgd")
      return std::make_unique<optim::SGD>(
          m, optim::SGD::Options{*cfg_.lr, cfg_.momentum, 0.0f, cfg_.weight_decay, cfg_.nesterov});
    return std::make_unique<optim::AdamW>(
        m, optim::AdamW::Options{*cfg_.lr, cfg_.beta1, cfg_.beta2, cfg_.eps, cfg_.weight_decay});
  };
  DataParallelOptions o = cfg_.parallel;
  o.check_finite = true;
  o.group = group_;
  sched_ = {optim::parse_schedule(cfg_.schedule), *cfg_.lr, cfg_.warmup, cfg_.steps, *cfg_.lr * cfg_.lr_final};
  // Every optimizer consults the run's schedule, on the device, each step, and rounds the bf16 copy as the run asks.
  const OptimizerFactory scheduled = [this, make_opt](nn::Module& m) {
    std::unique_ptr<optim::Optimizer> opt = make_opt(m);
    opt->set_schedule(sched_);
    opt->set_bf16_rounding(cfg_.bf16_rounding, cfg_.seed);
    return opt;
  };
  dp_ = std::make_unique<DataParallel>(model_, cfg_.devices, scheduled, o);
  watch_ = std::make_unique<NonFiniteWatch>(*dp_);
  // Each replica's inputs (its thread asks its own feeder), of a split refused here if it
  // cannot work, before any step.
  std::vector<Device> replicas;
  for (size_t r = 0; r < dp_->size(); ++r) replicas.push_back(dp_->device(r));
  const data::FeedOptions feed{
      cfg_.seed, cfg_.shuffle, classes_, cfg_.parallel.cuda_graph, cfg_.parallel.precision, cfg_.parallel.gemm};
  feeders_ =
      data::make_feeders(train_data_.get(), dc, replica_shares(dp_->plan(cfg_.batch), replicas, cfg_.steps), feed);
  fill_next_inputs_ =
      std::all_of(feeders_.begin(), feeders_.end(), [](const auto& f) { return f->fills_next_inputs(); });
  if (!cfg_.resume.empty()) resume(cfg_.resume);
  if (cfg_.save == cfg_.resume && steps_done_ < cfg_.steps) check_save_path(cfg_.save);
  // Each rank reads its own copy of the checkpoint (a rank that cannot has failed above):
  // copies of other runs at the same step would train replicas that never agree.
  if (group_) {
    check_ranks_agree(*group_,
                      {{field("resume"), cfg_.resume.empty() ? "none" : "step " + std::to_string(steps_done_)}});
    if (!cfg_.resume.empty()) {
      const std::vector<uint64_t> all = group_->gather_all(local_parameter_hash());
      for (size_t r = 1; r < all.size(); ++r)
        if (all[r] != all[0])
          throw UsageError("rank 0 and rank " + std::to_string(r) +
                               " resumed checkpoints of other parameters at the same step ({}): every rank must resume "
                               "a copy of one checkpoint",
                           {field("resume")});
    }
  }
}

namespace {

ckpt::HostTensor host_tensor(const Tensor& t) {
  const auto v = t.to_host();
  return ckpt::make_tensor(ckpt::DType::f32, t.shape().vec(), v.data());
}
}  // namespace

// What the data is, as far as a resumed run must see the same: synthetic, or the rows, the
// order and each file's size and header hash (not its path: files move).
std::string Trainer::data_identity() const {
  if (!train_data_) return "synthetic";
  return "rows " + std::to_string(train_data_->rows()) + ", shuffle " + (cfg_.shuffle ? "on" : "off") + ", " +
         train_data_->origin();
}

// A field's value as a checkpoint records it and the ranks compare it, where the field's
// own text would not do: the data's identity and rows stand for the paths (files move,
// and each rank may read its own copy), and a rank's checkpoint path for whether it has one.
std::string Trainer::setting_text(const OptionField<TrainConfig>& f) const {
  if (f.id.name == "data") return data_identity();
  if (f.id.name == "val_data") return val_data_ ? std::to_string(val_data_->rows()) + " rows" : "none";
  // Rank 0 writes the checkpoint, but under ZeRO every rank takes part in gathering its
  // optimizer state (a rank without a path would be in another collective).
  if (f.id.name == "save") return cfg_.save.empty() ? "none" : "a path";
  return f.get(cfg_);
}

std::vector<std::pair<std::string, std::string>> Trainer::run_settings() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (const OptionField<TrainConfig>& f : train_schema())
    if (f.recorded) out.emplace_back(f.id.name, setting_text(f));
  return out;
}

// What every rank must share (before DataParallel, whose first collectives assume it): what
// a checkpoint records, and how the steps meet in collectives. The first field that differs
// is named: the ones a user sets come before those derived from them (the data's rows and
// the samples follow from the validation split; the data's identity holds the shuffle).
std::vector<std::pair<FieldId, std::string>> Trainer::shared_settings() const {
  std::vector<std::pair<FieldId, std::string>> out, derived;
  for (const OptionField<TrainConfig>& f : train_schema()) {
    if (!f.ranks_agree) continue;
    const bool follows = f.id.name == "data" || f.id.name == "val_data" || f.id.name == "samples";
    (follows ? derived : out).emplace_back(f.id, setting_text(f));
  }
  out.insert(out.end(), derived.begin(), derived.end());
  return out;
}

void Trainer::save(const std::string& path) { write_checkpoint(path, gather_state()); }

std::vector<std::pair<std::string, Tensor>> Trainer::gather_state() {
  dp_->synchronize();
  // Collective under ZeRO with ranks (the shards travel to every rank): before rank 0 goes on alone.
  return dp_->optimizer_state();
}

void Trainer::write_checkpoint(const std::string& path,
                               const std::vector<std::pair<std::string, Tensor>>& optimizer_state) {
  if (group_ && group_->rank() != 0) return;
  if (path.empty()) throw UsageError("Trainer::save: an empty path");
  try {
    check_output_file(path, "Trainer::save");  // a missing folder named as such, not as a failed rename
  } catch (const UsageError& e) {
    throw Error(e.what());  // the file system's state now (its folder may have gone mid-run), not bad input
  }
  ckpt::Checkpoint c;
  c.metadata = {{"format", "dptrain-1"},
                {"step", std::to_string(steps_done_)},
                {"optimizer_steps", std::to_string(optimizer().steps_taken())},
                // Data and randomness are counter-based: the next sample index is the
                // whole of their state.
                {"rng", "philox4x32-10, seed " + std::to_string(cfg_.seed)},
                {"data_position", std::to_string(steps_done_ * cfg_.batch)},
                {"elapsed_s", option_text::of(elapsed_seconds())}};
  for (const auto& [key, value] : run_settings()) c.metadata[key] = value;
  if (train_data_) {  // where the position falls in the epochs, for a reader of the file
    const data::SamplePosition at = data::sample_position(steps_done_ * cfg_.batch, cfg_.samples);
    c.metadata["data_epoch"] = std::to_string(at.epoch);
    c.metadata["data_index"] = std::to_string(at.index);
  }
  for (auto& [name, p] : model_->named_parameters()) c.tensors.push_back({name, host_tensor(p->value)});
  for (auto& [name, b] : model_->named_buffers()) c.tensors.push_back({name, host_tensor(b->value)});
  for (auto& [name, t] : optimizer_state) c.tensors.push_back({name, host_tensor(t)});
  for (const auto& [key, value] : c.metadata)  // a resumed run refuses any key it does not know
    DPT_CHECK(is_checkpoint_key(key), "Trainer::save: metadata key '" + key + "' is not in load_checkpoint's list");
  ckpt::save(path, c);
}

void Trainer::resume(const std::string& path) {
  const ckpt::Checkpoint c = load_checkpoint(path, !group_ || group_->rank() == 0);
  auto meta = [&](const std::string& key) { return metadata(c, path, key); };
  const SettingText ours = [this](const OptionField<TrainConfig>& f) {
    return f.id.name == "optimizer" ? optimizer().kind() : setting_text(f);
  };
  check_fixed_settings(c, path, ours);
  const int64_t step = metadata_int(c, path, "step", 0, std::numeric_limits<int64_t>::max());
  if (step > cfg_.steps)
    throw UsageError(
        "checkpoint '" + path + "' is at step " + std::to_string(step) + ", past {} " + std::to_string(cfg_.steps),
        {field("steps")});
  // An optimizer steps at most once a training step (skipped steps do not count).
  const int64_t optimizer_steps = metadata_int(c, path, "optimizer_steps", 0, step);
  // The data's position is one counter, the samples the steps have taken.
  if (metadata_int(c, path, "data_position", 0, std::numeric_limits<int64_t>::max()) != step * cfg_.batch)
    throw UsageError("checkpoint '" + path + "': metadata 'data_position' " + meta("data_position") + " is not step " +
                     std::to_string(step) + " times batch " + std::to_string(cfg_.batch));
  // The settings a resumed run may change are checked as well, and reported when they differ.
  ResumeInfo info{path, step, changed_settings(c, path, ours)};
  if (c.metadata.count("elapsed_s")) {  // (a file written before it was kept starts at 0)
    const std::string text = meta("elapsed_s");
    char* end = nullptr;
    const double was = std::strtod(text.c_str(), &end);
    if (text.empty() || end != text.c_str() + text.size() || !(was >= 0.0 && was < HUGE_VAL))
      throw UsageError("checkpoint '" + path + "': metadata 'elapsed_s' must be a number of seconds >= 0, got " +
                       ckpt::printable(text));
    elapsed_before_ = was;
  }
  std::set<std::string> used;  // every tensor the model and optimizer take; no other may be in the file
  load_replicas(c, path, *dp_, used);
  // The state is the whole flat buffers in the file, whatever the device count or ZeRO
  // stage; each optimizer takes its shard of it (all of it without ZeRO).
  const Shape flat = model_->flat_params().shape();
  // SGD's momentum may change to or from 0: a buffer the file has and the run does not use
  // is dropped; one the run needs and the file lacks starts at zero, as a fresh run's.
  const bool file_has_momentum = c.find("optimizer.momentum_buffer") != nullptr;
  // (A file of momentum above 0 without its buffer is refused: the fetch below names it.)
  const bool file_without_momentum =
      c.metadata.count("momentum") && std::strtof(meta("momentum").c_str(), nullptr) == 0;
  if (file_has_momentum && file_without_momentum)  // else reported as a tensor no optimizer has
    throw UsageError("checkpoint '" + path + "' says momentum " + ckpt::printable(meta("momentum")) +
                     " in its metadata, yet holds a momentum buffer: the file is inconsistent");
  if (file_has_momentum && cfg_.optimizer == "sgd" && cfg_.momentum == 0.0f) {
    used.insert("optimizer.momentum_buffer");
    info.changed.push_back("its momentum buffer dropped");
  }
  for (optim::Optimizer* o : dp_->optimizers()) {
    for (auto& [name, t] : o->state())
      if (name != "optimizer.momentum_buffer" || !file_without_momentum)
        fetch_tensor_part(c, path, name, flat, o->shard_begin(), t, used);
    o->set_steps_taken(optimizer_steps);
    o->refresh_shadow();  // as the last update rounded it (stochastically: with that step's bits)
  }
  for (size_t r = 0; r < dp_->size(); ++r) context(dp_->device(r)).synchronize();  // written on this thread's stream
  check_all_used(c, path, used);
  dp_->synchronize();
  steps_done_ = step;
  resumed_ = std::move(info);
}

std::string Trainer::parameter_at(int64_t index) {
  int64_t total = 0;
  const std::vector<int64_t> offsets = model_->layout(&total);
  const auto named = model_->named_parameters();
  for (size_t k = 0; k < named.size() && k < offsets.size(); ++k)
    if (index >= offsets[k] && index < offsets[k] + numel(named[k].second->shape)) return named[k].first;
  return "";
}

Trainer::~Trainer() {
  // Nothing queued may still read the input pipeline's buffers when they are freed, nor
  // write a synthetic block made ahead (a run stopped early leaves one in the making).
  try {
    for (auto& f : feeders_) f->synchronize();
    if (dp_) dp_->synchronize();
  } catch (const std::exception& e) {
    report(Severity::warning, "the last step failed while the trainer ended: " + Message::of(e));
  }
}

namespace {
// The loss of a task: mean squared error, cross-entropy over `outputs` classes, or a
// language model's next-token cross-entropy over its vocabulary of `outputs`.
LossFn task_loss(data::Task task, int64_t outputs) {
  switch (task) {
    case data::Task::classification:
      return nn::CrossEntropyLoss();
    case data::Task::language_model:
      return [outputs](const Tensor& logits, const Tensor& targets) { return nn::lm_loss(logits, targets, outputs); };
    case data::Task::regression:
      break;
  }
  return nn::MSELoss();
}
}  // namespace

EvalResult evaluate(DataParallel& dp, const data::Dataset& d, int64_t batch, int64_t classes) {
  DPT_CHECK(batch >= 1 && d.rows() > 0 && d.has_targets(), "evaluate: a data set of rows with targets, a batch >= 1");
  const bool classify = d.task() == data::Task::classification;
  const LossFn loss = task_loss(d.task(), classes);
  const LossFn metric = classify ? LossFn(dpt::accuracy) : LossFn();
  std::vector<std::vector<int64_t>> rows(dp.size());
  const ShardSource source = [&](size_t r, int64_t first, int64_t n) {
    rows[r].resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) rows[r][static_cast<size_t>(i)] = first + i;
    data::Batch b = d.empty_batch(n, dp.device(r));
    d.gather(rows[r], b, classes);
    return b;
  };
  // Each chunk's means weighted by its rows: the means over the whole set.
  double loss_sum = 0, right_sum = 0;
  for (int64_t first = 0; first < d.rows(); first += batch) {
    const int64_t n = std::min(batch, d.rows() - first);
    const StepLoss l = dp.evaluate(first, n, source, loss, metric);
    loss_sum += static_cast<double>(l.value()) * static_cast<double>(n);
    if (classify) right_sum += static_cast<double>(l.metric()) * static_cast<double>(n);
  }
  const double rows_total = static_cast<double>(d.rows()), mean = loss_sum / rows_total;
  return {mean, classify ? right_sum / rows_total : NAN, d.task() == data::Task::language_model ? std::exp(mean) : NAN,
          d.rows()};
}

EvalResult Trainer::validate_now() {
  if (!val_data_) return {};
  // In the micro-batches' size: what fits a step's forward fits validation's.
  return evaluate(*dp_, *val_data_, (cfg_.batch + cfg_.parallel.grad_accum - 1) / cfg_.parallel.grad_accum, classes_);
}

StepLoss Trainer::step(int64_t s, bool measure) {
  if (s != steps_done_ || s >= cfg_.steps)
    throw UsageError("Trainer::step(" + std::to_string(s) + "): the steps run in order, " +
                     (steps_done_ < cfg_.steps ? "the next is " + std::to_string(steps_done_)
                                               : "and all " + std::to_string(cfg_.steps) + " are done"));
  const bool classify = cfg_.task == data::Task::classification;
  const LossFn loss = task_loss(cfg_.task, classes_);
  // A recorded step cannot change what it computes: with a CUDA graph, every step measures.
  const LossFn metric = classify && (measure || cfg_.parallel.cuda_graph) ? LossFn(dpt::accuracy) : LossFn();
  // Its phases are timed only when it is measured (logged): four events less a step.
  // The next step's samples, so that a CUDA graph's replay copies them in beside its update
  // (not where they are made straight into its inputs).
  const int64_t next = s + 1 < cfg_.steps && !fill_next_inputs_ ? (s + 1) * cfg_.batch : -1;
  const ShardSource inputs = [this](size_t r, int64_t first, int64_t n) {
    return feeders_[r]->inputs(first, n, fill_next_inputs_ ? dp_->next_step_inputs(r) : data::Batch());
  };
  StepLoss l = dp_->train_step(s * cfg_.batch, cfg_.batch, inputs, loss, metric, measure, next);
  steps_done_ = s + 1;
  // The device skipped the update of a non-finite step; the host learns of it kLag
  // steps later (run() reports it), or at the next log point or save, without waiting.
  watch_->after_step(s);
  return l;
}

uint64_t Trainer::parameter_hash() {
  const uint64_t h = local_parameter_hash();
  if (group_) {
    const auto all = group_->gather_all(h);
    for (size_t r = 0; r < all.size(); ++r)
      if (all[r] != h)
        throw Error("the parameters differ between ranks: rank " + std::to_string(group_->rank()) + " and rank " +
                    std::to_string(r) + " hash differently");
  }
  return h;
}

uint64_t Trainer::local_parameter_hash() {
  dp_->synchronize();
  auto p = model_->flat_params().to_host();
  if (const Tensor& b = model_->flat_buffers(); b.defined()) {  // the running statistics too
    const auto bv = b.to_host();
    p.insert(p.end(), bv.begin(), bv.end());
  }
  return fnv1a(p.data(), p.size() * sizeof(float));
}

namespace {
// "9.7 hours", "42 minutes": the size of a wait, for a warning.
std::string rough_duration(double seconds) {
  char buf[40];
  if (seconds >= 2 * 3600) std::snprintf(buf, sizeof buf, "%.1f hours", seconds / 3600);
  else std::snprintf(buf, sizeof buf, "%.0f minutes", seconds / 60);
  return buf;
}
}  // namespace

namespace {
// Whether two paths name one file (the same path, or two names of one existing file).
bool same_path(const std::string& a, const std::string& b) {
  std::error_code ec;
  return a == b || (std::filesystem::equivalent(a, b, ec) && !ec);
}
}  // namespace

// The checkpoints of a run: a periodic save that fails is a warning (once, with the
// reason) and is tried again at the next period, since the run and its later checkpoints
// matter more than one of them; the final save's failure ends the run, naming what the
// file still holds.
struct Trainer::PeriodicSaves {
  const std::string& path;
  int64_t saved_step;  // the step the file holds from this run (or the run it resumed), -1: none
  Message first_failure;
  int64_t first_failed_step = -1;

  PeriodicSaves(const std::string& p, int64_t begin, bool resumed_here)
      : path(p), saved_step(resumed_here ? begin : -1) {}

  void save(Trainer& t, const std::vector<std::pair<std::string, Tensor>>& state, TrainResult& r) {
    try {
      t.write_checkpoint(path, state);
      saved_step = t.steps_done_;
    } catch (const Error& e) {
      if (r.failed_saves++ > 0) return;
      first_failure = e.line();
      first_failed_step = t.steps_done_;
      report(
          Severity::warning,
          "saving the checkpoint at step " + std::to_string(t.steps_done_) + " failed (" + e.line() +
              Message("); training goes on and tries again every " + std::to_string(t.cfg_.save_every) + " steps ({})",
                      {{"TrainConfig", "save_every"}}));
    }
  }

  void save_final(Trainer& t, const std::vector<std::pair<std::string, Tensor>>& state, const TrainResult& r) {
    try {
      t.write_checkpoint(path, state);
    } catch (const Error& e) {
      std::error_code ec;
      const std::string held = saved_step >= 0 ? ": it holds the checkpoint of step " + std::to_string(saved_step)
                               : std::filesystem::exists(path, ec) ? ": it holds a checkpoint of an earlier run"
                                                                   : " (there was none)";
      throw Error(e.line() + held);
    }
    if (r.failed_saves > 0)
      report(Severity::warning, std::to_string(r.failed_saves) + " periodic save(s) failed, the first at step " +
                                    std::to_string(first_failed_step) + " (" + first_failure +
                                    "); the final one, of step " + std::to_string(t.steps_done_) + ", was written");
  }
};

double Trainer::elapsed_seconds() const {
  const double now =
      run_started_ ? std::chrono::duration<double>(std::chrono::steady_clock::now() - *run_started_).count() : 0.0;
  return elapsed_before_ + now;
}

void Trainer::take_nonfinite(int64_t now, TrainResult& r) {
  for (const NonFiniteWatch::Finding& f : watch_->take()) {
    const std::string where = f.index == std::numeric_limits<int32_t>::max() ? "" : parameter_at(f.index);
    const std::string what = "step " + std::to_string(f.step + 1) + ": the gradient" +
                             (where.empty() ? std::string("'s norm") : " of parameter " + where) + " is not finite" +
                             (where.empty() ? " (its squares overflowed)" : "") + "; the update was not applied";
    if (cfg_.on_nonfinite == "stop") {
      const std::string later = now > f.step + 1 ? " at step " + std::to_string(now) : "";
      // The stop writes no checkpoint: one of an earlier save point (or run) stays as it was.
      std::error_code ec;
      const std::string kept = cfg_.save.empty() ? ""
                               : std::filesystem::exists(cfg_.save, ec)
                                   ? ", the checkpoint '" + cfg_.save + "' is left as it was"
                                   : ", no checkpoint was written";
      throw NonFiniteError(what + "; run stopped" + later + kept);
    }
    if (!group_ || group_->rank() == 0) report(Severity::warning, what);
    ++r.skipped;
  }
}

// A bad row of the training data, met as its step gathered it: DataParallel abandoned that
// step before its update, so the model holds the steps before it, which are saved (as a
// signal's stop saves them) rather than lost with the run. Not in a --ddp job: the other
// ranks applied the step, and rank 0's state may be a step ahead of this rank's.
DataError Trainer::after_data_fault(const DataError& e, PeriodicSaves& periodic, TrainResult& r) {
  if (cfg_.save.empty() || (group_ && group_->size() > 1) || steps_done_ == 0) return e;
  // A step before it whose gradients were not finite is the earlier fault: under "stop" its
  // NonFiniteError (status 4) ends the run, with no checkpoint after it.
  watch_->drain();
  take_nonfinite(steps_done_, r);
  const std::string stopped = "; the run stopped at step " + std::to_string(steps_done_ + 1);
  const std::string held = "step " + std::to_string(steps_done_);
  if (periodic.saved_step != steps_done_) try {
      periodic.save_final(*this, gather_state(), r);
    } catch (const std::exception& failed) {
      return DataError(e.line() + Message(stopped + " and could not save " + held + " (") + Message::of(failed) +
                       Message(")"));
    }
  // (Which mend a resume takes depends on the file: one that changes the bytes a checkpoint
  // identifies a file by is other data; docs/data.md says which.)
  return DataError(e.line() + Message(stopped + ", and '" + cfg_.save + "' holds " + held));
}

// A CPU device can be slower than a GPU by a thousand times: say so once, early, rather
// than let hours pass in silence (a CPU step is over when step() returns). The first step
// pays for the start (up to 8 times a steady step): an eighth of it is a floor on the
// pace, enough to warn at once of a run of hours. Otherwise the steps after it tell the
// pace, over 3 steps or a second, whichever is first.
struct Trainer::CpuPace {
  using clock = std::chrono::steady_clock;
  bool untold;                   // the CPU's pace not yet told
  clock::time_point paced_from;  // the end of the first step
  double eval_seconds_then = 0;  // the validation's seconds by then

  // After step s (`begin` the run's first): `start` the run's start, `eval_seconds` the
  // validation's seconds so far, which are no step's.
  void after_step(const Trainer& t, int64_t s, int64_t begin, clock::time_point start, double eval_seconds) {
    const int64_t done = s + 1, steps_total = t.cfg_.steps;
    if (untold) {
      const bool at_first = s == begin;
      const double since = std::chrono::duration<double>(clock::now() - (at_first ? start : paced_from)).count() -
                           (eval_seconds - (at_first ? 0.0 : eval_seconds_then));
      const int64_t steps = at_first ? 1 : done - (begin + 1);
      const double per = at_first ? since / 8 : since / static_cast<double>(steps);  // steps >= 1 after the first
      const double left = per * static_cast<double>(steps_total - done);
      if (at_first ? left > 3600 : steps >= 3 || since >= 1.0) {
        untold = false;
        char per_step[32];
        std::snprintf(per_step, sizeof per_step, "%.3g", per);
        if (left > 3600 && (!t.group_ || t.group_->rank() == 0))
          report(Severity::warning, std::string("at ") + (at_first ? "least " : "") + per_step + " s a step" +
                                        (at_first ? " (an eighth of the first, which pays for the start)" : "") +
                                        ", the " + std::to_string(steps_total - done) + " steps left will take about " +
                                        rough_duration(left) + " on the CPU; a GPU (" +
                                        Message("{}", {{"TrainConfig", "devices"}}) +
                                        " cuda:0) trains this model far faster");
      }
    }
    if (s == begin) paced_from = clock::now(), eval_seconds_then = eval_seconds;
  }
};

TrainResult Trainer::run(const std::function<void(const StepLog&)>& on_log, const std::function<bool()>& stop) {
  using clock = std::chrono::steady_clock;
  TrainResult r;
  const auto start = clock::now();
  run_started_ = start;
  auto last = start, after_first = start;
  const int64_t begin = steps_done_;
  // The rates are timed after the steps that set up rather than train: the first (the
  // allocator, cuBLAS's tuning) and, with a CUDA graph, the two that record the graphs
  // (one for each parity of the optimizer's twin buffers), which a long run pays once.
  const int64_t setup = cfg_.parallel.cuda_graph ? 3 : 1;
  std::optional<clock::time_point> after_setup;
  double eval_seconds_in_setup = 0;
  int64_t last_step = begin;
  StepLoss unread;  // the last step's loss when it was not logged
  double eval_seconds = 0;
  CpuPace pace{cfg_.devices.front().is_cpu(), start};
  PeriodicSaves periodic{cfg_.save, begin, resumed_ && same_path(resumed_->path, cfg_.save)};
  for (int64_t s = begin; s < cfg_.steps; ++s) {
    if (stop) {
      // Every rank must stop at the same step: the decision is shared.
      const bool asked = stop();
      if (group_ ? group_->sum(asked ? 1.0 : 0.0) > 0 : asked) {
        r.stopped = true;
        break;
      }
    }
    unread = StepLoss();  // freed before the step, which reuses its memory
    const int64_t done = s + 1;
    const bool first = s == begin;
    // Validation every eval_every steps, or by default at each step that ends an epoch
    // (whose samples reach the next epoch's first), and at the end.
    const bool epoch_ended = train_data_ && (done * cfg_.batch) / cfg_.samples != (s * cfg_.batch) / cfg_.samples;
    const bool evaluated = val_data_ && (eval_every_ > 0 ? done % eval_every_ == 0 || done == cfg_.steps
                                                         : epoch_ended || done == cfg_.steps);
    const bool logged = first || evaluated || done % cfg_.log_every == 0 || done == cfg_.steps;
    const bool saved = cfg_.save_every > 0 && done % cfg_.save_every == 0 && done != cfg_.steps;
    StepLoss loss;
    try {
      loss = step(s, logged);
    } catch (const DataError& e) {
      throw after_data_fault(e, periodic, r);
    }
    if (logged || saved) watch_->drain();
    take_nonfinite(done, r);
    if (logged) {
      dp_->synchronize();                // bounded by --comm-timeout across ranks
      const float value = loss.value();  // the only host synchronization of a step
      const float accuracy = loss.metric();
      const auto now = clock::now();
      const double dt = std::chrono::duration<double>(now - last).count();
      const int64_t n = done - last_step;
      if (first) {
        r.first_loss = value;
        after_first = now;
      }
      EvalResult val;
      if (evaluated) {  // not step time: the rates leave it out
        r.val = val = validate_now();
        eval_seconds += std::chrono::duration<double>(clock::now() - now).count();
      }
      if (on_log)
        on_log({done, cfg_.steps, value, accuracy, sched_.at(s),
                dt > 0 ? static_cast<double>(n * cfg_.batch) / dt : 0.0, 1e3 * dt / static_cast<double>(n),
                elapsed_before_ + std::chrono::duration<double>(now - start).count(), val});
      r.final_loss = value;
      r.final_accuracy = accuracy;
      last = evaluated ? clock::now() : now;
      last_step = done;
    } else {
      unread = std::move(loss);
    }
    if (done - begin == setup && setup > 1) {
      if (!logged) dp_->synchronize();  // once a run: the recordings' end
      after_setup = clock::now(), eval_seconds_in_setup = eval_seconds;
    }
    pace.after_step(*this, s, begin, start, eval_seconds);
    if (saved) periodic.save(*this, gather_state(), r);
  }
  watch_->drain();
  take_nonfinite(steps_done_, r);  // before the last save
  // A stopped run reports the loss of the last step it did, logged or not (every rank
  // stopped at the same step, so the collective read matches).
  if (!unread.losses.empty()) r.final_loss = unread.value();
  // A run that took no step leaves the checkpoint it resumed from as it is (it holds this
  // very state): a finished run run again writes nothing.
  const bool unchanged = steps_done_ == begin && resumed_ && same_path(resumed_->path, cfg_.save);
  if (!cfg_.save.empty() && !unchanged) periodic.save_final(*this, gather_state(), r);
  dp_->synchronize();
  const auto end = clock::now();
  r.steps = steps_done_ - begin;
  r.seconds = std::chrono::duration<double>(end - start).count();
  elapsed_before_ += r.seconds;  // a run() after this one continues the count
  run_started_.reset();
  // After the set-up where steps followed it; else after the first step.
  const bool steady = after_setup && r.steps > setup;
  const int64_t timed_steps = steady ? r.steps - setup : r.steps - 1;
  const double timed =
      steady ? std::chrono::duration<double>(end - *after_setup).count() - (eval_seconds - eval_seconds_in_setup)
             : std::chrono::duration<double>(end - after_first).count() - eval_seconds;
  if (r.steps > 1 && timed > 0) {
    r.samples_per_s = static_cast<double>(timed_steps * cfg_.batch) / timed;
    r.step_ms = 1e3 * timed / static_cast<double>(timed_steps);
  } else if (r.steps == 1) {  // the first step alone, warm-up and all (rather than none)
    const double first = std::chrono::duration<double>(after_first - start).count();
    if (first > 0) {
      r.samples_per_s = static_cast<double>(cfg_.batch) / first;
      r.step_ms = 1e3 * first;
    }
  }
  add_resource_use(r);
  return r;
}

void Trainer::add_resource_use(TrainResult& r) const {
  if (r.steps > 0) r.times = dp_->last_times();
  for (const auto& f : feeders_) r.input += f->stats();
  std::vector<Device> seen;
  for (const Device& d : cfg_.devices)
    if (std::find(seen.begin(), seen.end(), d) == seen.end()) {
      seen.push_back(d);
      r.memory.push_back({d, memory_stats(d)});
    }
  r.model_state = dp_->model_state_bytes();
}

}  // namespace dpt
