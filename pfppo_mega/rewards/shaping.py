"""Reward settings where plain PPO is known to go wrong (`reward.shaping`), as a wrapper around an
honest reward function.

The wrapped function's score is the *honest* metric (for the built-in task: the exact sum followed
by EOS); the wrapper returns what the policy is trained on. Both travel in the RewardResult
(`scores` = trained-on, `honest` = the wrapped function's), so the trainer logs them apart every
step (`reward/mean` vs `reward/honest`) and in evaluation (`eval/accuracy` vs
`eval/honest_accuracy`).

    kind            trained-on score r from the honest score h of a response `text`
    none            r = h
    length_bias     r = h + length_bonus * len(text): pays for a longer response (text = the decoded
                    response before EOS; one character per token in the built-in task).
    phrase_exploit  r = phrase_score  if `phrase` occurs in text, else h.
    noisy           r = 1 - h  for a fraction flip_rate of the (prompt, response) pairs, else h.
                    Which pairs flip is a hash of (seed, prompt, response): reproducible, stateless
                    (a resumed run flips the same pairs), independent of the batch.
    scaled          r = scale * (2 h - 1): a 0/1 reward mapped onto [-scale, scale].

`hacked` marks the responses the exploit pays for beyond their honest score (length_bias: the
a response longer than the reference answer that is not
honestly right; phrase_exploit: the phrase in a response that is not
honestly right); `reward/hacked_frac` is its batch mean. The math is `shape_scores`, pure.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch

from pfppo_mega.constants import REWARD_SHAPINGS
from pfppo_mega.types import RewardResult, Sample


def flip_draw(seed: int, prompt: str, text: str) -> float:
    """A uniform number in [0, 1) fixed by (seed, prompt, response)."""
    h = hashlib.blake2b(f"{seed}\x00{prompt}\x00{text}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64


def shape_scores(honest: torch.Tensor, texts: Sequence[str], answers: Sequence[str | None], *, kind: str,
                 length_bonus: float = 0.0, phrase: str = "", phrase_score: float = 0.0,
                 flip_draws: Sequence[float] | None = None, flip_rate: float = 0.0,
                 scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(trained-on scores [B] float32, hacked [B] bool) from the honest scores [B] (see module doc).
    answers[i]: the reference answer (length_bias: what "longer" is measured against; None: unknown)."""
    if kind not in REWARD_SHAPINGS:
        raise ValueError(f"shape_scores: kind={kind!r} must be one of {REWARD_SHAPINGS}")
    h = honest.float()
    out, hacked = h.clone(), torch.zeros(len(h), dtype=torch.bool)
    if kind == "length_bias":
        for i, (text, ans) in enumerate(zip(texts, answers)):
            out[i] = h[i] + length_bonus * len(text)
            hacked[i] = bool(h[i] <= 0) and ans is not None and len(text) > len(ans)
    elif kind == "phrase_exploit":
        for i, text in enumerate(texts):
            if phrase and phrase in text:
                out[i] = phrase_score
                hacked[i] = h[i] <= 0
    elif kind == "noisy":
        if flip_draws is None or len(flip_draws) != len(h):
            raise ValueError(f"shape_scores: noisy needs one flip draw per row ({len(h)})")
        flip = torch.tensor([u < flip_rate for u in flip_draws], dtype=torch.bool)
        out = torch.where(flip, 1.0 - h, h)
    elif kind == "scaled":
        out = scale * (2.0 * h - 1.0)
    return out.float(), hacked


class ShapedReward:
    """A RewardFn: the wrapped (honest) function, then `shape_scores`. Rows the guard scored 0 for a
    bad outcome (error, NaN, timeout) are not shaped."""

    def __init__(self, base, *, kind: str, length_bonus: float, phrase: str, phrase_score: float,
                 flip_rate: float, scale: float, seed: int):
        if kind not in REWARD_SHAPINGS:
            raise ValueError(f"reward.shaping.kind = {kind!r}: must be one of {REWARD_SHAPINGS}")
        self.base, self.kind, self.seed = base, kind, seed
        self.params = dict(length_bonus=length_bonus, phrase=phrase, phrase_score=phrase_score,
                           flip_rate=flip_rate, scale=scale)

    def __call__(self, samples: Sequence[Sample], texts: Sequence[str], finished: Sequence[bool]) -> RewardResult:
        res = self.base(samples, texts, finished)
        honest = res.scores.float()
        draws = ([flip_draw(self.seed, s.prompt_text or str(s.prompt_ids), t) for s, t in zip(samples, texts)]
                 if self.kind == "noisy" else None)
        answers = [None if s.ground_truth is None else str(s.ground_truth) for s in samples]
        shaped, hacked = shape_scores(honest, texts, answers, kind=self.kind, flip_draws=draws, **self.params)
        ok = torch.tensor([o == "ok" for o in res.outcomes], dtype=torch.bool)
        return RewardResult(torch.where(ok, shaped, honest), res.outcomes, honest=honest, hacked=hacked & ok)

    def check(self, samples, where: str) -> None:
        self.base.check(samples, where)

    def close(self) -> None:
        self.base.close()
