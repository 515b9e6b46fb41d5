"""Damaged model directories: each gets a named error (file, key or tensor, value), never a
traceback or a silent load.

Table-driven: every case is a copy of one tiny checkpoint (shaped as configs/demo.yaml, with the
built-in tokenizer) with one thing broken. ``outcome`` runs the loaders in the trainer's order
(tokenizer, config.json, model config, actor, critic) and classifies what happens:

    named      a ValueError or FileNotFoundError (ModelDirError / TokenizerError; `pfppo train`
               prints it and exits 2) whose message contains every expected fragment
    vague      one of those that does not name the problem
    traceback  any other exception
    silent     the model loads

`python tests/adversarial/test_adv_modeldir_load.py` prints the count per class (used for the
before / after figures of issue 8).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Callable

import pytest
import torch

torch.set_num_threads(1)

from safetensors.torch import load_file, save_file  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WEIGHTS = "model.safetensors"
# configs/demo.yaml's model, so `pfppo train configs/demo.yaml` accepts the intact directory.
SHAPE = dict(vocab_size=16, hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=384, max_position_embeddings=32, rms_norm_eps=1e-5, rope_theta=10000.0,
             tie_word_embeddings=False)


def make_model_dir(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from pfppo_mega.tokenizer import char_tokenizer

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(path)
    char_tokenizer().save(path)
    return path


# ----------------------------------------------------------------------------- damage


def _edit_config(**changes) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(changes)
        (d / "config.json").write_text(json.dumps(cfg))
    return damage


def _edit_tensors(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        sd = load_file(str(d / WEIGHTS))
        edit(sd)
        save_file(sd, str(d / WEIGHTS), metadata={"format": "pt"})
    return damage


def _write(name: str, data: bytes) -> Callable[[Path], None]:
    return lambda d: (d / name).write_bytes(data)


def _truncate(d: Path) -> None:
    data = (d / WEIGHTS).read_bytes()
    (d / WEIGHTS).write_bytes(data[: len(data) // 2])


def _corrupt_header(d: Path) -> None:
    data = bytearray((d / WEIGHTS).read_bytes())
    data[8:40] = b"\xff" * 32  # inside the JSON header
    (d / WEIGHTS).write_bytes(bytes(data))


def _extra_layer(sd: dict) -> None:  # weights hold num_hidden_layers + 1 layers
    last = SHAPE["num_hidden_layers"] - 1
    for name in [n for n in sd if n.startswith(f"model.layers.{last}.")]:
        sd[name.replace(f"layers.{last}.", f"layers.{last + 1}.")] = sd[name].clone()


def _set(name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Path], None]:
    def edit(sd: dict) -> None:
        sd[name] = fn(sd[name])
    return _edit_tensors(edit)


def _nan(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[3] = float("nan")
    return t


def _inf(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[5] = float("-inf")
    return t


def _sharded_index(weight_map) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        (d / "model.safetensors.index.json").write_text(json.dumps(weight_map))
    return damage


# (case id, damage, fragments the error message must contain)
CASES: list[tuple[str, Callable[[Path], None], tuple[str, ...]]] = [
    ("zero_byte_weights", _write(WEIGHTS, b""), (WEIGHTS, "0 bytes", "not a readable safetensors")),
    ("truncated_weights", _truncate, (WEIGHTS, "not a readable safetensors")),
    ("corrupt_header", _corrupt_header, (WEIGHTS, "not a readable safetensors")),
    ("garbage_weights", _write(WEIGHTS, b"not safetensors at all" * 20), (WEIGHTS, "not a readable safetensors")),
    ("missing_tensor", _edit_tensors(lambda sd: sd.pop("model.norm.weight")), ("lacks tensor", "model.norm.weight")),
    ("missing_layer_tensor", _edit_tensors(lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight")),
     ("lacks tensor", "model.layers.1.mlp.up_proj.weight")),
    ("config_2_weights_3_layers", _edit_tensors(_extra_layer), ("unexpected tensor", "model.layers.3.")),
    ("extra_tensor", _edit_tensors(lambda sd: sd.update({"model.extra.weight": torch.zeros(4)})),
     ("unexpected tensor", "model.extra.weight")),
    ("unexpected_bias", _edit_tensors(lambda sd: sd.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(128)})),
     ("unexpected tensor", "model.layers.0.self_attn.q_proj.bias")),
    ("config_tied_distinct_lm_head", _edit_config(tie_word_embeddings=True),
     ("tie_word_embeddings = true", "lm_head.weight differs")),
    ("int64_weights", _set("model.layers.0.mlp.down_proj.weight", lambda t: (t * 100).to(torch.int64)),
     ("model.layers.0.mlp.down_proj.weight", "I64", "non-floating dtype")),
    ("int32_norm", _set("model.norm.weight", lambda t: t.to(torch.int32)), ("model.norm.weight", "I32")),
    ("nan_weight", _set("model.layers.1.self_attn.k_proj.weight", _nan),
     (WEIGHTS, "model.layers.1.self_attn.k_proj.weight", "NaN/inf")),
    ("inf_embedding", _set("model.embed_tokens.weight", _inf), ("model.embed_tokens.weight", "NaN/inf")),
    ("nan_lm_head", _set("lm_head.weight", _nan), ("lm_head.weight", "NaN/inf")),
    ("config_hidden_size_text", _edit_config(hidden_size="one hundred"),
     ("config.json", "hidden_size", "'one hundred'", "positive integer")),
    ("config_layers_float", _edit_config(num_hidden_layers=2.5), ("num_hidden_layers", "2.5", "positive integer")),
    ("config_layers_bool", _edit_config(num_hidden_layers=True), ("num_hidden_layers", "True", "positive integer")),
    ("config_heads_zero", _edit_config(num_attention_heads=0), ("num_attention_heads", "0")),
    ("config_eps_text", _edit_config(rms_norm_eps="1e-5"), ("rms_norm_eps", "'1e-5'", "finite number")),
    ("config_theta_nan", _edit_config(rope_parameters={"rope_type": "default", "rope_theta": float("nan")}),
     ("rope_theta", "nan")),
    ("config_tie_text", _edit_config(tie_word_embeddings="no"), ("tie_word_embeddings", "'no'", "true or false")),
    ("config_missing_key", _edit_config(intermediate_size=None), ("config.json", "intermediate_size")),
    # issue 40: ModelConfig's own rules broken by config.json read as the YAML's model keys
    ("config_heads_not_dividing_hidden", _edit_config(num_attention_heads=6),
     ("config.json: hidden_size = 128", "must be divisible by num_attention_heads (6)")),
    ("config_kv_heads_not_dividing_heads", _edit_config(num_key_value_heads=3),
     ("config.json: num_key_value_heads = 3", "must divide num_attention_heads (4)")),
    ("config_ffn_too_wide", _edit_config(intermediate_size=10**9), ("config.json: intermediate_size = 1000000000",)),
    ("config_invalid_json", _write("config.json", b'{"hidden_size": 128,'), ("config.json", "not valid JSON")),
    ("config_not_utf8", _write("config.json", b"\xff\xfe{\x00}"), ("config.json", "not valid JSON")),
    ("config_list", _write("config.json", b"[1, 2]"), ("config.json", "JSON object")),
    ("tokenizer_invalid_json", _write("tokenizer.json", b'{"model": '), ("tokenizer.json", "cannot be parsed")),
    ("tokenizer_binary", _write("tokenizer.json", bytes(range(256))), ("tokenizer.json", "cannot be parsed")),
    ("tokenizer_empty", _write("tokenizer.json", b""), ("tokenizer.json", "cannot be parsed")),
    ("index_list", _sharded_index([1, 2]), ("model.safetensors.index.json", "weight_map")),
    ("index_missing_shard", _sharded_index({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}),
     ("model-00002-of-00002.safetensors", "missing")),
    ("index_path_escape", _sharded_index({"weight_map": {"model.norm.weight": "../config.json"}}),
     ("model.safetensors.index.json", "weight_map")),
]


def load_like_trainer(model_dir: Path) -> None:
    """The trainer's loader calls, in its order (the tokenizer first; then config, actor, critic)."""
    from pfppo_mega.config.tree import ModelConfig
    from pfppo_mega.models import gpt, hf_io
    from pfppo_mega.tokenizer import Tokenizer

    Tokenizer.from_dir(model_dir)
    hf_cfg = hf_io.read_hf_config(model_dir)
    cfg = hf_io.model_config_from_hf(hf_cfg, ModelConfig())
    hf_io.load_actor_from_hf(gpt.build_actor(cfg), model_dir)
    hf_io.load_critic_trunk_from_hf(gpt.build_critic(cfg), model_dir)


def outcome(model_dir: Path, fragments: tuple[str, ...]) -> tuple[str, str]:
    """(class, message) of loading ``model_dir``; see the module docstring."""
    try:
        load_like_trainer(model_dir)
    except (ValueError, FileNotFoundError) as e:  # what `pfppo train` turns into a message
        named = all(f in str(e) for f in fragments)
        return ("named" if named else "vague"), f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - classified, reported by the test
        return "traceback", f"{type(e).__name__}: {e}"
    return "silent", ""


# ----------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def world():
    from pfppo_mega import parallel
    from pfppo_mega.compat import megatron_cpu

    parallel.init_parallel(tp=1, pp=1, seed=1)
    yield
    parallel.destroy_parallel()
    megatron_cpu.disable()


@pytest.fixture(scope="module")
def intact(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("modeldir") / "intact")


def _damaged(intact: Path, tmp_path: Path, damage: Callable[[Path], None]) -> Path:
    d = tmp_path / "damaged"
    shutil.copytree(intact, d)
    damage(d)
    return d


def test_intact_directory_loads(world, intact):
    assert outcome(intact, ()) == ("silent", "")


@pytest.mark.parametrize("case,damage,fragments", CASES, ids=[c[0] for c in CASES])
def test_damaged_directory_gets_a_named_error(world, intact, tmp_path, case, damage, fragments):
    kind, message = outcome(_damaged(intact, tmp_path, damage), fragments)
    assert kind == "named", f"{case}: {kind}: {message!r} (expected all of {fragments})"


CLI_CASES = ["truncated_weights", "config_2_weights_3_layers", "nan_weight", "tokenizer_invalid_json"]


def test_pfppo_train_prints_a_clean_message(intact, tmp_path):
    """`pfppo train` on damaged directories: exit 2, one `pfppo: cannot start:` line naming the
    problem, no traceback (one process per case; the cases cover weights, shapes, values and
    the tokenizer)."""
    table = {c[0]: c for c in CASES}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for case in CLI_CASES:
        _, damage, fragments = table[case]
        d = _damaged(intact, tmp_path / case, damage)
        proc = subprocess.run(
            [sys.executable, "-m", "pfppo_mega", "train", str(REPO / "configs" / "demo.yaml"),
             f"actor_rollout.model_path={d}", f"logging.output_dir={tmp_path / case / 'run'}"],
            env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert proc.returncode == 2, f"{case}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
        assert "Traceback" not in proc.stderr, f"{case}:\n{proc.stderr[-2000:]}"
        assert "pfppo: cannot start:" in proc.stderr and all(f in proc.stderr for f in fragments), proc.stderr


if __name__ == "__main__":  # count per class (issue 8's before / after figures)
    import tempfile

    from pfppo_mega import parallel

    parallel.init_parallel(tp=1, pp=1, seed=1)
    root = Path(tempfile.mkdtemp())
    base = make_model_dir(root / "intact")
    counts: Counter = Counter()
    for i, (case, damage, fragments) in enumerate(CASES):
        kind, message = outcome(_damaged(base, root / str(i), damage), fragments)
        counts[kind] += 1
        print(f"{case:28s} {kind:9s} {message[:150]!r}")
    print(f"{len(CASES)} cases: " + ", ".join(f"{k} {counts[k]}" for k in ("named", "vague", "traceback", "silent")))
    shutil.rmtree(root, ignore_errors=True)
