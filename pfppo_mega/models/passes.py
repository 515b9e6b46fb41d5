"""The training-side model API: log-probs, values and one optimizer step at any TP x PP x DP layout.

Every function runs megatron's pipeline schedule (``get_forward_backward_func``), so the same call
works with one process or many: each data-parallel rank passes its own batch, and every rank of
one model replica (its tensor- and pipeline-parallel ranks) passes the same batch. Batches are
``PackedInputs`` (right-padded prompt + response rows, see pfppo_mega.trainer.batch).

    forward_logp_entropy(actor, inputs, temperature=, micro_batch_size=)  -> logp, entropy [B, T]
    forward_values(critic, inputs, micro_batch_size=)                     -> values [B, T]
    train_step(actor, optimizer, inputs, loss_fn, temperature=, micro_batch_size=) -> StepResult
    critic_train_step(critic, optimizer, inputs, loss_fn, micro_batch_size=)       -> StepResult

``micro_batch_size`` is an int (consecutive rows, every micro-batch as long as the batch) or a
``Batching``: micro-batches by token budget (rows sorted by length, each micro-batch cut to its
longest row; pfppo_mega.models.microbatch) and/or the output layer at the response tokens only
(gpt.head_at: the decoder's hidden states are cut to those positions before the LM / value head,
so no [b, S, V] logits exist). At pp > 1 token-budget micro-batches differ in shape, and megatron's
``variable_seq_lengths`` sends each one's shape between the stages first (_variable_shapes).

Forward results are computed on the last pipeline stage and broadcast to every stage, so every
rank of the model-parallel group returns them, on the model's device (whatever device the inputs
were on: the trainer passes them there too). Log-probs come from the kernels backend passed in
(``kernels=``, pure torch when None) through pfppo_mega.kernels.vocab_parallel: at tp > 1 each
rank reduces its vocabulary shard to per-row partials and two all-reduces combine them (the
vocabulary is never gathered); temperature and megatron's vocabulary padding are handled inside
the backend's kernel. With ``Batching(fused_head=True)`` (the trainer's default, training.fused_head)
the LM head returns its input hidden states (gpt.hidden_at_head) and pfppo_mega.kernels.fused_head
multiplies them by the head's weight shard chunk by chunk, with the same backend and collectives:
no [tokens, V] logits exist, forward or backward.

Loss normalisation (the rule that makes micro-batching and data parallelism invisible):
``loss_fn`` returns this micro-batch's *share* of the global loss, i.e. the step minimises

    L = sum over data-parallel ranks, sum over micro-batches of loss_fn(...)[0]

For an aggregate over tokens or rows, the share is the micro-batch aggregate times
``share_scale(mask, norm, mode=)`` (its tokens or rows over the global count across all
micro-batches and DP ranks, which ``MicroBatch.norm`` carries for the response mask and
``global_normalizers`` computes for any other mask). Then token-mean, seq-mean-token-sum,
seq-mean-token-mean and seq-mean-token-sum-norm (verl 0.9.1's Dr.GRPO: the token sum over the
global rows times a constant) of the whole global batch come out exactly, whatever the
micro-batch size and the DP degree. megatron's schedule divides a returned loss by the number of micro-batches and
megatron DDP averages gradients over DP ranks; the engine multiplies the share by both first.
With one micro-batch on one rank the share is the plain aggregate (scale 1.0): the computation is
the single-rank one of the trainer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from pfppo_mega import parallel, ppo
from pfppo_mega.compat import onednn
from pfppo_mega.models import microbatch
from pfppo_mega.models.gpt import (_check_right_padded, _positions, _quiet_megatron, head_at, hidden_at_head,
                                   loss_scale, optimizer_step, unwrap, zero_grads)
from pfppo_mega.models.microbatch import Tally
from pfppo_mega.kernels import KernelBackend, vocab_parallel_logprob_entropy
from pfppo_mega.kernels.fused_head import DEFAULT_CHUNK_TOKENS, fused_linear_logprob_entropy
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

    inputs: PackedInputs  # this micro-batch's rows (cut to its own length under a token budget)
    rows: Union[slice, Tensor]  # their rows in the local batch (a slice, or an index [b] under a token
    #                             budget): index the caller's other [B, ...] tensors with it
    norm: Normalizers     # global counts of the response mask


@dataclass(frozen=True)
class Batching:
    """How a pass cuts its batch into micro-batches and where the output layer runs. Every engine
    call takes one as ``micro_batch_size=`` (a plain int n means Batching(n): the default plan).

    The plan changes no result beyond the order of floating-point sums (losses are normalised by
    global counts, outputs return in row order); it changes how many positions are computed."""

    micro_batch_size: int               # rows per micro-batch; with max_tokens: at most this many
    max_tokens: Optional[int] = None    # token budget: rows x padded length per micro-batch, rows sorted
    #                                     by length (microbatch.by_token_budget); None: consecutive rows
    response_only: bool = False         # run the LM / value head only at the response tokens
    tally: Optional[Tally] = None       # counts the work of the pass (decoder positions, padding, head)
    fused_head: bool = False            # the LM head fused with log-prob + entropy over chunks of
    #                                     head_chunk_tokens rows (kernels.fused_head): no [tokens, V] logits;
    #                                     megatron's head instead under sequence parallelism
    head_chunk_tokens: int = DEFAULT_CHUNK_TOKENS


def _as_batching(micro_batch_size: Union[int, Batching]) -> Batching:
    return micro_batch_size if isinstance(micro_batch_size, Batching) else Batching(int(micro_batch_size))


@dataclass
class StepResult:
    loss: float              # the global loss L (sum of the shares over micro-batches and DP ranks)
    stats: dict[str, float]  # loss_fn's stats, averaged over micro-batches and DP ranks weighted by tokens
    grad_norm: float         # global gradient norm before clipping (nan when skipped)
    update_successful: bool  # False when the loss or grad norm was not finite (no step taken) or the optimizer refused
    overflow: bool = False   # fp16: the loss scaler found an inf/nan gradient, skipped the step and lowered its scale
    loss_scale: Optional[float] = None  # fp16: the scale after this step (None without a scaler)


ActorLossFn = Callable[[Tensor, Tensor, MicroBatch], tuple[Tensor, Stats]]  # (logp, entropy, mb) -> (share, stats)
CriticLossFn = Callable[[Tensor, MicroBatch], tuple[Tensor, Stats]]        # (values, mb) -> (share, stats)


# ----------------------------------------------------------------------------- normalisation


def global_normalizers(mask: Tensor) -> Normalizers:
    """Normalizers of ``mask`` [B, T] (this rank's whole batch), summed over data-parallel ranks.
    Collective over the DP group when dp > 1; a host sync."""
    counts = torch.stack([mask.float().sum(), (mask.float().sum(dim=1) > 0).float().sum()]).double()
    tokens, rows = parallel.dp_sum(counts, parallel.data_parallel_group()).cpu().tolist()
    return Normalizers(tokens=tokens, rows=rows)


def share_scale(mask: Tensor, norm: Normalizers, *, mode: str, like: Optional[Tensor] = None) -> Union[Tensor, float]:
    """Factor turning ppo.agg_loss(loss_mat, mask, mode=mode) over a micro-batch into its share of
    the same aggregate over the global batch: local tokens / global tokens (token-mean) or local
    rows with tokens / global rows (seq-mean-*, seq-mean-token-sum-norm included: verl 0.9.1 divides
    Dr.GRPO's token sum by the optimizer step's rows, global_batch_size, as well as by its constant).
    1.0 when the micro-batch is the global batch. A 0-dim tensor on the mask's device, in
    ``like``'s dtype (the loss it scales; float64 without one), the ratio taken in float64 and
    rounded once, as a Python float multiplied into the loss would be: no host sync per
    micro-batch (the global counts are host numbers already); x / x is exactly 1.0."""
    if mode == "token-mean":
        local, total = mask.sum(dtype=torch.float64), norm.tokens                   # 0-dim, on the device
    elif mode in ppo.LOSS_AGG_MODES:
        local, total = (mask.sum(dim=1) > 0).sum(dtype=torch.float64), norm.rows
    else:
        raise ValueError(f"share_scale: mode={mode!r} is not one of {ppo.LOSS_AGG_MODES}")
    scale = local / total if total > 0 else torch.zeros((), dtype=torch.float64, device=mask.device)
    return scale if like is None else scale.to(like.dtype)


def agg_loss_share(loss_mat: Tensor, mask: Tensor, norm: Normalizers, *, mode: str,
                   loss_scale_factor: float | None = None) -> Tensor:
    """ppo.agg_loss over the micro-batch times share_scale: this micro-batch's share of the
    global-batch aggregate (the value loss_fn returns)."""
    loss = ppo.agg_loss(loss_mat, mask, mode=mode, loss_scale_factor=loss_scale_factor)
    return loss * share_scale(mask, norm, mode=mode, like=loss)


# ----------------------------------------------------------------------------- micro-batches


@dataclass(frozen=True)
class _Chunk:
    input_ids: Tensor             # [b', S'] on the model's device; rows past `real` are padding (pp > 1 only)
    rows: Union[slice, Tensor]    # the real rows in the local batch (a slice, or an index [real])
    real: int
    inputs: PackedInputs          # those rows, cut to S' (masked response slots point inside it)
    head_index: Optional[Tensor]  # [N] flat positions s * b' + row of the response tokens (response_only)


def seq_multiple(model: torch.nn.Module) -> int:
    """What S must be a multiple of for ``model``: tp under sequence parallelism (megatron splits
    the sequence over the TP ranks), else 1."""
    config = getattr(unwrap(model), "config", None)
    return config.tensor_model_parallel_size if config is not None and config.sequence_parallel else 1


def _chunks(input_ids: Tensor, micro_batch_size: int, *, pad: bool, device: torch.device,
            multiple: int = 1) -> list[_Chunk]:
    """The by-rows plan of [B, S] ids alone (no head selection): see _plan."""
    zeros = torch.zeros(input_ids.shape[0], 1, dtype=torch.long)                  # [B, 1]: no response
    inputs = PackedInputs(input_ids, torch.ones_like(input_ids, dtype=torch.bool), zeros, zeros, zeros.float())
    return _plan(inputs, Batching(micro_batch_size), pad=pad, device=device, multiple=multiple)


def _cut(inputs: PackedInputs, rows: Union[slice, Tensor], s: int) -> PackedInputs:
    """``rows`` of ``inputs`` with the sequence cut (or right-padded with token 0) to length s."""
    ids, mask = inputs.input_ids[rows], inputs.attention_mask[rows]
    if ids.shape[1] < s:
        ids = torch.cat([ids, ids.new_zeros((ids.shape[0], s - ids.shape[1]))], dim=1)
        mask = torch.cat([mask, mask.new_zeros((mask.shape[0], s - mask.shape[1]))], dim=1)
    resp_pos = inputs.resp_pos[rows]
    if s < inputs.input_ids.shape[1]:
        resp_pos = resp_pos.clamp(max=s - 1)  # only masked slots (clamped by pack) can point past s
    return PackedInputs(ids[:, :s], mask[:, :s], resp_pos, inputs.labels[rows], inputs.response_mask[rows])


def _head_index(inputs: PackedInputs, width: int) -> Tensor:
    """[N] flat positions s * width + row of the response tokens of ``inputs`` in the [S, width]
    layout megatron's decoder returns, row-major (the order of response_mask.bool() indexing).
    No response token at all: position 0 alone, whose output is discarded (the head must run once
    for the backward to reach it)."""
    resp = inputs.response_mask.bool()                                   # [b, T]
    row, t = resp.nonzero(as_tuple=True)                                 # [N] each
    index = inputs.resp_pos[row, t] * width + row
    return index if index.numel() else index.new_zeros(1)


def _plan(inputs: PackedInputs, batching: Batching, *, pad: bool, device: torch.device,
          multiple: int = 1) -> list[_Chunk]:
    """The micro-batches of ``inputs`` under ``batching`` (pfppo_mega.models.microbatch), their
    rows moved to ``device``. By rows: ceil(B / mbs) micro-batches of consecutive rows, all of the
    batch's S, and with ``pad`` (pipeline parallelism at fixed shapes) the last filled with token-0
    rows. By token budget: each micro-batch cut to its longest row (the stages exchange each
    micro-batch's shape, see _variable_shapes). S is right-padded with token 0 to a multiple of
    ``multiple`` (``seq_multiple``) unless ``pack(..., multiple_of=)`` did it: causal attention, so
    no real position sees the padding. Counts the work into batching.tally."""
    b, s = inputs.input_ids.shape
    full = -(-s // multiple) * multiple
    if batching.max_tokens is None:
        lengths = None
        groups = [slice(r[0], r[-1] + 1) for r in microbatch.by_rows(b, batching.micro_batch_size)]
        widths = [full] * len(groups)
    else:
        lengths = inputs.attention_mask.sum(1).tolist()                 # a host sync
        plan = microbatch.by_token_budget(lengths, max_tokens=batching.max_tokens,
                                          max_rows=batching.micro_batch_size, multiple=multiple)
        groups = [torch.tensor(r, dtype=torch.long, device=inputs.input_ids.device) for r in plan]
        widths = [-(-max(lengths[i] for i in r) // multiple) * multiple for r in plan]
    out = []
    for rows, width in zip(groups, widths):
        cut = _cut(inputs, rows, width)
        cut = PackedInputs(*(t.to(device) for t in (cut.input_ids, cut.attention_mask, cut.resp_pos, cut.labels,
                                                      cut.response_mask)))
        ids, real = cut.input_ids, cut.input_ids.shape[0]
        if pad and lengths is None and real < batching.micro_batch_size:
            ids = torch.cat([ids, ids.new_zeros((batching.micro_batch_size - real, ids.shape[1]))])
        index = _head_index(cut, ids.shape[0]) if batching.response_only else None
        out.append(_Chunk(ids, rows if lengths is None else rows.to(device), real, cut, index))
    if batching.tally is not None:
        _count(batching, inputs, out)
    return out


def _count(batching: Batching, inputs: PackedInputs, chunks: list[_Chunk]) -> None:
    n = inputs.attention_mask.sum(1).double()                            # [B] real tokens per row
    need = int(inputs.response_mask.sum())
    t = batching.tally
    t.passes += 1
    t.micro_batches += len(chunks)
    t.computed += sum(c.input_ids.numel() for c in chunks)
    t.real += int(n.sum())
    t.attn_pairs += int((n * (n + 1) / 2).sum())
    t.head_computed += (sum(int(c.head_index.numel()) for c in chunks) if batching.response_only
                        else sum(c.input_ids.numel() for c in chunks))
    t.head_needed += need


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


@contextlib.contextmanager
def _variable_shapes(model: torch.nn.Module, chunks: list[_Chunk]) -> Iterator[None]:
    """megatron's pipeline stages receive tensors of the shape given to the schedule unless
    ``config.variable_seq_lengths``, which sends each micro-batch's shape first: on while the
    chunks differ in shape at pp > 1 (token-budget micro-batches), restored after."""
    config = unwrap(model).config
    varying = _pp() > 1 and len({tuple(c.input_ids.shape) for c in chunks}) > 1
    before = config.variable_seq_lengths
    config.variable_seq_lengths = before or varying
    try:
        yield
    finally:
        config.variable_seq_lengths = before


def _run_schedule(model: torch.nn.Module, chunks: list[_Chunk], micro_batch_size: int,
                  head: Callable[[_Chunk, Tensor], tuple[Tensor, dict]], *, forward_only: bool,
                  hidden_head: bool = False) -> None:
    """megatron's schedule over ``chunks``; ``head(chunk, output)`` runs on the last stage and
    returns what megatron's loss function returns (loss, dict). ``hidden_head``: the LM head returns
    its input hidden states (gpt.hidden_at_head) for the fused head in ``head``."""
    def forward_step(data_iterator, module):
        chunk = next(data_iterator)
        with head_at(module, chunk.head_index), hidden_at_head(module, hidden_head):
            output = module(chunk.input_ids, _positions(chunk.input_ids), None)
        return output, functools.partial(head, chunk)

    # oneDNN packs of the weights for a forward-only schedule's matmuls (CPU fp32; compat/onednn.py):
    # no weight changes inside it. Not for a training schedule: its micro-batches' forwards are too
    # few rows per pack to repay the reorder, and the backward's products stay on torch.mm anyway
    # (measured on the SmolLM2-135M shape: an actor step 9.3-9.6 s without packs, 11.1-11.4 s with)
    packs = onednn.packed_weights(onednn.frozen_packs(unwrap(model))) if forward_only else contextlib.nullcontext()
    with _variable_shapes(model, chunks), packs:
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(chunks), model=model,
            num_microbatches=len(chunks), seq_length=chunks[0].input_ids.shape[1],
            micro_batch_size=chunks[0].input_ids.shape[0] if micro_batch_size is None else micro_batch_size,
            forward_only=forward_only)


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


def from_last_stage(t: Tensor, device: torch.device) -> Tensor:
    """The last pipeline stage's float32 ``t`` on every stage (each stage passes one of the same
    shape; only the last stage's values count)."""
    return _broadcast_from_last_stage(t if _last_stage() else None, tuple(t.shape), device)


# ----------------------------------------------------------------------------- model heads


def _tp() -> tuple[int, int, Optional[dist.ProcessGroup]]:
    if not ps.model_parallel_is_initialized():
        return 1, 0, None
    return (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_group())


def fused_head_on(model: torch.nn.Module, batching: Batching) -> bool:
    """Whether ``batching`` runs ``model``'s LM head fused (not under sequence parallelism, where the
    head's input is split over the sequence: megatron's head there)."""
    config = getattr(unwrap(model), "config", None)
    return batching.fused_head and not (config is not None and config.sequence_parallel)


def _head_main_grad(model: torch.nn.Module, weight: Tensor) -> Optional[Tensor]:
    """The head weight's DDP main_grad when training.sparse_vocab_grads installed its path
    (pfppo_mega.models.vocab_grads): the fused head adds its weight gradient there directly."""
    layer = unwrap(model).output_layer
    if getattr(layer, "vocab_grad_buffer", None) is None or not (torch.is_grad_enabled() and weight.requires_grad):
        return None
    return getattr(weight, "main_grad", None)


def _logp_entropy(model: torch.nn.Module, logits: Tensor, chunk: _Chunk, *, temperature: float,
                  kernels: Optional[KernelBackend], fused: Optional[Batching] = None) -> tuple[Tensor, Tensor]:
    """This rank's vocab shard of the chunk's logits -> logp, entropy [b, T] of its labels under
    logits / temperature over the unpadded vocabulary (b = the chunk's real rows). logits: [b', S,
    Vp/tp] (every position; extra padded rows ignored), or [1, N, Vp/tp] at the response tokens
    only (chunk.head_index; the other slots of the result are 0). With ``fused`` (a Batching with
    fused_head) ``logits`` are the final hidden states [b', S, H] / [1, N, H] (gpt.hidden_at_head)
    and kernels.fused_head multiplies them by the head's weight shard chunk by chunk."""
    b, t = chunk.inputs.labels.shape
    vs = logits.shape[-1]  # Vp/tp, or H for the fused head
    sel, labels, resp = _response_rows(logits, chunk)
    tp, tp_rank, group = _tp()
    vocab_size = unwrap(model).unpadded_vocab_size
    if fused is not None:
        weight = unwrap(model).output_layer.head_weight                           # [Vp/tp, H]
        logp, ent = fused_linear_logprob_entropy(
            sel, weight, labels, vocab_start=tp_rank * weight.shape[0], vocab_size=vocab_size,
            group=group if tp > 1 else None, temperature=temperature, backend=kernels,
            chunk_tokens=fused.head_chunk_tokens, grad_weight_into=_head_main_grad(model, weight))
    else:
        logp, ent = vocab_parallel_logprob_entropy(
            sel, labels, vocab_start=tp_rank * vs, vocab_size=vocab_size,
            group=group if tp > 1 else None, temperature=temperature, backend=kernels)
    if chunk.head_index is None:
        return logp.view(b, t), ent.view(b, t)
    return _scatter(logp, resp), _scatter(ent, resp)


def _response_rows(logits: Tensor, chunk: _Chunk) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """The response positions' rows of logits (or hidden states) [N, Vp/tp or H], their labels [N], and
    the response mask [b, T] when the head ran at the response tokens only (else None: N = b*T)."""
    inputs = chunk.inputs
    b = inputs.labels.shape[0]
    vs = logits.shape[-1]
    if chunk.head_index is not None:
        resp = inputs.response_mask.to(logits.device).bool()                      # [b, T]
        labels = inputs.labels.to(logits.device)[resp]                             # [N]
        labels = labels if labels.numel() else labels.new_zeros(1)                 # the head's one dummy row
        return logits.reshape(-1, vs), labels, resp                                # [N, Vp/tp]
    resp_pos = inputs.resp_pos.to(logits.device)
    labels = inputs.labels.to(logits.device).reshape(-1)                           # [b*T]
    # The one [b, T, Vp/tp] copy: the response rows, contiguous for the kernel. The temperature
    # and the padding columns are applied inside the backend's kernel, not on this tensor.
    sel = logits[:b].gather(1, resp_pos[..., None].expand(-1, -1, vs)).view(-1, vs)  # [b*T, Vp/tp or H]
    return sel, labels, None


def _sum_pi_squared(model: torch.nn.Module, logits: Tensor, chunk: _Chunk, *, temperature: float) -> Tensor:
    """sum_v softmax(logits / temperature)_v^2 [b, T] over the unpadded vocabulary, from this rank's
    vocab shard (the max, the normaliser and the sum of squares all-reduced over TP)."""
    b, t = chunk.inputs.labels.shape
    sel, _, resp = _response_rows(logits, chunk)
    tp, tp_rank, group = _tp()
    vs = sel.shape[-1]
    valid = max(0, min(vs, unwrap(model).unpadded_vocab_size - tp_rank * vs))
    z = sel[:, :valid].float() / temperature                                       # [N, valid]
    m = z.amax(-1) if valid else z.new_full(z.shape[:1], float("-inf"))          # [N]
    if tp > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(z - m[:, None])                                                  # [N, valid]
    parts = torch.stack([e.sum(-1), (e * e).sum(-1)])                              # [2, N]
    if tp > 1:
        dist.all_reduce(parts, group=group)
    spp = parts[1] / parts[0] ** 2                                                 # [N]
    return spp.view(b, t) if resp is None else _scatter(spp, resp)


def _scatter(values: Tensor, resp: Tensor) -> Tensor:
    """values [>= N] at the N response slots of resp [b, T] (row-major), 0 elsewhere; differentiable."""
    return values.new_zeros(resp.shape).masked_scatter(resp, values)


def _values(values: Tensor, chunk: _Chunk) -> Tensor:
    """values [b', S] (or [1, N] at the response tokens only) -> [b, T] at the response positions."""
    inputs = chunk.inputs
    if chunk.head_index is not None:
        return _scatter(values.reshape(-1), inputs.response_mask.to(values.device).bool())
    b = inputs.labels.shape[0]
    return values[:b].gather(1, inputs.resp_pos.to(values.device))


# ----------------------------------------------------------------------------- forward only


def _forward_collect(model: torch.nn.Module, inputs: PackedInputs, micro_batch_size: Union[int, Batching],
                     compute: Callable[[Tensor, _Chunk], Tensor], out_shape: tuple[int, ...], *,
                     hidden_head: bool = False) -> Tensor:
    """Run the forward schedule; compute(output, chunk) -> [b, ...] per micro-batch on the last
    stage; the results in row order, float32, on every stage and on the model's device (where the
    trainer keeps everything that meets the model; see pfppo_mega.trainer.instruments.devicecheck)."""
    batching = _as_batching(micro_batch_size)
    _check_inputs(inputs, batching.micro_batch_size)
    mbs = min(batching.micro_batch_size, inputs.labels.shape[0])
    batching = dataclasses.replace(batching, micro_batch_size=mbs)
    device = _device(model)
    chunks = _plan(inputs, batching, pad=_pp() > 1, device=device, multiple=seq_multiple(model))
    parts: list[Tensor] = []

    def head(chunk: _Chunk, output: Tensor):
        parts.append(compute(output, chunk).float())
        return torch.zeros((), device=output.device), {}

    with torch.no_grad():
        _run_schedule(model, chunks, None if batching.max_tokens is not None else mbs, head, forward_only=True,
                      hidden_head=hidden_head)
        result = _in_row_order(parts, chunks, out_shape) if _last_stage() else None
        result = _broadcast_from_last_stage(result, out_shape, device)
    return result


def _in_row_order(parts: list[Tensor], chunks: list[_Chunk], out_shape: tuple[int, ...]) -> Tensor:
    """The chunks' results [b, ...] as one [B, ...] in the batch's row order."""
    if all(isinstance(c.rows, slice) for c in chunks):
        return torch.cat(parts)
    out = parts[0].new_empty(out_shape)
    for chunk, part in zip(chunks, parts):
        out[chunk.rows] = part
    return out


def forward_logp_entropy(model: torch.nn.Module, inputs: PackedInputs, *, temperature: float,
                         micro_batch_size: Union[int, Batching], kernels: Optional[KernelBackend] = None
                         ) -> tuple[Tensor, Tensor]:
    """(logp, entropy) [B, T] float32 of inputs.labels at inputs.resp_pos under logits / temperature.

    No gradients. ``kernels`` (the trainer's backend, get_backend(cfg.kernels); None: pure torch)
    computes them at every tp (at tp > 1 from vocabulary shards, see _logp_entropy). With
    Batching(response_only=True) the masked slots are 0 (else the log-prob at a clamped position).
    """
    if not temperature > 0:
        raise ValueError(f"temperature({temperature}) must be > 0")
    b, t = inputs.labels.shape
    batching = _as_batching(micro_batch_size)
    fused = batching if fused_head_on(model, batching) else None
    both = _forward_collect(
        model, inputs, batching,
        lambda logits, chunk: torch.stack(_logp_entropy(model, logits, chunk, temperature=temperature,
                                                        kernels=kernels, fused=fused), dim=1),   # [b, 2, T]
        (b, 2, t), hidden_head=fused is not None)
    return both[:, 0], both[:, 1]


def forward_sum_pi_squared(model: torch.nn.Module, inputs: PackedInputs, *, temperature: float,
                           micro_batch_size: Union[int, Batching]) -> Tensor:
    """sum_v pi(v)^2 [B, T] float32 under logits / temperature at inputs.resp_pos (verl's sum_pi_squared,
    read by the optimal-token-baseline estimator). No gradients. Megatron's head (the fused head has
    no such statistic): one more forward pass, with its [tokens, V/tp] logits."""
    if not temperature > 0:
        raise ValueError(f"temperature({temperature}) must be > 0")
    batching = dataclasses.replace(_as_batching(micro_batch_size), fused_head=False)
    return _forward_collect(model, inputs, batching,
                            lambda logits, chunk: _sum_pi_squared(model, logits, chunk, temperature=temperature),
                            tuple(inputs.labels.shape))


def forward_values(critic: torch.nn.Module, inputs: PackedInputs, *,
                   micro_batch_size: Union[int, Batching]) -> Tensor:
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

    def compute(logits: Tensor, chunk: _Chunk) -> Tensor:
        full = gather_from_tensor_model_parallel_region(logits) if _tp()[0] > 1 else logits
        return full[:chunk.real, :s, :vocab_size]  # S padding (seq_multiple) dropped

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


def _to_host(shares: list, stats: list[dict], tokens: list) -> tuple[list[float], list[dict[str, float]], list[float]]:
    """The micro-batches' loss shares, stats and token counts as Python floats, with one device ->
    host copy for all of them (plain numbers among them pass through)."""
    flat = [*shares, *tokens, *(v for s in stats for v in s.values())]
    held = [x for x in flat if isinstance(x, Tensor)]
    dev = held[0].device if held else None
    values = iter(torch.stack([x.to(device=dev, dtype=torch.float64).reshape(()) for x in held]).tolist()
                  if held else [])
    host = [next(values) if isinstance(x, Tensor) else float(x) for x in flat]
    n_s, n_t = len(shares), len(tokens)
    it = iter(host[n_s + n_t:])
    return host[:n_s], [{k: next(it) for k in s} for s in stats], host[n_s:n_s + n_t]


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
                         "(loss shares, see pfppo_mega.models.passes)")
    if model.config.finalize_model_grads_func is None:
        raise ValueError("model.config.finalize_model_grads_func is unset: wrap the model with gpt.wrap_ddp, "
                         "or data-parallel replicas silently drift apart")


def _train(model: DistributedDataParallel, optimizer: MegatronOptimizer, inputs: PackedInputs,
           micro_batch_size: Union[int, Batching],
           share_of: Callable[[Tensor, _Chunk, MicroBatch], tuple[Tensor, Stats]], *,
           hidden_head: bool = False) -> StepResult:
    _require_ddp(model, optimizer)
    batching = _as_batching(micro_batch_size)
    _check_inputs(inputs, batching.micro_batch_size)
    mbs = min(batching.micro_batch_size, inputs.labels.shape[0])
    batching = dataclasses.replace(batching, micro_batch_size=mbs)
    chunks = _plan(inputs, batching, pad=_pp() > 1, device=_device(model), multiple=seq_multiple(model))
    norm = global_normalizers(inputs.response_mask)
    # megatron divides the returned loss by the number of micro-batches and DDP averages over dp.
    undo = float(len(chunks) * (ps.get_data_parallel_world_size() if ps.model_parallel_is_initialized() else 1))
    shares: list[float] = []
    stats: list[dict[str, float]] = []
    tokens: list[float] = []

    def head(chunk: _Chunk, output: Tensor):
        mb = MicroBatch(inputs=chunk.inputs, rows=chunk.rows, norm=norm)
        share, mb_stats = share_of(output, chunk, mb)
        if share.dim() != 0:
            raise ValueError(f"loss_fn must return a 0-dim loss share, got shape {tuple(share.shape)}")
        # kept on the device: read once after the schedule (a host sync per micro-batch stalls a GPU's queue)
        shares.append(share.detach())
        stats.append({k: v.detach() if isinstance(v, Tensor) else v for k, v in mb_stats.items()})
        tokens.append(mb.inputs.response_mask.sum())
        return share * undo if undo != 1.0 else share, {}

    zero_grads(model, optimizer)
    _run_schedule(model, chunks, None if batching.max_tokens is not None else mbs, head,
                  forward_only=False, hidden_head=hidden_head)  # backward + finalize_model_grads
    shares, stats, tokens = _to_host(shares, stats, tokens)  # one host sync for every micro-batch
    local_loss = math.fsum(shares) if _last_stage() else None
    local_stats = _token_weighted(stats, tokens, norm.tokens) if _last_stage() else None
    loss, mean_stats = _reduce_summary(local_loss, local_stats)
    if not math.isfinite(loss):  # never step on a NaN / inf loss
        zero_grads(model, optimizer)
        return StepResult(loss=loss, stats=mean_stats, grad_norm=float("nan"), update_successful=False)
    step = optimizer_step(model, optimizer, finalize=False)  # a non-finite grad norm is skipped there too
    return StepResult(loss=loss, stats=mean_stats, grad_norm=step.grad_norm, update_successful=step.update_successful,
                      overflow=step.overflow, loss_scale=loss_scale(optimizer))


def train_step(model: DistributedDataParallel, optimizer: MegatronOptimizer, inputs: PackedInputs,
               loss_fn: ActorLossFn, *, temperature: float, micro_batch_size: Union[int, Batching],
               kernels: Optional[KernelBackend] = None) -> StepResult:
    """One actor update: zero grads, forward + backward of every micro-batch through megatron's
    schedule (gradients accumulate; finalize_model_grads reduces them over DP and ties), then the
    optimizer step (clipping included). loss_fn(logp [b, T], entropy [b, T], mb) -> (share, stats),
    the share as defined in the module docstring."""
    if not temperature > 0:
        raise ValueError(f"temperature({temperature}) must be > 0")

    batching = _as_batching(micro_batch_size)
    fused = batching if fused_head_on(model, batching) else None

    def share_of(logits: Tensor, chunk: _Chunk, mb: MicroBatch):
        logp, ent = _logp_entropy(model, logits, chunk, temperature=temperature, kernels=kernels, fused=fused)
        return loss_fn(logp, ent, mb)

    return _train(model, optimizer, inputs, batching, share_of, hidden_head=fused is not None)


def critic_train_step(critic: DistributedDataParallel, optimizer: MegatronOptimizer, inputs: PackedInputs,
                      loss_fn: CriticLossFn, *, micro_batch_size: Union[int, Batching]) -> StepResult:
    """train_step for the critic: loss_fn(values [b, T], mb) -> (share, stats)."""
    return _train(critic, optimizer, inputs, micro_batch_size,
                  lambda values, chunk, mb: loss_fn(_values(values, chunk), mb))
