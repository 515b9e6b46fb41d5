"""How a batch of right-padded rows is cut into micro-batches, and the work that costs.

Two plans (pfppo_mega.models.passes runs both through megatron's schedule):

- by rows (the default): consecutive rows, ``micro_batch_size`` at a time, every micro-batch as
  long as the longest row of the whole batch;
- by token budget (verl's ``use_dynamic_bsz``): rows sorted by length, longest first, and taken
  in that order while rows x (longest row of the micro-batch) stays within ``max_tokens``; each
  micro-batch is cut to its own longest row. Rows of similar length share a micro-batch, so the
  positions computed on padding shrink to what the length spread within a micro-batch leaves.

Either way every row is in exactly one micro-batch; losses normalised by global counts (engine
``share_scale``) and outputs put back in row order make the plan invisible in the results, up to
the order of floating-point sums.

``Tally`` counts the work of the passes that used it: positions the decoder ran (padding
included), real tokens, causal attention pairs of the real tokens, and positions the head (LM or
value head) ran at against the response tokens it was needed at.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class Tally:
    """Work of the forward passes that counted into it (a training pass counts its forward once)."""

    passes: int = 0          # engine calls
    micro_batches: int = 0
    computed: int = 0        # decoder positions run: rows x S of every micro-batch (padding rows included)
    real: int = 0            # real tokens among them (the attention mask)
    attn_pairs: int = 0      # causal (query, key) pairs of the real tokens: sum over rows of n (n + 1) / 2
    head_computed: int = 0   # positions the output layer (LM / value head) ran at
    head_needed: int = 0     # response tokens: where its output is used

    def add(self, other: "Tally") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def take(self) -> "Tally":
        """This tally's counts; the tally itself starts again from zero."""
        out = Tally(**{f.name: getattr(self, f.name) for f in fields(self)})
        for f in fields(self):
            setattr(self, f.name, 0)
        return out

    @property
    def padding_frac(self) -> float:
        """Share of the decoder positions run that were padding (0 when nothing ran)."""
        return 1.0 - self.real / self.computed if self.computed else 0.0

    @property
    def head_waste_frac(self) -> float:
        """Share of the head's positions whose output nobody reads (prompt and padding positions)."""
        return 1.0 - self.head_needed / self.head_computed if self.head_computed else 0.0


def by_rows(batch: int, micro_batch_size: int) -> list[list[int]]:
    """[[0 .. mbs-1], [mbs .. 2 mbs-1], ...]: consecutive rows."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size({micro_batch_size}) must be >= 1")
    return [list(range(s, min(s + micro_batch_size, batch))) for s in range(0, batch, micro_batch_size)]


def by_token_budget(lengths: list[int], *, max_tokens: int, max_rows: int | None = None,
                    multiple: int = 1) -> list[list[int]]:
    """Row indices of each micro-batch: rows sorted by length (longest first, ties in row order),
    added to the current micro-batch while rows x padded length <= max_tokens (the padded length:
    its longest row rounded up to ``multiple``) and rows <= max_rows (None: no cap).

    A row longer than max_tokens runs alone in its micro-batch (over the budget; verl refuses such a
    batch). Deterministic: the same lengths always give the same plan."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens({max_tokens}) must be >= 1")
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows({max_rows}) must be >= 1 or None")
    if not lengths:
        return []
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))

    def padded(n: int) -> int:
        return -(-n // multiple) * multiple

    plan: list[list[int]] = []
    current: list[int] = []
    width = 0  # padded length of the current micro-batch: its first (longest) row's
    for i in order:
        if not current:
            current, width = [i], padded(lengths[i])
        elif (len(current) + 1) * width <= max_tokens and (max_rows is None or len(current) < max_rows):
            current.append(i)
        else:
            plan.append(current)
            current, width = [i], padded(lengths[i])
    plan.append(current)
    return plan


def padding_frac(lengths: list[int], plan: list[list[int]], *, width: int | None = None,
                 multiple: int = 1) -> float:
    """Share of the positions a plan runs that are padding: each micro-batch runs rows x its padded
    length (``width`` when given: the by-rows plan's common length)."""
    computed = real = 0
    for rows in plan:
        s = width if width is not None else -(-max(lengths[i] for i in rows) // multiple) * multiple
        computed += len(rows) * s
        real += sum(lengths[i] for i in rows)
    return 1.0 - real / computed if computed else 0.0
