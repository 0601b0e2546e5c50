// Reading a model's state out of a checkpoint, shared by the Trainer (resume) and
// Inference (predict, eval). Internal to the library.
#pragma once
#include <set>
#include <string>

#include <dptrain/parallel/data_parallel.hpp>
#include <dptrain/runtime/tensor.hpp>
#include <dptrain/train/checkpoint.hpp>

namespace dpt {

// Copies tensor `name` of checkpoint `c` (read from `path`) into `into`, and adds the name
// to `used`. Throws UsageError when the tensor is missing, is not F32, has another shape,
// or holds a value that is not finite (naming the tensor and the first bad index).
void fetch_tensor(const ckpt::Checkpoint& c, const std::string& path, const std::string& name, const Tensor& into,
                  std::set<std::string>& used);
// The same for elements [begin, begin + into.numel()) of a tensor of shape `whole` (a
// ZeRO shard of the flat optimizer state).
void fetch_tensor_part(const ckpt::Checkpoint& c, const std::string& path, const std::string& name, const Shape& whole,
                       int64_t begin, const Tensor& into, std::set<std::string>& used);

// Throws UsageError (as fetch_tensor) unless `c` holds every parameter and buffer of
// `model` as F32 of its shape: checked before the model is placed, so that a checkpoint
// whose metadata names a huge model fails at once instead of building it.
void check_shapes(const ckpt::Checkpoint& c, const std::string& path, nn::Module& model);

// Every replica's parameters and buffers from `c` (the bf16 copies follow), names added
// to `used`.
void load_replicas(const ckpt::Checkpoint& c, const std::string& path, DataParallel& dp, std::set<std::string>& used);

// Throws UsageError naming the first tensor of `c` that is not in `used`: a tensor no one
// takes means the file is another model's or another optimizer's.
void check_all_used(const ckpt::Checkpoint& c, const std::string& path, const std::set<std::string>& used);

// A safetensors file given to read from (its tensors checked against their checksums): a
// missing, cut or corrupt one is bad input (UsageError), not a runtime error.
ckpt::Checkpoint load_input_file(const std::string& path);

// Checkpoint `path`, loaded as load_input_file loads it. A dptrain checkpoint is checked further: its
// format, and that its metadata holds the keys that Trainer::save writes and no other (a
// key renamed or added by hand is refused). A file written before checkpoints kept
// checksums may lack the keys added since the first format; it loads, with a note that it
// carries no checksums when `note` (rank 0 alone gives it under --ddp).
ckpt::Checkpoint load_checkpoint(const std::string& path, bool note = true);

// Whether Trainer::save writes `key` into a checkpoint's metadata (it checks each one).
bool is_checkpoint_key(const std::string& key);
// Whether `key` came after checkpoints kept checksums: a checksummed file may lack it, and
// then holds the setting's default.
bool is_newer_checkpoint_key(const std::string& key);

}  // namespace dpt
