"""Shared types below the trainer: what a prompt source yields and what a reward function returns.

The trainer sees prompts and rewards only through the two protocols here (docs/design.md, "The three
seams"); `pfppo_mega.data` and `pfppo_mega.rewards` hold the implementations and the config
builds the one it names. Nothing here imports the trainer, a task or a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

import torch


@dataclass(frozen=True)
class Sample:
    """One prompt: its token ids (chat template applied) and free metadata for the reward."""

    prompt_ids: tuple[int, ...]
    data_source: str
    ground_truth: Any = None
    extra_info: dict[str, Any] = field(default_factory=dict)
    prompt_text: str = ""              # the rendered prompt, for logs
    row: str = ""                      # "file:row" (or a task's name for the item), for error messages
    messages: tuple = ()               # the prompt's chat messages ({role, content}) when it had some: a
    #                                    multi-turn rollout's conversation starts from them


# Guard outcomes of one reward call; each non-"ok" outcome is counted in guard/<outcome>.
REWARD_OUTCOMES = ("ok", "reward_errors", "bad_rewards", "reward_timeouts")


@dataclass
class RewardResult:
    """Scores of a batch; every bad call scored 0 and counted by outcome."""

    scores: torch.Tensor               # [B] float32, finite: what the policy is trained on
    outcomes: list[str]                # [B] one of REWARD_OUTCOMES
    # The honest metric when it differs from `scores` (reward.shaping wraps an honest reward in a
    # gameable one, rewards/shaping.py): [B] float32; None = `scores` is itself the honest metric.
    honest: torch.Tensor | None = None
    hacked: torch.Tensor | None = None  # [B] bool: the exploit paid beyond the honest score

    def count(self, outcome: str) -> int:
        return sum(o == outcome for o in self.outcomes)

    @property
    def errors(self) -> int:           # raised / wrong type
        return self.count("reward_errors")

    @property
    def nonfinite(self) -> int:        # NaN / inf
        return self.count("bad_rewards")

    @property
    def timeouts(self) -> int:         # a call that hung past reward.timeout_s (or killed its worker)
        return self.count("reward_timeouts")


@runtime_checkable
class PromptSource(Protocol):
    """Training prompts. The position is checkpoint state: a resumed run continues where it stopped."""

    rows_per_pass: int | None  # prompts this rank draws in one pass over the data; None: generated, no end
    observes: bool             # wants observe() after each step (a curriculum); the trainer gathers rows only then

    def next_batch(self, n: int) -> list[Sample]: ...

    def observe(self, rows: list[Sample], scores: torch.Tensor, rewards: torch.Tensor, step: int) -> None:
        """After step ``step``: every rank's rows of it ([B]), the verifier's scores and the rewards trained on."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class RewardFn(Protocol):
    """Scores responses; never raises or hangs on a bad sample (scores 0 and counts it instead)."""

    def __call__(self, samples: Sequence[Sample], texts: Sequence[str],
                 finished: Sequence[bool]) -> RewardResult: ...

    def check(self, samples: Sequence[Sample], where: str) -> None:
        """Refuse at start (naming the row) data this function cannot score."""
        ...

    def close(self) -> None: ...


# ----------------------------------------------------------------------------- model inputs


@dataclass
class PackedInputs:
    """Prompt + response concatenated per row for the trainer models (right-padded)."""

    input_ids: torch.Tensor            # [B, S]
    attention_mask: torch.Tensor       # [B, S] bool
    resp_pos: torch.Tensor             # [B, T] position whose logits predict response token t
    labels: torch.Tensor               # [B, T] response tokens (pad where masked)
    response_mask: torch.Tensor        # [B, T]


def response_extent(response_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] mask -> [B] long: each row's tokens up to its last mask-1 token (0 for none). A single-turn
    row's mask is a prefix, so this is its mask's sum; a multi-turn row's mask has gaps (tool and user
    tokens, mask 0, inside the response), and the extent counts them too."""
    B, T = response_mask.shape
    if T == 0:
        return torch.zeros(B, dtype=torch.long, device=response_mask.device)
    m = response_mask.bool()                                                             # [B, T]
    # no new tensor beside the mask (made here, it would sit on the host while the mask may be on the GPU)
    last = T - m.flip(1).to(torch.int8).argmax(dim=1)                                    # [B] last 1, 1-based
    return torch.where(m.any(dim=1), last, torch.zeros_like(last))


def pack(prompt_ids: list[list[int]], responses: torch.Tensor, response_mask: torch.Tensor,
         *, pad_id: int, device: torch.device | None = None, multiple_of: int = 1) -> PackedInputs:
    """Concatenate prompt_i + response_i (its real tokens) and right-pad to the longest row,
    rounded up to a multiple of ``multiple_of`` (tp under sequence parallelism, which splits S
    over the TP ranks; the padding is masked and, attention being causal, changes no log-prob).

    The rows are assembled on the host from Python lists (a per-row loop) and moved to ``device``
    (the model's; None: the responses' device) in one copy per tensor."""
    if not isinstance(multiple_of, int) or multiple_of < 1:
        raise ValueError(f"multiple_of({multiple_of!r}) must be an int >= 1")
    B, T = responses.shape
    if device is None and responses.device.type != "cpu":
        device = responses.device
    lengths = response_extent(response_mask).tolist()  # tool tokens inside a multi-turn response included
    responses, response_mask = responses.cpu(), response_mask.cpu()
    rows = [p + responses[i, : lengths[i]].tolist() for i, p in enumerate(prompt_ids)]
    S = -(-max(len(r) for r in rows) // multiple_of) * multiple_of
    input_ids = torch.full((B, S), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(B, S, dtype=torch.bool)
    for i, r in enumerate(rows):
        input_ids[i, : len(r)] = torch.tensor(r)
        attention_mask[i, : len(r)] = True
    plen = torch.tensor([len(p) for p in prompt_ids])                       # [B]
    resp_pos = (plen[:, None] - 1 + torch.arange(T)[None, :]).clamp(max=S - 1)  # [B, T]
    labels = torch.where(response_mask.bool(), responses, torch.full_like(responses, pad_id))
    out = (input_ids, attention_mask, resp_pos, labels, response_mask.float())
    return PackedInputs(*(t if device is None else t.to(device) for t in out))
