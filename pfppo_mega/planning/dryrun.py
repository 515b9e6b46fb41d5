"""Check the planner's layout arithmetic against megatron itself, for one rank of the full world,
in one CPU process, without GPUs.

For each requested rank r of WORLD = nodes x gpus_per_node:
1. torch.distributed starts with torch's fake backend (``FakeStore`` + backend "fake": every
   collective returns at once, nothing is sent) as rank r of WORLD;
2. megatron's ``parallel_state.initialize_model_parallel(tp, pp)`` builds its real groups
   (``create_gloo_process_groups=False``: a gloo group would try to connect to the other,
   absent, ranks); the rank's tp / dp / pp coordinates and its tensor, data, pipeline and
   embedding groups are compared with ``shapes.rank_coords`` / ``shapes.group_ranks``;
3. the actor (GPTModel, LM head) and the critic (same trunk, ValueHead) of the config's shape
   and training features (sequence parallelism, recompute, dtype, layer spec: as on a GPU) are built for that rank's stage on the meta device (megatron-core 0.16.1 supports it with
   ``use_cpu_initialization=True, perform_initialization=False`` inside ``torch.device("meta")``:
   no parameter memory is allocated, a 70B rank builds in ~0.1 s), and every parameter's name
   and shape is compared with ``shapes.param_shapes``, hence the per-rank counts the memory
   plan uses.

The models are built by ``pfppo_mega.models.gpt`` itself: its ``transformer_config`` with the two
init flags above (which ``build_actor`` / ``build_critic`` do not expose) passed to its model
constructor ``gpt._gpt`` (spec, vocab padding, rope), then the critic's ValueHead, as
``build_critic`` does. A rename of ``_gpt`` fails the dry-run test loudly.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field
from typing import Iterator

import torch

from pfppo_mega.families import DecoderShape
from pfppo_mega.planning.shapes import Layout, group_ranks, param_shapes, rank_coords, count


@dataclass
class DryRunResult:
    rank: int
    world_size: int
    coords: dict[str, int]           # megatron's tp / dp / pp rank
    groups: dict[str, list[int]]     # megatron's groups of this rank
    actor_params: int                # megatron, meta device
    critic_params: int
    planner_actor_params: int
    planner_critic_params: int
    mismatches: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.mismatches


@contextlib.contextmanager
def _fake_world(rank: int, world_size: int) -> Iterator[None]:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised; the dry run needs its own (fake) world")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _megatron_groups() -> tuple[dict[str, int], dict[str, list[int]]]:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    coords = {"tp_rank": ps.get_tensor_model_parallel_rank(), "dp_rank": ps.get_data_parallel_rank(),
              "pp_rank": ps.get_pipeline_model_parallel_rank()}
    groups = {"tensor": dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
              "data": dist.get_process_group_ranks(ps.get_data_parallel_group()),
              "pipeline": dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())}
    if ps.is_rank_in_embedding_group(ignore_virtual=True):
        groups["embedding"] = sorted(dist.get_process_group_ranks(ps.get_embedding_group()))
    return coords, groups


def _meta_models(model_cfg, arch=None, features=None) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """Actor and critic of this rank's stage on the meta device: name -> shape of each.
    ``arch``: the checkpoint's pfppo_mega.families.Architecture (None: Llama). ``features``: the
    config's training features (``gpt.features_from_config``; None: all off), checked and built as
    on a GPU (``device_type="cuda"``), so what megatron asserts at construction there (a norm that
    refuses sequence parallelism, a recompute setting it rejects) fails here too."""
    from pfppo_mega.models import gpt

    shape = DecoderShape.from_model_config(model_cfg, arch)
    config = gpt.transformer_config(model_cfg, arch=shape.arch, features=features, device_type="cuda")
    config.use_cpu_initialization = True   # weights created with torch.empty(...) and no device=
    config.perform_initialization = False  # no init kernels (they cannot run on meta tensors)

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        actor = gpt._gpt(gpt.GPTModel, shape, config, tie=shape.tie_word_embeddings)
        critic = gpt._gpt(gpt.CriticModel, shape, config, tie=False)
        if critic.post_process:
            critic.output_layer = gpt.ValueHead(shape.hidden_size, config.params_dtype, torch.device("meta"))
    shapes = []
    for m in (actor, critic):
        on_meta = {p.device.type for p in m.parameters()}
        if on_meta != {"meta"}:
            raise RuntimeError(f"dry run built parameters on {sorted(on_meta)}, expected only meta")
        shapes.append({n: tuple(p.shape) for n, p in m.named_parameters()})
    return shapes[0], shapes[1]


def _compare(label: str, got: dict[str, tuple], want: dict[str, tuple]) -> list[str]:
    out = [f"{label}: megatron has {n} {got[n]}, planner does not" for n in sorted(set(got) - set(want))]
    out += [f"{label}: planner has {n} {want[n]}, megatron does not" for n in sorted(set(want) - set(got))]
    out += [f"{label}: {n} megatron {got[n]} != planner {want[n]}"
            for n in sorted(set(got) & set(want)) if got[n] != want[n]]
    return out


def dry_run_rank(model_cfg, *, tp: int, pp: int, world_size: int, rank: int, arch=None,
                 features=None) -> DryRunResult:
    """Build rank ``rank``'s megatron groups and meta-device models (with the config's ``features``,
    ``gpt.features_from_config``) and compare with the planner."""
    from pfppo_mega.compat import megatron_cpu

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state as ps

    t0 = time.perf_counter()
    shape = DecoderShape.from_model_config(model_cfg, arch)
    layout = Layout.for_world(world_size, tp, pp)
    with _fake_world(rank, world_size):
        megatron_cpu.enable()  # megatron passes torch.cuda.current_device() for small buffers
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     create_gloo_process_groups=False)
        try:
            coords, groups = _megatron_groups()
            actor, critic = _meta_models(model_cfg, arch, features)
        finally:
            ps.destroy_model_parallel()

    c = rank_coords(rank, layout)
    want_coords = {"tp_rank": c.tp_rank, "dp_rank": c.dp_rank, "pp_rank": c.pp_rank}
    want_groups = group_ranks(rank, layout)
    mismatches = [f"{k}: megatron {coords[k]} != planner {want_coords[k]}" for k in coords
                  if coords[k] != want_coords[k]]
    for name, ranks in groups.items():
        if ranks != want_groups[name]:
            mismatches.append(f"{name} group: megatron {ranks} != planner {want_groups[name]}")
    if "embedding" not in groups and rank in want_groups["embedding"]:
        mismatches.append(f"embedding group: megatron leaves rank {rank} out, planner has {want_groups['embedding']}")
    want_actor = param_shapes(shape, tp, pp, c.pp_rank, "lm")
    want_critic = param_shapes(shape, tp, pp, c.pp_rank, "value")
    mismatches += _compare("actor", actor, want_actor) + _compare("critic", critic, want_critic)
    return DryRunResult(rank, world_size, coords, groups, count(actor), count(critic),
                        count(want_actor), count(want_critic), mismatches, time.perf_counter() - t0)
