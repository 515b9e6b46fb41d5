"""vocab_parallel_logprob_entropy across a real 2-rank gloo group equals the full vocabulary."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pfppo_mega.kernels import is_built

pytestmark = pytest.mark.skipif(
    os.environ.get("PFPPO_NO_EXT") == "1", reason="PFPPO_NO_EXT=1: pfppo_mega._C not built"
)

ROWS, VOCAB, SPLIT = 6, 700, 333  # rank 0 holds columns [0, 333), rank 1 [333, 700)


def _inputs():
    from pfppo_mega.kernels.testing import labels_for, logits

    x = logits(ROWS, VOCAB, seed=40, dtype=torch.float32)
    g = torch.Generator().manual_seed(41)
    return x, labels_for(x, seed=40), torch.randn(ROWS, generator=g), torch.randn(ROWS, generator=g)


def _rank(rank: int, store_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    from pfppo_mega.kernels import vocab_parallel_logprob_entropy

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    x, labels, grad_logp, grad_ent = _inputs()
    start, end = (0, SPLIT) if rank == 0 else (SPLIT, VOCAB)
    shard = x[:, start:end].contiguous().requires_grad_()
    logp, ent = vocab_parallel_logprob_entropy(shard, labels, start, group=dist.group.WORLD)
    (logp * grad_logp + ent * grad_ent).sum().backward()
    torch.save({"logp": logp.detach(), "entropy": ent.detach(), "grad": shard.grad}, f"{out_path}.{rank}")
    dist.destroy_process_group()


def test_vocab_parallel_two_ranks_match_full(tmp_path):
    assert is_built(), "pfppo_mega._C does not import"
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path / "out")), nprocs=2, join=True)
    parts = [torch.load(tmp_path / f"out.{r}") for r in range(2)]

    from pfppo_mega import ppo
    from pfppo_mega.kernels.testing import assert_within_torch_error

    x, labels, grad_logp, grad_ent = _inputs()

    def reference(inp):
        inp = inp.detach().clone().requires_grad_()
        logp = ppo.logprobs_from_logits(inp, labels)
        ent = ppo.entropy_from_logits(inp)
        (logp * grad_logp.to(inp.dtype) + ent * grad_ent.to(inp.dtype)).sum().backward()
        return logp.detach(), ent.detach(), inp.grad

    same, exact = reference(x), reference(x.double())
    for rank, part in enumerate(parts):  # every rank holds the full-vocabulary result
        assert_within_torch_error(f"rank {rank} logp", part["logp"], same[0], exact[0])
        assert_within_torch_error(f"rank {rank} entropy", part["entropy"], same[1], exact[1])
    grad = torch.cat([parts[0]["grad"], parts[1]["grad"]], dim=1)
    assert_within_torch_error("grad", grad, same[2], exact[2])
