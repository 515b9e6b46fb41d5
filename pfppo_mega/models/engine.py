"""The training-side model API: log-probs, values and one optimizer step at any TP x PP x DP layout.

Every function runs megatron's pipeline schedule (``get_forward_backward_func``), so the same call
works with one process or many: each data-parallel rank passes its own batch, and every rank of
one model replica (its tensor- and pipeline-parallel ranks) passes the same batch. Batches are
``PackedInputs`` (right-padded prompt + response rows, see pfppo_mega.trainer.batch).

    forward_logp_entropy(actor, inputs, temperature=, micro_batch_size=)  -> logp, entropy [B, T]
    forward_values(critic, inputs, micro_batch_size=)                     -> values [B, T]
    train_step(actor, optimizer, inputs, loss_fn, temperature=, micro_batch_size=) -> StepResult
    critic_train_step(critic, optimizer, inputs, loss_fn, micro_batch_size=)       -> StepResult

Forward results are computed on the last pipeline stage and broadcast to every stage, so every
rank of the model-parallel group returns them, on the model's device (whatever device the inputs
were on: the trainer passes them there too). Log-probs come from the kernels backend passed in
(``kernels=``, pure torch when None) through pfppo_mega.kernels.vocab_parallel: at tp > 1 each
rank reduces its vocabulary shard to per-row partials and two all-reduces combine them (the
vocabulary is never gathered); temperature and megatron's vocabulary padding are handled inside
the backend's kernel.

Loss normalisation (the rule that makes micro-batching and data parallelism invisible):
``loss_fn`` returns this micro-batch's *share* of the global loss, i.e. the step minimises

    L = sum over data-parallel ranks, sum over micro-batches of loss_fn(...)[0]

For an aggregate over tokens or rows, the share is the micro-batch aggregate times
``share_scale(mask, norm, mode=)`` (its tokens or rows over the global count across all
micro-batches and DP ranks, which ``MicroBatch.norm`` carries for the response mask and
``global_normalizers`` computes for any other mask). Then token-mean, seq-mean-token-sum and
seq-mean-token-mean of the whole global batch come out exactly, whatever the micro-batch size and
the DP degree. megatron's schedule divides a returned loss by the number of micro-batches and
megatron DDP averages gradients over DP ranks; the engine multiplies the share by both first.
With one micro-batch on one rank the share is the plain aggregate (scale 1.0): the computation is
the single-rank one of the trainer.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from pfppo_mega import parallel, ppo
from pfppo_mega.models.gpt import _check_right_padded, _positions, _quiet_megatron, unwrap, zero_grads
from pfppo_mega.kernels import KernelBackend, vocab_parallel_logprob_entropy
from pfppo_mega.types import PackedInputs

with _quiet_megatron():
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

Stats = dict[str, Union[Tensor, float]]


@dataclass(frozen=True)
class Normalizers:
    """Global counts of a mask: over all micro-batches of all data-parallel ranks."""

    tokens: float  # sum of the mask
    rows: float    # rows with at least one real token


@dataclass(frozen=True)
class MicroBatch:
    """What loss_fn sees besides the model outputs."""

    inputs: PackedInputs  # this micro-batch's rows
    rows: slice           # their rows in the local batch: index the caller's other [B, ...] tensors with it
    norm: Normalizers     # global counts of the response mask


@dataclass
class StepResult:
    loss: float              # the global loss L (sum of the shares over micro-batches and DP ranks)
    stats: dict[str, float]  # loss_fn's stats, averaged over micro-batches and DP ranks weighted by tokens
    grad_norm: float         # global gradient norm before clipping (nan when skipped)
    update_successful: bool  # False when the loss was not finite (no step taken) or the optimizer refused


ActorLossFn = Callable[[Tensor, Tensor, MicroBatch], tuple[Tensor, Stats]]  # (logp, entropy, mb) -> (share, stats)
CriticLossFn = Callable[[Tensor, MicroBatch], tuple[Tensor, Stats]]        # (values, mb) -> (share, stats)


# ----------------------------------------------------------------------------- normalisation


def global_normalizers(mask: Tensor) -> Normalizers:
    """Normalizers of ``mask`` [B, T] (this rank's whole batch), summed over data-parallel ranks.
    Collective over the DP group when dp > 1; a host sync."""
    counts = torch.stack([mask.float().sum(), (mask.float().sum(dim=1) > 0).float().sum()]).double()
    tokens, rows = parallel.dp_sum(counts, parallel.data_parallel_group()).cpu().tolist()
    return Normalizers(tokens=tokens, rows=rows)


def share_scale(mask: Tensor, norm: Normalizers, *, mode: str) -> float:
    """Factor turning ppo.agg_loss(loss_mat, mask, mode=mode) over a micro-batch into its share of
    the same aggregate over the global batch: local tokens / global tokens (token-mean) or local
    rows with tokens / global rows (seq-mean-*). 1.0 when the micro-batch is the global batch, and
    for seq-mean-token-sum-norm (sum / constant: the shares add up to the global sum / constant)."""
    if mode == "seq-mean-token-sum-norm":  # a sum over a constant: each micro-batch's is its share
        return 1.0
    if mode == "token-mean":
        local, total = float(mask.float().sum()), norm.tokens
    elif mode in ppo.LOSS_AGG_MODES:
        local, total = float((mask.float().sum(dim=1) > 0).float().sum()), norm.rows
    else:
        raise ValueError(f"share_scale: mode={mode!r} is not one of {ppo.LOSS_AGG_MODES}")
    if local == total:
        return 1.0
    return local / total if total > 0 else 0.0


def agg_loss_share(loss_mat: Tensor, mask: Tensor, norm: Normalizers, *, mode: str,
                   loss_scale_factor: float | None = None) -> Tensor:
    """ppo.agg_loss over the micro-batch times share_scale: this micro-batch's share of the
    global-batch aggregate (the value loss_fn returns)."""
    return ppo.agg_loss(loss_mat, mask, mode=mode, loss_scale_factor=loss_scale_factor) * share_scale(
        mask, norm, mode=mode)


# ----------------------------------------------------------------------------- micro-batches


@dataclass(frozen=True)
class _Chunk:
    input_ids: Tensor  # [mbs, S] on the model's device; rows past `real` are padding (pp > 1 only)
    rows: slice        # the real rows in the local batch
    real: int


def seq_multiple(model: torch.nn.Module) -> int:
    """What S must be a multiple of for ``model``: tp under sequence parallelism (megatron splits
    the sequence over the TP ranks), else 1."""
    config = getattr(unwrap(model), "config", None)
    return config.tensor_model_parallel_size if config is not None and config.sequence_parallel else 1


def _chunks(input_ids: Tensor, micro_batch_size: int, *, pad: bool, device: torch.device,
            multiple: int = 1) -> list[_Chunk]:
    """Split [B, S] into ceil(B / mbs) micro-batches. With ``pad`` (pipeline parallelism: every
    micro-batch must have the shape the stages exchange) the last one is filled with token-0 rows.
    S is right-padded with token 0 to a multiple of ``multiple`` (``seq_multiple``) unless
    ``pack(..., multiple_of=)`` did it: causal attention, so no real position sees the padding."""
    b, s = input_ids.shape
    if s % multiple:
        input_ids = torch.cat([input_ids, input_ids.new_zeros((b, multiple - s % multiple))], dim=1)
    out = []
    for start in range(0, b, micro_batch_size):
        ids = input_ids[start:start + micro_batch_size].to(device)
        real = ids.shape[0]
        if pad and real < micro_batch_size:
            ids = torch.cat([ids, ids.new_zeros((micro_batch_size - real, ids.shape[1]))])
        out.append(_Chunk(ids, slice(start, start + real), real))
    return out


def _slice(inputs: PackedInputs, rows: slice) -> PackedInputs:
    return PackedInputs(inputs.input_ids[rows], inputs.attention_mask[rows], inputs.resp_pos[rows],
                        inputs.labels[rows], inputs.response_mask[rows])


def _check_inputs(inputs: PackedInputs, micro_batch_size: int) -> None:
    b, t = inputs.labels.shape
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size({micro_batch_size}) must be >= 1")
    if inputs.input_ids.dim() != 2 or inputs.input_ids.shape[0] != b or b < 1:
        raise ValueError(f"input_ids {tuple(inputs.input_ids.shape)} must be [B, S] with B = labels' "
                         f"B ({b}) >= 1")
    for name in ("resp_pos", "response_mask"):
        if tuple(getattr(inputs, name).shape) != (b, t):
            raise ValueError(f"{name} {tuple(getattr(inputs, name).shape)} must be [B, T] = {(b, t)}")
    _check_right_padded(inputs.attention_mask, inputs.input_ids)


def _device(model: torch.nn.Module) -> torch.device:
    return next(unwrap(model).parameters()).device


def _pp() -> int:
    return ps.get_pipeline_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def _run_schedule(model: torch.nn.Module, chunks: list[_Chunk], micro_batch_size: int,
                  head: Callable[[_Chunk, Tensor], tuple[Tensor, dict]], *, forward_only: bool) -> None:
    """megatron's schedule over ``chunks``; ``head(chunk, output)`` runs on the last stage and
    returns what megatron's loss function returns (loss, dict)."""
    def forward_step(data_iterator, module):
        chunk = next(data_iterator)
        output = module(chunk.input_ids, _positions(chunk.input_ids), None)
        return output, functools.partial(head, chunk)

    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(chunks), model=model,
        num_microbatches=len(chunks), seq_length=chunks[0].input_ids.shape[1],
        micro_batch_size=micro_batch_size, forward_only=forward_only)


def _last_stage() -> bool:
    return not ps.model_parallel_is_initialized() or ps.is_pipeline_last_stage(ignore_virtual=True)


def _broadcast_from_last_stage(t: Optional[Tensor], shape: tuple[int, ...], device: torch.device) -> Tensor:
    """The last pipeline stage's float32 tensor ``t`` on every stage (others pass None)."""
    if _pp() == 1:
        return t
    if t is None:
        t = torch.empty(shape, dtype=torch.float32, device=device)
    dist.broadcast(t, src=ps.get_pipeline_model_parallel_last_rank(),
                   group=ps.get_pipeline_model_parallel_group())
    return t


# ----------------------------------------------------------------------------- model heads


def _tp() -> tuple[int, int, Optional[dist.ProcessGroup]]:
    if not ps.model_parallel_is_initialized():
        return 1, 0, None
    return (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_group())


def _logp_entropy(model: torch.nn.Module, logits: Tensor, inputs: PackedInputs, *, temperature: float,
                  kernels: Optional[KernelBackend]) -> tuple[Tensor, Tensor]:
    """logits [b', S, Vp/tp] of this rank's vocab shard -> logp, entropy [b, T] of inputs.labels
    under logits / temperature over the unpadded vocabulary (b = inputs' rows; extra padded rows
    of logits are ignored)."""
    b, t = inputs.labels.shape
    vs = logits.shape[-1]
    resp_pos = inputs.resp_pos.to(logits.device)
    labels = inputs.labels.to(logits.device).reshape(-1)                          # [b*T]
    # The one [b, T, Vp/tp] copy: the response rows, contiguous for the kernel. The temperature
    # and the padding columns are applied inside the backend's kernel, not on this tensor.
    sel = logits[:b].gather(1, resp_pos[..., None].expand(-1, -1, vs))            # [b, T, Vp/tp]
    tp, tp_rank, group = _tp()
    logp, ent = vocab_parallel_logprob_entropy(
        sel.view(-1, vs), labels, vocab_start=tp_rank * vs, vocab_size=unwrap(model).unpadded_vocab_size,
        group=group if tp > 1 else None, temperature=temperature, backend=kernels)
    return logp.view(b, t), ent.view(b, t)


def _values(values: Tensor, inputs: PackedInputs) -> Tensor:
    """values [b', S] -> [b, T] at the response positions."""
    b = inputs.labels.shape[0]
    return values[:b].gather(1, inputs.resp_pos.to(values.device))


# ----------------------------------------------------------------------------- forward only


def _forward_collect(model: torch.nn.Module, inputs: PackedInputs, micro_batch_size: int,
                     compute: Callable[[Tensor, PackedInputs], Tensor], out_shape: tuple[int, ...]) -> Tensor:
    """Run the forward schedule; compute(output, chunk inputs) -> [b, ...] per micro-batch on the
    last stage; the concatenation, float32, on every stage and on the model's device (where the
    trainer keeps everything that meets the model; see pfppo_mega.trainer.devicecheck)."""
    _check_inputs(inputs, micro_batch_size)
    mbs = min(micro_batch_size, inputs.labels.shape[0])
    device = _device(model)
    chunks = _chunks(inputs.input_ids, mbs, pad=_pp() > 1, device=device, multiple=seq_multiple(model))
    parts: list[Tensor] = []

    def head(chunk: _Chunk, output: Tensor):
        parts.append(compute(output, _slice(inputs, chunk.rows)).float())
        return torch.zeros((), device=output.device), {}

    with torch.no_grad():
        _run_schedule(model, chunks, mbs, head, forward_only=True)
        result = torch.cat(parts) if _last_stage() else None
        result = _broadcast_from_last_stage(result, out_shape, device)
    return result


def forward_logp_entropy(model: torch.nn.Module, inputs: PackedInputs, *, temperature: float,
                         micro_batch_size: int, kernels: Optional[KernelBackend] = None
                         ) -> tuple[Tensor, Tensor]:
    """(logp, entropy) [B, T] float32 of inputs.labels at inputs.resp_pos under logits / temperature.

    No gradients. ``kernels`` (the trainer's backend, get_backend(cfg.kernels); None: pure torch)
    computes them at every tp (at tp > 1 from vocabulary shards, see _logp_entropy).
    """
    if not temperature > 0:
        raise ValueError(f"temperature({temperature}) must be > 0")
    b, t = inputs.labels.shape
    both = _forward_collect(
        model, inputs, micro_batch_size,
        lambda logits, mb: torch.stack(_logp_entropy(model, logits, mb, temperature=temperature,
                                                     kernels=kernels), dim=1),   # [b, 2, T]
        (b, 2, t))
    return both[:, 0], both[:, 1]


def forward_values(critic: torch.nn.Module, inputs: PackedInputs, *, micro_batch_size: int) -> Tensor:
    """Critic values [B, T] float32 at inputs.resp_pos. No gradients."""
    return _forward_collect(critic, inputs, micro_batch_size, _values, tuple(inputs.labels.shape))


def forward_logits(model: torch.nn.Module, input_ids: Tensor, *, micro_batch_size: int) -> Tensor:
    """Full-vocabulary logits [B, S, V] float32 (vocab gathered over tp, padding removed) on every
    rank. For checks and evaluation; training never gathers the vocabulary."""
    b, s = input_ids.shape
    vocab_size = unwrap(model).unpadded_vocab_size
    dev = _device(model)
    input_ids = input_ids.to(dev)
    inputs = PackedInputs(input_ids, torch.ones_like(input_ids, dtype=torch.bool),
                          torch.zeros(b, 1, dtype=torch.long, device=dev), torch.zeros(b, 1, dtype=torch.long, device=dev),
                          torch.ones(b, 1, device=dev))

    def compute(logits: Tensor, mb: PackedInputs) -> Tensor:
        full = gather_from_tensor_model_parallel_region(logits) if _tp()[0] > 1 else logits
        return full[:mb.input_ids.shape[0], :s, :vocab_size]  # S padding (seq_multiple) dropped

    return _forward_collect(model, inputs, micro_batch_size, compute, (b, s, vocab_size))


# ----------------------------------------------------------------------------- training


def _reduce_summary(loss: Optional[float], stats: Optional[dict[str, float]]) -> tuple[float, dict[str, float]]:
    """The last stage's (loss, stats) on every stage, then summed over DP: the loss shares add up
    to the global loss, and the stats arrive already weighted by each micro-batch's share of the
    global response tokens (see _train), so their sum is the token-weighted global mean."""
    if _pp() > 1:
        box = [(loss, stats)]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        loss, stats = box[0]
    group = parallel.data_parallel_group()
    if group is None:
        return loss, stats
    keys = sorted(stats)
    values = torch.tensor([loss] + [stats[k] for k in keys], dtype=torch.float64)
    values = parallel.dp_sum(values, group).tolist()
    return values[0], dict(zip(keys, values[1:]))


def _token_weighted(stats: list[dict[str, float]], tokens: list[float], total: float) -> dict[str, float]:
    """sum_mb stats_mb * tokens_mb / total: each micro-batch's stats weighted by its share of the
    global response tokens (summed over DP ranks afterwards, this is the global token-weighted mean;
    with one micro-batch on one rank it is the micro-batch's own stats). No tokens anywhere: the
    unweighted mean over this rank's micro-batches (averaged over DP below, so divided by dp)."""
    if len(stats) == 1 and tokens[0] == total:  # the whole global batch: exactly its own stats
        return dict(stats[0])
    if total > 0:
        return {k: math.fsum(s[k] * n for s, n in zip(stats, tokens)) / total for k in stats[0]}
    dp = ps.get_data_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    return {k: sum(s[k] for s in stats) / len(stats) / dp for k in stats[0]}


def _require_ddp(model: torch.nn.Module, optimizer: MegatronOptimizer) -> None:
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"train_step needs the megatron DDP module returned by gpt.wrap_ddp(model), got "
                        f"{type(model).__name__}")
    if model.config.calculate_per_token_loss:
        raise ValueError("config.calculate_per_token_loss must be False: the engine normalises losses itself "
                         "(loss shares, see pfppo_mega.models.engine)")
    if model.config.finalize_model_grads_func is None:
        raise ValueError("model.config.finalize_model_grads_func is unset: wrap the model with gpt.wrap_ddp, "
                         "or data-parallel replicas silently drift apart")


def _train(model: DistributedDataParallel, optimizer: MegatronOptimizer, inputs: PackedInputs,
           micro_batch_size: int, share_of: Callable[[Tensor, MicroBatch], tuple[Tensor, Stats]]) -> StepResult:
    _require_ddp(model, optimizer)
    _check_inputs(inputs, micro_batch_size)
    mbs = min(micro_batch_size, inputs.labels.shape[0])
    chunks = _chunks(inputs.input_ids, mbs, pad=_pp() > 1, device=_device(model), multiple=seq_multiple(model))
    norm = global_normalizers(inputs.response_mask)
    # megatron divides the returned loss by the number of micro-batches and DDP averages over dp.
    undo = float(len(chunks) * (ps.get_data_parallel_world_size() if ps.model_parallel_is_initialized() else 1))
    shares: list[float] = []
    stats: list[dict[str, float]] = []
    tokens: list[float] = []

    def head(chunk: _Chunk, output: Tensor):
        mb = MicroBatch(inputs=_slice(inputs, chunk.rows), rows=chunk.rows, norm=norm)
        share, mb_stats = share_of(output, mb)
        if share.dim() != 0:
            raise ValueError(f"loss_fn must return a 0-dim loss share, got shape {tuple(share.shape)}")
        shares.append(float(share.detach()))
        stats.append({k: float(v) for k, v in mb_stats.items()})
        tokens.append(float(mb.inputs.response_mask.sum()))
        return share * undo if undo != 1.0 else share, {}

    zero_grads(model, optimizer)
    _run_schedule(model, chunks, mbs, head, forward_only=False)  # backward + finalize_model_grads
    local_loss = math.fsum(shares) if _last_stage() else None
    local_stats = _token_weighted(stats, tokens, norm.tokens) if _last_stage() else None
    loss, mean_stats = _reduce_summary(local_loss, local_stats)
    if not math.isfinite(loss):  # never step on a NaN / inf loss
        zero_grads(model, optimizer)
        return StepResult(loss=loss, stats=mean_stats, grad_norm=float("nan"), update_successful=False)
    ok, grad_norm, _ = optimizer.step()
    return StepResult(loss=loss, stats=mean_stats,
                      grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                      update_successful=bool(ok))


def train_step(model: DistributedDataParallel, optimizer: MegatronOptimizer, inputs: PackedInputs,
               loss_fn: ActorLossFn, *, temperature: float, micro_batch_size: int,
               kernels: Optional[KernelBackend] = None) -> StepResult:
    """One actor update: zero grads, forward + backward of every micro-batch through megatron's
    schedule (gradients accumulate; finalize_model_grads reduces them over DP and ties), then the
    optimizer step (clipping included). loss_fn(logp [b, T], entropy [b, T], mb) -> (share, stats),
    the share as defined in the module docstring."""
    if not temperature > 0:
        raise ValueError(f"temperature({temperature}) must be > 0")

    def share_of(logits: Tensor, mb: MicroBatch):
        logp, ent = _logp_entropy(model, logits, mb.inputs, temperature=temperature, kernels=kernels)
        return loss_fn(logp, ent, mb)

    return _train(model, optimizer, inputs, micro_batch_size, share_of)


def critic_train_step(critic: DistributedDataParallel, optimizer: MegatronOptimizer, inputs: PackedInputs,
                      loss_fn: CriticLossFn, *, micro_batch_size: int) -> StepResult:
    """train_step for the critic: loss_fn(values [b, T], mb) -> (share, stats)."""
    return _train(critic, optimizer, inputs, micro_batch_size,
                  lambda values, mb: loss_fn(_values(values, mb.inputs), mb))
