"""Prompt truncation (data.overlong_prompts left / right / middle; verl's data.truncation): the cut
verl's postprocess_data makes, on the data path, and verl's key onto ours."""

import random

import pytest

from pfppo_mega.config import ConfigError, resolve_config_dict
from pfppo_mega.data import DataError, build_prompt_data
from pfppo_mega.data.files import Keys, encode_rows, truncate

from test_data import _cfg, example  # noqa: F401  (the module's example files and tokenizer)


def test_truncate_written_out():
    ids = list(range(10))
    assert truncate(ids, 4, side="left") == [6, 7, 8, 9]
    assert truncate(ids, 4, side="right") == [0, 1, 2, 3]
    assert truncate(ids, 4, side="middle") == [0, 1, 8, 9]
    assert truncate(ids, 5, side="middle") == [0, 1, 7, 8, 9]   # head = 5 // 2, tail = 5 - 2
    assert truncate(ids, 10, side="left") == ids and truncate(ids, 12, side="middle") == ids
    with pytest.raises(ValueError, match="side='error': must be one of 'left', 'right', 'middle'"):
        truncate(ids, 4, side="error")


@pytest.mark.parametrize("side", ["left", "right", "middle"])
def test_encode_rows_cuts_and_keeps_every_row(example, side):  # noqa: F811
    _, tok = example
    rows = [{"prompt": "1 2 3 4 5 6 7 8 9 10 11 12", "data_source": "x"}, {"prompt": "1 2", "data_source": "x"}]
    full = [tok.encode(r["prompt"]) for r in rows]
    assert len(full[0]) > 6 >= len(full[1])
    enc = encode_rows(rows, key="data.train_files", file="f.jsonl", keys=Keys(), tokenizer=tok, template=None,
                      max_prompt_length=6, overlong=side)
    assert (enc.truncated, enc.overlong, len(enc.samples)) == (1, 0, 2)
    assert list(enc.samples[0].prompt_ids) == truncate(full[0], 6, side=side)
    assert list(enc.samples[1].prompt_ids) == full[1]
    assert enc.samples[0].prompt_text == tok.decode(list(enc.samples[0].prompt_ids))


def test_the_data_path_cuts_with_the_key(example):  # noqa: F811
    paths, tok = example
    cfg = _cfg(paths, max_prompt_length=20, overlong_prompts="left")
    logs = []
    data = build_prompt_data(cfg, tok, model_dir=paths["tokenizer"], rng=random.Random(0), log=logs.append)
    assert len(data.train.samples) == 40 and max(len(s.prompt_ids) for s in data.train.samples) == 20
    assert any("cut" in m and "(data.overlong_prompts = left)" in m for m in logs), logs
    with pytest.raises(DataError, match="'left' / 'right' / 'middle' cut them as verl's data.truncation"):
        build_prompt_data(_cfg(paths, max_prompt_length=20, overlong_prompts="error"), tok,
                          model_dir=paths["tokenizer"], rng=random.Random(0), log=lambda *_: None)


def _verl(*overrides):
    return resolve_config_dict({}, ["actor_rollout_ref.model.path=/m", *overrides])


@pytest.mark.parametrize("overrides, want", [
    (["data.truncation=left"], "left"), (["data.truncation=right"], "right"), (["data.truncation=middle"], "middle"),
    (["data.truncation=error"], "error"), ([], "error"),  # verl's default: refuse a long prompt
    (["data.truncation=left", "data.filter_overlong_prompts=True"], "filter"),  # verl drops them first
])
def test_verl_truncation_maps(overrides, want):
    assert _verl(*overrides).config.data.overlong_prompts == want


def test_an_unknown_truncation_names_verls_values():
    with pytest.raises(ConfigError, match=r"data.truncation = 'top': must be one of 'error', 'left', 'right', "
                                          r"'middle' \(verl's data.truncation\)"):
        _verl("data.truncation=top")
