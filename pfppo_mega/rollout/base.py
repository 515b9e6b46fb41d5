"""The rollout-engine interface shared by every generation backend.

A trainer pushes policy weights into an engine as named tensors in Hugging Face Llama naming
(``model.layers.0.self_attn.q_proj.weight`` ...) tagged with an integer version, then asks it to
complete a batch of token-id prompts. The built-in pure-torch engine, a vLLM engine and a pool of
policy snapshots all implement :class:`RolloutEngine`, and one conformance test runs over each.

Log-prob contract (every backend):
    sampled:  logprob_t = log_softmax(logits_t / temperature)[token_t]
    greedy:   logprob_t = log_softmax(logits_t)[token_t]                  (temperature 1)
Top-p truncation changes which tokens can be drawn but NOT the reported log-prob, so the trainer
recomputes it exactly from its own logits divided by the temperature.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float
    """Softmax temperature T > 0; logits are divided by T before sampling. Ignored when greedy."""
    top_p: float
    """Nucleus mass in (0, 1]: sample from the smallest set of most likely tokens whose
    probability (at temperature T) reaches top_p. 1.0 disables the truncation."""
    max_new_tokens: int
    """Largest number of response tokens per prompt (the EOS token included), >= 1."""
    eos_token_id: int | None
    """Token that ends a response (it is kept in the response, mask 1); None never stops early."""
    greedy: bool = False
    """Take argmax instead of sampling; temperature and top_p are then ignored."""
    seed: int | None = None
    """Seed of a private generator: same seed, weights and prompts -> same output.
    None draws from torch's global generator."""

    def __post_init__(self) -> None:
        if not self.greedy and not self.temperature > 0:
            raise ValueError(
                f"SamplingParams.temperature={self.temperature} must be > 0 "
                "unless greedy=True"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p={self.top_p} must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError(
                f"SamplingParams.max_new_tokens={self.max_new_tokens} must be >= 1"
            )


@dataclass
class RolloutOutput:
    """Responses of one generate() call; row b answers prompts[b].

    T is the longest response in the batch. Padding slots hold pad_token_id in `responses`
    and 0 in `response_mask` and `logprobs`. An EOS token, when generated, is part of the
    response (mask 1, counted in `lengths`).
    """

    prompts: list[list[int]]
    responses: torch.Tensor  # [B, T] int64, right-padded with pad_token_id
    response_mask: torch.Tensor  # [B, T] float32, 1 on response tokens
    logprobs: torch.Tensor  # [B, T] float32, see the module docstring; 0 on padding
    lengths: torch.Tensor  # [B] int64, number of response tokens
    finished: torch.Tensor  # [B] bool, True if the row ended with EOS, False if cut at the limit
    weight_version: int  # version of the weights that generated every row


class RolloutEngine(abc.ABC):
    """Generates responses with the most recently pushed policy weights."""

    @abc.abstractmethod
    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Replace all weights with `named_tensors` (Hugging Face Llama names) and tag them
        with `version`. The set of names and the shapes must match the engine's model exactly;
        on error nothing is changed."""

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """Version passed to the last successful load_weights; -1 before the first one."""

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        """Complete every prompt (a non-empty list of token ids). Log-probs follow the
        module-level contract."""
