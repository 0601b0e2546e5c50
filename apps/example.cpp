// A program that embeds dptrain: build an MLP, make synthetic regression data, train a
// few steps with SGD on the first device there is, and print the loss. Built by the
// tests as a separate CMake project against the installed package:
//   find_package(dptrain) + target_link_libraries(app dptrain::dptrain)
#include <cstdio>
#include <exception>

#include <dptrain/dptrain.hpp>

int main() try {
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
  return last < first ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "example: error: %s\n", e.what());
  return 1;
}
