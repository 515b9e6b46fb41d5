"""The rollout-engine interface shared by every generation backend.

A trainer pushes policy weights into an engine as a stream of buckets (pfppo_mega.rollout.weights:
flat buffers of whole tensors in Hugging Face Llama naming, ``model.layers.0.self_attn.q_proj.weight``
...) tagged with an integer version, then asks it to complete a batch of token-id prompts. The
built-in pure-torch engine and the vLLM engine implement :class:`RolloutEngine`; one conformance
suite (tests/test_rollout_engine.py) runs over both.

Lifecycle: ``update_weights(buckets, version)`` (refit to the current policy and switching to a
pool snapshot are the same call), ``generate`` (every row tagged with the version and stream
checksum of the weights that produced it), ``sleep()`` / ``wake_up()`` around the trainer's
update (free what the engine can; a logged no-op where it cannot). An engine whose sleep frees the
weights themselves (``sleep_discards_weights``: vLLM's level 2 on a GPU, where wake_up brings back
memory, not weights) holds no version afterwards: weight_version -1 until the next complete update,
so every "already holds that version" check (Generation.ensure_current, EngineSync.switch, the
PF-PPO pool's held snapshot) pushes the weights again instead of generating on what is left.

Log-prob contract (every backend):
    sampled:  logprob_t = log_softmax(logits_t / temperature)[token_t]
    greedy:   logprob_t = log_softmax(logits_t)[token_t]                  (temperature 1)
Top-p truncation changes which tokens can be drawn but NOT the reported log-prob, so the trainer
recomputes it exactly from its own logits divided by the temperature. Exception, declared by
``RolloutEngine.top_p_logprobs = "nucleus"``: vLLM reports, for top_p < 1, the log-prob under the
renormalised nucleus (the distribution the token was drawn from), log_softmax(logits / T)[token]
- log(nucleus mass); the trainer refuses top_p < 1 with such an engine.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional

import torch

from pfppo_mega.rollout.source import NamedTensorSource
from pfppo_mega.rollout.weights import (Bucket, BucketReceiver, BucketSpec, WeightLayout, WeightUpdateError,
                                        plan_buckets)

DEFAULT_BUCKET_BYTES = 64 << 20
WAKE_TAGS = ("weights", "kv_cache")  # what wake_up() can bring back, in the colocated order


class EngineSetupError(ValueError):
    """The configured rollout engine cannot run in this job; the message names the key, the value
    and the rule."""


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def engine_dtype(cfg) -> torch.dtype:
    """actor_rollout.dtype: auto = the training dtype (model.params_dtype)."""
    name = cfg.actor_rollout.dtype
    return _DTYPES[cfg.model.params_dtype if name == "auto" else name]


@dataclass(frozen=True)
class EngineSpec:
    """One kind of engine as the run builder sees it; registered by name in
    ``pfppo_mega.registry.ROLLOUT_ENGINES`` (the key ``actor_rollout.engine``).

    check(cfg, world_size=):  every check that needs no engine; raises EngineSetupError
    build(cfg, model_dir, hf_cfg, pad_token_id=, bucket_bytes=, max_model_len=, device=, log=) -> RolloutEngine
    from_hf_model(hf_model, pad_token_id=, version=1, **engine kw) -> RolloutEngine holding that
        in-memory transformers model's weights as ``version`` (the conformance suite, benchmarks)
    unavailable() -> '' when the engine can run here, else why not (a missing package)
    """

    check: Callable[..., None]
    build: Callable[..., "RolloutEngine"]
    from_hf_model: Callable[..., "RolloutEngine"]
    unavailable: Callable[[], str] = lambda: ""


def row_seed(seed: int, row: int) -> int:
    """The seed of row ``row`` of a request seeded ``seed`` (every engine uses this rule)."""
    return (seed * 1_000_003 + row) % (2 ** 31)


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
    """Seeds every row's own generator, row_seed(seed, row_offset + i) for row i of the call: the same
    seed, weights and prompt give the same response whichever call, batch or engine the row is in.
    None draws from torch's global generator."""
    row_offset: int = 0
    """Index of this call's first row in the request it is a share of (rollout split across engines)."""

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
    weight_version: int  # version of the weights that generated every row (a partial rollout: the last)
    versions: Optional[torch.Tensor] = None  # [B] int64, the weight version of each row (partial: its oldest token's)
    weight_checksum: str = ""  # stream checksum of the update that produced the rows
    token_versions: Optional[torch.Tensor] = None  # [B, T] int64, the version of each token (-1 on padding);
    # None: every token of row b is versions[b]'s (set by generate_partial only)

    def __post_init__(self) -> None:
        if self.versions is None:
            self.versions = torch.full((len(self.prompts),), self.weight_version, dtype=torch.long)


def oldest_versions(token_versions: torch.Tensor, fallback: int) -> torch.Tensor:
    """token_versions [B, T] (-1 on padding) -> [B] each row's oldest token's version (``fallback``
    for a row without tokens): the version a partial rollout's row is as stale as."""
    big = torch.iinfo(torch.long).max
    low = token_versions.masked_fill(token_versions < 0, big).min(dim=1).values                  # [B]
    return torch.where(low == big, torch.full_like(low, fallback), low)


def check_prompts(prompts: list[list[int]], params: SamplingParams, *, max_positions: int,
                  vocab_size: int) -> None:
    """Every engine's prompt rules: a non-empty batch of non-empty prompts of in-vocabulary ids,
    each leaving room for max_new_tokens within max_positions."""
    if len(prompts) == 0:
        raise ValueError("generate() got an empty batch; need at least one prompt")
    limit = max_positions - params.max_new_tokens
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs >= 1 token")
        if len(prompt) > limit:
            raise ValueError(
                f"prompt {i} has length {len(prompt)} > {limit} = max_position_embeddings"
                f"({max_positions}) - max_new_tokens({params.max_new_tokens})"
            )
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids {bad[:5]} outside [0, {vocab_size})")


class RolloutEngine(abc.ABC):
    """Generates responses with the most recently pushed policy weights.

    Subclasses implement ``weight_layout``, ``_begin_update`` / ``_apply`` / ``_commit`` (the
    engine-specific part of update_weights), ``generate`` and, where they can, sleep / wake_up.
    """

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    log: Callable[[str], None] = print
    top_p_logprobs: str = "full"  # or "nucleus": see the module docstring
    partial_rollouts: bool = False  # generate_partial: new weights enter between two decode steps
    _version: int = -1
    _checksum: str = ""
    sleep_discards_weights: bool = False  # sleep() frees the weights (not a host copy): see the module docstring

    # ----------------------------------------------------------------- weights
    @abc.abstractmethod
    def weight_layout(self) -> WeightLayout:
        """Names, shapes and dtype of the weights this engine takes, in order."""

    def bucket_plan(self) -> list[BucketSpec]:
        return plan_buckets(self.weight_layout(), self.bucket_bytes)

    @property
    def weight_version(self) -> int:
        """Version of the last complete update; -1 before the first one and after a failed one."""
        return self._version

    @property
    def weight_checksum(self) -> str:
        """Stream checksum of the last complete update ('' when weight_version is -1)."""
        return self._checksum

    def update_weights(self, buckets: Iterable[Bucket], version: int) -> None:
        """Take a new set of weights, bucket by bucket, and tag them ``version``.

        Each bucket is checked (plan order, version, checksum) before it is applied; the stream
        must cover the whole plan. On any error the engine holds no valid version (weight_version
        -1, generate refuses) until a complete update succeeds: a refit interrupted half-way never
        produces a silent mix of two versions. After a bucket is refused the rest of the stream is
        still consumed (not applied), so every rank of a broadcast stream takes part in every
        broadcast whichever rank failed (no rank is left waiting); then the error is raised.
        """
        receiver = BucketReceiver(self.weight_layout(), version)
        self._version, self._checksum = -1, ""
        self._begin_update()
        stream = iter(buckets)
        error: Exception | None = None
        try:
            self._apply_stream(receiver.accept(bucket) for bucket in stream)
            checksum = receiver.finish()
        except Exception as e:
            error = e
        if error is not None:
            self._abort_update()
            if not isinstance(error, WeightUpdateError):
                cause = error
                error = WeightUpdateError(f"update to version {version} failed after {len(receiver.checksums)} "
                                          f"bucket(s): {type(cause).__name__}: {cause}")
                error.__cause__ = cause
            try:
                for _ in stream:  # drain: the other ranks' broadcasts must complete
                    pass
            except Exception:  # the stream's own error (e.g. an owner that produced nothing) ends it
                pass
            raise error
        self._commit()
        self._version, self._checksum = version, checksum

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """A full set of (Hugging Face name, tensor) pairs -> update_weights. Strict: every
        expected name exactly once, nothing else, exact shapes; checked before anything changes."""
        source = NamedTensorSource(named_tensors, version, layout=self.weight_layout())
        self.update_weights(source.buckets(self.bucket_plan()), version)

    def invalidate(self) -> None:
        """Hold no valid version (generate refuses) until the next complete update."""
        self._version, self._checksum = -1, ""

    def _begin_update(self) -> None:
        """Called before the first bucket of an update."""

    @abc.abstractmethod
    def _apply(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Put one verified bucket's tensors (whole fused groups) into the model."""

    def _apply_stream(self, buckets: Iterator[list[tuple[str, torch.Tensor]]]) -> None:
        """Put every verified bucket of one update into the model, in order (a bucket's tensors may
        be views of a buffer the stream reuses once the next bucket is drawn). An error raised by
        ``buckets`` (a refused bucket, a lost producer) propagates; what was applied stays applied,
        and update_weights leaves the engine without a valid version. Default: _apply per bucket."""
        for named in buckets:
            self._apply(named)

    def _commit(self) -> None:
        """Called after the last bucket of a complete update (e.g. reset a prefix cache)."""

    def _abort_update(self) -> None:
        """Called when an update fails part-way."""

    def _require_weights(self) -> None:
        if self._version < 0:
            raise RuntimeError("generate() called before any load_weights() / update_weights(), or after a "
                               "failed one: push a complete, verified set of weights first")

    # ----------------------------------------------------------------- memory
    def sleep(self) -> None:
        """Free what the engine can (KV cache, on GPUs the weights) while the trainer runs. When that
        discards the weights (sleep_discards_weights), call invalidate(): the engine holds no version."""
        self._log_once(f"[rollout] {type(self).__name__}.sleep(): nothing to free on this engine (no-op)")

    def _log_once(self, line: str) -> None:
        if not getattr(self, "_logged_sleep", False):
            self._logged_sleep = True
            self.log(line)

    def wake_up(self, tags: Optional[tuple[str, ...]] = None) -> None:
        """Undo sleep() before the next generate(): ``tags`` among WAKE_TAGS ("weights" first, so a
        refit can land before the KV cache takes its memory; None: all)."""

    # -------------------------------------------------------------- generation
    def generate_partial(self, prompts: list[list[int]], params: SamplingParams,
                         switch: Callable[[int], bool]) -> RolloutOutput:
        """generate(), calling ``switch(t)`` at every token boundary (before token t >= 1 of the rows
        is drawn); a switch that pushed new weights (update_weights) returns True and the rest of the
        rows is generated with them. Each token is tagged with the version that drew it
        (``token_versions``) and its log-prob is that version's, conditioned on the whole prefix.
        Only where ``partial_rollouts`` is declared."""
        raise NotImplementedError(f"{type(self).__name__} cannot take new weights inside a request "
                                  f"(partial_rollouts = False)")

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        """Complete every prompt (a non-empty list of token ids). Log-probs follow the
        module-level contract."""
