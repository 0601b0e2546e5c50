#include <dptrain/runtime/autograd.hpp>

#include <atomic>
#include <utility>

#include <dptrain/error.hpp>
#include <dptrain/runtime/ops.hpp>

namespace dpt {

namespace {
thread_local bool t_grad_enabled = true;

// A tensor of t's own: t, or a copy where another tensor holds t's memory too.
Tensor own(const Tensor& t) {
  if (!t.storage_shared()) return t;
  Tensor c = Tensor::empty(t.shape(), t.dtype(), t.device());
  copy_cast(c, t);
  return c;
}

// Adds g to slot, or makes g the slot's value when it is empty (a copy where g's memory is
// shared: the slot is added into in place later).
void accumulate(Tensor& slot, const Tensor& g) {
  if (!slot.defined()) slot = own(g);
  else axpy_(1.0f, g, slot);
}

// The same for a node's pending gradient, which may share its memory with another node's
// (one gradient handed to several inputs): then the sum goes to a new tensor.
// A second gradient drops the column sums of the first (Grads::put's).
void accumulate_pending(Node& node, const Tensor& g) {
  Tensor& slot = node.pending;
  if (!slot.defined()) {
    slot = g;  // shared or not: whoever adds into it checks
    return;
  }
  node.pending_sums = ColumnSums();
  if (slot.storage_shared()) slot = own(slot);
  axpy_(1.0f, g, slot);
}

// The same for a leaf's gradient `slot`, which overwrites what zero_grad() left stale.
void add_to_leaf(Tensor& leaf, Tensor& slot, const Tensor& g) {
  if (slot.defined() && leaf.grad_stale()) {
    copy_cast(slot, g);
    leaf.set_grad_stale(false);
  } else {
    accumulate(slot, g);
  }
}
}  // namespace

bool grad_enabled() { return t_grad_enabled; }
NoGradGuard::NoGradGuard() : prev_(t_grad_enabled) { t_grad_enabled = false; }
NoGradGuard::~NoGradGuard() { t_grad_enabled = prev_; }

bool any_requires_grad(std::initializer_list<const Tensor*> ts) {
  if (!t_grad_enabled) return false;
  for (const Tensor* t : ts)
    if (t->defined() && t->requires_grad()) return true;
  return false;
}

Tensor Grads::accumulator(size_t i) const {
  const Tensor& in = inputs_[i];
  return in.is_leaf() ? in.grad() : Tensor();
}

Tensor Grads::gathered(size_t i) const {
  const Tensor& in = inputs_[i];
  if (in.is_leaf() || !in.requires_grad() || !in.grad_fn()) return Tensor();
  const Tensor& p = in.grad_fn()->pending;
  return p.storage_shared() ? Tensor() : p;
}

void Grads::before_write(size_t i) const {
  const Tensor& in = inputs_[i];
  if (before_write_ && *before_write_ && in.is_leaf() && in.requires_grad()) (*before_write_)(in);
}

void Grads::handed(size_t i) {
  Tensor in = inputs_[i];  // shares the leaf's autograd state
  if (!in.is_leaf() || !in.requires_grad()) return;
  if (out_[i].defined()) {
    Tensor acc = in.grad();
    add_to_leaf(in, acc, out_[i]);
    in.set_grad(acc);
    out_[i] = Tensor();
  }
  handed_.resize(inputs_.size(), 0);
  handed_[i] = 1;
  if (on_done_ && *on_done_) (*on_done_)(in);
}

namespace {
const ColumnSums kNoSums;
}

const ColumnSums& Grads::output_sums() const { return out_sums_ ? *out_sums_ : kNoSums; }

bool Grads::sums_wanted(size_t i) const {
  const Tensor& in = inputs_[i];
  return self_ && !in.is_leaf() && in.requires_grad() && in.grad_fn() && in.grad_fn()->last_consumer == self_ &&
         in.grad_fn()->takes_output_sums();
}

void Grads::put(size_t i, Tensor g, const ColumnSums& sums) {
  // Kept where g will be the whole gradient: nothing gathered before, nothing after.
  if (sums.defined() && sums_wanted(i) && !inputs_[i].grad_fn()->pending.defined())
    inputs_[i].grad_fn()->pending_sums = sums;
  put(i, std::move(g));
}

void Grads::gathered_sums(size_t i, const ColumnSums& sums) {
  if (sums.defined() && sums_wanted(i)) inputs_[i].grad_fn()->pending_sums = sums;
}

bool Grads::stale(size_t i) const { return inputs_[i].is_leaf() && inputs_[i].grad_stale(); }

float Grads::take_beta(size_t i) const {
  if (!stale(i)) return 1.0f;
  Tensor in = inputs_[i];  // shares the leaf's autograd state
  in.set_grad_stale(false);
  return 0.0f;
}

namespace {
// The engine: `seed` is the root's gradient, or undefined when it is the host number
// `host_seed` (then the root's node may take it as a number: Node::backward_scalar).
void backward_from(const Tensor& root, Tensor seed, float host_seed, const LeafHook& on_leaf_done,
                   const LeafHook& before_leaf_write) {
  NoGradGuard no_grad;  // the backward pass records no history of its own
  if (!seed.defined() && root.is_leaf()) seed = Tensor::full(root.shape(), host_seed, root.device());
  if (root.is_leaf()) {
    if (before_leaf_write) before_leaf_write(root);
    Tensor g = root.grad();
    add_to_leaf(const_cast<Tensor&>(root), g, seed);
    const_cast<Tensor&>(root).set_grad(g);
    if (on_leaf_done) on_leaf_done(root);
    return;
  }
  // Reverse topological order: a node runs only after every node that consumes its
  // output has handed it a gradient. The engine's lists keep their memory from pass to
  // pass (a step allocates nothing for them), and a node is marked seen by the pass's
  // number instead of in a set.
  static std::atomic<uint64_t> passes{0};
  const uint64_t pass = passes.fetch_add(1, std::memory_order_relaxed) + 1;
  thread_local bool running = false;
  thread_local std::vector<std::shared_ptr<Node>> order;
  thread_local std::vector<std::pair<std::shared_ptr<Node>, size_t>> stack;
  thread_local std::vector<Tensor> node_grads;  // Grads' slots, a node at a time
  DPT_REQUIRE(!running, "backward() from inside a backward pass (a hook that runs backward)");
  running = true;
  // The lists hold nodes only during the pass: emptying them frees what the nodes saved.
  // A pass that failed leaves no gradient in the nodes it did not reach.
  struct Clear {
    ~Clear() {
      for (const std::shared_ptr<Node>& n : order)
        if (n) {
          n->pending = Tensor();
          n->pending_sums = ColumnSums();
          n->last_consumer = nullptr;
        }
      order.clear();
      stack.clear();
      node_grads.clear();
      running = false;
    }
  } clear_on_exit;
  const std::shared_ptr<Node>& root_node = root.grad_fn();
  auto visit = [&](const std::shared_ptr<Node>& node) {
    node->seen_in_pass = pass;
    stack.emplace_back(node, 0);
  };
  visit(root_node);
  while (!stack.empty()) {
    auto& [node, next] = stack.back();
    DPT_REQUIRE(!node->released, std::string("backward() through part of a graph a second time (") + node->name() +
                                     "): the first backward freed it");
    if (next < node->inputs.size()) {
      const std::shared_ptr<Node>& child = node->inputs[next++].grad_fn();
      if (child && child->seen_in_pass != pass) visit(child);  // may move the stack: `node` is not used after
    } else {
      order.push_back(std::move(node));
      stack.pop_back();
    }
  }
  // Each node's last consumer in the order the nodes run (the column sums' condition).
  for (auto it = order.rbegin(); it != order.rend(); ++it)
    for (const Tensor& in : (*it)->inputs)
      if (in.requires_grad() && in.grad_fn()) in.grad_fn()->last_consumer = it->get();
  root_node->pending = std::move(seed);
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    Node* node = it->get();
    if (!node->pending.defined() && node != root_node.get()) continue;  // no gradient flows through it
    Tensor g = std::move(node->pending);
    const ColumnSums sums = std::exchange(node->pending_sums, {});
    const bool in_turn = node->hands_over_in_turn();
    if (before_leaf_write && !in_turn)
      for (const Tensor& in : node->inputs)
        if (in.is_leaf() && in.requires_grad()) before_leaf_write(in);
    Grads grads(node->inputs, node_grads, &before_leaf_write, &on_leaf_done, node, &sums);
    if (g.defined() && node->overwrites_grad()) g = own(g);  // another node's too: a copy to write into
    if (g.defined()) {
      node->backward(g, grads);
    } else if (!node->backward_scalar(host_seed, grads)) {  // the root, seeded from the host
      Tensor s = Tensor::full(root.shape(), host_seed, root.device());
      node->backward(s, grads);
    }
    for (size_t i = 0; i < node->inputs.size(); ++i) {
      const Tensor& gi = grads.taken(i);
      Tensor& in = node->inputs[i];
      if (!gi.defined() || !in.requires_grad()) continue;
      if (in.is_leaf()) {
        Tensor acc = in.grad();
        add_to_leaf(in, acc, gi);
        in.set_grad(acc);
      } else {
        accumulate_pending(*in.grad_fn(), gi);
      }
    }
    if (on_leaf_done)
      for (size_t i = 0; i < node->inputs.size(); ++i)
        if (const Tensor& in = node->inputs[i]; in.is_leaf() && in.requires_grad() && !grads.was_handed(i))
          on_leaf_done(in);
    // Done with this node: dropping its edges and our reference frees it, and the
    // activations it saved, unless something outside holds its output. So activations
    // go as backward passes them, as in PyTorch, instead of all living to its end.
    node->inputs.clear();
    node->last_consumer = nullptr;  // this pass's, which may be freed before the next
    node->released = true;
    it->reset();
  }
}

}  // namespace

void run_backward(const Tensor& root, Tensor seed, const LeafHook& on_leaf_done, const LeafHook& before_leaf_write) {
  DPT_REQUIRE(root.requires_grad(), "backward() on a tensor that does not require a gradient");
  DPT_REQUIRE(seed.defined() && seed.shape() == root.shape(),
              "backward(): seed " + shape_str(seed.shape()) + " for a tensor of shape " + shape_str(root.shape()));
  backward_from(root, std::move(seed), 0.0f, on_leaf_done, before_leaf_write);
}

void run_backward(const Tensor& root, float seed, const LeafHook& on_leaf_done, const LeafHook& before_leaf_write) {
  DPT_REQUIRE(root.requires_grad(), "backward() on a tensor that does not require a gradient");
  DPT_REQUIRE(root.numel() == 1, "backward() from a number needs a scalar, got shape " + shape_str(root.shape()));
  backward_from(root, Tensor(), seed, on_leaf_done, before_leaf_write);
}

}  // namespace dpt
