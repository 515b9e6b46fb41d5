// Torch-free launcher API of the CUDA kernels (csrc/cuda/*.cu). The torch binding
// (csrc/cuda/ops_cuda.cpp) checks tensors, allocates outputs and workspace, and calls these on
// the current stream. Every launcher returns the launch error (cudaSuccess when queued).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "../kernel_types.h"

namespace pfppo::cuda {

cudaError_t logprob_entropy_fwd(const LogProbArgs& a, const LogProbOut& out, cudaStream_t stream);

cudaError_t logprob_entropy_partials(const LogProbArgs& a, const LogProbPartialsOut& out,
                                     cudaStream_t stream);

cudaError_t logprob_entropy_bwd(const LogProbArgs& a, const LogProbBwdArgs& b,
                                cudaStream_t stream);

// The five PolicyLossOutput scalars, each a 0-dim tensor of the inputs' dtype.
struct PolicyStatsOut {
  void* stat[kNumPolicyStats];
};

size_t policy_loss_workspace_bytes(const PolicyLossArgs& a);

// grad_logp [B, T] (dtype of logp) and the stats; workspace: policy_loss_workspace_bytes.
cudaError_t policy_loss_fwd(const PolicyLossArgs& a, void* grad_logp, const PolicyStatsOut& out,
                            void* workspace, cudaStream_t stream);

// Pieces each row is cut into for the chunked scan (g.row_chunks, or chosen for sm_count).
int64_t gae_pieces(const GaeArgs& g, int sm_count);

size_t gae_workspace_bytes(const GaeArgs& g, int64_t pieces);

cudaError_t gae(const GaeArgs& g, int64_t pieces, void* advantages, void* returns,
                void* workspace, cudaStream_t stream);

}  // namespace pfppo::cuda
