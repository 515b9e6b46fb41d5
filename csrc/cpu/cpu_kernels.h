// Raw-pointer CPU kernels (OpenMP over rows, SIMD inside a row). No torch types here:
// csrc/ops.cpp checks the tensors and calls these.
#pragma once

#include "../kernel_types.h"

namespace pfppo::cpu {

// Token log-prob, entropy and logsumexp of every row of logits [N, V].
void logprob_entropy_fwd(const LogProbArgs& a, const LogProbOut& out);

// Per-row partials of a vocab shard (combine across shards in pfppo_mega/kernels).
void logprob_entropy_partials(const LogProbArgs& a, const LogProbPartialsOut& out);

// grad_logits [N, V] from grad_logp, grad_entropy [N] and the saved lse, entropy [N].
void logprob_entropy_bwd(const LogProbArgs& a, const LogProbBwdArgs& b);

// PPO clipped loss: writes grad_logp [B, T] (d loss / d logp) and stats[kNumPolicyStats].
void policy_loss_fwd(const PolicyLossArgs& a, void* grad_logp, double* stats);

// GAE advantages and returns [B, T] (advantages optionally whitened over real tokens).
void gae(const GaeArgs& a, void* advantages, void* returns);

}  // namespace pfppo::cpu
