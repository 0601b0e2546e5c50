// dptrain's public API in one include, <dptrain/dptrain.hpp>: every public header, from
// the bottom up (tests/layering_test.py checks that none is missing).
#pragma once
#include <dptrain/enum_names.hpp>
#include <dptrain/error.hpp>
#include <dptrain/options.hpp>
#include <dptrain/types.hpp>

#include <dptrain/runtime/autograd.hpp>
#include <dptrain/runtime/context.hpp>
#include <dptrain/runtime/device.hpp>
#include <dptrain/runtime/memory.hpp>
#include <dptrain/runtime/ops.hpp>
#include <dptrain/runtime/tensor.hpp>

#include <dptrain/layers/conv.hpp>
#include <dptrain/layers/gpt.hpp>
#include <dptrain/layers/layers.hpp>
#include <dptrain/layers/loss.hpp>
#include <dptrain/layers/model_spec.hpp>
#include <dptrain/layers/module.hpp>

#include <dptrain/optim/adamw.hpp>
#include <dptrain/optim/clip.hpp>
#include <dptrain/optim/optim.hpp>
#include <dptrain/optim/optimizer.hpp>
#include <dptrain/optim/schedule.hpp>
#include <dptrain/optim/sgd.hpp>

#include <dptrain/data/array.hpp>
#include <dptrain/data/batch.hpp>
#include <dptrain/data/bpe.hpp>
#include <dptrain/data/dataset.hpp>
#include <dptrain/data/input_stats.hpp>
#include <dptrain/data/npy.hpp>
#include <dptrain/data/shuffle.hpp>
#include <dptrain/data/synthetic.hpp>
#include <dptrain/data/tokens.hpp>

#include <dptrain/parallel/data_parallel.hpp>
#include <dptrain/parallel/process_group.hpp>
#include <dptrain/parallel/shard_plan.hpp>

#include <dptrain/train/checkpoint.hpp>
#include <dptrain/train/generate.hpp>
#include <dptrain/train/hf.hpp>
#include <dptrain/train/inference.hpp>
#include <dptrain/train/trainer.hpp>
