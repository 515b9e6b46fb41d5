"""Generation with the run's engine, as every behaviour policy and the evaluation use it.

``Generation`` owns no weights: it asks EngineSync to put a version into the engine, generates
n responses per prompt with whatever the engine holds (rows tagged with its version), guards a
failing engine (push the same verified weights again, generate once more) and runs the rollout
colocated (the trainer's states on the host while the engine generates, the engine asleep
before they come back).
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch

from pfppo_mega.rollout import SamplingParams
from pfppo_mega.tokenizer import Tokenizer
from pfppo_mega.trainer import devicecheck
from pfppo_mega.trainer.batch import RolloutBatch
from pfppo_mega.trainer.engine_sync import EngineSync
from pfppo_mega.trainer.offload import TrainerOffload
from pfppo_mega.types import Sample


class Generation:
    def __init__(self, cfg, *, engine, sync: EngineSync, offload: TrainerOffload, tokenizer: Tokenizer,
                 rng: random.Random, device: torch.device, guards: dict[str, int],
                 log: Callable[[str], None]) -> None:
        self.cfg, self.engine, self.sync, self.offload = cfg, engine, sync, offload
        self.tokenizer, self.rng, self.device, self.guards, self.log = tokenizer, rng, device, guards, log
        self.rollout_trainer_bytes = -1  # trainer bytes on the device during the last generation

    # ------------------------------------------------------------------ weights

    def sync_weights(self, version: int) -> None:
        """The actor's current weights into the engine as ``version``."""
        self.engine.wake_up()  # a sleeping engine takes no weights
        # on_device: a live refit inside the rollout phase (PF-PPO's current policy) while offloaded;
        # paused: the engine seam keeps host wire buffers by design
        with self.offload.on_device(), devicecheck.paused():
            self.sync.refit_live(version)

    def ensure_current(self, step: int) -> None:
        """The engine holds the current weights (version == step) afterwards."""
        if self.engine.weight_version != step:  # it may hold a behaviour snapshot
            self.sync_weights(step)

    # ------------------------------------------------------------------ generation

    @contextmanager
    def colocated(self) -> Iterator[None]:
        """The rollout phase's frame: the trainer's states on the host (training.offload_during_rollout)
        and the engine put to sleep once it has generated, before those states come back."""
        self.engine.wake_up()
        with self.offload.offloaded():
            self.rollout_trainer_bytes = self.offload.device_bytes()
            try:
                yield
            finally:
                self.engine.sleep()

    def offload_stats(self) -> dict[str, float]:
        if not self.offload.enabled:
            return {}
        return {"time/offload_s": self.offload.last_offload_s, "time/reload_s": self.offload.last_reload_s}

    def generate(self, samples: list[Sample], n: int, *, step: int, groups: Optional[list[int]] = None,
                 pool=None) -> RolloutBatch:
        """n responses per prompt with whatever weights the engine holds (rows carry its version).
        ``groups``: each prompt's index in the step (default 0..len-1; rows carry it as group_ids).
        ``pool``: where a failed generation's snapshot is pushed again from (None: live weights)."""
        cfg = self.cfg
        groups = list(range(len(samples))) if groups is None else groups
        group_ids = torch.tensor([g for g in groups for _ in range(n)], dtype=torch.long)       # [B]
        samples = [s for s in samples for _ in range(n)]
        prompt_ids = [list(s.prompt_ids) for s in samples]
        self._check_prompts(prompt_ids)
        params = SamplingParams(temperature=cfg.actor_rollout.temperature, top_p=cfg.actor_rollout.top_p,
                                max_new_tokens=cfg.algorithm.max_response_length,
                                eos_token_id=self.tokenizer.eos_id, seed=self.rng.randrange(1 << 31))
        with devicecheck.paused():  # the engine's own device world; its rows are host until moved
            out = self._guarded_generate(prompt_ids, params, step=step, pool=pool)
        devicecheck.mark_host(out.responses, out.response_mask, out.logprobs, out.finished)
        self.sync.check_versions(f"rollout at step {step}")  # every engine, same version and checksum
        texts = [self.tokenizer.decode(r[: int(l)].tolist()) for r, l in zip(out.responses, out.lengths)]
        return RolloutBatch(samples=samples, prompt_ids=prompt_ids, responses=out.responses,
                            response_mask=out.response_mask, behav_logp=out.logprobs, finished=out.finished,
                            versions=torch.full((len(samples),), out.weight_version), texts=texts,
                            group_ids=group_ids).to(self.device)

    def _guarded_generate(self, prompt_ids: list[list[int]], params: SamplingParams, *, step: int, pool):
        """engine.generate, agreed on by every rank. When it fails anywhere (an engine that died or
        raised mid-generation), every rank pushes the same verified weights again (the snapshot or
        the live weights it was generating with) and generates once more, counted in
        guard/engine_failures; a second failure stops the run with the ranks and the cause."""
        version = self.engine.weight_version
        for attempt in (1, 2):
            out, error = None, None
            try:
                out = self.engine.generate(prompt_ids, params)
            except Exception as e:  # any engine failure: agreed on below, so no rank is left waiting
                error = e
            bad = self.sync.failing_ranks(error is None)
            if not bad:
                return out
            cause = f"{type(error).__name__}: {error}" if error is not None else f"see rank {bad[0]}'s log"
            if attempt == 2:
                raise RuntimeError(
                    f"rollout at step {step}: the rollout engine failed on rank(s) {bad} again after its weights "
                    f"(version {version}) were pushed again; stopping ({cause})") from error
            self.guards["engine_failures"] += 1  # every rank agrees: no DP sum needed
            self.log(f"[pfppo] step {step}: the rollout engine failed on rank(s) {bad} ({cause}); pushing "
                     f"weight version {version} again and regenerating")
            with self.offload.on_device():  # the live weights, also while offloaded
                self.sync.reload(pool, version, step)
        raise AssertionError("unreachable")

    def _check_prompts(self, prompt_ids: list[list[int]]) -> None:
        limit = self.cfg.data.max_prompt_length
        for i, p in enumerate(prompt_ids):
            if len(p) > limit:
                raise ValueError(f"prompt {i} has {len(p)} tokens > data.max_prompt_length ({limit})")
