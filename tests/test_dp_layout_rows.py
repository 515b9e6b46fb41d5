"""A step's rows and their sampling seeds do not depend on the data-parallel size: every replica
holds the job's prompt stream, draws the global batch and keeps its slice, and the rollout split
seeds each row by its index in the job's rows. So a DP2 run asks for a DP1 run's rows, and a resume
at another DP size (1 -> 2, 2 -> 1) continues them exactly (the 2-process resume:
tests/test_trainer_parallel.py)."""

import random

import pytest

from pfppo_mega.rollout import SamplingParams
from pfppo_mega.rollout.base import row_seed
from pfppo_mega.tasks.addition import AdditionPrompts, AdditionTask
from pfppo_mega.tokenizer import char_tokenizer
from pfppo_mega.trainer.colocation.rollout_split import share_of
from pfppo_mega.trainer.seeds import stream_seed

SEED = 11


def _step_requests(dp: int, steps: int, per_step: int) -> list[list[tuple[list[tuple[int, ...]], int]]]:
    """What each replica asks for at each step: (its prompts, the call's seed), drawn as the trainer
    draws them (the step's prompts from the stream, then the generate call's seed from the same one)."""
    tok, task = char_tokenizer(), AdditionTask(3)
    out = []
    for d in range(dp):
        rng = random.Random(stream_seed("prompts", SEED))  # build.py: one stream, the same on every rank
        src = AdditionPrompts(task, tok, rng, dp_rank=d, dp_size=dp)
        out.append([([s.prompt_ids for s in src.next_batch(per_step // dp)], rng.randrange(1 << 31))
                    for _ in range(steps)])
    return out


def _row_seeds(leaders: dict, engines: int) -> dict[int, tuple[tuple[int, ...], int]]:
    """{row of the job: (prompt, its sampling seed)} over every engine's share."""
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4, eos_token_id=0)
    starts = {d: sum(len(leaders[e][0]) for e in sorted(leaders) if e < d) for d in leaders}
    rows = {}
    for engine in range(engines):
        for d, first, prompts, prm in share_of(engine, engines, leaders, params).calls:
            for i, p in enumerate(prompts):
                rows[starts[d] + first + i] = (tuple(p), row_seed(prm.seed, prm.row_offset + i))
    return rows


def test_dp1_and_dp2_draw_the_same_global_rows_and_seeds():
    one, = _step_requests(1, steps=3, per_step=8)
    two = _step_requests(2, steps=3, per_step=8)
    for step in range(3):
        (p0, s0), (p1, s1) = two[0][step], two[1][step]
        assert p0 + p1 == one[step][0], step      # replica 0's slice, then replica 1's: the DP1 batch
        assert s0 == s1 == one[step][1], step      # one seed per call for the job
    assert len({tuple(p) for p, _ in one}) == 3    # the steps differ: the check can tell


@pytest.mark.parametrize("dp,engines", [(2, 2), (2, 1), (2, 4), (4, 4), (4, 2)])
def test_every_row_is_seeded_by_its_place_in_the_job_not_its_replica(dp, engines):
    """The split at DP1 (one engine) and at DP dp over ``engines`` engines: each row of the job
    gets the same prompt and the same sampling seed."""
    (prompts, seed), = [r[0] for r in _step_requests(1, steps=1, per_step=8)]
    rows = [list(p) for p in prompts for _ in range(2)]                      # n = 2 samples per prompt
    want = _row_seeds({0: (rows, seed)}, 1)
    k = len(rows) // dp
    got = _row_seeds({d: (rows[d * k:(d + 1) * k], seed) for d in range(dp)}, engines)
    assert got == want and len(want) == len(rows)
    # seeded by the row's place in its replica (before the job-wide stream), replica 1 would repeat
    # replica 0's seeds: the rows' draws would depend on the DP size
    assert len({s for _, s in got.values()}) == len(rows)
