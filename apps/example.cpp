// A program that embeds dptrain, two ways: (1) its own loop: build an MLP, make synthetic
// regression data, train a few steps with SGD on the first device there is; (2) the
// Trainer on arrays the program made itself (a data set over them, not copied), with
// validation rows, on every device there is. Built by the tests as a separate CMake
// project against the installed package:
//   find_package(dptrain) + target_link_libraries(app dptrain::dptrain)
#include <cmath>
#include <cstdio>
#include <exception>
#include <memory>
#include <vector>

#include <dptrain/dptrain.hpp>

// (1) The library's parts in a loop of one's own.
bool own_loop() {
  const dpt::Device device = dpt::default_devices().front();
  auto model = dpt::nn::mlp("16-64x2-4", dpt::Act::relu);
  model->to(device, /*seed=*/1);
  dpt::optim::SGD opt(*model, {.lr = 0.05f, .momentum = 0.9f});
  dpt::data::Synthetic data({.task = dpt::data::Task::regression, .in = 16, .out = 4, .seed = 1}, device);

  float first = 0.0f, last = 0.0f;
  for (int64_t step = 0; step < 100; ++step) {
    dpt::data::Batch batch = data.batch(step * 128, 128);  // a function of (seed, indices)
    model->zero_grad();
    dpt::Tensor loss = dpt::nn::MSELoss()(model->forward(batch.x), batch.y);
    loss.backward();
    opt.step();
    if (step == 0) first = loss.item();
    if (step == 99) last = loss.item();
  }
  std::printf("example on %s: loss %.4f -> %.4f\n", device.str().c_str(), first, last);
  return last < first;
}

// (2) The Trainer on the program's own arrays: 2000 rows of 8 features, labelled by which
// of three directions each is closest to; the last 200 rows validate.
bool trainer_on_arrays() {
  const int64_t rows = 2000, features = 8;
  std::vector<float> x(static_cast<size_t>(rows * features));
  std::vector<int32_t> labels(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    float score[3] = {0, 0, 0};
    for (int64_t f = 0; f < features; ++f) {
      const float v = std::sin(0.7f * static_cast<float>(r * features + f) + 0.3f * static_cast<float>(f));
      x[static_cast<size_t>(r * features + f)] = v;
      for (int k = 0; k < 3; ++k) score[k] += v * std::cos(static_cast<float>(k * features + f));
    }
    labels[static_cast<size_t>(r)] =
        score[0] > score[1] ? (score[0] > score[2] ? 0 : 2) : (score[1] > score[2] ? 1 : 2);
  }
  const dpt::data::ArrayDataset all({x.data(), dpt::data::ArrayDType::f32, {rows, features}},
                                    {labels.data(), dpt::data::ArrayDType::i32, {rows}});
  const dpt::data::DataSplit split = all.split(0.1);  // the last 10% of the rows validate
  dpt::TrainConfig cfg;
  cfg.model = "8-64-3";
  cfg.epochs = 20;
  cfg.batch = 100;
  cfg.log_every = 1000;
  dpt::Trainer trainer(cfg, std::make_shared<dpt::data::ArrayDataset>(split.train),
                       std::make_shared<dpt::data::ArrayDataset>(*split.val));
  const dpt::TrainResult r = trainer.run();
  std::printf("example Trainer on %zu device(s): loss %.4f -> %.4f, validation accuracy %.1f%% over %lld rows\n",
              trainer.config().devices.size(), r.first_loss, r.final_loss, 100.0 * r.val.accuracy,
              static_cast<long long>(r.val.rows));
  return r.final_loss < r.first_loss && r.val.accuracy > 0.6;
}

int main() try {
  const bool ok = own_loop() && trainer_on_arrays();
  return ok ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "example: error: %s\n", e.what());
  return 1;
}
