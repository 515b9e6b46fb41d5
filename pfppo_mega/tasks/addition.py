"""Built-in task: integer addition with an exact, rule-based reward.

Two written forms (`data.addition_format`):

- ``plain``: prompt ``"<s>123+45="``, correct response ``"168</s>"``.
- ``padded``: every number zero-padded (operands to `num_digits`, the sum to `num_digits + 1`
  digits): prompt ``"<s>123+045="``, correct response ``"0168</s>"``.
- ``reversed``: every number written least-significant digit first and zero-padded (operands to
  `num_digits`, the sum to `num_digits + 1` digits): 123 + 45 is prompt ``"<s>321+540="``,
  correct response ``"8610</s>"``: answer digit i comes right after the carry it needs.

In the padded forms every digit sits at a fixed position, so digit i of the answer is always at the
same distance from digit i of the operands (in the plain form that distance depends on the
operands' lengths, which a rotary-position model has to learn case by case).

The operand pairs are split into a training and a held-out set by a fixed hash, so evaluation
never sees a training prompt.

Why RL has something to add here: the SFT warm start learns from demonstrations with a
*systematic* error (`carry_drop`: in that fraction of the problems that need a carry into digit
`carry_digit`, the demonstrator forgets it and writes a + b - 10**carry_digit), so the warm start's
greedy answer is wrong exactly there while sampling still finds the right one sometimes; the PPO
reward is the exact verifier, which carries what the demonstrations do not. (Random label noise,
`noise`, only blurs the demonstrations: greedy decoding already averages it away.)
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pfppo_mega.constants import ADDITION_FORMATS as FORMATS
from pfppo_mega.types import Sample


@dataclass(frozen=True)
class AdditionProblem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        """The plain form's prompt (AdditionTask.prompt_text gives the task's own form)."""
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        """The plain form's answer (AdditionTask.answer_text gives the task's own form)."""
        return str(self.a + self.b)


class AdditionTask:
    """Operands in [0, 10**num_digits); about 1 pair in `holdout_every` is held out."""

    def __init__(self, num_digits: int, *, holdout_every: int = 8, format: str = "plain"):
        if num_digits < 1:
            raise ValueError(f"num_digits = {num_digits}: must be >= 1")
        if format not in FORMATS:
            raise ValueError(f"addition format = {format!r}: must be one of {', '.join(map(repr, FORMATS))}")
        self.num_digits = num_digits
        self.limit = 10**num_digits
        self.holdout_every = holdout_every
        self.format = format

    @classmethod
    def from_config(cls, data) -> "AdditionTask":
        """The task a DataConfig names (data.num_digits, data.addition_format)."""
        return cls(data.num_digits, format=data.addition_format)

    # ------------------------------------------------------------------ written form

    def prompt_text(self, p: AdditionProblem) -> str:
        if self.format == "plain":
            return p.prompt
        n = self.num_digits
        a, b = f"{p.a:0{n}d}", f"{p.b:0{n}d}"
        if self.format == "reversed":
            a, b = a[::-1], b[::-1]
        return f"{a}+{b}="

    def _write(self, total: int) -> str:
        """A sum (or a demonstrator's wrong sum) in the task's form."""
        if self.format == "plain":
            return str(total)
        padded = f"{total:0{self.num_digits + 1}d}"
        return padded[::-1] if self.format == "reversed" else padded

    def answer_text(self, p: AdditionProblem) -> str:
        return self._write(p.a + p.b)

    def read(self, response: str) -> int | None:
        """The number a response writes in the task's form (None if it is not one)."""
        if not response.isdigit():
            return None
        return int(response[::-1] if self.format == "reversed" else response)

    # ------------------------------------------------------------------ problems

    def is_held_out(self, p: AdditionProblem) -> bool:
        # A fixed multiplicative hash: independent of the seed, so every run agrees on the split.
        return ((p.a * 2654435761 + p.b * 40503) >> 7) % self.holdout_every == 0

    def _draw(self, rng: random.Random, held_out: bool) -> AdditionProblem:
        while True:
            p = AdditionProblem(rng.randrange(self.limit), rng.randrange(self.limit))
            if self.is_held_out(p) == held_out:
                return p

    def train_prompts(self, n: int, rng: random.Random) -> list[AdditionProblem]:
        return [self._draw(rng, held_out=False) for _ in range(n)]

    def eval_prompts(self, n: int, *, seed: int = 12345) -> list[AdditionProblem]:
        rng = random.Random(seed)
        return [self._draw(rng, held_out=True) for _ in range(n)]

    # ------------------------------------------------------------------ demonstrations

    @staticmethod
    def carries_into(p: AdditionProblem, digit: int) -> bool:
        """Whether adding p's operands carries into `digit` (0 = units, which nothing carries into)."""
        m = 10**digit
        return digit > 0 and (p.a % m) + (p.b % m) >= m

    def demonstration(self, p: AdditionProblem, rng: random.Random, *, noise: float, carry_drop: float = 0.0,
                      carry_digit: int = 2) -> str:
        """The SFT target for `p`, in the task's form. Systematic error first: if the sum carries
        into `carry_digit`, with probability `carry_drop` the demonstrator drops that carry (writes
        a + b - 10**carry_digit). Then random noise: with probability `noise` one digit is wrong.
        With carry_drop = 0 the rng is drawn from exactly as before carry_drop existed."""
        noisy = rng.random() < noise
        total = p.a + p.b
        if carry_drop > 0 and self.carries_into(p, carry_digit) and rng.random() < carry_drop:
            total -= 10**carry_digit
        ans = self._write(total)
        if noisy:
            i = rng.randrange(len(ans))
            wrong = rng.choice([d for d in "0123456789" if d != ans[i]])
            ans = ans[:i] + wrong + ans[i + 1:]
        return ans

    def reward(self, p: AdditionProblem, response: str, finished: bool) -> float:
        """1 for the exact sum in the task's form followed by EOS, else 0."""
        return 1.0 if finished and response == self.answer_text(p) else 0.0

    @property
    def max_answer_tokens(self) -> int:
        return self.num_digits + 2  # digits of the sum + EOS


# ----------------------------------------------------------------------------- the task as a
# PromptSource (pfppo_mega.types), data.source = task, data.task = addition; its RewardFn, which goes
# through the rewards' guard, is pfppo_mega.rewards.task.AdditionReward

DATA_SOURCE = "addition"


def to_sample(p: AdditionProblem, tokenizer, task: AdditionTask | None = None) -> Sample:
    """`p` as a Sample in `task`'s written form (None: the plain form)."""
    prompt, answer = (p.prompt, p.answer) if task is None else (task.prompt_text(p), task.answer_text(p))
    return Sample(prompt_ids=tuple(tokenizer.encode(prompt)), data_source=DATA_SOURCE, ground_truth=answer,
                  extra_info={"a": p.a, "b": p.b}, prompt_text=prompt, row=f"addition {prompt}")


class AdditionPrompts:
    """Training prompts drawn from `rng` (the trainer's prompt stream, the same on every rank, so the
    draws interleave with its sampling seeds exactly as before the seam); held-out prompts fixed.
    Each data-parallel replica draws the whole global batch and keeps its slice: the rows do not
    depend on the DP size. The position is that stream's state, which its owner checkpoints:
    state_dict holds nothing more."""

    rows_per_pass = None  # generated: no pass over the data ends
    observes = False      # the draws do not depend on the scores

    def __init__(self, task: AdditionTask, tokenizer, rng: random.Random, *, dp_rank: int = 0, dp_size: int = 1):
        self.task, self.tokenizer, self.rng = task, tokenizer, rng
        self.dp_rank, self.dp_size = dp_rank, dp_size

    def next_batch(self, n: int) -> list[Sample]:
        """n prompts for this replica: rows [dp_rank * n, (dp_rank + 1) * n) of the global n * dp_size."""
        drawn = self.task.train_prompts(n * self.dp_size, self.rng)
        return [to_sample(p, self.tokenizer, self.task) for p in drawn[self.dp_rank * n: (self.dp_rank + 1) * n]]

    def observe(self, rows: list[Sample], scores, rewards, step: int) -> None:
        pass

    def eval_samples(self, n: int) -> list[Sample]:
        return [to_sample(p, self.tokenizer, self.task) for p in self.task.eval_prompts(n)]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state != {}:
            raise ValueError(f"addition task data state {str(state)[:100]} must be {{}} (the position is the "
                             f"trainer's rng)")
