// The library used wrongly by a program that embeds it: each misuse here once crashed,
// read or wrote out of bounds, hung or trained on garbage in silence (a hostile review of
// the public API, 2026-12-05). Each is now an exception with one line that says what.
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cmath>
#include <filesystem>
#include <memory>
#include <string>

#include <dptrain/dptrain.hpp>
#include "catch.hpp"
#include "common.hpp"

using namespace dpt;

namespace {
const Device kCpu0{DeviceType::cpu, 0}, kCpu1{DeviceType::cpu, 1};

using test::usage_error;

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::unique_ptr<optim::Optimizer> sgd(nn::Module& m) { return std::make_unique<optim::SGD>(m, optim::SGD::Options{}); }

// A small run on cpu:0: `model`, a batch of `batch`, `steps` steps, logging off.
TrainConfig small_run(const std::string& model, int64_t batch, int64_t steps) {
  TrainConfig c;
  c.model = model;
  c.devices = {kCpu0};
  c.batch = batch;
  c.steps = steps;
  c.log_every = 1000;
  return c;
}

// A data set of the program's: 3 features, class labels as given (not checked up front).
class LabelRows : public data::Dataset {
 public:
  explicit LabelRows(std::vector<int32_t> labels) : labels_(std::move(labels)) {}
  int64_t rows() const override { return static_cast<int64_t>(labels_.size()); }
  Shape input_shape() const override { return {3}; }
  bool has_targets() const override { return true; }
  data::Task task() const override { return data::Task::classification; }
  Shape target_shape() const override { return {}; }
  std::string inputs_name() const override { return "rows: x"; }
  std::string targets_name() const override { return "rows: y"; }
  void gather_host(std::span<const int64_t> rows, const data::HostRows& into) const override {
    for (size_t i = 0; i < rows.size(); ++i) {
      const auto r = static_cast<size_t>(rows[i]);
      if (into.x)
        for (int j = 0; j < 3; ++j) into.x[i * 3 + static_cast<size_t>(j)] = static_cast<float>(r + j) * 0.1f;
      if (into.labels) into.labels[i] = labels_[r];
    }
  }

 private:
  std::vector<int32_t> labels_;
};
}  // namespace

TEST_CASE("a class label outside the model's classes is refused, never read out of bounds", "[api]") {
  // The CPU kernel read logits[label] (a heap overflow for -1); now NaN, as on a GPU.
  const Tensor logits = Tensor::zeros({2, 3}, DType::f32, kCpu0);
  for (int32_t bad : {-1, 3, -100000}) {
    INFO(bad);
    CHECK(std::isnan(cross_entropy(logits, Tensor::from_host_i32({bad, 0}, {2}, kCpu0)).item()));
  }
  CHECK(std::isfinite(cross_entropy(logits, Tensor::from_host_i32({2, 0}, {2}, kCpu0)).item()));
  CHECK_THROWS_AS(cross_entropy(Tensor::zeros({2, 0}, DType::f32, kCpu0), Tensor::zeros({2}, DType::i32, kCpu0)),
                  Error);

  // A data set of the program's is not read whole up front: its gathers check the labels
  // against the classes of the model it was checked for.
  TrainConfig c = small_run("3-8-3", 4, 3);
  c.task = data::Task::classification;
  CHECK(usage_error([&] {
          Trainer(c, std::make_shared<LabelRows>(std::vector<int32_t>{0, 1, 2, 7, 0, 1})).run();
        }) == "rows: y[3] is 7, outside [0, 3): the model has 3 classes");
  CHECK(has(usage_error([&] {
              Trainer(c, std::make_shared<LabelRows>(std::vector<int32_t>{0, -1, 2, 1})).run();
            }),
            "rows: y[1] is -1, outside [0, 3)"));
  CHECK(Trainer(c, std::make_shared<LabelRows>(std::vector<int32_t>{0, 1, 2, 1, 0, 2})).run().steps == 3);
}

TEST_CASE("views, rows and optimizer ranges are bounds-checked without a sum that overflows", "[api]") {
  const Tensor x = Tensor::full({4}, 1.0f, kCpu0);
  CHECK(has(usage_error([&] { x.view(INT64_MAX, {2}); }), "outside [4]"));
  CHECK(has(usage_error([&] { x.view(INT64_MAX - 1, {3}); }), "outside [4]"));
  CHECK(has(usage_error([&] { x.view(-1, {2}); }), "outside [4]"));
  CHECK(x.view(2, {2}).to_host() == std::vector<float>{1.0f, 1.0f});
  const Tensor m = x.reshape({2, 2});
  CHECK(has(usage_error([&] { m.rows(INT64_MAX, 2); }), "outside [2, 2]"));
  CHECK(has(usage_error([&] { m.rows(1, INT64_MAX); }), "outside [2, 2]"));
  CHECK(m.rows(1, 1).numel() == 2);
  // A negative size whose product is positive is no shape.
  CHECK(has(usage_error([&] { x.reshape({-2, -2}); }), "has a negative size"));
  CHECK(has(usage_error([&] { Tensor::zeros({-2, -3}, DType::f32, kCpu0); }), "has a negative size"));

  auto net = nn::mlp("2-3");
  net->to(kCpu0, 1);
  optim::SGD opt(*net, {});
  CHECK(has(usage_error([&] { opt.step_part(INT64_MAX, 5, true); }), "are outside the"));
  CHECK(has(usage_error([&] { opt.step_part(0, INT64_MAX, true); }), "are outside the"));
}

TEST_CASE("a CNN spec or model spec built by hand is checked before it is read", "[api]") {
  nn::CnnSpec s;
  s.input = {3, 8, 8};
  s.layers.push_back({nn::CnnSpec::Kind::conv, 4, 3, 1, 1, 1, {4, 8, 8}});  // a conv last: read past the end
  s.classes = 4;
  CHECK(has(usage_error([&] { nn::cnn(s); }), "layers that end in a linear one"));
  s.layers.push_back({nn::CnnSpec::Kind::linear, 4, 0, 1, 0, 1, {4}});
  CHECK(nn::cnn(s)->parameters().size() == 4);
  CHECK(has(usage_error([&] { nn::ModelSpec{}.outputs(); }), "ModelSpec: no layers"));
  CHECK(has(usage_error([&] { nn::ModelSpec{}.input_shape(); }), "ModelSpec: no input shape"));
  CHECK(nn::parse_model_spec("seed").outputs() == 1000);
}

TEST_CASE("modules are placed once, and a module holds no null child, nor itself", "[api]") {
  auto s = std::make_shared<nn::Sequential>();
  CHECK(has(usage_error([&] { s->add(nullptr); }), "no module (a null pointer)"));
  CHECK(has(usage_error([&] { s->add(s); }), "or holds this one"));
  auto leaf = std::make_shared<nn::Linear>(2, 2);
  s->add(leaf);
  CHECK(has(usage_error([&] { s->add(leaf); }), "belongs to a model already"));
  auto outer = std::make_shared<nn::Sequential>();
  outer->add(s);
  CHECK(has(usage_error([&] { s->add(outer); }), "or holds this one"));
  // A module in another branch of the same model was bound, and trained, twice.
  auto other = std::make_shared<nn::Sequential>();
  outer->add(other);
  CHECK(has(usage_error([&] { other->add(leaf); }), "belongs to a model already"));
  outer->to(kCpu0, 1);
  // Placing again left an optimizer built on the old buffers updating those, in silence.
  optim::SGD opt(*outer, {.lr = 0.1f});
  CHECK(has(usage_error([&] { outer->to(kCpu1, 1); }), "the module is on cpu:0 already"));
  CHECK(has(usage_error([&] { outer->to(kCpu0, 2); }), "a module is placed once"));
  auto placed = nn::mlp("2-2");
  placed->to(kCpu0, 1);
  CHECK(has(usage_error([&] { std::make_shared<nn::Sequential>()->add(placed); }), "on a device already"));
}

TEST_CASE("DataParallel refuses a factory or source that would break it, and bad indices", "[api]") {
  auto model = [] {
    auto m = nn::mlp("3-4-2");
    m->to(kCpu0, 1);
    return std::shared_ptr<nn::Module>(m);
  };
  const std::vector<Device> two{kCpu0, kCpu1};
  // A null optimizer trained nothing and then crashed at optimizer(); one bound to another
  // module trained that one.
  CHECK(usage_error([&] {
          DataParallel(model(), two, [](nn::Module&) { return std::unique_ptr<optim::Optimizer>(); });
        }) == "DataParallel: the optimizer factory returned no optimizer");
  CHECK(usage_error([&] { DataParallel(model(), two, OptimizerFactory()); }) ==
        "DataParallel: an empty optimizer factory");
  auto other = nn::mlp("3-4-2");
  other->to(kCpu0, 2);
  CHECK(has(usage_error([&] {
              DataParallel(model(), two,
                           [&](nn::Module&) { return std::make_unique<optim::SGD>(*other, optim::SGD::Options{}); });
            }),
            "updates a module other than the one given"));
  CHECK(has(usage_error([&] { DataParallel(model(), std::vector<Device>(kMaxDevices + 1, kCpu0), sgd); }),
            "1 to 1024 devices"));
  CHECK(has(usage_error([&] { check_device({DeviceType::cpu, -1}); }), "an index is at least 0"));

  const std::shared_ptr<nn::Module> master = model();
  DataParallel dp(master, two, sgd);
  // A second DataParallel over the same model stepped the master from its own replicas.
  CHECK(has(usage_error([&] { DataParallel(master, {kCpu0}, sgd); }), "trained by another DataParallel already"));
  CHECK(usage_error([&] { dp.device(5); }) == "DataParallel::device(5): there are 2 replicas");
  CHECK(usage_error([&] { dp.replica(2); }) == "DataParallel::replica(2): there are 2 replicas");
  CHECK(dp.device(1) == kCpu1);

  const nn::MSELoss mse;
  const LossFn loss = [&](const Tensor& y, const Tensor& t) { return mse(y, t); };
  const data::Synthetic synth({.task = data::Task::regression, .in = 3, .out = 2, .seed = 1}, kCpu0);
  // The first step of batch 0 named ShardPlan::micro; later ones said what was wrong.
  CHECK(usage_error([&] { dp.train_step(0, 0, ShardSource(), loss); }) ==
        "a batch must hold at least one sample, got 0");
  CHECK(usage_error([&] { dp.train_step(0, 4, ShardSource(), loss); }).find("an empty ShardSource") !=
        std::string::npos);
  // A source that gives other rows than asked was weighted by the plan's share all the same.
  const ShardSource one_row = [&](size_t r, int64_t first, int64_t) { return synth.batch(first, 1, dp.device(r)); };
  CHECK(has(usage_error([&] { dp.train_step(0, 4, one_row, loss); }), "for 2 rows from sample"));
  const ShardSource right = [&](size_t r, int64_t first, int64_t n) { return synth.batch(first, n, dp.device(r)); };
  CHECK(std::isfinite(dp.train_step(0, 4, right, loss).value()));
  // A program's loss function that is empty or gives no scalar is the program's mistake.
  CHECK(usage_error([&] { dp.train_step(0, 4, right, LossFn()); }) == "train_step: an empty LossFn");
  const LossFn not_scalar = [](const Tensor& y, const Tensor&) { return y; };
  CHECK(has(usage_error([&] { dp.train_step(0, 4, right, not_scalar); }), "backward() from a number needs a scalar"));

  // A StepLoss read after its DataParallel is gone waited on freed memory.
  StepLoss kept;
  {
    DataParallel gone(model(), two, sgd);
    kept = gone.train_step(0, 4, right, loss);
  }
  CHECK(has(usage_error([&] { kept.value(); }), "the DataParallel that made it is gone"));
  StepLoss odd;
  odd.losses = {Tensor::zeros({1}, DType::f32, kCpu0)};
  CHECK(has(usage_error([&] { odd.value(); }), "1 losses and 0 weights"));
}

TEST_CASE("a moved-from ArrayDataset says so instead of crashing", "[api]") {
  std::vector<float> x(6, 1.0f), y(2, 0.0f);
  data::ArrayDataset d(data::Array{x.data(), data::ArrayDType::f32, {2, 3}},
                       data::Array{y.data(), data::ArrayDType::f32, {2, 1}});
  data::ArrayDataset taken = std::move(d);
  CHECK(taken.batch(0, 2, kCpu0).x.numel() == 6);
  CHECK(has(usage_error([&] { d.batch(0, 2, kCpu0); }),
            "without its arrays (it was moved from)"));  // NOLINT(bugprone-use-after-move)
}

TEST_CASE("a message handler may call the library: no deadlock, its own messages dropped", "[api]") {
  int calls = 0;
  set_message_handler([&](Severity, const std::string&) {
    ++calls;
    report(Severity::note, "from inside the handler");  // deadlocked on the handler's lock
  });
  report(Severity::warning, "one");
  CHECK(calls == 1);
  // A handler that replaces itself.
  std::string last;
  set_message_handler([&](Severity, const std::string& m) {
    set_message_handler([&](Severity, const std::string& n) { last = "second: " + n; });
    last = "first: " + m;
  });
  report(Severity::note, "a");
  CHECK(last == "first: a");
  report(Severity::note, "b");
  CHECK(last == "second: b");
  set_message_handler({});
}

TEST_CASE("optimizer, schedule, clipping, batch norm and synthetic options are checked where they are given", "[api]") {
  auto net = nn::mlp("2-3");
  net->to(kCpu0, 1);
  // Each of these ran: NaN parameters after one step, or clipping off, in silence.
  CHECK(usage_error([&] { optim::SGD(*net, {.lr = NAN}); }) == "SGD::Options::lr must be a positive number, got nan");
  CHECK(has(usage_error([&] { optim::SGD(*net, {.lr = -1.0f}); }), "SGD::Options::lr must be a positive number"));
  CHECK(has(usage_error([&] { optim::SGD(*net, {.momentum = 1.0f}); }), "SGD::Options::momentum must be in [0, 1)"));
  CHECK(has(usage_error([&] { optim::SGD(*net, {.weight_decay = INFINITY}); }), "SGD::Options::weight_decay must be"));
  CHECK(has(usage_error([&] { optim::AdamW(*net, {.beta1 = 1.0f}); }), "AdamW::Options::beta1 must be in [0, 1)"));
  CHECK(has(usage_error([&] { optim::AdamW(*net, {.beta2 = -0.5f}); }), "AdamW::Options::beta2 must be in [0, 1)"));
  CHECK(has(usage_error([&] { optim::AdamW(*net, {.eps = 0.0f}); }), "AdamW::Options::eps must be a positive number"));
  optim::SGD opt(*net, {.lr = 0.1f});
  CHECK(has(usage_error([&] { opt.set_schedule({optim::Schedule::Kind::constant, NAN, 0, 1}); }), "Schedule::base_lr"));
  CHECK(has(usage_error([&] { opt.set_schedule({optim::Schedule::Kind::warmup, 0.1f, -1, 10}); }), "Schedule::warmup"));
  CHECK(has(usage_error([&] { opt.checked_step(NAN); }), "checked_step: max_norm must be"));
  CHECK(has(usage_error([&] { opt.step(Tensor::zeros({5}, DType::f32, kCpu0)); }),
            "grad_scale must be one f32 on cpu:0"));
  CHECK(has(usage_error([&] { opt.step(Tensor::zeros({1}, DType::f32, kCpu1)); }),
            "grad_scale must be one f32 on cpu:0"));
  opt.step(Tensor::full({1}, 1.0f, kCpu0));
  auto m = nn::mlp("3-2");
  m->to(kCpu0, 1);
  CHECK(has(usage_error([&] { DataParallel(std::shared_ptr<nn::Module>(m), {kCpu0}, sgd, {.clip = NAN}); }),
            "DataParallelOptions::clip must be a finite number >= 0"));
  DataParallelOptions odd;
  odd.precision = static_cast<Precision>(77);  // ran as fp32
  CHECK(usage_error([&] { DataParallel(std::shared_ptr<nn::Module>(m), {kCpu0}, sgd, odd); }) ==
        "DataParallelOptions::precision holds no value of its enum (77)");
  CHECK(has(usage_error([&] { nn::BatchNorm2d(4, Act::none, {.eps = 0.0f}); }), "BatchNormArgs: eps must be"));
  CHECK(has(usage_error([&] { data::Synthetic({.in = 3, .out = 2, .noise = NAN}, kCpu0); }), "SyntheticConfig::noise"));
  CHECK(has(usage_error([&] { data::random_labels(4, 0, 1, 0, 0, kCpu0); }), "random_labels: a count >= 0 and 1 to"));
}

TEST_CASE("Trainer::step runs the steps in order, none past the last", "[api]") {
  const TrainConfig c = small_run("4-8-2", 8, 2);
  Trainer t(c);
  // step(100) of 2 counted 101 steps done, and run() then reported a loss of 0.
  CHECK(usage_error([&] { t.step(1); }) == "Trainer::step(1): the steps run in order, the next is 0");
  CHECK(usage_error([&] { t.step(-1); }) == "Trainer::step(-1): the steps run in order, the next is 0");
  t.step(0);
  t.step(1);
  CHECK(usage_error([&] { t.step(2); }) == "Trainer::step(2): the steps run in order, and all 2 are done");
  const TrainResult r = t.run();
  CHECK(r.steps == 0);
  CHECK(std::isnan(r.first_loss));
  CHECK(std::isnan(r.final_loss));
}

TEST_CASE("what a program hands the ops is a UsageError without a source path; sizes beyond memory are out of memory",
          "[api]") {
  const Tensor y = Tensor::zeros({4, 3}, DType::f32, kCpu0);
  CHECK(usage_error([&] {
          mse_loss(y, Tensor::zeros({4, 2}, DType::f32, kCpu0));
        }) == "mse_loss: prediction [4, 3] and target [4, 2]");
  CHECK(has(usage_error([&] { matmul(y, y); }), "gemm: shapes [4, 3] x [4, 3] -> [4, 3] do not match"));
  CHECK(has(usage_error([&] { y.i32(); }), "expected an i32 tensor, got f32"));
  CHECK(has(usage_error([&] { mse_loss(y, Tensor::zeros({4, 3}, DType::f32, kCpu1)); }), "cpu:1"));

  // These threw std::length_error, or wrapped a byte count to 0 and returned no data.
  std::vector<int64_t> out;
  CHECK_THROWS_AS(data::epoch_permutation(int64_t{1} << 62, 1, 0, out), OutOfMemory);
  for (int shift : {61, 62})
    CHECK(has(usage_error([&] { ckpt::make_tensor(ckpt::DType::f32, {int64_t{1} << shift}, nullptr); }),
              "holds more bytes than an array can"));
  CHECK_THROWS_AS(data::Synthetic({.in = int64_t{1} << 40, .out = 2, .teacher_hidden = int64_t{1} << 30}, kCpu0),
                  OutOfMemory);
  const data::Synthetic endless({.in = 3, .out = 2}, kCpu0);
  CHECK(has(usage_error([&] { endless.batch(INT64_MAX, 2, kCpu0); }), "Synthetic::batch: 2 rows from row"));

  Trainer t(small_run("4-8-2", 8, 1));
  CHECK(usage_error([&] { t.save(""); }) == "Trainer::save: an empty path");
  CHECK_THROWS_WITH(t.save("no/such/folder/ck.safetensors"), dpt_test::contains("does not exist"));
}

TEST_CASE(
    "Inference and the trainer refuse a data set of no rows; inference checks a checkpoint before placing its model",
    "[api]") {
  TrainConfig c = small_run("3-8-3", 4, 1);
  c.task = data::Task::classification;
  CHECK(usage_error([&] { Trainer(c, std::make_shared<LabelRows>(std::vector<int32_t>{})); }) ==
        "rows: x has 0 rows: a data set needs at least one");
  const std::string path =
      (std::filesystem::temp_directory_path() / ("dpt_api_misuse_" + std::to_string(::getpid()) + ".safetensors"))
          .string();
  c.save = path;
  Trainer(c, std::make_shared<LabelRows>(std::vector<int32_t>{0, 1, 2, 1})).run();
  Inference inf({.checkpoint = path, .devices = {kCpu0}});
  CHECK(has(usage_error([&] { inf.predict(data::Synthetic({.in = 3, .out = 3}, kCpu0)); }), "has 0 rows"));
  // A checkpoint whose metadata names a huge model built it (8 GB for 16-32768x3-4) before
  // its tensors were compared.
  ckpt::Checkpoint k = ckpt::load(path);
  k.metadata["model"] = "3-1048576x100-3";
  ckpt::save(path, k);
  CHECK(has(usage_error([&] { Inference({.checkpoint = path, .devices = {kCpu0}}); }),
            "tensor '0.weight' has shape [8, 3], the model needs [1048576, 3]"));
  k.metadata["model"] = "3-8-3";
  k.metadata["act"] = "sigmoid";
  ckpt::save(path, k);
  CHECK(has(usage_error([&] { Inference({.checkpoint = path, .devices = {kCpu0}}); }),
            "': its metadata's act: unknown activation 'sigmoid'"));
  std::filesystem::remove(path);
  CHECK_THROWS_WITH(ckpt::save("", k), dpt_test::contains("an empty path"));
}

TEST_CASE("a checkpoint whose metadata contradicts its tensors says so", "[api]") {
  TrainConfig c = small_run("4-8-2", 8, 2);
  c.momentum = 0.9f;
  const std::string path =
      (std::filesystem::temp_directory_path() / ("dpt_api_momentum_" + std::to_string(::getpid()) + ".safetensors"))
          .string();
  c.save = path;
  Trainer(c).run();
  ckpt::Checkpoint k = ckpt::load(path);
  k.metadata["momentum"] = "0";  // yet the file holds the momentum buffer
  ckpt::save(path, k);
  c.steps = 4;
  c.save.clear();
  c.resume = path;
  // This was "a tensor 'optimizer.momentum_buffer' that this model and optimizer do not have".
  CHECK(has(usage_error([&] { Trainer t(c); }), "says momentum '0' in its metadata, yet holds a momentum buffer"));
  std::filesystem::remove(path);
}

namespace {
// The program's own error, from its data set.
struct DiskGone : std::runtime_error {
  DiskGone() : std::runtime_error("the disk is gone") {}
};
// LabelRows whose gathers fail from the `fail_from`-th on (counting from 0).
class FailingRows : public LabelRows {
 public:
  FailingRows(std::vector<int32_t> labels, int fail_from) : LabelRows(std::move(labels)), left_(fail_from) {}
  void gather_host(std::span<const int64_t> rows, const data::HostRows& into) const override {
    if (left_.fetch_sub(1) <= 0) throw DiskGone();  // the replicas' threads gather at once
    LabelRows::gather_host(rows, into);
  }

 private:
  mutable std::atomic<int> left_;
};
}  // namespace

TEST_CASE("a data set's own exception reaches the program unchanged: training, validation and inference", "[api]") {
  TrainConfig c = small_run("3-8-3", 4, 3);
  c.task = data::Task::classification;
  const std::vector<int32_t> labels{0, 1, 2, 1, 0, 2, 1, 0};
  CHECK_THROWS_AS(Trainer(c, std::make_shared<FailingRows>(labels, 1)).run(), DiskGone);
  c.eval_every = 2;
  CHECK_THROWS_AS(Trainer(c, std::make_shared<LabelRows>(labels), std::make_shared<FailingRows>(labels, 0)).run(),
                  DiskGone);
  c.devices = {kCpu0, kCpu1};  // one replica's gather fails, the other's not
  CHECK_THROWS_AS(Trainer(c, std::make_shared<LabelRows>(labels), std::make_shared<FailingRows>(labels, 1)).run(),
                  DiskGone);
  const std::string path =
      (std::filesystem::temp_directory_path() / ("dpt_api_disk_" + std::to_string(::getpid()) + ".safetensors"))
          .string();
  c.save = path;
  c.eval_every = 0;
  Trainer(c, std::make_shared<LabelRows>(labels)).run();
  InferenceConfig ic;
  ic.checkpoint = path;
  ic.devices = {kCpu0, kCpu1};
  ic.batch = 2;
  Inference inf(ic);
  CHECK_THROWS_AS(inf.predict(FailingRows(labels, 1)), DiskGone);
  CHECK_THROWS_AS(inf.evaluate(FailingRows(labels, 0)), DiskGone);
  std::filesystem::remove(path);
}
