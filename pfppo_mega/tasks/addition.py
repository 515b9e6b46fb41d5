"""Built-in task: integer addition with an exact, rule-based reward.

Prompt ``"<s>123+45="``, correct response ``"168</s>"``. The operand pairs are split into a
training and a held-out set by a fixed hash, so evaluation never sees a training prompt.

Why RL has something to add here: the SFT warm start learns from *noisy* demonstrations
(`sft_noise`: a fraction of the answers carry one wrong digit, as imperfect human labels would),
while the PPO reward is the exact verifier. The reward carries what the SFT data does not:
which answers are right.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pfppo_mega.rewards.base import OutcomeLog, call_guarded, result_of
from pfppo_mega.types import RewardResult, Sample


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)


class AdditionTask:
    """Operands in [0, 10**num_digits); about 1 pair in `holdout_every` is held out."""

    def __init__(self, num_digits: int, *, holdout_every: int = 8):
        if num_digits < 1:
            raise ValueError(f"num_digits = {num_digits}: must be >= 1")
        self.num_digits = num_digits
        self.limit = 10**num_digits
        self.holdout_every = holdout_every

    def is_held_out(self, p: Problem) -> bool:
        # A fixed multiplicative hash: independent of the seed, so every run agrees on the split.
        return ((p.a * 2654435761 + p.b * 40503) >> 7) % self.holdout_every == 0

    def _draw(self, rng: random.Random, held_out: bool) -> Problem:
        while True:
            p = Problem(rng.randrange(self.limit), rng.randrange(self.limit))
            if self.is_held_out(p) == held_out:
                return p

    def train_prompts(self, n: int, rng: random.Random) -> list[Problem]:
        return [self._draw(rng, held_out=False) for _ in range(n)]

    def eval_prompts(self, n: int, *, seed: int = 12345) -> list[Problem]:
        rng = random.Random(seed)
        return [self._draw(rng, held_out=True) for _ in range(n)]

    def demonstration(self, p: Problem, rng: random.Random, *, noise: float) -> str:
        """The SFT target for `p`; with probability `noise` one digit of it is wrong."""
        ans = p.answer
        if rng.random() < noise:
            i = rng.randrange(len(ans))
            wrong = rng.choice([d for d in "0123456789" if d != ans[i]])
            ans = ans[:i] + wrong + ans[i + 1:]
        return ans

    @staticmethod
    def reward(p: Problem, response: str, finished: bool) -> float:
        """1 for the exact sum followed by EOS, else 0."""
        return 1.0 if finished and response == p.answer else 0.0

    @property
    def max_answer_tokens(self) -> int:
        return self.num_digits + 2  # digits of the sum + EOS


# ----------------------------------------------------------------------------- the task as a
# PromptSource + RewardFn pair (pfppo_mega.types), registered as data.source = task, data.task = addition

DATA_SOURCE = "addition"


def to_sample(p: Problem, tokenizer) -> Sample:
    return Sample(prompt_ids=tuple(tokenizer.encode(p.prompt)), data_source=DATA_SOURCE, ground_truth=p.answer,
                  extra_info={"a": p.a, "b": p.b}, prompt_text=p.prompt, row=f"addition {p.prompt}")


class AdditionPrompts:
    """Training prompts drawn from `rng` (the trainer's per-data-parallel-rank stream, so the draws
    interleave with its sampling seeds exactly as before the seam); held-out prompts fixed. The
    position is that stream's state, which its owner checkpoints (and reseeds per rank at dp > 1):
    state_dict holds nothing more."""

    def __init__(self, task: AdditionTask, tokenizer, rng: random.Random):
        self.task, self.tokenizer, self.rng = task, tokenizer, rng

    def next_batch(self, n: int) -> list[Sample]:
        return [to_sample(p, self.tokenizer) for p in self.task.train_prompts(n, self.rng)]

    def eval_samples(self, n: int) -> list[Sample]:
        return [to_sample(p, self.tokenizer) for p in self.task.eval_prompts(n)]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state != {}:
            raise ValueError(f"addition task data state {str(state)[:100]} must be {{}} (the position is the "
                             f"trainer's rng)")


class AdditionReward:
    """`task.reward` on each sample through the shared guard (rewards.base): exact sum + EOS."""

    def __init__(self, task: AdditionTask, *, log=print):
        self.task = task
        self.outcomes = OutcomeLog(log, f"{DATA_SOURCE} reward")

    def __call__(self, samples, texts, finished) -> RewardResult:
        calls = [call_guarded(self.task.reward, Problem(s.extra_info["a"], s.extra_info["b"]), text, bool(f))
                 for s, text, f in zip(samples, texts, finished)]
        return result_of(calls, samples, texts, self.outcomes)

    def check(self, samples, where: str) -> None:  # the task's own samples only (data.source = task)
        pass

    def close(self) -> None:
        pass
