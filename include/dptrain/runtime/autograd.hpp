// Reverse-mode autograd: every op that has an input requiring a gradient records a
// Node on a tape (the graph of grad_fn links); backward() visits the nodes in reverse
// topological order and accumulates each gradient where it belongs. Leaf gradients
// that already exist (parameters' views into the flat gradient buffer) are written in
// place, so a GEMM can accumulate straight into them with beta = 1.
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include <dptrain/runtime/tensor.hpp>

namespace dpt {

struct AutogradMeta {
  bool requires_grad = false;
  Tensor grad;
  // The gradient's contents are left from an earlier step: the next write overwrites
  // them (beta 0) instead of adding. Module::zero_grad() sets it instead of zeroing.
  bool grad_stale = false;
  std::shared_ptr<Node> grad_fn;
};

// Called for a leaf input of a node once that node's backward has run: the leaf's
// gradient from that use is then complete (queued). Data parallelism uses it to reduce
// gradient buckets while the rest of backward still runs.
using LeafHook = std::function<void(const Tensor& leaf)>;

// The column sums of a [rows, cols] gradient, made by the node that wrote it while it had
// the rows at hand, for a node downstream in backward whose bias gradient they are (a
// residual projection's, from the LayerNorm backward that finishes the residual stream's
// gradient): stage one of a deterministic column sum, `part` [chunks, cols] f32, each row a
// chunk of rows' sums, added in chunk order by whoever takes them (finish_column_sums).
struct ColumnSums {
  Tensor part;
  bool defined() const { return part.defined(); }
};

// What a node's backward hands back for its inputs.
class Grads {
 public:
  // `slots` holds the gradients handed back (emptied and sized here: the engine lends the
  // same vector to every node, so a pass allocates nothing for them). `self` is the node
  // whose backward this is, `out_sums` its output gradient's column sums where they came
  // with it.
  Grads(const std::vector<Tensor>& inputs, std::vector<Tensor>& slots, const LeafHook* before_write = nullptr,
        const LeafHook* on_done = nullptr, const Node* self = nullptr, const ColumnSums* out_sums = nullptr)
      : inputs_(inputs), out_(slots), before_write_(before_write), on_done_(on_done), self_(self), out_sums_(out_sums) {
    out_.assign(inputs.size(), Tensor());
  }
  // Whether input i needs a gradient at all.
  bool needed(size_t i) const { return inputs_[i].requires_grad(); }
  // The existing gradient of leaf input i, to accumulate into in place (e.g. a GEMM
  // with beta = 1); undefined when there is none, and then put() must be used.
  Tensor accumulator(size_t i) const;
  // Whether that accumulator's contents are stale (see AutogradMeta::grad_stale).
  bool stale(size_t i) const;
  // The beta to write the accumulator with: 0 (overwrite) while stale, else 1 (add).
  // Taking it counts as writing: the caller must then write the whole accumulator.
  float take_beta(size_t i) const;
  // A new gradient for input i; the engine adds it to what is there.
  void put(size_t i, Tensor g) { out_[i] = std::move(g); }
  // The gradient that non-leaf input i has gathered so far from the nodes that ran before
  // (undefined when none, for leaves, and while another node's gradient shares its memory):
  // the engine's own tensor, which a node may add its gradient into in place instead of
  // put()ting it (one pass fewer, e.g. LayerNorm's dx added to the residual stream's
  // gradient in its kernel).
  Tensor gathered(size_t i) const;
  const Tensor& taken(size_t i) const { return out_[i]; }

  // Column sums riding along with gradients (ColumnSums). They reach a node only where one
  // node alone makes its output's gradient (its only consumer, or the last one to run,
  // adding into what the others gathered in place): any other sum of gradients drops them.
  // The column sums of this node's output gradient, where they came with it (else empty).
  const ColumnSums& output_sums() const;
  // Whether making input i's gradient's column sums is worth it: input i's node takes them
  // (Node::takes_output_sums) and this node is the last to hand it a gradient.
  bool sums_wanted(size_t i) const;
  // put() with the column sums of g.
  void put(size_t i, Tensor g, const ColumnSums& sums);
  // This node added its gradient for input i into gathered(i) in place; `sums` are the
  // column sums of the result.
  void gathered_sums(size_t i, const ColumnSums& sums);

  // For a node that writes its inputs' gradients in turn (Node::hands_over_in_turn): call
  // before_write(i) before writing input i's gradient, and handed(i) once it is written
  // (a put() gradient of a leaf is then added to it at once), so that the engine's leaf
  // hooks see each leaf when a node of its own would have shown it.
  void before_write(size_t i) const;
  void handed(size_t i);
  bool was_handed(size_t i) const { return i < handed_.size() && handed_[i] != 0; }
  // Whether something waits before each leaf's write (ZeRO stage 2: a node that can write
  // all its leaves at once should then write them one at a time).
  bool watches_writes() const { return before_write_ && *before_write_; }

 private:
  const std::vector<Tensor>& inputs_;
  std::vector<Tensor>& out_;
  std::vector<char> handed_;  // sized at the first handed(): other nodes never need it
  const LeafHook* before_write_;
  const LeafHook* on_done_;
  const Node* self_;
  const ColumnSums* out_sums_;
};

class Node {
 public:
  virtual ~Node() = default;
  virtual const char* name() const = 0;
  // grad_out belongs to this call alone: a node may overwrite it.
  virtual void backward(Tensor& grad_out, Grads& grads) = 0;
  // The backward of a scalar root whose seed gradient is a number known on the host
  // (1 for loss.backward(), a replica's share of the batch in data parallelism), so the
  // seed never has to be written to the device. False when the node has no such shortcut:
  // the engine then makes the seed tensor and calls backward().
  virtual bool backward_scalar(float seed, Grads& grads) {
    (void)seed;
    (void)grads;
    return false;
  }
  // True for a node made of several ops' backwards (a run of layers) that calls
  // Grads::before_write and Grads::handed for each leaf input as it writes it; the engine
  // then calls the leaf hooks from there instead of around the whole backward.
  virtual bool hands_over_in_turn() const { return false; }
  // Whether backward may write into the gradient it is handed. One node may hand the same
  // tensor to several inputs (the residual add); the engine copies such a shared gradient
  // first for a node that may write into it, and adds into a shared one out of place.
  virtual bool overwrites_grad() const { return true; }
  // Whether backward uses its output gradient's column sums where they come with it
  // (Grads::output_sums): a node that makes such a gradient makes them only when asked.
  virtual bool takes_output_sums() const { return false; }
  // The op's inputs: the edges of the graph. Tensors the backward needs are kept as
  // detached copies in the node, so a node never holds its own output's history.
  std::vector<Tensor> inputs;
  // Set once a backward pass has run this node and dropped its edges: a second pass
  // through it (backward() from another loss sharing this part of the graph) is an error,
  // as in PyTorch without retain_graph.
  bool released = false;
  // The engine's own: the backward pass that last reached this node, the gradient of its
  // output gathered so far in that pass with its column sums where one node alone made it,
  // and the last node in the pass's order to hand it a gradient.
  uint64_t seen_in_pass = 0;
  Tensor pending;
  ColumnSums pending_sums;
  const Node* last_consumer = nullptr;
};

// Runs backward from `root` with the seed gradient `seed` (same shape as root).
// `before_leaf_write` is called for each leaf input of a node before that node's backward
// writes its gradient (ZeRO stage 2 waits there until the gradient's storage is free).
void run_backward(const Tensor& root, Tensor seed, const LeafHook& on_leaf_done = {},
                  const LeafHook& before_leaf_write = {});
// The same from a scalar root with the seed gradient `seed` given on the host.
void run_backward(const Tensor& root, float seed, const LeafHook& on_leaf_done = {},
                  const LeafHook& before_leaf_write = {});

// Whether ops record autograd history in this thread.
bool grad_enabled();

// Turns autograd recording off in this thread until the guard ends.
class NoGradGuard {
 public:
  NoGradGuard();
  ~NoGradGuard();
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};

// True when recording is on and one of the tensors requires a gradient.
bool any_requires_grad(std::initializer_list<const Tensor*> ts);

}  // namespace dpt
