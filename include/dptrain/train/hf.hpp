// GPT-2 weights in the Hugging Face layout: what transformers.GPT2LMHeadModel.from_pretrained
// loads (model.safetensors and config.json in a folder) and what such a folder holds.
// Their names are nanoGPT's ("transformer.h.0.attn.c_attn.weight"), but the four
// projections of a block (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj) are Conv1D
// weights stored [in, out], the transpose of dptrain's Linear [out, in]; the token
// embedding has the vocabulary's rows (dptrain's padding rows are dropped, and read back as
// zeros); lm_head.weight is the token embedding (tied) and is not written.
#pragma once
#include <memory>
#include <string>

#include <dptrain/layers/gpt.hpp>

namespace dpt::hf {

// Writes DIR/model.safetensors (fp32, marked as dptrain's export) and DIR/config.json for
// `model` (placed on any device), making DIR when it is missing; each file atomically. It
// replaces only an earlier export of dptrain's, never `checkpoint` (the file the model
// came from, if any): anything else there is a UsageError before a byte is written, as is
// a folder it cannot make. Throws dpt::Error naming the file on a failed write.
void export_gpt2(nn::GPT& model, const std::string& dir, const std::string& checkpoint = "");

// Loads `path` (a model.safetensors of GPT-2 in this layout, F32 or BF16, as transformers
// writes it, with or without the "transformer." prefix; lm_head.weight, when present, must
// be the token embedding's copy, and the attention's mask buffers older files hold are
// skipped) into `model`'s parameters (placed on any device). Throws UsageError with one
// line naming the file and the tensor that is missing, unknown, of another shape or not
// finite: the model's spec must be the file's sizes (its head count, where a config.json
// beside the file gives n_head). A missing or broken file is a UsageError too.
void load_gpt2(nn::GPT& model, const std::string& path);

// A dptrain checkpoint of a GPT (Trainer::save's) written as export_gpt2 writes a model:
// `dptrain export --hf DIR --resume CKPT`. UsageError for a checkpoint that is not a GPT's.
void export_gpt2_checkpoint(const std::string& checkpoint, const std::string& dir);

// The GPT of a dptrain checkpoint, placed on `device` with the checkpoint's weights.
// UsageError for a checkpoint that is not a GPT's.
std::shared_ptr<nn::GPT> load_gpt2_checkpoint(const std::string& checkpoint, const Device& device);

}  // namespace dpt::hf
