// Torch-free launcher API of the CUDA kernels (csrc/cuda/*.cu). The host wrappers
// (csrc/ops.cpp; the policy loss: csrc/policy_loss.h) check tensors, allocate outputs and
// workspace, and call these on the current stream. Every launcher returns the launch error (cudaSuccess when queued).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "../kernel_types.h"

namespace pfppo::cuda {

// Streaming multiprocessors of a device (cached per device).
int sm_count(int device);

// Workspace of the two log-prob forwards (per-split partials when long rows are split).
size_t logprob_workspace_bytes(const LogProbArgs& a);

cudaError_t logprob_entropy_fwd(const LogProbArgs& a, const LogProbOut& out, void* workspace,
                                void* stream);

cudaError_t logprob_entropy_partials(const LogProbArgs& a, const LogProbPartialsOut& out,
                                     void* workspace, void* stream);

cudaError_t logprob_entropy_bwd(const LogProbArgs& a, const LogProbBwdArgs& b, void* stream);

// Pieces each row is cut into for the chunked scan (g.row_chunks, or chosen for sm_count).
int64_t gae_pieces(const GaeArgs& g, int sm_count);

size_t gae_workspace_bytes(const GaeArgs& g, int64_t pieces);

cudaError_t gae(const GaeArgs& g, int64_t pieces, void* advantages, void* returns,
                void* workspace, void* stream);

}  // namespace pfppo::cuda
