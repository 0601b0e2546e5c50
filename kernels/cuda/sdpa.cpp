// cuDNN's fused attention through the cuDNN frontend's graph API (sdpa.hpp), after llm.c's
// cudnn_att.cpp: q, k and v are read in place from the fused qkv rows by strides (no
// permute), the output written in y's row layout.
#include "kernels/cuda/sdpa.hpp"

#include <atomic>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include <cudnn_frontend.h>

#include "kernels/cuda/check.hpp"

namespace dpt::cuda {

namespace fe = cudnn_frontend;

namespace {

enum Uid : int64_t { kQ = 1, kK, kV, kScale, kO, kStats, kdO, kdQ, kdK, kdV };

// device, B, H, T, hs, training, backward, a deterministic backward
using Key = std::tuple<int, int64_t, int64_t, int64_t, int64_t, bool, bool, bool>;

// A built graph, or none where cuDNN cannot run the shape (then never tried again).
struct Built {
  std::shared_ptr<fe::graph::Graph> graph;
  size_t workspace = 0;
};

std::mutex cache_mutex;
std::atomic<int64_t> deterministic_calls{0}, fast_calls{0};
std::map<Key, Built>& cache() {
  static std::map<Key, Built> c;
  return c;
}

// q, k or v of the fused rows: [B, H, T, hs] at strides (T rows of 3C, a head hs apart).
fe::graph::Tensor_attributes qkv_part(const SdpaShape& s, const char* name, int64_t uid) {
  const int64_t H = s.heads, T = s.seq, hs = s.head_size;
  return fe::graph::Tensor_attributes()
      .set_name(name)
      .set_uid(uid)
      .set_dim({s.batch, H, T, hs})
      .set_stride({3 * H * hs * T, hs, 3 * H * hs, 1});
}
// y or dy: [B, H, T, hs] in rows of C.
std::vector<int64_t> out_stride(const SdpaShape& s) {
  const int64_t H = s.heads, T = s.seq, hs = s.head_size;
  return {H * hs * T, hs, H * hs, 1};
}
std::vector<int64_t> stats_dim(const SdpaShape& s) { return {s.batch, s.heads, s.seq, 1}; }
std::vector<int64_t> stats_stride(const SdpaShape& s) { return {s.heads * s.seq, s.seq, 1, 1}; }

std::shared_ptr<fe::graph::Graph> new_graph() {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

std::shared_ptr<fe::graph::Tensor_attributes> scale_tensor(fe::graph::Graph& g) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name("attn_scale")
                      .set_uid(kScale)
                      .set_dim({1, 1, 1, 1})
                      .set_stride({1, 1, 1, 1})
                      .set_is_pass_by_value(true)
                      .set_data_type(fe::DataType_t::FLOAT));
}

std::shared_ptr<fe::graph::Graph> forward_graph(const SdpaShape& s) {
  auto g = new_graph();
  auto Q = g->tensor(qkv_part(s, "Q", kQ)), K = g->tensor(qkv_part(s, "K", kK)), V = g->tensor(qkv_part(s, "V", kV));
  auto options = fe::graph::SDPA_attributes()
                     .set_name("causal_attention")
                     .set_generate_stats(s.training)
                     .set_attn_scale(scale_tensor(*g))
                     .set_causal_mask(true);
  auto [O, stats] = g->sdpa(Q, K, V, options);
  O->set_output(true).set_dim({s.batch, s.heads, s.seq, s.head_size}).set_stride(out_stride(s)).set_uid(kO);
  if (s.training)
    stats->set_output(true)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim(stats_dim(s))
        .set_stride(stats_stride(s))
        .set_uid(kStats);
  return g;
}

std::shared_ptr<fe::graph::Graph> backward_graph(const SdpaShape& s) {
  auto g = new_graph();
  auto Q = g->tensor(qkv_part(s, "Q", kQ)), K = g->tensor(qkv_part(s, "K", kK)), V = g->tensor(qkv_part(s, "V", kV));
  const std::vector<int64_t> dim = {s.batch, s.heads, s.seq, s.head_size};
  auto O = g->tensor(fe::graph::Tensor_attributes().set_name("O").set_uid(kO).set_dim(dim).set_stride(out_stride(s)));
  auto dO =
      g->tensor(fe::graph::Tensor_attributes().set_name("dO").set_uid(kdO).set_dim(dim).set_stride(out_stride(s)));
  auto stats = g->tensor(fe::graph::Tensor_attributes()
                             .set_name("stats")
                             .set_uid(kStats)
                             .set_dim(stats_dim(s))
                             .set_stride(stats_stride(s))
                             .set_data_type(fe::DataType_t::FLOAT));
  auto options = fe::graph::SDPA_backward_attributes()
                     .set_name("causal_attention_backward")
                     .set_deterministic_algorithm(s.deterministic)
                     .set_causal_mask(true)
                     .set_attn_scale(scale_tensor(*g));
  auto [dQ, dK, dV] = g->sdpa_backward(Q, K, V, O, dO, stats, options);
  const std::vector<int64_t> qkv_stride = qkv_part(s, "", 0).get_stride();
  dQ->set_output(true).set_dim(dim).set_stride(qkv_stride).set_uid(kdQ);
  dK->set_output(true).set_dim(dim).set_stride(qkv_stride).set_uid(kdK);
  dV->set_output(true).set_dim(dim).set_stride(qkv_stride).set_uid(kdV);
  return g;
}

// The graph of this shape, built on first use; an empty one where cuDNN cannot run it.
const Built& built(cudnnHandle_t h, const SdpaShape& s, bool backward) {
  int device = 0;
  DPT_CUDA_CHECK(cudaGetDevice(&device));
  const Key key{
      device, s.batch, s.heads, s.seq, s.head_size, s.training || backward, backward, backward && s.deterministic};
  std::lock_guard<std::mutex> lock(cache_mutex);
  auto it = cache().find(key);
  if (it != cache().end()) return it->second;
  Built b;
  auto g = backward ? backward_graph(s) : forward_graph(s);
  if (g->validate().is_good() && g->build_operation_graph(h).is_good() &&
      g->create_execution_plans({fe::HeurMode_t::A}).is_good() && g->check_support(h).is_good() &&
      g->build_plans(h).is_good()) {
    int64_t ws = 0;
    if (g->get_workspace_size(ws).is_good()) {
      b.graph = std::move(g);
      b.workspace = static_cast<size_t>(ws);
    }
  }
  return cache().emplace(key, std::move(b)).first->second;
}

void execute(cudnnHandle_t h, const Built& b, std::unordered_map<int64_t, void*>& pack, void* ws, const char* what) {
  DPT_CHECK(b.graph, std::string(what) + ": cuDNN cannot run this shape (ask sdpa_supported first)");
  const fe::error_object e = b.graph->execute(h, pack, ws);
  if (!e.is_good()) throw Error(std::string(what) + ": cuDNN: " + e.err_msg);
  DPT_CUDA_CHECK_LAUNCH();
}

}  // namespace

bool sdpa_supported(cudnnHandle_t h, const SdpaShape& s) {
  return built(h, s, false).graph && (!s.training || built(h, s, true).graph);
}

size_t sdpa_forward_workspace(cudnnHandle_t h, const SdpaShape& s) { return built(h, s, false).workspace; }
size_t sdpa_backward_workspace(cudnnHandle_t h, const SdpaShape& s) { return built(h, s, true).workspace; }

void sdpa_forward(cudnnHandle_t h, const SdpaShape& s, const uint16_t* qkv, uint16_t* y, float* stats, void* ws) {
  const int64_t C = s.heads * s.head_size;
  float scale = 1.0f / std::sqrt(static_cast<float>(s.head_size));
  auto* in = const_cast<uint16_t*>(qkv);  // cuDNN's pack is of void*; it only reads the inputs
  std::unordered_map<int64_t, void*> pack = {{kQ, in}, {kK, in + C}, {kV, in + 2 * C}, {kScale, &scale}, {kO, y}};
  if (s.training) pack[kStats] = stats;
  execute(h, built(h, s, false), pack, ws, "sdpa_forward");
}

void sdpa_backward(cudnnHandle_t h, const SdpaShape& s, const uint16_t* qkv, const uint16_t* y, const uint16_t* dy,
                   const float* stats, uint16_t* dqkv, void* ws) {
  const int64_t C = s.heads * s.head_size;
  float scale = 1.0f / std::sqrt(static_cast<float>(s.head_size));
  auto* in = const_cast<uint16_t*>(qkv);
  std::unordered_map<int64_t, void*> pack = {{kQ, in},
                                             {kK, in + C},
                                             {kV, in + 2 * C},
                                             {kO, const_cast<uint16_t*>(y)},
                                             {kdO, const_cast<uint16_t*>(dy)},
                                             {kStats, const_cast<float*>(stats)},
                                             {kdQ, dqkv},
                                             {kdK, dqkv + C},
                                             {kdV, dqkv + 2 * C},
                                             {kScale, &scale}};
  execute(h, built(h, s, true), pack, ws, "sdpa_backward");
  (s.deterministic ? deterministic_calls : fast_calls) += 1;
}

SdpaBackwardCalls sdpa_backward_calls() { return {deterministic_calls.load(), fast_calls.load()}; }

}  // namespace dpt::cuda
