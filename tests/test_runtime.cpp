// Devices, the caching allocator, tensors, model specs and modules, synthetic data on the
// CPU; on the GPU, the allocator's steady state and out-of-memory message, a failing CUDA
// call.

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <fstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <dptrain/data/synthetic.hpp>
#include <dptrain/error.hpp>
#include <dptrain/layers/layers.hpp>
#include <dptrain/optim/optim.hpp>
#include <dptrain/runtime/memory.hpp>
#include <dptrain/runtime/ops.hpp>
#include <dptrain/train/trainer.hpp>
#include "kernels/cpu/cpu.hpp"

#if DPT_WITH_CUDA
#include "kernels/cuda/cuda.hpp"
#endif

#include "catch.hpp"
#include "common.hpp"
#include "runtime/allocator.hpp"
#include "train/nonfinite_watch.hpp"
#include "train_common.hpp"

using namespace dpt;
using namespace dpt::test;

#ifndef DPT_GPU_TESTS  // ---- the CPU cases (dpt_tests) ----

TEST_CASE("device strings parse and bad ones are refused with a reason", "[device]") {
  CHECK(parse_device("cpu") == Device{DeviceType::cpu, 0});
  CHECK(parse_device("cpu:3") == Device{DeviceType::cpu, 3});
  CHECK(parse_device("cuda:1") == Device{DeviceType::cuda, 1});
  CHECK(parse_devices("cpu:0,cpu:1,cpu:2").size() == 3);
  for (const char* bad : {"gpu:0", "cuda:", "cpu:-1", "cpu:x", "cuda:0x", ""})
    CHECK_THROWS_AS(parse_device(bad), UsageError);
  CHECK_THROWS_AS(parse_devices("cpu:0,,cpu:1"), UsageError);
  const int gpus = cuda_device_count();
  CHECK_THROWS_AS(check_device({DeviceType::cuda, gpus}), UsageError);  // one past the last GPU
  if (gpus > 0) CHECK_THROWS_AS(parse_devices("cpu:0,cuda:0"), UsageError);
  CHECK(default_devices().size() == static_cast<size_t>(std::max(gpus, 1)));
  // A GPU's PCI location tells GPUs apart (ranks sharing one are refused by it); a CPU
  // device has none.
  CHECK_THROWS_AS(pci_location(Device{DeviceType::cpu, 0}), UsageError);
  if (gpus > 1) CHECK(pci_location({DeviceType::cuda, 0}) != pci_location({DeviceType::cuda, 1}));
}

TEST_CASE("an element type's name parses back to it, and no other name does", "[dtype]") {
  for (const DType t : {DType::f32, DType::bf16, DType::i32}) CHECK(parse_dtype(dtype_name(t)) == t);
  for (const char* other : {"", "F32", "fp32", "float32", "f16", "bf16 "}) CHECK(!parse_dtype(other));
  CHECK(dtype_size(DType::bf16) == 2);
  CHECK(dtype_size(DType::i32) == 4);
}

TEST_CASE("the caching allocator reuses blocks and keeps exact stats", "[allocator]") {
  CachingAllocator a({DeviceType::cpu, 7});
  void* p = a.allocate(1000, nullptr);
  CHECK(a.stats().allocated == 1024);
  CHECK(a.stats().system_allocs == 1);
  a.free(p);
  CHECK(a.stats().allocated == 0);
  CHECK(a.stats().reserved == 1024);
  void* q = a.allocate(900, nullptr);  // same size class: served from the cache
  CHECK(q == p);
  CHECK(a.stats().system_allocs == 1);
  void* r = a.allocate(3 << 20, nullptr);  // large: rounded to 2 MiB
  CHECK(a.stats().allocated == 1024 + (4 << 20));
  CHECK(a.stats().peak_allocated == 1024 + (4 << 20));
  // Blocks of one class are handed out again in the order they were freed.
  void* q2 = a.allocate(1000, nullptr);
  void* q3 = a.allocate(1000, nullptr);
  a.free(q3);
  a.free(q2);
  CHECK(a.allocate(1000, nullptr) == q3);
  CHECK(a.allocate(1000, nullptr) == q2);
  a.free(q2);
  a.free(q3);
  // Many of one class, freed and taken in turns: still the order they were freed in.
  std::vector<void*> many;
  for (int i = 0; i < 9; ++i) many.push_back(a.allocate(100, nullptr));
  for (void* m : many) a.free(m);
  std::vector<void*> again;
  for (int i = 0; i < 5; ++i) again.push_back(a.allocate(100, nullptr));
  a.free(again[0]);  // behind the four still free
  for (int i = 0; i < 5; ++i) again.push_back(a.allocate(100, nullptr));
  std::vector<void*> want(many.begin(), many.begin() + 5);
  want.insert(want.end(), many.begin() + 5, many.end());
  want.push_back(many[0]);
  CHECK(again == want);
  for (size_t i = 1; i < again.size(); ++i) a.free(again[i]);
  CHECK(a.stats().system_allocs == 4 + 9);  // the second round came from the cache
  a.free(q);
  a.free(r);
  a.empty_cache();
  CHECK(a.stats().reserved == 0);
  CHECK(a.stats().system_frees == 4 + 9);
}

TEST_CASE("a recording may take an earlier recording's temporaries, and both hold them", "[allocator][graph]") {
  CachingAllocator a({DeviceType::cpu, 8});
  int s1 = 0, s2 = 0;
  void* rec = &s1;
  void* side = &s2;
  a.begin_capture(rec);
  a.add_capture_stream(side);
  void* t = a.allocate(2000, rec);
  void* t2 = a.allocate(2000, rec);
  void* u = a.allocate(2000, side);
  void* kept = a.allocate(4000, rec);  // the first graph's output: not a temporary
  a.free(t);
  a.free(t2);
  a.free(u);
  CachingAllocator::Capture first = a.end_capture();
  const size_t cls = CachingAllocator::round_size(2000);
  CHECK(first.temporaries[rec].size() == 1);  // one size class
  CHECK(first.temporaries[rec][cls] == std::vector<void*>{t, t2});
  CHECK(first.temporaries[side][cls] == std::vector<void*>{u});
  // Without `reuse` a second recording never gets them.
  a.begin_capture(rec);
  void* fresh = a.allocate(2000, rec);
  CHECK(fresh != t);
  CHECK(fresh != t2);
  a.free(fresh);
  CachingAllocator::Capture other = a.end_capture();
  // With them: each stream takes its own (a stream opened twice is offered them once).
  a.begin_capture(rec, first.temporaries);
  a.add_capture_stream(side);
  a.add_capture_stream(side);
  void* took = a.allocate(2000, rec);
  CHECK((took == t || took == t2));
  void* left = took == t ? t2 : t;  // offered, not taken
  CHECK(a.allocate(2000, side) == u);
  void* side_more = a.allocate(2000, side);
  CHECK(side_more != u);  // u was offered once
  void* big = a.allocate(4000, rec);
  CHECK(big != kept);  // the first graph's live block is not a temporary
  a.free(side_more);
  CachingAllocator::Capture second = a.end_capture();
  CHECK(std::find(second.blocks.begin(), second.blocks.end(), took) != second.blocks.end());
  CHECK(std::find(second.blocks.begin(), second.blocks.end(), left) == second.blocks.end());
  // Its temporaries are what it freed itself; `left` stays the first graph's alone.
  CHECK(second.temporaries[side].size() == 1);
  CHECK(second.temporaries[side][cls] == std::vector<void*>{side_more});
  CHECK(second.temporaries[rec].empty());
  // The first graph released: what only it held returns to the pool, what both hold not.
  a.release(first.blocks);
  void* after = a.allocate(2000, rec);
  CHECK(after == left);
  a.release(second.blocks);
  a.release(other.blocks);
  for (void* p : {kept, after, big, took, u}) a.free(p);
  a.empty_cache();
  CHECK(a.stats().allocated == 0);
  CHECK(a.stats().reserved == 0);  // every block came back
}

TEST_CASE("a recording reuses the blocks it frees and keeps its blocks from everyone else until released",
          "[allocator][graph]") {
  // The logic is the same for every device; a CPU allocator with two "streams" shows it.
  CachingAllocator a({DeviceType::cpu, 8});
  int s1 = 0, s2 = 0;
  void* rec = &s1;
  void* other = &s2;
  void* before = a.allocate(1000, rec);  // live before the recording, freed during it
  void* cached = a.allocate(5000, rec);
  a.free(cached);  // in the stream's pool before the recording
  a.begin_capture(rec);
  void* t1 = a.allocate(2000, rec);
  a.free(t1);
  void* o = a.allocate(2000, other);
  CHECK(o != t1);  // another stream never gets the recording's block
  void* t2 = a.allocate(2000, rec);
  CHECK(t2 == t1);  // the recording reuses what it handed out and freed
  a.free(before);
  void* before2 = a.allocate(1000, rec);
  CHECK(before2 != before);  // live before the recording: the graph's, but recorded kernels may read it
  void* c = a.allocate(5000, rec);
  CHECK(c == cached);                 // the pool's cached block, taken into the graph
  void* out = a.allocate(3000, rec);  // still held by a tensor when the recording ends
  a.free(t2);
  a.free(c);
  const size_t live = a.stats().allocated;
  auto held = a.end_capture().blocks;
  std::sort(held.begin(), held.end());
  std::vector<void*> want{t1, before, before2, cached, out};
  std::sort(want.begin(), want.end());
  CHECK(held == want);  // each once
  // After the recording nothing of the graph's is handed out, even once freed.
  std::vector<void*> live_after;
  live_after.push_back(a.allocate(2000, rec));
  live_after.push_back(a.allocate(5000, rec));
  live_after.push_back(a.allocate(1000, rec));
  CHECK(live_after[0] != t1);
  CHECK(live_after[1] != cached);
  CHECK(live_after[2] != before);
  a.free(out);
  live_after.push_back(a.allocate(3000, rec));
  CHECK(live_after[3] != out);
  CHECK(a.stats().allocated > live);
  // A second recording that frees a block of the first graph's (one the first graph wrote
  // and a tensor held until now) owns it too: it comes back only when both are released.
  a.begin_capture(rec);
  void* g2 = a.allocate(3000, rec);
  CHECK(g2 != out);
  a.free(before2);
  void* x = a.allocate(1000, rec);
  CHECK(x != before2);  // live before this recording: not reused by it
  const auto held2 = a.end_capture().blocks;
  CHECK(std::find(held2.begin(), held2.end(), out) == held2.end());
  CHECK(std::find(held2.begin(), held2.end(), before2) != held2.end());
  // The first graph is gone: its free blocks return to the pool, but not one the second
  // graph holds; a block a tensor still holds returns when freed.
  a.release(held);
  void* again = a.allocate(3000, rec);
  CHECK(again == out);
  void* b3 = a.allocate(1000, rec);
  CHECK(b3 == before);
  a.release(held2);
  void* b4 = a.allocate(1000, rec);
  CHECK(b4 == before2);  // both graphs gone
  for (void* p : {o, again, b3, b4, x, g2}) a.free(p);
  for (void* p : live_after) a.free(p);
  CHECK(a.stats().allocated == 0);
  a.empty_cache();
  CHECK(a.stats().reserved == 0);  // every block came back
}

TEST_CASE("MLP specs parse; malformed ones are refused", "[layers]") {
  CHECK(nn::parse_mlp_spec("1024-4096x3-1024") == std::vector<int64_t>{1024, 4096, 4096, 4096, 1024});
  CHECK(nn::parse_mlp_spec("seed") == std::vector<int64_t>{1000, 1000});
  CHECK(nn::parse_mlp_spec("mlp").size() == 5);
  for (const char* bad : {"", "10", "10-", "-10", "10-x3", "10-0", "a-b", "10-5x0", "10--5", "10-5x"})
    CHECK_THROWS_AS(nn::parse_mlp_spec(bad), UsageError);
  auto m = nn::mlp("8-16x2-4");
  CHECK(m->size() == 3);
  CHECK(m->num_parameters() == 8 * 16 + 16 + 16 * 16 + 16 + 16 * 4 + 4);
}

TEST_CASE("rows of a tensor are a view of its storage", "[tensor]") {
  const Device cpu{DeviceType::cpu, 0};
  std::vector<float> v(24);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i);
  const Tensor t = Tensor::from_host(v, {4, 2, 3}, cpu);
  const Tensor r = t.rows(1, 2);
  CHECK(r.shape() == Shape{2, 2, 3});
  CHECK(r.to_host() == std::vector<float>(v.begin() + 6, v.begin() + 18));
  *r.f32() = -1.0f;  // shares the storage
  CHECK(t.to_host()[6] == -1.0f);
  CHECK(t.rows(4, 0).numel() == 0);
  CHECK_THROWS_AS(t.rows(3, 2), Error);
  CHECK_THROWS_AS(t.rows(-1, 1), Error);
}

TEST_CASE("a shape holds up to kMaxDims extents inline and refuses one more", "[tensor]") {
  Shape s{3, 4};
  CHECK(s.size() == 2);
  CHECK(s == Shape{3, 4});
  CHECK(s != Shape{4, 3});
  CHECK(s != Shape{3});
  s.insert(s.begin(), 2);
  s.push_back(5);
  CHECK(s == Shape{2, 3, 4, 5});
  CHECK(s.front() == 2);
  CHECK(s.back() == 5);
  CHECK(s.at(3) == 5);
  CHECK_THROWS_AS(s.at(4), Error);
  CHECK(numel(s) == 120);
  CHECK(shape_str(s) == "[2, 3, 4, 5]");
  CHECK(Shape(std::vector<int64_t>{7, 8}).vec() == std::vector<int64_t>{7, 8});
  CHECK(shape_str(std::vector<int64_t>{1, 2}) == "[1, 2]");
  Shape full;
  for (size_t i = 0; i < Shape::kMaxDims; ++i) full.push_back(1);
  try {
    full.push_back(2);
    FAIL("a ninth dimension was taken");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("at most 8 dimensions") != std::string::npos);
  }
  CHECK(full.size() == Shape::kMaxDims);
  CHECK_THROWS_AS(Shape({1, 1, 1, 1, 1, 1, 1, 1, 1}), Error);
}

TEST_CASE("a dimension outside a tensor is named in the error", "[tensor]") {
  const Tensor t = Tensor::zeros({2, 3}, DType::f32, {DeviceType::cpu, 0});
  CHECK(t.size(-1) == 3);
  CHECK(t.size(-2) == 2);
  for (int64_t d : {2, -3}) {
    try {
      (void)t.size(d);
      FAIL("dimension " << d << " was given");
    } catch (const Error& e) {
      CHECK(std::string(e.what()) == "dimension " + std::to_string(d) + " of a tensor of shape [2, 3]");
    }
  }
}

TEST_CASE("a module placed on a device takes no more parameters, nor do its children", "[layers]") {
  auto inner = std::make_shared<nn::Sequential>();
  inner->add(std::make_shared<nn::Linear>(4, 4, Act::relu, true));
  auto outer = std::make_shared<nn::Sequential>();
  outer->add(inner);
  outer->to({DeviceType::cpu, 0}, 1);
  CHECK_THROWS_AS(inner->add(std::make_shared<nn::Linear>(4, 4, Act::relu, true)), Error);
  CHECK_THROWS_AS(outer->add(std::make_shared<nn::Linear>(4, 4, Act::relu, true)), Error);
  CHECK(outer->parameters().size() == 2);
}

TEST_CASE("a tensor's autograd state is shared by its copies; detach() and untracked() leave it behind", "[tensor]") {
  const Device cpu{DeviceType::cpu, 0};
  Tensor a = Tensor::zeros({3}, DType::f32, cpu);
  Tensor before = a;  // a handle: it sees what is set through another copy later
  std::vector<Tensor> handles{a};
  handles[0].set_requires_grad(true);
  CHECK(before.requires_grad());
  CHECK(a.requires_grad());
  before.set_grad(Tensor::full({3}, 2.0f, cpu));
  CHECK(a.grad().to_host() == std::vector<float>{2, 2, 2});
  a.set_grad_stale(true);
  CHECK(before.grad_stale());
  // A view, detach() and untracked() share the data, not the autograd state.
  const Tensor v = a.view(1, {2});
  const Tensor d = a.detach();
  Tensor u = a.untracked();
  for (const Tensor* t : {&v, &d, static_cast<const Tensor*>(&u)}) {
    CHECK(!t->requires_grad());
    CHECK(!t->grad().defined());
    CHECK(!t->grad_fn());
  }
  *u.f32() = 5.0f;
  CHECK(a.to_host()[0] == 5.0f);
  u.set_requires_grad(true);  // a state of its own
  CHECK(!d.requires_grad());
  CHECK(a.grad().defined());
}

TEST_CASE("parameters are views into one flat buffer, initialized like torch.nn.Linear", "[layers]") {
  auto m = nn::mlp("8-16-4");
  m->to({DeviceType::cpu, 0}, 3);
  auto params = m->parameters();
  REQUIRE(params.size() == 4);
  const float* base = m->flat_params().f32();
  for (auto* p : params) {
    const float* at = p->value.f32();
    CHECK(at >= base);
    CHECK((at - base) % nn::Module::kAlign == 0);
    CHECK(p->value.grad().defined());
    for (float v : p->value.to_host()) CHECK(std::fabs(v) <= p->init_bound);
  }
  CHECK(params[0]->init_bound == 1.0f / std::sqrt(8.0f));
  // The same seed gives the same weights.
  auto m2 = nn::mlp("8-16-4");
  m2->to({DeviceType::cpu, 1}, 3);
  CHECK(m2->flat_params().to_host() == m->flat_params().to_host());
}

TEST_CASE("synthetic samples are a pure function of (seed, index)", "[data]") {
  const Device cpu{DeviceType::cpu, 0};
  for (auto task : {data::Task::regression, data::Task::classification}) {
    data::Synthetic d({.task = task, .in = 6, .out = 3, .seed = 9}, cpu);
    auto whole = d.batch(10, 8);
    auto part = d.batch(13, 3);
    auto xs = whole.x.to_host(), xp = part.x.to_host();
    CHECK(std::vector<float>(xs.begin() + 3 * 6, xs.begin() + 6 * 6) == xp);
    if (task == data::Task::regression) {
      auto ys = whole.y.to_host(), yp = part.y.to_host();
      CHECK(test::rel_error(std::vector<float>(ys.begin() + 9, ys.begin() + 18), yp) < 1e-6);
    } else {
      auto ys = whole.y.to_host_i32(), yp = part.y.to_host_i32();
      CHECK(std::vector<int32_t>(ys.begin() + 3, ys.begin() + 6) == yp);
    }
  }
  // A finite dataset wraps: sample samples+i is sample i.
  data::Synthetic f({.task = data::Task::regression, .in = 4, .out = 2, .seed = 9, .samples = 5}, cpu);
  CHECK(f.batch(5, 5).x.to_host() == f.batch(0, 5).x.to_host());
  CHECK(f.batch(3, 4).x.to_host() == f.batch(8, 4).x.to_host());
}

TEST_CASE("synthetic rows of several steps at once are the samples each step makes", "[data]") {
  // A replica's part of 4 steps' batches: 3 rows of every batch of 10, from sample 2.
  const Device cpu{DeviceType::cpu, 0};
  for (int64_t samples : {0, 17})  // endless, and a set that wraps within the block
    for (auto task : {data::Task::regression, data::Task::classification}) {
      INFO("samples " << samples << ", " << data::task_name(task));
      data::Synthetic d({.task = task, .in = 8, .out = 3, .seed = 4, .samples = samples}, cpu);
      const data::Batch block = d.rows({2, 3, 10, 0}, 12);
      for (int64_t g = 0; g < 4; ++g) {
        const data::Batch step = d.batch(2 + 10 * g, 3);
        const auto bx = block.x.to_host(), sx = step.x.to_host();
        CHECK(std::vector<float>(bx.begin() + g * 24, bx.begin() + (g + 1) * 24) == sx);
        if (task == data::Task::regression) {
          const auto by = block.y.to_host(), sy = step.y.to_host();
          CHECK(test::rel_error(std::vector<float>(by.begin() + g * 9, by.begin() + (g + 1) * 9), sy) < 1e-6);
        } else {
          const auto by = block.y.to_host_i32(), sy = step.y.to_host_i32();
          CHECK(std::vector<int32_t>(by.begin() + g * 3, by.begin() + (g + 1) * 3) == sy);
        }
      }
    }
}

TEST_CASE("synthetic rows made into given tensors are the same bits, in those tensors", "[data]") {
  // The trainer makes a block of one step straight into a CUDA graph's inputs this way.
  const Device cpu{DeviceType::cpu, 0};
  const std::vector<data::SyntheticConfig> sets = {
      {.task = data::Task::regression, .in = 8, .out = 3, .seed = 4},
      {.task = data::Task::classification, .in = 8, .out = 3, .seed = 4},
      {.task = data::Task::classification, .out = 4, .image = {2, 4, 4}, .seed = 3}};
  for (const data::SyntheticConfig& cfg : sets) {
    INFO(data::task_name(cfg.task) << (cfg.image.empty() ? "" : ", images"));
    data::Synthetic d(cfg, cpu);
    const data::Batch made = d.rows({2, 3, 10, 0}, 6);
    const data::Batch into = d.empty_batch(6, cpu);
    const data::Batch b = d.rows({2, 3, 10, 0}, 6, into);
    CHECK(b.x.data() == into.x.data());
    CHECK(b.y.data() == into.y.data());
    CHECK(b.x.shape() == made.x.shape());
    CHECK(into.x.to_host() == made.x.to_host());
    if (cfg.task == data::Task::regression) CHECK(into.y.to_host() == made.y.to_host());
    else CHECK(into.y.to_host_i32() == made.y.to_host_i32());
    CHECK_THROWS_AS(d.rows({2, 3, 10, 0}, 5, into), Error);  // 6 rows given for 5
    const data::Batch wrong_type{into.x, Tensor::empty(into.y.shape(), DType::bf16, cpu)};
    CHECK_THROWS_AS(d.rows({2, 3, 10, 0}, 6, wrong_type), Error);
  }
}

#else  // ---- CUDA against the CPU (dpt_gpu_tests: where there is a GPU) ----

TEST_CASE("the GPU allocator makes no cudaMalloc after the first training step", "[gpu][allocator]") {
  for (GemmImpl impl : {GemmImpl::cublas, GemmImpl::native}) {
    TrainConfig cfg;
    cfg.model = "64-256x3-16";
    cfg.batch = 512;
    cfg.steps = 30;
    cfg.log_every = 7;
    cfg.parallel.gemm = impl;
    cfg.devices = {gpu};
    Trainer t(cfg);
    check_no_allocs_after_first(t, {gpu});
  }
}

TEST_CASE("out of memory names the device and the sizes and says what to change", "[gpu][allocator][faults]") {
  try {
    Tensor::empty({int64_t(1) << 40}, DType::f32, gpu);  // 4 TiB
    FAIL("no out-of-memory error");
  } catch (const OutOfMemory& e) {
    const std::string msg = e.what();
    INFO(msg);
    CHECK(msg.find("cuda:0") != std::string::npos);
    CHECK(msg.find("4.00 TiB") != std::string::npos);             // the bytes asked
    CHECK(msg.find("use a smaller batch") != std::string::npos);  // what to change, in the runtime's terms
  }
  Tensor ok = Tensor::zeros({1024}, DType::f32, gpu);  // the device still works
  CHECK(ok.to_host()[1023] == 0.0f);
}

TEST_CASE("a failing CUDA call names the call and the device", "[gpu][errors][faults]") {
  Tensor a = Tensor::empty({4}, DType::f32, gpu), b = Tensor::empty({8}, DType::f32, gpu);
  CHECK_THROWS_AS(copy(a, b), Error);  // shape mismatch caught before CUDA
  try {
    check_device({DeviceType::cuda, 99});
    FAIL("cuda:99 accepted");
  } catch (const UsageError& e) {
    CHECK(std::string(e.what()).find("cuda:99") != std::string::npos);
  }
}

#endif  // DPT_GPU_TESTS
