"""Built-in rollout engine: the pure-torch LlamaDecoder with a preallocated KV cache.

generate(): prefill the prompts in one packed forward (no padding computed; each row's keys and
values land left-padded in the cache), then decode one token per step for all rows at once; a row
that emitted EOS keeps being computed (its outputs are discarded) until every row is finished or
max_new_tokens is reached. A prompt that several rows share (GRPO's n samples of a prompt) is
prefilled once: its keys, values and last-token logits are copied to each of its rows
(``share_prompts``; the rows' draws and log-probs are those of separate prefills).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

from pfppo_mega.families import DecoderShape
from pfppo_mega.rollout.base import (DEFAULT_BUCKET_BYTES, EngineSetupError, EngineSpec, RolloutEngine, RolloutOutput,
                                     SamplingParams, check_prompts, engine_dtype, oldest_versions, row_seed)
from pfppo_mega.rollout.llama import (
    KVCache,
    LlamaDecoder,
    positions_from_mask,
    prefill_mask,
)
from pfppo_mega.rollout.weights import WeightLayout, check_named_tensors


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [B, V] -> probs with every token outside the nucleus set to 0 (not renormalised).

    The nucleus keeps, in order of decreasing probability, each token whose preceding
    cumulative mass is < top_p; the most likely token is always kept.
    """
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # [B, V]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [B, V]
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def draw_tokens(probs: torch.Tensor,
                generator: torch.Generator | list[torch.Generator] | None) -> torch.Tensor:
    """probs [B, V] (unnormalised, >= 0) -> tokens [B] int64, one draw per row by inverse CDF.

    A row takes one uniform u from its generator (or the batch's) and the first token whose
    cumulative mass exceeds u x the row's total. One random number a row, where torch.multinomial
    cost ~1.5 ms per row at V = 49,152 on this CPU (more than a decode step's matmuls). A token of
    mass 0 is never drawn: the cumulative mass only grows at tokens of positive mass, and the
    threshold stays below the total.
    """
    B = probs.shape[0]
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)  # [B, V]
    total = cdf[:, -1:]  # [B, 1]
    if isinstance(generator, list):  # per-row generators: each row draws from its own stream
        u = torch.cat([torch.rand(1, dtype=torch.float64, generator=g, device=probs.device) for g in generator])
    else:
        u = torch.rand(B, dtype=torch.float64, generator=generator, device=probs.device)
    threshold = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, threshold, right=True).squeeze(-1)  # [B]


def sample_tokens(logits: torch.Tensor, params: SamplingParams,
                  generator: torch.Generator | list[torch.Generator] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] fp32 -> (tokens [B] int64, logprobs [B] fp32).

    logprob = log_softmax(logits / T)[token] (T = 1 when greedy); top-p only restricts the draw.
    ``generator``: one for the batch, or one per row (a row's draws then depend on its seed alone).
    """
    if params.greedy:
        tokens = logits.argmax(dim=-1)  # [B]
        logp = torch.log_softmax(logits, dim=-1)
    else:
        logp = torch.log_softmax(logits / params.temperature, dim=-1)  # [B, V]
        probs = logp.exp()
        if params.top_p < 1.0:
            probs = top_p_filter(probs, params.top_p)
        tokens = draw_tokens(probs, generator)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


class BuiltinEngine(RolloutEngine):
    """In-process generation with LlamaDecoder.

    max_batch_size bounds the KV cache: larger batches are generated in chunks of that size
    (every row has its own seeded generator, so results do not depend on the chunking).
    """

    def __init__(self, shape: DecoderShape, *, pad_token_id: int,
                 dtype: torch.dtype = torch.float32, max_batch_size: int | None = None,
                 device: torch.device | str = "cpu", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 pack_weights: bool = True, share_prompts: bool = True, log=print) -> None:
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1 or None")
        self.shape = shape
        self.pad_token_id = pad_token_id
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.device = torch.device(device)
        self.model = LlamaDecoder(shape, dtype=dtype, device=self.device)
        self._expected = shape.hf_shapes()
        self._params = dict(self.model.named_parameters())
        assert self._params.keys() == self._expected.keys(), "decoder names drifted from shape"
        self._version, self._checksum = -1, ""
        self.bucket_bytes = bucket_bytes
        self.log = log
        # oneDNN-prepacked weights on a CPU (twice the matmul rate of F.linear here, a second copy of
        # the weights in memory); packed lazily at the first generate() after each weight update
        self.pack_weights = pack_weights
        self._packed = False
        self.share_prompts = share_prompts  # prefill each distinct prompt of a generate() call once

    # ----------------------------------------------------------------- weights
    def weight_layout(self) -> WeightLayout:
        return WeightLayout.of(self._expected, self.dtype, tied=self.shape.tie_word_embeddings)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                     version: int) -> None:
        """Copy the tensors in place (cast to the engine dtype). Strict: every expected name
        exactly once, nothing else, exact shapes; on any error nothing is copied (unlike a
        failed update_weights, the previous version stays valid).

        With tied embeddings a `lm_head.weight` equal to `model.embed_tokens.weight` is
        accepted and skipped (Hugging Face state_dicts list the tied tensor under both names).
        """
        received = check_named_tensors(named_tensors, self.weight_layout(), version)
        self._apply(list(received.items()))
        self._version, self._checksum = version, f"load_weights:{version}"

    def _apply(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.model.unpack()  # a pack is a snapshot of the old weights; generate() repacks
        self._packed = False
        for name, tensor in named:
            self._params[name].copy_(tensor)

    def _pack(self, rows: int) -> None:
        """Prepack the matmul weights for oneDNN once per weight version (rollout/llama.py)."""
        if self.pack_weights and not self._packed:
            self._packed = self.model.pack(batch_hint=rows)

    # ----------------------------------------------------------------- scoring
    @torch.no_grad()
    def forward_logits(self, input_ids: torch.Tensor,
                       attention_mask: torch.Tensor) -> torch.Tensor:
        """input_ids, attention_mask [B, S] (1 = real token, left or right padding) ->
        logits [B, S, V] fp32, one full forward without a cache. Padded positions hold
        finite values that mean nothing."""
        key_valid = attention_mask.to(self.device).bool()
        input_ids = input_ids.to(self.device)
        self._pack(input_ids.shape[0])
        logits = self.model(input_ids, positions_from_mask(key_valid), prefill_mask(key_valid))
        return logits.float()

    # -------------------------------------------------------------- generation
    partial_rollouts = True

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        output, _ = self._generate(prompts, params, keep_logits=False)
        return output

    def generate_partial(self, prompts: list[list[int]], params: SamplingParams,
                         switch: Callable[[int], bool]) -> RolloutOutput:
        """generate(), taking new weights between two decode steps (RolloutEngine.generate_partial).
        After a switch the rows' keys and values are computed again with the new weights (one packed
        prefill of prompt + tokens so far), so every later token is drawn from, and its log-prob is,
        the new version's distribution given the whole prefix: exactly what a recomputation with
        that version's weights gives. A row's seeded generator runs on across the switch."""
        output, _ = self._generate(prompts, params, keep_logits=False, switch=switch)
        return output

    def generate_with_logits(self, prompts: list[list[int]],
                             params: SamplingParams) -> tuple[RolloutOutput, torch.Tensor]:
        """generate(), plus the raw logits [B, T, V] fp32 each response token was drawn from
        (0 on padding). For tests and debugging."""
        output, logits = self._generate(prompts, params, keep_logits=True)
        assert logits is not None
        return output, logits

    def _check_prompts(self, prompts: list[list[int]], params: SamplingParams) -> None:
        self._require_weights()
        check_prompts(prompts, params, max_positions=self.shape.max_position_embeddings,
                      vocab_size=self.shape.vocab_size)

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], params: SamplingParams, keep_logits: bool,
                  switch: Optional[Callable[[int], bool]] = None) -> tuple[RolloutOutput, torch.Tensor | None]:
        self._check_prompts(prompts, params)
        generators = None  # one per row, seeded by row_seed (the rule every engine follows)
        if params.seed is not None:
            generators = [torch.Generator(device=self.device).manual_seed(row_seed(params.seed, params.row_offset + i))
                          for i in range(len(prompts))]
        chunk = self.max_batch_size or len(prompts)
        parts = []
        for i in range(0, len(prompts), chunk):
            self._pack(chunk)  # again after a switch (new weights unpack)
            parts.append(self._generate_chunk(prompts[i:i + chunk], params, None if generators is None
                                              else generators[i:i + chunk], keep_logits, switch))
        T = max(p[0].shape[1] for p in parts)

        def cat(index: int, fill: float) -> torch.Tensor:
            padded = []
            for p in parts:
                x = p[index]
                pad_shape = (x.shape[0], T - x.shape[1]) + tuple(x.shape[2:])
                padded.append(torch.cat([x, x.new_full(pad_shape, fill)], dim=1))
            return torch.cat(padded)

        responses = cat(0, self.pad_token_id)
        logprobs = cat(1, 0.0)
        lengths = torch.cat([p[2] for p in parts])
        finished = torch.cat([p[3] for p in parts])
        mask = (torch.arange(T, device=self.device)[None, :] < lengths[:, None]).float()
        token_versions = None
        if switch is not None:
            token_versions = cat(5, -1).masked_fill(mask == 0, -1)                             # [B, T]
        output = RolloutOutput(
            prompts=[list(p) for p in prompts],
            responses=responses,
            response_mask=mask,
            logprobs=logprobs,
            lengths=lengths,
            finished=finished,
            weight_version=self._version,
            weight_checksum=self._checksum,
            versions=None if token_versions is None else oldest_versions(token_versions, self._version),
            token_versions=token_versions,
        )
        return output, (cat(4, 0.0) if keep_logits else None)

    def _generate_chunk(self, prompts: list[list[int]], params: SamplingParams,
                        generator: list[torch.Generator] | None, keep_logits: bool,
                        switch: Optional[Callable[[int], bool]] = None):
        """-> responses [B, T], logprobs [B, T], lengths [B], finished [B], logits [B, T, V]|None,
        token versions [B, T]"""
        B, N = len(prompts), params.max_new_tokens
        P = max(len(p) for p in prompts)
        dev = self.device
        key_valid = torch.zeros(B, P + N, dtype=torch.bool, device=dev)  # [B, K_max], left-padded prompts
        for b, prompt in enumerate(prompts):
            key_valid[b, P - len(prompt):] = True  # the response slots are real too
        logits, cache = self._prefill(prompts, P + N, end=P)  # [B, V], the rows' caches
        next_pos = key_valid[:, :P].sum(-1)  # [B] position of the token about to be sampled
        finished = torch.zeros(B, dtype=torch.bool, device=dev)
        lengths = torch.zeros(B, dtype=torch.long, device=dev)
        tokens_out, logprobs_out, logits_out, versions_out = [], [], [], []
        drawn: list[torch.Tensor] = []  # the tokens fed back (finished rows' too), for a re-prefill
        for t in range(N):
            step_logits = logits.float()  # [B, V]
            tokens, logprobs = sample_tokens(step_logits, params, generator)
            alive = ~finished
            tokens_out.append(torch.where(alive, tokens, self.pad_token_id))
            logprobs_out.append(torch.where(alive, logprobs, 0.0))
            versions_out.append(torch.full((B,), self._version, dtype=torch.long, device=dev))
            drawn.append(tokens)
            if keep_logits:
                logits_out.append(step_logits * alive[:, None])
            lengths += alive.long()
            if params.eos_token_id is not None:
                finished |= tokens == params.eos_token_id
            if t == N - 1 or bool(finished.all()):  # host sync, once per step
                break
            if switch is not None and switch(t + 1):  # new weights: the prefix's keys and values again
                self._pack(B)
                so_far = torch.stack(drawn, dim=1).tolist()                                      # [B, t + 1]
                logits, cache = self._prefill([list(p) + s for p, s in zip(prompts, so_far)], P + N, end=P + t + 1)
                next_pos = next_pos + 1
                continue
            mask = key_valid[:, None, None, :P + t + 1]  # [B, 1, 1, K]
            logits = self.model(tokens[:, None], next_pos[:, None], mask, cache,
                                start=P + t, last_only=True)[:, -1]  # [B, V]
            next_pos = next_pos + 1
        return (
            torch.stack(tokens_out, dim=1),
            torch.stack(logprobs_out, dim=1),
            lengths,
            finished,
            torch.stack(logits_out, dim=1) if keep_logits else None,
            torch.stack(versions_out, dim=1),
        )

    def _prefill(self, prompts: list[list[int]], max_len: int, *, end: int) -> tuple[torch.Tensor, KVCache]:
        """Logits [B, V] at each prompt's last token and a [B]-row cache holding its keys and values;
        with share_prompts every distinct prompt is computed once (U <= B rows) and copied to its rows."""
        B, dev = len(prompts), self.device
        first: dict[tuple[int, ...], int] = {}
        of_row = [first.setdefault(tuple(p), len(first)) for p in prompts]  # row -> its distinct prompt
        if not self.share_prompts or len(first) == B:
            cache = KVCache.allocate(self.shape, B, max_len, dtype=self.dtype, device=dev)
            return self.model.prefill(prompts, cache, end=end), cache
        distinct = KVCache.allocate(self.shape, len(first), max_len, dtype=self.dtype, device=dev)
        logits = self.model.prefill([list(p) for p in first], distinct, end=end)      # [U, V]
        rows = torch.tensor(of_row, dtype=torch.long, device=dev)                      # [B]
        # each row its own copy: decoding writes a row's new keys and values into its own slots
        return logits[rows], KVCache(distinct.k[:, rows], distinct.v[:, rows])


def _check(cfg, *, world_size: int) -> None:
    rtp = cfg.actor_rollout.tensor_model_parallel_size
    if rtp != 1:
        raise EngineSetupError(f"actor_rollout.tensor_model_parallel_size = {rtp}: the builtin engine runs "
                               f"one full copy per rank (allowed: 1); use engine: vllm for rollout TP > 1")


def _build(cfg, model_dir, hf_cfg: dict, *, pad_token_id: int, bucket_bytes: int, max_model_len: int,
           device: torch.device, log) -> BuiltinEngine:
    """On the trainer's device: on a GPU the engine generates there (on the host it would decode on
    one CPU thread while the colocated trainer's states are offloaded for nothing)."""
    return BuiltinEngine(DecoderShape.from_hf_config(hf_cfg), pad_token_id=pad_token_id, dtype=engine_dtype(cfg),
                         device=device, bucket_bytes=bucket_bytes, log=log)


def _from_hf_model(hf_model, *, pad_token_id: int, version: int = 1, **kw) -> BuiltinEngine:
    engine = BuiltinEngine(DecoderShape.from_hf_config(hf_model.config.to_dict()), pad_token_id=pad_token_id, **kw)
    engine.load_weights(hf_model.state_dict().items(), version=version)
    return engine


# actor_rollout.engine: builtin (pfppo_mega.registry)
ENGINE = EngineSpec(check=_check, build=_build, from_hf_model=_from_hf_model)
