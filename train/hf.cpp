#include <dptrain/train/hf.hpp>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>

#include <dptrain/error.hpp>
#include <dptrain/train/checkpoint.hpp>
#include "common/atomic_file.hpp"
#include "model_state.hpp"

namespace dpt::hf {

namespace {

const char* const kPrefix = "transformer.";

// The block weights Hugging Face stores as Conv1D [in, out].
bool is_conv1d_weight(const std::string& name) {
  for (const char* suffix : {".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight"}) {
    const size_t n = std::strlen(suffix);
    if (name.size() >= n && name.compare(name.size() - n, n, suffix) == 0) return true;
  }
  return false;
}

std::vector<float> transposed(const std::vector<float>& v, int64_t rows, int64_t cols) {
  std::vector<float> t(v.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[static_cast<size_t>(c * rows + r)] = v[static_cast<size_t>(r * cols + c)];
  return t;
}

std::vector<float> as_floats(const ckpt::HostTensor& t) {
  int64_t n = 1;
  for (int64_t d : t.shape) n *= d;
  std::vector<float> v(static_cast<size_t>(n));
  if (t.dtype == DType::f32) {
    std::memcpy(v.data(), t.data.data(), v.size() * sizeof(float));
  } else {  // bf16: the upper half of a float
    for (size_t i = 0; i < v.size(); ++i) {
      uint16_t h = 0;
      std::memcpy(&h, t.data.data() + 2 * i, 2);
      const uint32_t bits = uint32_t{h} << 16;
      std::memcpy(&v[i], &bits, 4);
    }
  }
  return v;
}

std::string config_json(const nn::GptConfig& c) {
  auto n = [](int64_t v) { return std::to_string(v); };
  // GPT-2's <|endoftext|>, or the last token of a smaller vocabulary.
  const std::string eot = n(std::min<int64_t>(50256, c.vocab - 1));
  return "{\n  \"architectures\": [\"GPT2LMHeadModel\"],\n  \"model_type\": \"gpt2\",\n  \"vocab_size\": " +
         n(c.vocab) + ",\n  \"n_positions\": " + n(c.context) + ",\n  \"n_embd\": " + n(c.width) +
         ",\n  \"n_layer\": " + n(c.layers) + ",\n  \"n_head\": " + n(c.heads) +
         ",\n  \"activation_function\": \"gelu_new\",\n  \"layer_norm_epsilon\": 1e-05,\n"
         "  \"resid_pdrop\": 0.0,\n  \"embd_pdrop\": 0.0,\n  \"attn_pdrop\": 0.0,\n  \"initializer_range\": 0.02,\n"
         "  \"tie_word_embeddings\": true,\n  \"bos_token_id\": " +
         eot + ",\n  \"eos_token_id\": " + eot + ",\n" + "  \"torch_dtype\": \"float32\"\n}\n";
}

// The metadata mark of an export's model.safetensors: what a later export may replace.
const char* const kExportedBy = "exported_by";

// What an export may replace in DIR (UsageError otherwise, before anything is written):
// its model.safetensors only where an export of dptrain's wrote it and it is not the
// checkpoint being exported (also through a link), config.json only as that file's pair;
// anything there that is not a regular file, never.
void check_export_targets(const std::string& dir, const std::string& checkpoint) {
  namespace fs = std::filesystem;
  const std::string model = dir + "/model.safetensors", config = dir + "/config.json";
  std::error_code ec;
  const bool has_model = fs::exists(model, ec), has_config = fs::exists(config, ec);
  for (const auto& [f, has] : {std::pair{model, has_model}, std::pair{config, has_config}})
    if (has && !fs::is_regular_file(f, ec))
      throw UsageError("export: '" + f + "' is not a regular file, which export would replace (name another folder)");
  if (has_model && !checkpoint.empty() && fs::equivalent(model, checkpoint, ec))
    throw UsageError("export: '" + model + "' is the checkpoint being exported (--resume); name another folder");
  bool ours = false;
  if (has_model) try {
      const auto meta = ckpt::read_metadata(model);
      const auto mark = meta.find(kExportedBy);
      ours = mark != meta.end() && mark->second == "dptrain";
    } catch (const Error&) {  // not a safetensors file at all
    }
  if ((has_model && !ours) || (has_config && !has_model))
    throw UsageError("export: '" + dir + "' holds a " + (has_model ? "model.safetensors" : "config.json") +
                     " that no export of dptrain's wrote, which export would replace (name another folder)");
}

// The head count of a config.json beside `path` (Hugging Face's "n_head"), against the
// model's: it changes no tensor's shape, so the weights alone cannot tell a file of 2 heads
// from one of 4. No config.json, or none that says, checks nothing.
void check_heads_beside(const std::string& path, const nn::GptConfig& cfg) {
  const std::filesystem::path config = std::filesystem::path(path).parent_path() / "config.json";
  std::ifstream in(config, std::ios::binary);
  if (!in) return;
  const std::string json{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  const std::string key = "\"n_head\"";
  size_t at = json.find(key);
  if (at == std::string::npos) return;
  at = json.find_first_not_of(" \t\r\n", at + key.size());
  if (at == std::string::npos || json[at] != ':') return;
  at = json.find_first_not_of(" \t\r\n", at + 1);
  int64_t heads = 0;
  const char* end = json.data() + json.size();
  const auto [stop, ec] = std::from_chars(json.data() + std::min(at, json.size()), end, heads);
  if (ec != std::errc() || heads == cfg.heads) return;
  throw UsageError("'" + path + "': " + config.string() + " says n_head " + std::to_string(heads) +
                   ", and the model has " + std::to_string(cfg.heads) + " heads (its spec must be the file's)");
}

}  // namespace

void export_gpt2(nn::GPT& model, const std::string& dir, const std::string& checkpoint) {
  const nn::GptConfig& cfg = model.config();
  check_export_targets(dir, checkpoint);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw UsageError("export: cannot make the folder '" + dir + "': " + ec.message());
  ckpt::Checkpoint c;
  c.metadata["format"] = "pt";  // what transformers asks of a safetensors file
  c.metadata[kExportedBy] = "dptrain";
  for (auto& [name, p] : model.named_parameters()) {
    std::vector<float> v = p->value.to_host();
    std::vector<int64_t> shape = p->shape.vec();
    if (name == "transformer.wte.weight") {  // the vocabulary's rows, not the padding
      shape[0] = cfg.vocab;
      v.resize(static_cast<size_t>(cfg.vocab * cfg.width));
    } else if (is_conv1d_weight(name)) {
      v = transposed(v, shape[0], shape[1]);
      std::swap(shape[0], shape[1]);
    }
    c.tensors.push_back({name, ckpt::make_tensor(DType::f32, shape, v.data())});
  }
  ckpt::save(dir + "/model.safetensors", c);
  write_file_atomic(dir + "/config.json", config_json(cfg));
}

void load_gpt2(nn::GPT& model, const std::string& path) {
  const ckpt::Checkpoint c = load_input_file(path);  // a missing or broken file is bad input, as --resume's
  check_heads_beside(path, model.config());
  const nn::GptConfig& cfg = model.config();
  auto bad = [&](const std::string& why) { throw UsageError("'" + path + "': " + why); };
  // The file's name for one of ours: with the prefix, or without it (GPT2Model's files).
  auto find = [&](const std::string& name) -> std::pair<const ckpt::HostTensor*, std::string> {
    if (const auto* t = c.find(name)) return {t, name};
    const std::string bare = name.substr(std::strlen(kPrefix));
    return {c.find(bare), bare};
  };
  std::set<std::string> used;
  std::vector<float> wte;
  for (auto& [name, p] : model.named_parameters()) {
    const auto [t, file_name] = find(name);
    if (!t) bad("no tensor " + name + " (a GPT-2 " + nn::gpt_spec_str(cfg) + " has it)");
    if (t->dtype == DType::i32) bad(file_name + " is I32; GPT-2's weights are F32 or BF16");
    std::vector<int64_t> want = p->shape.vec();
    const bool is_wte = name == "transformer.wte.weight";
    if (is_wte) want[0] = cfg.vocab;
    if (is_conv1d_weight(name)) std::swap(want[0], want[1]);
    if (t->shape != want)
      bad(file_name + " has shape " + shape_str(t->shape) + ", the model's " + nn::gpt_spec_str(cfg) + " wants " +
          shape_str(want));
    std::vector<float> v = as_floats(*t);
    for (size_t i = 0; i < v.size(); ++i)
      if (!std::isfinite(v[i])) bad(file_name + "[" + std::to_string(i) + "] is not finite");
    if (is_conv1d_weight(name)) v = transposed(v, want[0], want[1]);
    if (is_wte) {
      wte = v;
      v.resize(static_cast<size_t>(numel(p->shape)), 0.0f);  // the padding rows: zeros
    }
    copy(p->value, Tensor::from_host(v, p->shape, p->value.device()));
    used.insert(file_name);
  }
  for (const auto& [name, t] : c.tensors) {
    if (used.count(name)) continue;
    // Older files keep the attention's causal mask as a buffer; dptrain's attention is causal by itself.
    if (name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias")) continue;
    if (name == "lm_head.weight") {
      if (t.shape != std::vector<int64_t>{cfg.vocab, cfg.width} || as_floats(t) != wte)
        bad("lm_head.weight is not the token embedding: dptrain's GPT ties its output projection to it");
      continue;
    }
    bad("a tensor " + name + " that GPT-2 " + nn::gpt_spec_str(cfg) + " does not have");
  }
  model.refresh_shadow();
}

std::shared_ptr<nn::GPT> load_gpt2_checkpoint(const std::string& checkpoint, const Device& device) {
  const ckpt::Checkpoint c = load_checkpoint(checkpoint);
  const auto model = c.metadata.find("model");
  if (model == c.metadata.end() || !nn::is_gpt_spec(model->second))
    throw UsageError("checkpoint '" + checkpoint + "' holds no GPT (its model is " +
                     (model == c.metadata.end() ? std::string("not named") : ckpt::printable(model->second)) + ")");
  auto gpt = nn::gpt(nn::parse_gpt_spec(model->second));
  gpt->to(device, 0);  // the checkpoint's values replace these
  std::set<std::string> used;
  for (auto& [name, p] : gpt->named_parameters()) fetch_tensor(c, checkpoint, name, p->value, used);
  return gpt;
}

void export_gpt2_checkpoint(const std::string& checkpoint, const std::string& dir) {
  export_gpt2(*load_gpt2_checkpoint(checkpoint, Device{}), dir, checkpoint);
}

}  // namespace dpt::hf
