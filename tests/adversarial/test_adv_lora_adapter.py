"""Damaged or mismatched PEFT adapters (model.lora.adapter_path, pfppo_mega/models/lora.py): each gets a
LoraError naming the file, the tensor or the setting (the trainer turns it into a SetupError before
any step), never a traceback or a silent load. Every case starts from an adapter this trainer wrote
(lora.export_peft) for a tiny Llama, with one thing broken."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multirank"))
import common  # noqa: E402  (tiny checkpoints)

from pfppo_mega.config.tree import LoraConfig  # noqa: E402
from pfppo_mega.models import lora  # noqa: E402

W, C = lora.PEFT_WEIGHTS, lora.PEFT_CONFIG
QB = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
QA = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    yield from common.tp1_world(tmp_path_factory.mktemp("adv_lora"))


def _actor(path: Path):
    from pfppo_mega.models import gpt, hf_io

    cfg, arch = common.model_config(path)
    actor = gpt.build_actor(cfg, arch=arch)
    hf_io.load_actor_from_hf(actor, path)
    return actor


@pytest.fixture(scope="module")
def good(world, tmp_path_factory) -> Path:
    actor = _actor(world["llama"])
    spec = lora.apply(actor, LoraConfig(rank=4, alpha=8.0), seed=1)
    out = tmp_path_factory.mktemp("adapter") / "good"
    lora.export_peft(actor, spec, out)
    return out


def _tensors(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        t = load_file(str(d / W))
        fn(t)
        save_file(t, str(d / W))
    return edit


def _config(**changes) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        cfg = json.loads((d / C).read_text())
        cfg.update(changes)
        (d / C).write_text(json.dumps(cfg))
    return edit


def _distinct_a(t: dict) -> None:
    t[QA] = t[QA] + 1.0


# (case, edit of the adapter directory, config rank, fragments the error names)
CASES = [
    ("no directory", lambda d: shutil.rmtree(d), 0, ["no such directory"]),
    ("config missing", lambda d: (d / C).unlink(), 0, [C, "missing"]),
    ("weights missing", lambda d: (d / W).unlink(), 0, [W, "missing"]),
    ("config not json", lambda d: (d / C).write_text("{r: 4"), 0, [C, "JSON"]),
    ("config a list", lambda d: (d / C).write_text("[4]"), 0, [C, "JSON object"]),
    ("not lora", _config(peft_type="PREFIX_TUNING"), 0, ["peft_type", "LORA"]),
    ("rank zero", _config(r=0), 0, ["r = 0"]),
    ("alpha text", _config(lora_alpha="big"), 0, ["lora_alpha"]),
    ("dora", _config(use_dora=True), 0, ["use_dora"]),
    ("bias trained", _config(bias="all"), 0, ["bias"]),
    ("fused subset", _config(target_modules=["q_proj", "v_proj"]), 0, ["without k_proj"]),
    ("rank differs from the config", lambda d: None, 8, ["model.lora.rank = 8", "r = 4"]),
    ("tensor missing", _tensors(lambda t: t.pop(QB)), 0, ["missing adapter tensor", "layer 0 q_proj.lora_B"]),
    ("unknown tensor", _tensors(lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 8)})), 0,
     ["no LoRA adapter of a decoder linear", "lm_head"]),
    ("tensor rank", _tensors(lambda t: t.update({QB: t[QB][:, :2].contiguous()})), 0, ["layer 0 q_proj", "not of rank 4"]),
    ("tensor shape", _tensors(lambda t: t.update({QB: torch.zeros(7, 4)})), 0, ["layer 0 q_proj", "(7, 4)"]),
    ("tensor 1-D", _tensors(lambda t: t.update({QA: torch.zeros(4)})), 0, ["layer 0 q_proj", "2-D"]),
    ("q/k/v A differ", _tensors(_distinct_a), 0, ["layer 0", "different lora_A"]),
    ("outside the targets", _config(target_modules=["q_proj", "k_proj", "v_proj"]), 0, ["outside the targets"]),
    ("truncated weights", lambda d: (d / W).write_bytes((d / W).read_bytes()[:100]), 0, [W, "safetensors"]),
]


@pytest.mark.parametrize("case,edit,rank,fragments", CASES, ids=[c[0] for c in CASES])
def test_a_bad_adapter_is_refused_by_name(world, good, tmp_path, case, edit, rank, fragments):
    d = tmp_path / "adapter"
    shutil.copytree(good, d)
    edit(d)
    actor = _actor(world["llama"])
    with pytest.raises(lora.LoraError) as e:
        lora.apply(actor, LoraConfig(rank=rank, adapter_path=str(d)), seed=1)
    missing = [f for f in fragments if f not in str(e.value)]
    assert not missing, (missing, str(e.value))


def test_the_unbroken_adapter_loads(world, good):
    actor = _actor(world["llama"])
    spec = lora.apply(actor, LoraConfig(adapter_path=str(good)), seed=1)
    assert spec.rank == 4 and spec.alpha == 8.0 and len(list(lora.adapted(actor))) == 4 * common.LAYERS
