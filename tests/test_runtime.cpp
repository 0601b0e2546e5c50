// Devices, the caching allocator, model specs, schedules, synthetic data and training
// on the CPU.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include <dptrain/data/synthetic.hpp>
#include <dptrain/error.hpp>
#include <dptrain/layers/layers.hpp>
#include <dptrain/optim/optim.hpp>
#include <dptrain/runtime/ops.hpp>
#include <dptrain/train/trainer.hpp>
#include "catch.hpp"
#include "common.hpp"
#include "runtime/allocator.hpp"
#include "train/nonfinite_watch.hpp"

using namespace dpt;

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

TEST_CASE("learning-rate schedules", "[optim]") {
  optim::Schedule c{optim::Schedule::Kind::constant, 0.1f, 0, 100};
  CHECK(c.at(0) == 0.1f);
  CHECK(c.at(99) == 0.1f);
  optim::Schedule w{optim::Schedule::Kind::warmup, 0.1f, 10, 100};
  CHECK(std::fabs(w.at(0) - 0.01f) < 1e-7f);
  CHECK(std::fabs(w.at(4) - 0.05f) < 1e-7f);
  CHECK(w.at(50) == 0.1f);
  optim::Schedule k{optim::Schedule::Kind::cosine, 0.1f, 10, 110};
  CHECK(std::fabs(k.at(10) - 0.1f) < 1e-7f);
  CHECK(std::fabs(k.at(60) - 0.05f) < 1e-6f);
  CHECK(k.at(110) < 1e-7f);
  CHECK_THROWS_AS(optim::parse_schedule("linear"), UsageError);
}

TEST_CASE("optimizers follow their schedule from a counter on the device, as the host computes it", "[optim]") {
  // Each step's lr and AdamW's bias corrections come from the step counter that the
  // update reads and moves on, on the device; the same steps taken with host values (the
  // update ops given lr and the corrections of step t) give the same parameters, bit for
  // bit. A resumed count (set_steps_taken) continues the schedule where it was.
  const Device dev{DeviceType::cpu, 9};
  const optim::Schedule sched{optim::Schedule::Kind::cosine, 0.05f, 3, 20};
  auto grads_of = [&](nn::Module& m, int t) {  // a gradient that changes with the step
    std::vector<float> g(static_cast<size_t>(m.flat_grads().numel()));
    for (size_t i = 0; i < g.size(); ++i) g[i] = std::sin(0.37f * static_cast<float>(i) + static_cast<float>(t));
    copy(m.flat_grads(), Tensor::from_host(g, m.flat_grads().shape(), dev));
  };
  for (std::string kind : {"sgd", "adamw"}) {
    INFO(kind);
    auto make = [&] {
      auto m = nn::mlp("6-10-3");
      m->to(dev, 4);
      return m;
    };
    auto a = make(), b = make(), c = make();
    auto opt = [&](nn::Module& m) -> std::unique_ptr<optim::Optimizer> {
      std::unique_ptr<optim::Optimizer> o;
      if (kind == "sgd") o = std::make_unique<optim::SGD>(m, optim::SGD::Options{.lr = 0.05f});
      else o = std::make_unique<optim::AdamW>(m, optim::AdamW::Options{.lr = 0.05f});
      o->set_schedule(sched);
      return o;
    };
    auto oa = opt(*a), oc = opt(*c);
    Tensor m1 = Tensor::zeros(b->flat_params().shape(), DType::f32, dev);
    Tensor v1 = Tensor::zeros(b->flat_params().shape(), DType::f32, dev);
    for (int t = 0; t < 20; ++t) {
      CHECK(oa->lr() == sched.at(t));
      grads_of(*a, t);
      oa->step();
      grads_of(*b, t);
      if (kind == "sgd") {
        sgd_step(b->flat_params(), b->flat_grads(), Tensor(), SgdArgs{.lr = sched.at(t)}, Tensor());
      } else {
        const float bc1 = 1.0f - std::pow(0.9f, static_cast<float>(t + 1));
        const float bc2 = 1.0f - std::pow(0.999f, static_cast<float>(t + 1));
        adamw_step(b->flat_params(), b->flat_grads(), m1, v1,
                   AdamArgs{sched.at(t), 0.9f, 0.999f, 1e-8f, 0.01f, bc1, bc2}, Tensor());
      }
    }
    CHECK(oa->steps_taken() == 20);
    CHECK(a->flat_params().to_host() == b->flat_params().to_host());
    if (kind == "sgd") {  // stateless: a fresh optimizer told the count continues the schedule
      for (int t = 0; t < 12; ++t) {
        grads_of(*c, t);
        oc->step();
      }
      auto resumed = opt(*c);
      resumed->set_steps_taken(12);
      for (int t = 12; t < 20; ++t) {
        grads_of(*c, t);
        resumed->step();
      }
      CHECK(c->flat_params().to_host() == a->flat_params().to_host());
    }
  }
}

TEST_CASE("twin buffers: the alternating update gives checked_step's parameters, state and scales bit for bit",
          "[optim]") {
  // Twin buffers on against off, the same gradients: SGD with Nesterov momentum and
  // weight decay, SGD without momentum (no state), AdamW with a schedule; step 3's
  // gradients not finite (skipped by both). After each step the parameters live in the
  // other copy's memory and every parameter's view follows.
  const Device dev{DeviceType::cpu, 9};
  auto grads_of = [&](nn::Module& m, int t) {
    std::vector<float> g(static_cast<size_t>(m.flat_grads().numel()));
    for (size_t i = 0; i < g.size(); ++i) g[i] = std::sin(0.37f * static_cast<float>(i) + static_cast<float>(t));
    if (t == 3) g[g.size() / 2] = NAN;
    copy(m.flat_grads(), Tensor::from_host(g, m.flat_grads().shape(), dev));
  };
  for (std::string kind : {"sgd momentum", "sgd", "adamw"}) {
    INFO(kind);
    auto make = [&] {
      auto m = nn::mlp("6-10-3");
      m->to(dev, 4);
      return m;
    };
    auto opt = [&](nn::Module& m) -> std::unique_ptr<optim::Optimizer> {
      std::unique_ptr<optim::Optimizer> o;
      if (kind == "adamw") o = std::make_unique<optim::AdamW>(m, optim::AdamW::Options{.lr = 0.05f});
      else if (kind == "sgd") o = std::make_unique<optim::SGD>(m, optim::SGD::Options{.lr = 0.05f});
      else
        o = std::make_unique<optim::SGD>(
            m, optim::SGD::Options{.lr = 0.05f, .momentum = 0.9f, .weight_decay = 0.01f, .nesterov = true});
      o->set_schedule({optim::Schedule::Kind::cosine, 0.05f, 2, 10});
      return o;
    };
    auto a = make(), b = make();
    auto twin = opt(*a), plain = opt(*b);
    twin->set_twin_buffers(true);
    CHECK(twin->twin_buffers());
    CHECK(twin->twin_bytes() == static_cast<int64_t>(a->flat_params().nbytes() * (kind == "sgd"     ? 1
                                                                                  : kind == "adamw" ? 3
                                                                                                    : 2)));
    auto state_of = [](const optim::Optimizer& o) {
      std::vector<float> all;
      for (const auto& [name, t] : o.state()) {
        const auto v = t.to_host();
        all.insert(all.end(), v.begin(), v.end());
      }
      return all;
    };
    for (int t = 0; t < 8; ++t) {
      INFO("step " << t);
      grads_of(*a, t);
      grads_of(*b, t);
      const void* before = a->flat_params().data();
      const float sa = twin->checked_step(0.0f).item(), sb = plain->checked_step(0.0f).item();
      CHECK(std::memcmp(&sa, &sb, sizeof sa) == 0);
      CHECK(std::isnan(sa) == (t == 3));
      CHECK(a->flat_params().data() != before);  // the other copy
      CHECK(a->parameters().front()->value.data() == a->flat_params().data());
      CHECK(a->flat_params().to_host() == b->flat_params().to_host());
      CHECK(state_of(*twin) == state_of(*plain));
    }
    CHECK(twin->steps_taken() == 8);
    // Only checked_step without clipping swaps the copies: the others refuse.
    CHECK_THROWS_AS(twin->step(), UsageError);
    CHECK_THROWS_AS(twin->checked_step(1.0f), UsageError);
    CHECK_THROWS_AS(twin->step_part(0, 4, true), UsageError);
    // A replay moves the device's count and not the host's: telling the host swaps the copies.
    const void* now = a->flat_params().data();
    twin->set_host_steps(9);
    CHECK(a->flat_params().data() != now);
    twin->set_host_steps(8);
    CHECK(a->flat_params().data() == now);
    // A resume to a count of the other parity keeps the values (in the copy that count reads).
    twin->set_steps_taken(11);
    plain->set_steps_taken(11);
    CHECK(a->flat_params().data() != now);
    CHECK(a->flat_params().to_host() == b->flat_params().to_host());
    CHECK(state_of(*twin) == state_of(*plain));
    grads_of(*a, 11);
    grads_of(*b, 11);
    twin->checked_step(0.0f);
    plain->checked_step(0.0f);
    CHECK(a->flat_params().to_host() == b->flat_params().to_host());
    twin->set_twin_buffers(false);
    CHECK(twin->twin_bytes() == 0);
    twin->step();  // in place again
  }
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

TEST_CASE("linear writes into a given output the bits it would allocate", "[ops]") {
  const Device cpu{DeviceType::cpu, 0};
  const Tensor x = test::randn_tensor({5, 7}, 1, cpu);
  const Tensor W = test::randn_tensor({4, 7}, 2, cpu);
  const Tensor b = test::randn_tensor({4}, 3, cpu);
  for (Act act : {Act::none, Act::relu, Act::tanh}) {
    const Tensor out = Tensor::empty({5, 4}, DType::f32, cpu);
    const Tensor y = linear(x, W, b, act, out);
    CHECK(y.data() == out.data());
    CHECK(out.to_host() == linear(x, W, b, act).to_host());
  }
  CHECK_THROWS_AS(linear(x, W, b, Act::none, Tensor::empty({4, 5}, DType::f32, cpu)), Error);
  Tensor w = test::randn_tensor({4, 7}, 2, cpu);
  w.set_requires_grad(true);
  CHECK_THROWS_AS(linear(x, w, b, Act::none, Tensor::empty({5, 4}, DType::f32, cpu)), Error);  // backward would save it
}

TEST_CASE("training on the CPU is deterministic, reduces the loss and allocates only in step 1", "[train]") {
  TrainConfig cfg;
  cfg.model = "16-64x2-4";
  cfg.batch = 64;
  cfg.steps = 150;
  cfg.log_every = 1000;
  const Device dev{DeviceType::cpu, 5};
  cfg.devices = {dev};
  for (auto task : {data::Task::regression, data::Task::classification})
    for (std::string opt : {"sgd", "adamw"}) {
      INFO(data::task_name(task) << " " << opt);
      cfg.task = task;
      cfg.optimizer = opt;
      cfg.lr = opt == "sgd" ? 0.05f : 0.003f;
      Trainer a(cfg);
      a.step(0, /*measure=*/true);  // as a run's first step, which is logged
      const int64_t after_first = allocator(dev).stats().system_allocs;
      const TrainResult r = a.run();
      CHECK(allocator(dev).stats().system_allocs == after_first);
      CHECK(r.final_loss < 0.5f * r.first_loss);
      Trainer b(cfg);
      b.run();
      CHECK(a.model().flat_params().to_host() == b.model().flat_params().to_host());
    }
}

TEST_CASE("the training loop waits for its devices only at log points", "[train][sync]") {
  // stop() is asked before every step: the host's waits between two asks are the step's.
  TrainConfig cfg;
  cfg.model = "16-64x2-4";
  cfg.batch = 48;
  cfg.steps = 40;
  cfg.log_every = 10;
  cfg.parallel.clip = 1.0f;  // the gradient check and the clipping scale, read behind the steps
  struct Case {
    const char* what;
    size_t replicas;
    int accum;
  };
  for (const Case c :
       {Case{"one device", 1, 1}, Case{"3 replicas", 3, 1}, Case{"3 replicas x 2 micro-batches", 3, 2}}) {
    INFO(c.what);
    cfg.devices = std::vector<Device>(c.replicas, Device{DeviceType::cpu, 7});
    cfg.parallel.grad_accum = c.accum;
    Trainer t(cfg);
    std::vector<int64_t> at;
    t.run({}, [&] {
      at.push_back(host_waits());
      return false;
    });
    REQUIRE(at.size() == 40);
    for (size_t s = 0; s + 1 < at.size(); ++s) {
      const int64_t done = static_cast<int64_t>(s) + 1;
      if (s == 0 || done % cfg.log_every == 0) continue;  // logged: the loss is read
      INFO("step " << done);
      CHECK(at[s + 1] - at[s] == 0);
    }
    CHECK(at.back() > at.front());  // the count counts: the log points waited
  }
}

TEST_CASE("a non-finite step is never applied, stops the run within kLag steps, and skip-step counts exactly",
          "[train][sync]") {
  TrainConfig cfg;
  cfg.model = "16-64x2-4";
  cfg.batch = 32;
  cfg.steps = 60;
  cfg.lr = 1e30f;  // the weights overflow within a few steps
  cfg.devices = {{DeviceType::cpu, 8}};
  // Read at every step (every step logged) against read behind the steps.
  auto stopped_at = [&](int64_t log_every, int64_t* steps_done) {
    cfg.log_every = log_every;
    Trainer t(cfg);
    try {
      t.run();
    } catch (const NonFiniteError& e) {
      *steps_done = t.steps_done();
      return std::string(e.what());
    }
    FAIL("the run did not stop");
    return std::string();
  };
  int64_t now_done = 0, late_done = 0;
  const std::string now = stopped_at(1, &now_done), late = stopped_at(1000, &late_done);
  INFO(now << "\n" << late);
  // "step K: the gradient of parameter P is not finite; the update was not applied; run stopped"
  CHECK(now.find("the gradient of parameter ") != std::string::npos);
  CHECK(now.find("run stopped at step") == std::string::npos);
  const int64_t bad = now_done;  // stopped at once, at the bad step
  CHECK(now.rfind("step " + std::to_string(bad) + ": ", 0) == 0);
  CHECK(late.rfind("step " + std::to_string(bad) + ": ", 0) == 0);  // the same step, named
  CHECK(late_done > bad);
  CHECK(late_done <= bad + NonFiniteWatch::kLag);
  CHECK(late.find("run stopped at step " + std::to_string(late_done)) != std::string::npos);
  // A stop writes no checkpoint, and says what there is at TrainConfig::save (it once
  // called a checkpoint that was never written "intact").
  test::TempDir dir;
  cfg.save = dir.file("run.safetensors");
  CHECK(stopped_at(1000, &late_done).find(", no checkpoint was written") != std::string::npos);
  CHECK(dir.entries().empty());
  { std::ofstream(cfg.save) << "an earlier run's"; }
  CHECK(stopped_at(1000, &late_done).find(", the checkpoint '" + cfg.save + "' is left as it was") !=
        std::string::npos);
  cfg.save.clear();
  // skip-step: the same count read at every step, behind the steps, and on 3 replicas.
  cfg.on_nonfinite = "skip-step";
  std::vector<int64_t> skipped;
  for (auto [log_every, replicas] : {std::pair<int64_t, size_t>{1, 1}, {1000, 1}, {7, 3}}) {
    cfg.log_every = log_every;
    cfg.devices = std::vector<Device>(replicas, Device{DeviceType::cpu, 8});
    skipped.push_back(Trainer(cfg).run().skipped);
  }
  CHECK(skipped[0] > 0);
  CHECK(skipped[1] == skipped[0]);
  CHECK(skipped[2] == skipped[0]);
}

TEST_CASE("the default job brings the loss below 10% of its first value", "[train]") {
  TrainConfig cfg;
  cfg.devices = {{DeviceType::cpu, 0}};
  cfg.log_every = 1000;
  const TrainResult r = Trainer(cfg).run();
  CHECK(r.final_loss < 0.1f * r.first_loss);
}

TEST_CASE("bad training configurations are refused", "[train]") {
  auto refused = [](auto change) {
    TrainConfig cfg;
    change(cfg);
    CHECK_THROWS_AS(validate(cfg), UsageError);
  };
  refused([](TrainConfig& c) { c.batch = 0; });
  refused([](TrainConfig& c) { c.batch = -3; });
  refused([](TrainConfig& c) { c.steps = 0; });
  refused([](TrainConfig& c) { c.epochs = 2; });  // without --samples
  refused([](TrainConfig& c) { c.lr = -1; });
  refused([](TrainConfig& c) { c.lr = NAN; });
  refused([](TrainConfig& c) { c.momentum = 1.5f; });
  refused([](TrainConfig& c) { c.optimizer = "lion"; });
  refused([](TrainConfig& c) { c.model = "3"; });
  refused([](TrainConfig& c) {  // the hand-written GEMM is a CUDA kernel
    c.devices = {{DeviceType::cpu, 0}};
    c.parallel.gemm = GemmImpl::native;
  });
  refused([](TrainConfig& c) {
    c.task = data::Task::classification;
    c.model = "4-1";
  });
  TrainConfig e;
  e.epochs = 3;
  e.samples = 1000;
  e.batch = 300;
  validate(e);
  CHECK(e.steps == 10);
}

// The library speaks its own language: an error names the option field and the value, never
// a flag of the CLI (which maps fields to flags itself).
TEST_CASE("configuration errors name the field and the value, not a flag", "[train]") {
  auto message = [](auto&& fn) -> std::string {
    try {
      fn();
    } catch (const UsageError& e) {
      return e.what();
    }
    return "(no error)";
  };
  auto config_error = [&](auto change) {
    TrainConfig cfg;
    change(cfg);
    return message([&] { validate(cfg); });
  };
  CHECK(config_error([](TrainConfig& c) { c.batch = 0; }) == "TrainConfig::batch must be >= 1, got 0");
  CHECK(config_error([](TrainConfig& c) { c.parallel.grad_accum = -2; }) ==
        "DataParallelOptions::grad_accum must be >= 1, got -2");
  // A CUDA graph is refused where it cannot be recorded, saying why: CPU devices, with
  // --ddp or without (ranks on GPUs record their steps, collectives and all).
  for (bool ddp : {false, true}) {
    const std::string e = config_error([&](TrainConfig& c) {
      c.parallel.cuda_graph = true;
      c.ddp = ddp;
      c.devices = {{DeviceType::cpu, 0}};
    });
    CHECK(e == "DataParallelOptions::cuda_graph records steps on GPUs: not on CPU devices (no CUDA there)");
  }
  CHECK(config_error([](TrainConfig& c) { c.parallel.bucket_mb = 0; }) ==
        "DataParallelOptions::bucket_mb must be in (0, 1048576] MiB, got 0");
  CHECK(config_error([](TrainConfig& c) { c.parallel.first_bucket_mb = NAN; }) ==
        "DataParallelOptions::first_bucket_mb must be in (0, 1048576] MiB, got nan");
  CHECK(config_error([](TrainConfig& c) { c.parallel.comm_ctas = 65; }) ==
        "DataParallelOptions::comm_ctas must be in [0, 64] (0: NCCL's choice), got 65");
  CHECK(config_error([](TrainConfig& c) { c.save_every = 5; }) ==
        "TrainConfig::save_every needs TrainConfig::save (a checkpoint path)");
  // NaN is outside every range; products that overflow are refused, not wrapped.
  CHECK(config_error([](TrainConfig& c) { c.momentum = NAN; }) == "TrainConfig::momentum must be in [0, 1), got nan");
  CHECK(config_error([](TrainConfig& c) { c.beta2 = -1; }) == "TrainConfig::beta2 must be in [0, 1), got -1");
  CHECK(config_error([](TrainConfig& c) { c.parallel.clip = INFINITY; }) ==
        "DataParallelOptions::clip must be a finite number >= 0 (0: off), got inf");
  CHECK(config_error([](TrainConfig& c) { c.eps = 0; }) == "TrainConfig::eps must be a positive number, got 0");
  CHECK(config_error([](TrainConfig& c) {
          c.nesterov = true;
          c.momentum = 0;
        }) == "TrainConfig::nesterov needs TrainConfig::momentum > 0, got 0");
  CHECK(config_error([](TrainConfig& c) {
          c.nesterov = true;
          c.optimizer = "adamw";
        }) == "TrainConfig::nesterov is an option of the sgd optimizer; TrainConfig::optimizer is adamw");
  CHECK(config_error([](TrainConfig& c) {
          c.epochs = 99999999999;
          c.samples = 99999999999;
          c.batch = 1;
        }) ==
        "TrainConfig::epochs times TrainConfig::samples is more samples than fit in 64 bits: 99999999999 x "
        "99999999999");
  CHECK(config_error([](TrainConfig& c) { c.save = "/"; }) == "TrainConfig::save '/': names a folder, not a file");
  // Each optimizer has its own default learning rate.
  for (const char* opt : {"sgd", "adamw"}) {
    TrainConfig cfg;
    cfg.optimizer = opt;
    validate(cfg);
    CHECK(*cfg.lr == (std::string(opt) == "sgd" ? 0.05f : 1e-3f));
  }
  CHECK(message([] { ShardPlan(10, 1, 0, 3, 5); }) ==
        "DataParallelOptions::grad_accum must be <= 4, the most samples a replica gets of a batch of 10 over 3 "
        "replica(s), got 5");
  CHECK(message([] { ShardPlan(10, 2, 0, 1, 5); }) == "(no error)");  // 5 + 5: one a micro-batch
  auto model = nn::mlp("4-8-2");
  model->to({DeviceType::cpu, 0}, 1);
  auto sgd = [](nn::Module& m) { return std::make_unique<optim::SGD>(m, optim::SGD::Options{}); };
  DataParallelOptions o;
  o.grad_accum = 0;
  CHECK(message([&] {
          DataParallel(model, {{DeviceType::cpu, 0}}, sgd, o);
        }) == "DataParallelOptions::grad_accum must be >= 1, got 0");
  CHECK(message([&] { optim::SGD(*model, {.momentum = 0.0f, .nesterov = true}); }) ==
        "SGD::Options::nesterov needs SGD::Options::momentum > 0 and dampening 0, got momentum 0 and dampening 0");
  CHECK(message([&] {
          (void)resolve_reduce(Reduce::nccl, {{DeviceType::cpu, 0}});
        }).rfind("DataParallelOptions::reduce nccl", 0) == 0);
}

TEST_CASE("the library reports notes through the handler the program installs, and never prints", "[train]") {
  std::vector<std::pair<Severity, std::string>> seen;
  set_message_handler([&](Severity s, const std::string& m) { seen.emplace_back(s, m); });
  TrainConfig c;
  c.devices = {{DeviceType::cpu, 0}, {DeviceType::cpu, 1}, {DeviceType::cpu, 2}};
  c.batch = 2;  // fewer samples than replicas
  c.steps = 2;
  c.log_every = 1;
  Trainer(c).run();
  set_message_handler({});
  REQUIRE(seen.size() == 1);  // once per run, not once per step
  CHECK(seen[0].first == Severity::note);
  CHECK(seen[0].second == "batch 2 is smaller than the 3 replicas; only 2 of them get samples");
  report(Severity::warning, "with no handler installed this goes nowhere");
}
