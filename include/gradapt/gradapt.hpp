#pragma once
/// @file
/// Umbrella header: everything a plain host C++20 compiler may see, with no dependency
/// beyond the standard library. The MPI and NCCL communicators (comm/mpi.hpp, comm/nccl.hpp)
/// and the CUDA backend (backend/cuda.cuh, from .cu files only) are included separately.

#include "gradapt/core/concepts.hpp"
#include "gradapt/core/config.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/param_list.hpp"
#include "gradapt/core/tensor_view.hpp"

#include "gradapt/backend/chunking.hpp"
#include "gradapt/backend/host.hpp"

#include "gradapt/comm/hierarchical.hpp"
#include "gradapt/comm/single.hpp"
#include "gradapt/comm/threads.hpp"

#include "gradapt/stats/allreduce_with_norms.hpp"
#include "gradapt/stats/gradient_noise_scale.hpp"

#include "gradapt/scaling/adascale.hpp"

#include "gradapt/combine/adasum.hpp"

#include "gradapt/sync/local_sgd.hpp"

#include "gradapt/precision/loss_scaler.hpp"

#include "gradapt/optim/clip.hpp"

#include "gradapt/optim/adafactor.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/optim/chain.hpp"
#include "gradapt/optim/lamb.hpp"
#include "gradapt/optim/lars.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/optim/sm3.hpp"
#include "gradapt/optim/transforms.hpp"

#include "gradapt/train/data_parallel_step.hpp"

#include "gradapt/elastic/policy.hpp"
#include "gradapt/elastic/straggler.hpp"

#include "gradapt/bucket/plan.hpp"
#include "gradapt/bucket/reducer.hpp"
#include "gradapt/shard/optimizer.hpp"
#include "gradapt/shard/partition.hpp"
