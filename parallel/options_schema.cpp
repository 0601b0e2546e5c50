// DataParallelOptions' fields, declared once: the table that DataParallel's checks,
// TrainConfig's schema (and through it dptrain's flags, config keys, checkpoints and the
// ranks' agreement) read.
#include <dptrain/parallel/data_parallel.hpp>

namespace dpt {

const OptionSchema<DataParallelOptions>& data_parallel_schema() {
  using O = DataParallelOptions;
  auto id = [](const char* name) { return FieldId{"DataParallelOptions", name}; };
  // More than a TiB a bucket is no bucket at all (and its byte count would not fit).
  const OptionRange bucket{0.0, 1048576.0, true, false, "must be in (0, 1048576] MiB"};
  static const OptionSchema<O> schema = {
      number_field(id("clip"), &O::clip, {0.0, HUGE_VAL, false, true, "must be a finite number >= 0 (0: off)"},
                   "Clip the global gradient norm to this value (0: off)")
          .in_checkpoint(),
      number_field(id("grad_accum"), &O::grad_accum, {1.0, HUGE_VAL, false, false, "must be >= 1"},
                   "Micro-batches per step; gradients are reduced on the last only")
          .in_checkpoint(),
      choice_field(id("precision"), &O::precision, kPrecisionNames,
                   "Precision: fp32, tf32 (TF32 GEMMs), bf16 (bf16 storage, fp32 master weights)")
          .in_checkpoint(),
      choice_field(id("gemm"), &O::gemm, kGemmNames, "GEMM implementation: cublas or native (hand-written, fp32)")
          .agreed(),
      choice_field(id("reduce"), &O::reduce, kReduceNames,
                   "Gradient reduction: auto, nccl, p2p (to the master), host (CPU devices)"),
      number_field(id("bucket_mb"), &O::bucket_mb, bucket,
                   "Gradient bucket size in MiB, reduced as soon as it is ready")
          .agreed(),
      number_field(id("first_bucket_mb"), &O::first_bucket_mb, bucket,
                   "The first bucket's size in MiB when smaller (the last layer's gradients go out at once)")
          .agreed(),
      switch_field(id("tune_buckets"), &O::tune_buckets,
                   "Try bucket sizes of 1 to 64 MiB over the first steps (five each) and keep the fastest")
          .agreed(),
      number_field(id("comm_ctas"), &O::comm_ctas,
                   {0.0, double{kMaxCommCtas}, false, false,
                    "must be in [0, " + std::to_string(kMaxCommCtas) + "] (0: NCCL's choice)"},
                   "NCCL: at most this many thread blocks a collective (fewer SMs taken from backward); 0: NCCL's "
                   "choice"),
      choice_field(id("grad_comm"), &O::grad_comm, kGradCommNames,
                   "The type gradients travel in between devices: fp32, or bf16 (rounded before they leave a device; "
                   "not with --ddp on CPUs)")
          .agreed(),
      number_field(id("zero"), &O::zero, {0.0, 2.0, false, false, "must be 0, 1 or 2"},
                   "ZeRO stage: 0 off, 1 the optimizer state sharded over the devices or ranks, 2 the gradients too "
                   "(not with --cuda-graph)")
          .agreed(),
      switch_field(id("cuda_graph"), &O::cuda_graph,
                   "Record the whole step as CUDA graphs (one for odd steps, one for even) once and replay them (GPUs; "
                   "--ddp too; in one process not NCCL over several GPUs: use --reduce p2p there)")
          .agreed(),
      choice_field(id("twin_buffers"), &O::twin_buffers, kTwinBufferNames,
                   "Keep one copy of the parameters and optimizer state (on GPUs there are two by default where they "
                   "serve: models of 2^21 (about 2.1M) up to 2^26 (about 67M) parameters, without --clip or --zero; "
                   "the update then checks the gradients in its own pass. This saves that memory for a second pass "
                   "over the gradients a step)"),
      switch_field(id("overlap"), &O::overlap,
                   "Reduce gradients only after backward, and copy p2p parameters whole after the update (to measure "
                   "what overlap gains)")
          .agreed(),
      switch_field(id("update_per_bucket"), &O::update_per_bucket,
                   "Update each bucket's parameters as soon as its reduction is done"),
      switch_field(id("check_finite"), &O::check_finite,
                   "Check the gradient norm every step and skip an update whose gradients are not finite"),
  };
  return schema;
}

}  // namespace dpt
