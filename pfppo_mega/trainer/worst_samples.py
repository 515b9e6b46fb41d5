"""Per-step dumps of the few worst samples (logging.worst_samples) to samples_worst.jsonl.

Each training step appends, for each kind, the k samples that rank first by it:

    longest         response length in tokens (ties: higher reward first)
    repetitive      repetition rate (fraction of repeated token bigrams; ties: longer first)
    highest_reward  the trained-on reward (ties: longer first)

one JSON record per sample: step, kind, rank, row (the prompt's id), prompt, text, length,
repetition, reward (trained-on, before preprocessing), honest (the honest metric, when the reward
reports one), finished, version (the weight version / PF-PPO snapshot that generated it). The
records of one step are what `pfppo doctor` quotes at a KL spike of that step.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

FILE = "samples_worst.jsonl"
KINDS = ("longest", "repetitive", "highest_reward")


@dataclass(frozen=True)
class WorstSample:
    step: int
    kind: str
    rank: int
    row: str
    prompt: str
    text: str
    length: int
    repetition: float
    reward: float
    honest: Optional[float]
    finished: bool
    version: int


def pick_worst(lengths: Sequence[int], repetition: Sequence[float], rewards: Sequence[float],
               k: int) -> list[tuple[str, int, int]]:
    """(kind, rank, row index) of the top k rows of each kind (a row may appear under several kinds)."""
    n = len(lengths)
    keys = {
        "longest": lambda i: (-lengths[i], -rewards[i], i),
        "repetitive": lambda i: (-repetition[i], -lengths[i], i),
        "highest_reward": lambda i: (-rewards[i], -lengths[i], i),
    }
    return [(kind, r, i) for kind in KINDS for r, i in enumerate(sorted(range(n), key=keys[kind])[:k])]


def append(path: Path, records: Sequence[WorstSample]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(asdict(rec)) + "\n")


def read(path: Path) -> dict[int, list[dict]]:
    """step -> its records (a torn or foreign line is skipped); {} when the file is absent."""
    out: dict[int, list[dict]] = {}
    if not path.is_file():
        return out
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            out.setdefault(rec["step"], []).append(rec)
    return out
