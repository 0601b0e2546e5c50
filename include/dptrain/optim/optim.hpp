// The optimizers, one header a concept: optimizer.hpp (the shared base: flat buffers, the
// device's step counter, ZeRO shards, per-bucket parts, twin buffers), sgd.hpp and
// adamw.hpp (torch.optim.SGD and torch.optim.AdamW), schedule.hpp (the learning rate by
// step) and clip.hpp (global gradient-norm clipping); their sources are optim/*.cpp under
// the same names. What an update computes is a fused kernel: runtime/ops.hpp declares the
// updates (sgd_step, adamw_step, their checked and alternating forms), runtime/ops/optim.cpp
// dispatches them, kernels/cpu/optim.cpp and kernels/cuda/optim*.cu implement them, and
// kernels/schedule.hpp holds the schedule's formula, which both compute from.
#pragma once
#include <dptrain/optim/adamw.hpp>
#include <dptrain/optim/clip.hpp>
#include <dptrain/optim/optimizer.hpp>
#include <dptrain/optim/schedule.hpp>
#include <dptrain/optim/sgd.hpp>
