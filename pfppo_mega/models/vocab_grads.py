"""Gradients of the vocabulary-sized weights without a dense [V, H] tensor per micro-batch.

megatron's layers, without its CUDA-only gradient-accumulation fusion, give the LM head and the
word embedding a fresh dense [V/tp, H] weight gradient in every micro-batch's backward, which DDP's
hook then adds into the gradient buffer (``param.main_grad``). For a 49,152 x 576 vocabulary that
is a 113 MB tensor written, faulted in and read again per micro-batch, whatever the number of rows
behind it: on the SmolLM2-135M shape ~2 s of a ~9 s actor step on 2 CPU threads (docs/perf.md).

Here, once the model is wrapped in megatron DDP (so ``main_grad`` exists):

- the **LM head** (``output_layer``; tied or not) keeps each micro-batch's input rows x [N, H] and
  output gradient g [N, V/tp] and adds ``g^T @ x`` into ``main_grad`` in one product over many
  micro-batches: when the rows held reach ``hidden_size`` (then the held g is no larger than one
  dense gradient), and at the end of the step, before megatron's ``finalize_model_grads`` reduces
  the buffers (``flush`` below runs first in the model's ``finalize_model_grads_func``, set by
  gpt.wrap_ddp). This is megatron's ``defer_embedding_wgrad_compute`` idea, which megatron
  itself offers only with pipeline parallelism and the CUDA fusion;
- the **word embedding** adds its output gradient into ``main_grad`` at the looked-up rows only
  (``index_add_``: B x S rows, not V).

Neither returns a weight gradient to autograd, so DDP's hook has nothing to add; everything lands in
the same buffer megatron reduces over data parallelism and between the tied stages. The input
gradient (what flows back into the decoder) is computed as megatron computes it, all-reduced over
tensor parallelism the same way. Results equal megatron's path up to the order of floating-point
sums (tests/test_token_budget.py compares the two at TP1; tests/test_parallel.py's layouts run
this path). Not applied, and megatron's forward runs instead, when gradients are off or the weight
is frozen (the reference policy, the forward-only passes), without DDP, or with sequence
parallelism (its reduce-scatter paths).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

from pfppo_mega.kernels.fused_head import accumulate  # main [V/tp, H] += g^T @ x, shared with the fused head


class _HeadBuffer:
    """The LM head's held (x [N, H], g [N, V/tp]) pairs for one weight, and their flush."""

    def __init__(self, max_rows: int):
        self.max_rows = max_rows
        self.pairs: list[tuple[Tensor, Tensor]] = []
        self.rows = 0
        self.weight: Optional[Tensor] = None

    def add(self, weight: Tensor, x: Tensor, g: Tensor) -> None:
        if self.weight is not None and self.weight is not weight:
            self.flush()
        self.weight = weight
        self.pairs.append((x.detach(), g.detach()))
        self.rows += x.shape[0]
        if self.rows >= self.max_rows:
            self.flush()

    @torch.no_grad()  # called outside autograd's backward too: the buffer must never join a graph
    def flush(self) -> None:
        if self.pairs:
            main = self.weight.main_grad                                             # [V/tp, H] fp32
            x = torch.cat([p[0] for p in self.pairs]) if len(self.pairs) > 1 else self.pairs[0][0]  # [N, H]
            g = torch.cat([p[1] for p in self.pairs]) if len(self.pairs) > 1 else self.pairs[0][1]  # [N, V/tp]
            accumulate(main, g, x)
        self.discard()

    def discard(self) -> None:
        self.pairs, self.rows, self.weight = [], 0, None


class _DeferredHead(torch.autograd.Function):
    """logits = x @ w^T; backward: dx = g @ w (all-reduced over TP when asked), w's gradient held."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, buffer: _HeadBuffer, allreduce_dgrad: bool,
                tp_group: Optional[dist.ProcessGroup]) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.buffer, ctx.allreduce_dgrad, ctx.tp_group = buffer, allreduce_dgrad, tp_group
        return torch.matmul(x, weight.t())                                           # [..., V/tp]

    @staticmethod
    def backward(ctx, g: Tensor):
        x, weight = ctx.saved_tensors
        dx = g.matmul(weight)                                                        # [..., H]
        handle = dist.all_reduce(dx, group=ctx.tp_group, async_op=True) if ctx.allreduce_dgrad else None
        ctx.buffer.add(weight, x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1]))
        if handle is not None:
            handle.wait()
        return dx, None, None, None, None


class _SparseEmbedding(torch.autograd.Function):
    """out = weight[ids]; backward: main_grad[ids] += g (index_add_), no dense weight gradient."""

    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return F.embedding(ids, weight)                                              # [B, S, H]

    @staticmethod
    def backward(ctx, g: Tensor):
        (ids,) = ctx.saved_tensors
        main = ctx.weight.main_grad                                                  # [V/tp, H]
        main.index_add_(0, ids.reshape(-1), g.reshape(-1, g.shape[-1]).to(main.dtype))
        return None, None


def _applies(weight: Optional[Tensor]) -> bool:
    return weight is not None and torch.is_grad_enabled() and weight.requires_grad and hasattr(weight, "main_grad")


def _install_head(layer: torch.nn.Module, hidden_size: int) -> None:
    megatron_impl = layer._forward_impl                                              # bound method
    layer.vocab_grad_buffer = _HeadBuffer(max_rows=hidden_size)

    def forward_impl(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                     *args, **kwargs):
        if not _applies(weight) or bias is not None or sequence_parallel or gradient_accumulation_fusion:
            return megatron_impl(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                                 sequence_parallel, *args, **kwargs)
        return _DeferredHead.apply(input, weight, layer.vocab_grad_buffer, allreduce_dgrad, kwargs.get("tp_group"))

    layer._forward_impl = forward_impl


def _install_embedding(layer: torch.nn.Module) -> None:
    megatron_forward = layer.forward                                                 # bound method

    def forward(input_: Tensor) -> Tensor:
        if not _applies(layer.weight) or layer.reduce_scatter_embeddings:
            return megatron_forward(input_)
        tp = layer.tp_group.size()
        if tp > 1:  # as megatron's VocabParallelEmbedding: ids outside this rank's shard look up row 0, zeroed
            outside = (input_ < layer.vocab_start_index) | (input_ >= layer.vocab_end_index)
            ids = input_.clone() - layer.vocab_start_index
            ids[outside] = 0
        else:
            ids = input_
        out = _SparseEmbedding.apply(ids, layer.weight)                              # [B, S, H]
        if tp > 1:
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(out, group=layer.tp_group)

    layer.forward = forward


def install(model: torch.nn.Module) -> None:
    """Give ``model`` (the GPTModel / CriticModel inside DDP) this module's head and embedding
    backward. The critic's ValueHead is not vocabulary-sized and keeps autograd's."""
    head = getattr(model, "output_layer", None) if getattr(model, "post_process", False) else None
    if head is not None and hasattr(head, "_forward_impl"):
        _install_head(head, model.config.hidden_size)
    embedding = getattr(model, "embedding", None) if getattr(model, "pre_process", False) else None
    if embedding is not None:
        _install_embedding(embedding.word_embeddings)


def _buffers(model_chunks) -> list[_HeadBuffer]:
    found = []
    for chunk in model_chunks:
        while not hasattr(chunk, "output_layer") and hasattr(chunk, "module"):  # DDP, Float16Module
            chunk = chunk.module
        layer = getattr(chunk, "output_layer", None)
        if getattr(layer, "vocab_grad_buffer", None) is not None:
            found.append(layer.vocab_grad_buffer)
    return found


def flush(model_chunks) -> None:
    """Add the held head gradients into ``main_grad`` (before any reduction reads it)."""
    for buffer in _buffers(model_chunks):
        buffer.flush()


def discard(model_chunks) -> None:
    """Drop held head gradients (a step abandoned before its reduction)."""
    for buffer in _buffers(model_chunks):
        buffer.discard()


def pending_rows(model_chunks) -> int:
    return sum(b.rows for b in _buffers(model_chunks))
