// TrainConfig's fields, declared once (train_schema(), <dptrain/train/trainer.hpp>).
#include <limits>

#include <dptrain/layers/conv.hpp>
#include <dptrain/layers/gpt.hpp>
#include <dptrain/layers/layers.hpp>
#include <dptrain/parallel/process_group.hpp>
#include <dptrain/train/trainer.hpp>

#include "common/atomic_file.hpp"
#include "field_error.hpp"

namespace dpt {

namespace {
using C = TrainConfig;
using option_text::got;
FieldId id(const char* name) { return {"TrainConfig", name}; }

// A word field whose words are `words` (the optimizer, the non-finite policy).
OptionField<C> word_field(const char* name, std::string C::*member, std::vector<std::string> words, std::string help) {
  OptionField<C> f = text_field(id(name), member, OptionKind::choice, std::move(help));
  f.choices = words;
  f.check = [member, words, name](const C& c) {
    std::string list;
    for (size_t i = 0; i < words.size(); ++i) list += (i == 0 ? "" : i + 1 == words.size() ? " or " : ", ") + words[i];
    for (const std::string& w : words)
      if (c.*member == w) return;
    throw UsageError("{} " + quote_value(c.*member) + " is unknown: expected " + list, {id(name)});
  };
  return f;
}

// The learning rate: none until validate() gives the optimizer's default.
OptionField<C> lr_field() {
  OptionField<C> f;
  f.id = id("lr");
  f.kind = OptionKind::real;
  f.type = "float";
  f.help = "Learning rate (default: 0.05 for sgd, 0.001 for adamw)";
  f.get = [](const C& c) { return c.lr ? option_text::of(*c.lr) : std::string(); };
  f.set = [](C& c, const std::string& t) { c.lr = option_text::parse<float>(t); };
  f.range = OptionRange{0, HUGE_VAL, true, true, "must be a positive number"};
  f.check = [](const C& c) {
    if (c.lr && (!(*c.lr > 0.0f) || !std::isfinite(*c.lr)))
      throw UsageError("{} must be a positive number" + option_text::got(*c.lr), {id("lr")});
  };
  return f.in_checkpoint();
}

OptionField<C> devices_field() {
  OptionField<C> f;
  f.id = id("devices");
  f.kind = OptionKind::devices;
  f.help =
      "Devices, e.g. cuda:0,cuda:1 or cpu:0,cpu:1 (default: every GPU, else cpu); a GPU listed twice holds two "
      "replicas";
  f.get = [](const C& c) {
    std::string out;
    for (const Device& d : c.devices) out += (out.empty() ? "" : ",") + d.str();
    return out;
  };
  f.set = [](C& c, const std::string& t) { c.devices = parse_devices(t); };
  return f;
}

OptionSchema<C> make_schema() {
  const OptionRange at_least_1{1, HUGE_VAL, false, false, "must be >= 1"};
  const OptionRange at_least_0{0, HUGE_VAL, false, false, "must be >= 0"};
  const OptionRange below_1{0, 1, false, true, "must be in [0, 1)"};
  const OptionRange positive{0, HUGE_VAL, true, true, "must be a positive number"};
  OptionSchema<C> s = {
      text_field(id("model"), &C::model, OptionKind::text,
                 "MLP spec (widths, e.g. 1024-4096x3-1024), CNN spec (cnn:3x32x32-c32k3-p2-c64k3-p2-f10), GPT spec "
                 "(gpt:L4-H4-C128-T256-V512) or preset: seed, mlp, cnn-small, cnn, gpt2, gpt2-medium")
          .fixed_on_resume(),
      choice_field(id("act"), &C::act, nn::kActNames,
                   "Hidden activation: relu, gelu, tanh, gelu_tanh, or none (a linear model)")
          .fixed_on_resume(),
      choice_field(id("task"), &C::task, data::kTaskNames,
                   "Synthetic task: regression or classification (a CNN classifies images; file data's targets say "
                   "it)")
          .fixed_on_resume(),
      number_field(id("batch"), &C::batch, at_least_1, "Global batch size").fixed_on_resume(),
      number_field(id("steps"), &C::steps, at_least_1, "Total optimizer steps").agreed(),
      number_field(id("epochs"), &C::epochs, at_least_0,
                   "Epochs over --samples (sets the number of steps instead of --steps)"),
      number_field(id("samples"), &C::samples, at_least_0,
                   "Synthetic dataset size (default: an endless stream of new samples)")
          .fixed_on_resume(),
      number_field(id("seq"), &C::seq, at_least_0, "GPT: tokens a sequence (default: its context)").fixed_on_resume(),
      number_field(id("batch_tokens"), &C::batch_tokens, at_least_0, "GPT: tokens a step (--batch: a device's part)"),
      choice_field(id("recompute"), &C::recompute, nn::kRecomputeNames,
                   "GPT: activations rebuilt in backward instead of kept, for memory (the same results): none, gelu "
                   "(the MLP's GELU output) or gelu+ln (and the LayerNorms' outputs)"),
      choice_field(id("attention_backward"), &C::attention_backward, nn::kAttentionBackwardNames,
                   "GPT: deterministic (the same bits every run) or fast (cuDNN's attention backward, bf16 on a GPU, "
                   "adds its parts as they finish: faster, the last bits varying from run to run)"),
      text_field(id("data"), &C::data, OptionKind::path,
                 "Train on this file: .safetensors (x, y, optional x_val, y_val) or .npy of inputs (with --targets)")
          .fixed_on_resume(),
      text_field(id("targets"), &C::targets, OptionKind::path,
                 "The .npy file of targets: float rows (regression) or integer class labels"),
      text_field(id("val_data"), &C::val_data, OptionKind::path,
                 "Validation inputs (.npy, with --val-targets, or .safetensors)")
          .agreed(),
      text_field(id("val_targets"), &C::val_targets, OptionKind::path, "Validation targets (.npy)"),
      number_field(id("val_fraction"), &C::val_fraction, below_1,
                   "Validate on the last F of the --data rows (never shuffled into training)")
          .agreed(),
      number_field(id("eval_every"), &C::eval_every, {0, HUGE_VAL, false, false, "must be >= 0 (0: once an epoch)"},
                   "Validate every N steps (0, the default: at the end of each epoch)")
          .agreed(),
      switch_field(id("shuffle"), &C::shuffle, "File data: a new order of the rows every epoch (the default)").agreed(),
      lr_field(),
      word_field("optimizer", &C::optimizer, {"sgd", "adamw"}, "sgd or adamw").fixed_on_resume(),
      number_field(id("momentum"), &C::momentum, below_1, "SGD momentum").in_checkpoint(),
      switch_field(id("nesterov"), &C::nesterov, "Nesterov momentum (SGD)").in_checkpoint(),
      number_field(id("weight_decay"), &C::weight_decay, {0, HUGE_VAL, false, true, "must be a finite number >= 0"},
                   "Weight decay (L2 for SGD, decoupled for AdamW)")
          .in_checkpoint(),
      number_field(id("beta1"), &C::beta1, below_1, "AdamW beta1").in_checkpoint(),
      number_field(id("beta2"), &C::beta2, below_1, "AdamW beta2").in_checkpoint(),
      number_field(id("eps"), &C::eps, positive, "AdamW epsilon").in_checkpoint(),
      word_field("schedule", &C::schedule, {"constant", "warmup", "cosine"},
                 "Learning-rate schedule: constant, warmup, cosine")
          .in_checkpoint(),
      number_field(id("warmup"), &C::warmup, at_least_0, "Linear warm-up steps (warmup, cosine)").in_checkpoint(),
      number_field(id("lr_final"), &C::lr_final, {0, 1, false, false, "must be in [0, 1]"},
                   "Cosine: the final learning rate as a fraction of --lr (default 0)")
          .in_checkpoint(),
      devices_field(),
  };
  // The Trainer checks every step's gradients itself (check_finite), so it never updates a
  // bucket on its own (update_per_bucket refuses the check).
  for (OptionField<C>& f : nested(&C::parallel, data_parallel_schema()))
    if (f.id.name != "check_finite" && f.id.name != "update_per_bucket") s.push_back(std::move(f));
  OptionSchema<C> rest = {
      choice_field(id("bf16_rounding"), &C::bf16_rounding, kBf16RoundingNames,
                   "How each update rounds the bf16 copy of the weights (--precision bf16): nearest (ties to even) "
                   "or stochastic (up with probability the distance to the value below, by random bits of the "
                   "seed, step and element: unbiased)")
          .agreed(),
      text_field(id("save"), &C::save, OptionKind::path,
                 "Write a checkpoint (safetensors) here at the end, on SIGINT/SIGTERM and every --save-every steps")
          .agreed(),
      number_field(id("save_every"), &C::save_every, at_least_0, "Also write the checkpoint every N steps").agreed(),
      text_field(id("resume"), &C::resume, OptionKind::path, "Continue from this checkpoint (--steps stays the total)"),
      text_field(id("init_from"), &C::init_from, OptionKind::path,
                 "GPT: start from these weights (a Hugging Face GPT-2 model.safetensors): fine-tuning"),
      word_field("on_nonfinite", &C::on_nonfinite, {"stop", "skip-step"},
                 "When a loss or gradient is not finite: stop (exit 4) or skip-step (the update is never applied)")
          .agreed(),
      switch_field(id("ddp"), &C::ddp, "One process per device under mpirun (MPI bootstrap, NCCL or MPI reduction)"),
      // Below a tenth of a second a healthy rank that is a little late would end the job.
      number_field(id("comm_timeout"), &C::comm_timeout,
                   {0.1, 1e9, false, false, "must be a number of seconds in [0.1, 1e9]"},
                   "Seconds a --ddp rank waits for the others before the job is ended"),
      number_field(id("seed"), &C::seed, {}, "Seed of the data, the teacher and the initial weights").fixed_on_resume(),
      number_field(id("log_every"), &C::log_every, at_least_1, "Read the loss back and log every N steps").agreed(),
  };
  for (OptionField<C>& f : rest) s.push_back(std::move(f));
  return s;
}
}  // namespace

const OptionSchema<TrainConfig>& train_schema() {
  static const OptionSchema<TrainConfig> schema = make_schema();
  return schema;
}

float default_lr(const std::string& optimizer) { return optimizer == "adamw" ? 1e-3f : 0.05f; }

namespace {

// A GPT's sequence length, and its batch in tokens as a global batch of sequences and an
// accumulation (before the steps of epochs are counted from the batch).
void validate_language_model(TrainConfig& cfg) {
  const nn::GptConfig g = nn::parse_gpt_spec(cfg.model);
  if (cfg.seq == 0) cfg.seq = g.context;
  if (cfg.seq > g.context)
    bad("seq", "of " + std::to_string(cfg.seq) + " tokens is longer than the model's context of " +
                   std::to_string(g.context) + " (" + cfg.model + ")");
  if (cfg.task == data::Task::regression || cfg.task == data::Task::classification)
    cfg.task = data::Task::language_model;
  if (cfg.batch_tokens == 0) return;
  if (cfg.batch < 1) return;  // the field's own check says so
  if (cfg.parallel.grad_accum != 1)
    bad("batch_tokens", "sets the accumulation itself; leave out {}", {"parallel.grad_accum"});
  // Each device's micro-batch is `batch` sequences; every replica (a device, or a rank) takes one.
  const int64_t replicas =
      cfg.ddp && built_with_mpi()
          ? ProcessGroup::world().size()
          : static_cast<int64_t>(cfg.devices.empty() ? default_devices().size() : cfg.devices.size());
  const int64_t micro_tokens = cfg.batch * cfg.seq * replicas;
  if (cfg.batch_tokens % micro_tokens != 0)
    bad("batch_tokens",
        "of " + std::to_string(cfg.batch_tokens) + " is not a multiple of a micro-step's " +
            std::to_string(micro_tokens) + " tokens ({} " + std::to_string(cfg.batch) + " x {} " +
            std::to_string(cfg.seq) + " x " + std::to_string(replicas) + " device(s))",
        {"batch", "seq"});
  cfg.parallel.grad_accum = static_cast<int>(cfg.batch_tokens / micro_tokens);
  cfg.batch = cfg.batch_tokens / cfg.seq;
}

}  // namespace

nn::ModelSpec validate(TrainConfig& cfg) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  if (nn::is_gpt_spec(cfg.model)) {
    validate_language_model(cfg);
  } else {
    if (cfg.seq != 0) bad("seq", "is a GPT's sequence length; {} is not a GPT", {"model"});
    if (cfg.batch_tokens != 0) bad("batch_tokens", "is a GPT's batch; {} is not a GPT", {"model"});
    if (cfg.task == data::Task::language_model) bad("task", "language-model needs a GPT {}", {"model"});
  }
  // The steps of epochs come first, so that the steps' own check sees them.
  if (cfg.epochs > 0 && cfg.samples >= 1 && cfg.batch >= 1) {
    if (cfg.epochs > kMax / cfg.samples)
      bad("epochs",
          "times {} is more samples than fit in 64 bits: " + std::to_string(cfg.epochs) + " x " +
              std::to_string(cfg.samples),
          {"samples"});
    const int64_t total = cfg.epochs * cfg.samples;
    cfg.steps = total / cfg.batch + (total % cfg.batch != 0);
  }
  check_fields(train_schema(), cfg);  // each field's own range (NaN falls outside every one)
  if (cfg.epochs > 0 && cfg.samples < 1) bad("epochs", "needs {} (the dataset size)", {"samples"});
  // Sample indices run to steps * batch (the data's position is one counter).
  if (cfg.steps > kMax / cfg.batch)
    bad("steps",
        "times {} is more samples than fit in 64 bits: " + std::to_string(cfg.steps) + " x " +
            std::to_string(cfg.batch),
        {"batch"});
  if (!cfg.lr) cfg.lr = default_lr(cfg.optimizer);
  if (cfg.nesterov && cfg.optimizer == "adamw")
    bad("nesterov", "is an option of the sgd optimizer; {} is adamw", {"optimizer"});
  if (cfg.nesterov && cfg.optimizer == "sgd" && cfg.momentum == 0.0f)
    bad("nesterov", "needs {} > 0" + got(cfg.momentum), {"momentum"});
  if (cfg.data.empty() &&
      !(cfg.targets.empty() && cfg.val_data.empty() && cfg.val_targets.empty() && cfg.val_fraction == 0.0))
    bad("data", "is needed by {}, {}, {} and {} (file data)", {"targets", "val_data", "val_targets", "val_fraction"});
  if (optim::parse_schedule(cfg.schedule) == optim::Schedule::Kind::constant && cfg.warmup > 0)
    bad("warmup", "has no effect with {} constant: use {} warmup (a linear warm-up, then constant) or cosine",
        {"schedule", "schedule"});
  if (cfg.lr_final != 0.0f && optim::parse_schedule(cfg.schedule) != optim::Schedule::Kind::cosine)
    bad("lr_final", "is where the cosine schedule ends; add {} cosine", {"schedule"});
  nn::ModelSpec spec = nn::parse_model_spec(cfg.model);
  if (spec.is_cnn) cfg.task = data::Task::classification;  // a CNN classifies images
  if (cfg.task == data::Task::classification && spec.outputs() < 2)
    bad("task", "classification needs at least 2 output classes, the model has " + std::to_string(spec.outputs()));
  if (cfg.save_every > 0 && cfg.save.empty()) bad("save_every", "needs {} (a checkpoint path)", {"save"});
  if (cfg.bf16_rounding == Bf16Rounding::stochastic && cfg.parallel.precision != Precision::bf16)
    bad("bf16_rounding", "stochastic rounds the bf16 copy of the weights, which only {} bf16 keeps",
        {"parallel.precision"});
  if (cfg.bf16_rounding == Bf16Rounding::stochastic && cfg.parallel.reduce == Reduce::p2p)
    bad("bf16_rounding",
        "stochastic needs every replica to round its own copy of the weights; {} p2p copies the master's to the "
        "others",
        {"parallel.reduce"});
  if (cfg.recompute != nn::Recompute::none && !spec.is_gpt)
    bad("recompute", "applies to GPT models; {} is not a GPT", {"model"});
  if (cfg.attention_backward != nn::AttentionBackward::deterministic && !spec.is_gpt)
    bad("attention_backward", "applies to GPT models; {} is not a GPT", {"model"});
  if (cfg.act != Act::relu && spec.is_gpt)  // relu, the default, is what a GPT's checkpoint records
    bad("act", "is an MLP's or a CNN's hidden activation; a GPT's MLP has GPT-2's GELU (tanh), and {} is a GPT",
        {"model"});
  if (!cfg.init_from.empty() && !spec.is_gpt)
    bad("init_from", "is a GPT's starting weights; {} is not a GPT", {"model"});
  if (!cfg.init_from.empty() && !cfg.resume.empty())
    bad("init_from", "and {} both give the weights to start from: give one", {"resume"});
  // A run that continues its own checkpoint checks the folder once it knows it has steps
  // to train (Trainer::Trainer): a finished one writes nothing, a read-only folder included.
  if (cfg.save != cfg.resume) check_save_path(cfg.save);
  if (cfg.devices.empty()) cfg.devices = default_devices();
  if (cfg.ddp && !built_with_mpi()) bad("ddp", "needs a build with MPI (install libopenmpi-dev and rebuild)");
  for (const Device& d : cfg.devices) {
    check_device(d);
    if (d.type != cfg.devices.front().type) bad("devices", "cannot mix CPU and CUDA devices");
  }
  // DataParallel's own checks, before anything is built. A ddp rank trains on one device,
  // and reduces over the ranks whatever reduce says (DataParallel checks the group's part).
  const DataParallelOptions& p = cfg.parallel;
  DataParallelOptions mine = p;
  if (cfg.ddp) mine.reduce = Reduce::automatic;
  check_options(mine, cfg.ddp ? std::vector<Device>{cfg.devices.front()} : cfg.devices);
  if (cfg.devices.front().is_cpu() && p.gemm == GemmImpl::native)
    bad("parallel.gemm", "native is a CUDA kernel; the CPU has one GEMM");
  if (p.gemm == GemmImpl::native && p.precision != Precision::fp32)
    bad("parallel.gemm", "native computes in fp32 only; use {} cublas for tf32 or bf16", {"parallel.gemm"});
  return spec;
}

void check_save_path(const std::string& path) {
  try {
    check_output_file(path, "{}");  // the message starts with the field
  } catch (const UsageError& e) {
    throw UsageError(e.what(), {field("save")});
  }
}

}  // namespace dpt
