"""Config loading: article example, coercion, aliases, unknown keys, problem collection,
overrides, round trip, generated reference, `pfppo validate`."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pfppo_mega.config import (
    Config,
    ConfigError,
    apply_overrides,
    config_to_dict,
    dump_yaml,
    load_config,
    load_config_dict,
    resolve_config_dict,
    validate_main,
)
from pfppo_mega.config import reference
from pfppo_mega.config.loader import _field_types, _is_section
from pfppo_mega.config.tree import PoolConfig, Problem, Section, TrainingConfig, _range, opt

ROOT = Path(__file__).resolve().parents[1]
ARTICLE = ROOT / "configs" / "article_example.yaml"

ARTICLE_TEXT = """\
actor_rollout:
  model_path: /path/to/sft_model
  temperature: 0.7
  top_p: 0.9
  gpu_memory_utilization: 0.85
algorithm:
  name: ppo
  use_pf_ppo: true
  kl_coeff: 0.05
  use_kl_loss: true
  clip_ratio: 0.2
  adv_estimator: gae
  lmbda: 0.95
  gamma: 1.0
  vf_coef: 0.1
  max_response_length: 1024
training:
  batch_size: 64
  rollout_batch_size: 64
  lr: 1e-6
  total_training_steps: 500
"""

BASE = {"actor_rollout": {"model_path": "/m"}}  # the smallest config that loads
FULL_MODEL = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
              "num_query_groups": 2, "vocab_size": 32, "max_position_embeddings": 64,
              "rope_theta": 10000, "norm_epsilon": "1e-5", "tie_word_embeddings": False}


def with_base(**sections) -> dict:
    d = {"actor_rollout": dict(BASE["actor_rollout"])}
    for name, body in sections.items():
        d.setdefault(name, {}).update(body)
    return d


def problems_of(d: dict, overrides=()) -> list:
    with pytest.raises(ConfigError) as info:
        load_config_dict(d, overrides)
    return info.value.problems


def only_problem(d: dict, overrides=()):
    problems = problems_of(d, overrides)
    assert len(problems) == 1, [str(p) for p in problems]
    return problems[0]


def get_path(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def sections(cls=Config, path=""):
    yield path, cls
    for name, tp in _field_types(cls).items():
        if _is_section(tp):
            yield from sections(tp, f"{path}.{name}" if path else name)


def nest(dotted: str, value) -> dict:
    out = value
    for part in reversed(dotted.split(".")):
        out = {part: out}
    return out


def deep_update(dst: dict, src: dict) -> dict:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            deep_update(dst[k], v)
        else:
            dst[k] = v
    return dst


# ----------------------------------------------------------------------------- article example


def test_article_example_is_verbatim_and_loads_exactly():
    assert ARTICLE_TEXT in ARTICLE.read_text()
    assert yaml.safe_load(ARTICLE_TEXT)["training"]["lr"] == "1e-6"  # YAML 1.1: a string
    cfg = load_config(ARTICLE)
    ar, al, tr = cfg.actor_rollout, cfg.algorithm, cfg.training
    assert (ar.model_path, ar.temperature, ar.top_p, ar.gpu_memory_utilization) == (
        "/path/to/sft_model", 0.7, 0.9, 0.85)
    assert (al.name, al.use_pf_ppo, al.kl_coeff, al.use_kl_loss, al.clip_ratio) == (
        "ppo", True, 0.05, True, 0.2)
    assert (al.adv_estimator, al.lmbda, al.gamma, al.vf_coef, al.max_response_length) == (
        "gae", 0.95, 1.0, 0.1, 1024)
    assert (tr.batch_size, tr.rollout_batch_size, tr.total_training_steps) == (64, 64, 500)
    assert type(tr.lr) is float and tr.lr == 1e-6
    assert type(al.gamma) is float and type(al.max_response_length) is int
    # untouched keys keep their defaults; derived defaults are filled in
    assert cfg.algorithm.pool == type(cfg.algorithm.pool)()
    assert (al.clip_ratio_low, al.clip_ratio_high, tr.critic_lr) == (0.2, 0.2, 1e-6)


# ----------------------------------------------------------------------------- coercion


@pytest.mark.parametrize("text, expected", [("1e-6", 1e-6), ("3E-5", 3e-5), ("+2.5e+3", 2500.0),
                                            (".5", 0.5), ("7", 7.0), (" 1e-6 ", 1e-6)])
def test_float_strings_are_floats(text, expected):
    cfg = load_config_dict(with_base(algorithm={"vf_coef": text}, reward={"clip_range": text}))
    assert type(cfg.algorithm.vf_coef) is float and cfg.algorithm.vf_coef == expected
    # Optional[float] takes the same strings
    assert type(cfg.reward.clip_range) is float and cfg.reward.clip_range == expected


def test_negative_float_string_reaches_the_range_rule():
    p = only_problem(with_base(training={"lr": "-2.5e+3"}))
    assert (p.key, p.value) == ("training.lr", -2500.0) and "> 0" in p.rule


def test_int_is_accepted_for_float_and_stays_float():
    cfg = load_config_dict(with_base(algorithm={"gamma": 1, "dual_clip_c": 2}))
    assert type(cfg.algorithm.gamma) is float and cfg.algorithm.gamma == 1.0
    assert type(cfg.algorithm.dual_clip_c) is float and cfg.algorithm.dual_clip_c == 2.0


@pytest.mark.parametrize("section, key, value, expected", [
    ("training", "batch_size", "64", "expected int, got str"),
    ("training", "seed", 2.5, "expected int, got float"),
    ("training", "seed", 2.0, "expected int, got float"),          # integral float: no truncation
    ("training", "seed", True, "expected int, got bool"),
    ("algorithm", "kl_coeff", True, "expected float, got bool"),
    ("algorithm", "kl_coeff", "0.1x", "expected float, got str"),
    ("algorithm", "use_pf_ppo", 1, "expected bool (true or false), got int"),
    ("algorithm", "use_pf_ppo", "true", "expected bool (true or false), got str"),
    ("training", "lr", None, "expected float, got null"),
    ("model", "num_layers", 2.0, "expected int or null, got float"),
    ("model", "num_layers", [1, 2], "expected int or null, got list"),
    ("actor_rollout", "engine", 3, "expected str, got int"),
])
def test_wrong_types(section, key, value, expected):
    p = only_problem(with_base(**{section: {key: value}}))
    assert p.key == f"{section}.{key}" and p.value == value and type(p.value) is type(value)
    assert expected in p.rule
    assert f"{section}.{key}" in str(p) and repr(value) in str(p)


def test_coerce_literal_and_union_syntax():
    from typing import Literal, Optional

    from pfppo_mega.config.loader import coerce

    assert coerce("a", Literal["a", "b"]) == ("a", None)
    assert coerce("c", Literal["a", "b"]) == (None, "expected one of 'a', 'b', got str")
    assert coerce(True, Literal[1, 2])[1] == "expected one of 1, 2, got bool"
    assert coerce(None, Optional[Literal["a"]]) == (None, None)
    assert coerce(3, int | None) == (3, None)
    assert coerce(3.0, int | None) == (None, "expected int or null, got float (write it without a decimal point)")
    assert coerce("nan", float)[1] == "expected float, got str"  # only decimal numbers


def test_null_only_for_optional():
    cfg = load_config_dict(with_base(algorithm={"value_clip": None, "dual_clip_c": None}))
    assert cfg.algorithm.value_clip is None and cfg.algorithm.dual_clip_c is None


def test_section_given_as_scalar():
    p = only_problem({**BASE, "algorithm": 5})
    assert (p.key, p.value) == ("algorithm", 5) and "expected a mapping" in p.rule


# ----------------------------------------------------------------------------- aliases


def _other_value(cls: type, name: str):
    """A valid value of field `name` of section `cls` that differs from its default."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    tp, default = _field_types(cls)[name], f.default
    if name in cls.CHOICES:
        return next(c for c in cls.CHOICES[name] if c != default)
    if default is None:
        return {"Optional[int]": 8, "Optional[float]": 1e-5, "Optional[str]": "/alias/path",
                "Optional[bool]": True}[str(tp).replace("typing.", "")]
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default // 2 if name == "batch_size" else default * 2  # batch_size divides 64
    if isinstance(default, float):
        return default / 2  # inside every (0, 1] / (> 1 when default > 2) range of the tree
    raise AssertionError(f"no test value for {cls.__name__}.{name}")


def all_aliases():
    for path, cls in sections():
        for alias, canonical in cls.ALIASES.items():
            owner, leaf = cls, canonical.split(".")
            for part in leaf[:-1]:
                owner = _field_types(owner)[part]
            full = lambda k: f"{path}.{k}" if path else k
            yield full(alias), full(canonical), _other_value(owner, leaf[-1])


ALIASES = list(all_aliases())


def test_alias_list_is_not_empty_and_covers_every_section_with_aliases():
    assert len(ALIASES) == sum(len(cls.ALIASES) for _, cls in sections()) >= 25
    assert {"algorithm.lam", "algorithm.kl_ctrl.kl_coef", "algorithm.cliprange_value",
            "trainer.total_training_steps"} <= {a for a, _, _ in ALIASES}


@pytest.mark.parametrize("form", ["nested", "dotted", "override"])
def test_every_alias_maps_to_its_canonical_key(form):
    for alias, canonical, value in ALIASES:
        # model_path itself has an alias: then the model is given by its shape instead
        base = {"model": dict(FULL_MODEL)} if canonical == "actor_rollout.model_path" else with_base()
        default = get_path(load_config_dict(base), canonical)
        assert value != default, (alias, value)
        if form == "nested":
            r = resolve_config_dict(deep_update(base, nest(alias, value)))
        elif form == "dotted":
            r = resolve_config_dict({**base, alias: value})
        else:
            r = resolve_config_dict(base, [f"{alias}={yaml.safe_dump(value).splitlines()[0]}"])
        assert get_path(r.config, canonical) == value, (form, alias)
        assert [(u.alias, u.canonical) for u in r.aliases] == [(alias, canonical)], (form, alias)
        assert f"{alias} read as {canonical}" in r.notes()[0]


def test_alias_prefix_leftovers_are_unknown_keys():
    p = only_problem(with_base(algorithm={"kl_ctrl": {"kl_coef": 0.1, "type": "fixed"}}))
    assert p.key == "algorithm.kl_ctrl.type" and "unknown key" in p.rule and "kl_coef" in p.rule


def test_value_alias_is_noted():
    r = resolve_config_dict(with_base(algorithm={"kl_loss_type": "low_var_kl"}))
    assert r.config.algorithm.kl_estimator == "k3"
    assert r.notes() == ["algorithm.kl_loss_type read as algorithm.kl_estimator",
                         "algorithm.kl_estimator = 'low_var_kl' read as 'k3'"]


def test_alias_and_canonical_conflict():
    p = only_problem(with_base(algorithm={"lam": 0.9, "lmbda": 0.95}))
    assert (p.key, p.value) == ("algorithm.lam", 0.9)
    assert "conflicts with algorithm.lmbda = 0.95" in p.rule
    p = only_problem(with_base(algorithm={"kl_coef": 0.1, "kl_loss_coef": 0.2}))
    assert (p.key, p.value) == ("algorithm.kl_loss_coef", 0.2)
    assert "conflicts with algorithm.kl_coef = 0.1" in p.rule and "algorithm.kl_coeff" in p.rule
    p = only_problem(with_base(algorithm={"kl_coeff": 0.1, "kl_coef": 0.1, "kl_loss_coef": 0.2}))
    assert "conflicts with algorithm.kl_coeff = 0.1 (kl_loss_coef is an alias of it)" in p.rule
    p = only_problem(with_base(algorithm={"cliprange_value": 0.3, "value_clip": 0.2}))
    assert p.key == "algorithm.cliprange_value" and "algorithm.value_clip = 0.2" in p.rule
    # equal values are not a conflict ("1e-6" and 1e-6 are one value; true and 1 are not)
    cfg = load_config_dict(with_base(algorithm={"lam": 0.9, "lmbda": 0.9},
                                     training={"actor_lr": "1e-6", "lr": 1e-6}))
    assert cfg.algorithm.lmbda == 0.9 and cfg.training.lr == 1e-6
    p = only_problem(with_base(algorithm={"norm_adv_by_std_in_grpo": 1, "whiten_advantages": True}))
    assert p.key == "algorithm.norm_adv_by_std_in_grpo" and "expected bool" in p.rule


def test_pf_ppo_names_one_feature_per_layout():
    """Our tree: algorithm.use_pf_ppo is the snapshot pool and pf_ppo.* is no key (filtration is
    algorithm.filtration.*); verl's layout keeps verl's meaning, pf_ppo.* = policy filtration."""
    p = only_problem(with_base(algorithm={"pf_ppo": {"weight_pow": 3.0}}))
    assert p.key == "algorithm.pf_ppo" and "unknown key" in p.rule and "verl's" in p.rule
    verl = resolve_config_dict({}, ["actor_rollout_ref.model.path=/m", "algorithm.use_pf_ppo=True",
                                    "algorithm.pf_ppo.weight_pow=3.0"]).config.algorithm
    assert (verl.filtration.enable, verl.filtration.weight_pow, verl.use_pf_ppo) == (True, 3.0, False)


def test_verl_grpo_std_switch_does_not_turn_ppo_whitening_off():
    # verl's norm_adv_by_std_in_grpo is the grpo estimators' own field (issue 22); it used to be
    # read as whiten_advantages, and must still not switch PPO whitening
    for whiten in (True, False):
        res = resolve_config_dict(with_base(algorithm={"norm_adv_by_std_in_grpo": False,
                                                       "whiten_advantages": whiten}))
        assert res.config.algorithm.whiten_advantages is whiten
        assert res.config.algorithm.norm_adv_by_std_in_grpo is False and res.notes() == []
    res = resolve_config_dict(BASE, ["algorithm.norm_adv_by_std_in_grpo=false"])
    assert res.config.algorithm.whiten_advantages is True
    assert res.config.algorithm.norm_adv_by_std_in_grpo is False and not res.ignored
    assert resolve_config_dict(BASE).config.algorithm.norm_adv_by_std_in_grpo is True  # verl's default
    p = only_problem(BASE, ["algorithm.norm_adv_by_std_in_grpo=maybe"])
    assert p.key == "algorithm.norm_adv_by_std_in_grpo" and "expected bool" in p.rule


def test_dotted_and_nested_spelling_of_one_key_must_agree():
    cfg = load_config_dict({**with_base(algorithm={"lmbda": 0.9}), "algorithm.lmbda": 0.9})
    assert cfg.algorithm.lmbda == 0.9
    p = only_problem({**with_base(algorithm={"lmbda": 0.9}), "algorithm.lmbda": 0.8})
    assert p.key == "algorithm.lmbda" and "given twice" in p.rule


# ----------------------------------------------------------------------------- unknown keys


def test_unknown_key_did_you_mean():
    p = only_problem(with_base(algorithm={"clip_raito": 0.3}))
    assert (p.key, p.value) == ("algorithm.clip_raito", 0.3)
    assert p.rule == "unknown key; did you mean algorithm.clip_ratio?"
    assert "did you mean algorithm?" in only_problem({**BASE, "algoritm": {}}).rule
    # a near miss of an alias suggests the canonical key
    assert "did you mean algorithm.kl_coeff?" in only_problem(with_base(algorithm={"kl_loss_cof": 1})).rule
    assert "did you mean algorithm.pool.pool_size?" in only_problem(
        with_base(algorithm={"pool": {"poolsize": 3}})).rule


def test_unknown_key_lists_valid_keys():
    p = only_problem(with_base(parallel={"zzz": 1}))
    assert p.key == "parallel.zzz"
    assert p.rule == ("unknown key; valid keys of section parallel: "
                      "tensor_model_parallel_size, pipeline_model_parallel_size, backend, collective_timeout_s, watchdog_s, "
                      "sequence_parallel, "
                      "use_distributed_optimizer, virtual_pipeline_size")


def test_duplicate_yaml_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("actor_rollout:\n  model_path: /m\ntraining:\n  lr: 1e-5\n  lr: 1e-6\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (p,) = info.value.problems
    assert p.key == "training.lr" and p.value == "lines 4 and 5" and "given twice" in p.rule


def test_non_mapping_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "must be a mapping" in info.value.problems[0].rule


# ----------------------------------------------------------------------------- many problems at once


def test_every_problem_is_reported_together():
    d = {
        "actor_rollout": {"model_path": "/m", "top_p": 1.5, "engine": "sglang"},
        "algorithm": {"clip_ratio": 1.5, "lmbda": 1.2, "clip_raito": 0.3, "max_response_length": 2.5,
                      "pool": {"pool_size": 0}},
        "training": {"lr": -1, "batch_size": 48, "seed": "one"},
        "model": {"hidden_size": 100, "num_attention_heads": 3},
        "kernels": "cuda",
    }
    expected = [  # key, value, words of the rule
        ("actor_rollout.top_p", 1.5, "must be > 0 and <= 1"),
        ("actor_rollout.engine", "sglang", "must be one of 'builtin', 'vllm'"),
        ("algorithm.clip_ratio", 1.5, "must be > 0 and < 1"),
        ("algorithm.lmbda", 1.2, "must be >= 0 and <= 1"),
        ("algorithm.clip_raito", 0.3, "did you mean algorithm.clip_ratio?"),
        ("algorithm.max_response_length", 2.5, "expected int, got float"),
        ("algorithm.pool.pool_size", 0, "must be >= 1"),
        ("training.lr", -1.0, "must be > 0"),
        ("training.seed", "one", "expected int, got str"),
        ("model.hidden_size", 100, "must be divisible by num_attention_heads (3)"),
        ("kernels", "cuda", "must be one of 'auto', 'torch', 'fused'"),
        # root rule, still checked although child sections failed
        ("training.batch_size", 48, "must divide rollout_batch_size * n_samples_per_prompt (64)"),
    ]
    problems = problems_of(d)
    assert len(problems) == len(expected), "\n".join(map(str, problems))
    assert sorted(p.key for p in problems) == sorted(k for k, _, _ in expected)
    by_key = {p.key: p for p in problems}
    for key, value, rule in expected:
        text = str(by_key[key])
        assert key in text and repr(value) in text and rule in text, (text, value, rule)
    message = str(ConfigError(problems))
    assert message.startswith(f"{len(expected)} config problem(s):")


def test_bad_child_value_is_not_reported_twice_by_a_parent_rule():
    # batch_size 0 breaks the training rule; the root's divisibility rule must not add a second line
    p = only_problem(with_base(training={"batch_size": 0}))
    assert (p.key, p.value, p.rule) == ("training.batch_size", 0, "must be >= 1 and <= 1048576")


def test_missing_model_is_a_root_problem():
    p = only_problem({})
    assert p.key == "model" and "actor_rollout.model_path" in p.rule
    cfg = load_config_dict({"model": FULL_MODEL})
    assert cfg.model.is_complete() and cfg.model.norm_epsilon == 1e-5


@dataclasses.dataclass
class _Child(Section):
    n: int = opt(1, "a divisor")

    def _check(self, p):
        _range(p, "n", self.n, ge=1)


@dataclasses.dataclass
class _Parent(Section):
    child: _Child = opt(factory=_Child, doc="child section")
    m: int = opt(4, "a multiple")

    def _check(self, p):  # no guard: divides by zero when child.n == 0
        _range(p, "m", self.m, ge=1)
        if self.m % self.child.n:
            p.append(Problem("child.n", self.child.n, f"must divide m ({self.m})"))


def test_parent_rules_run_on_a_failed_child_without_repeating_its_keys():
    def keys_rules(d):
        with pytest.raises(ConfigError) as info:
            resolve_config_dict(d, root=_Parent)
        return [(p.key, p.rule) for p in info.value.problems]

    assert resolve_config_dict({"child": {"n": 2}}, root=_Parent).config == _Parent(_Child(2), 4)
    assert keys_rules({"child": {"n": 3}}) == [("child.n", "must divide m (4)")]
    # child fails; the parent rule sees the same key again: reported once
    assert keys_rules({"child": {"n": -3}, "m": 4}) == [("child.n", "must be >= 1")]
    # child fails; the parent rule raises ZeroDivisionError on it: skipped, child problem kept
    assert keys_rules({"child": {"n": 0}}) == [("child.n", "must be >= 1")]
    # child fails; the parent's problems on other keys are still reported
    assert keys_rules({"child": {"n": -3}, "m": -4}) == [("child.n", "must be >= 1"),
                                                        ("m", "must be >= 1")]
    assert keys_rules({"child": {"n": 0}, "m": "x"}) == [("child.n", "must be >= 1"),
                                                        ("m", "expected int, got str")]


# ----------------------------------------------------------------------------- overrides


def test_overrides_are_read_as_yaml_and_replace_file_values():
    cfg = load_config(ARTICLE, ["training.lr=1e-5", "algorithm.use_pf_ppo=false",
                                "algorithm.value_clip=null", "algorithm.pool={pool_size: 3, sampling: kl}",
                                "actor_rollout.model_path=/other", "algorithm.pool.is_clip = 4"])
    assert type(cfg.training.lr) is float and cfg.training.lr == 1e-5
    assert cfg.algorithm.use_pf_ppo is False and cfg.algorithm.value_clip is None
    assert (cfg.algorithm.pool.pool_size, cfg.algorithm.pool.sampling) == (3, "kl")
    assert cfg.algorithm.pool.snapshot_interval == PoolConfig().snapshot_interval  # a mapping override merges
    assert cfg.algorithm.pool.is_clip == 4.0 and cfg.actor_rollout.model_path == "/other"


def test_alias_override_wins_over_the_canonical_file_value():
    r = resolve_config_dict(with_base(algorithm={"lmbda": 0.95, "lam": 0.95}), ["algorithm.lam=0.5"])
    assert r.config.algorithm.lmbda == 0.5
    assert [str(u) for u in r.aliases] == ["algorithm.lam read as algorithm.lmbda",
                                           "algorithm.lam read as algorithm.lmbda (override)"]


def test_bad_overrides_are_reported_with_file_problems():
    problems = problems_of(with_base(training={"lr": 0}),
                           ["algorithm.clip_raito=0.3", "training.lr", "training.seed=[1, 2]",
                            "training.lr.x=1", "nothing=1", "algorithm.pool.pool_sz=2"])
    by_key = {p.key: p for p in problems}
    assert len(problems) == 7, "\n".join(map(str, problems))
    assert "did you mean algorithm.clip_ratio?" in by_key["algorithm.clip_raito"].rule
    assert by_key["(override)"].value == "training.lr" and "key.path=value" in by_key["(override)"].rule
    assert by_key["training.seed"].value == [1, 2] and "expected int, got list" in by_key["training.seed"].rule
    assert "training.lr is a float, not a section" in by_key["training.lr.x"].rule
    assert "valid keys of the top level" in by_key["nothing"].rule
    assert "did you mean algorithm.pool.pool_size?" in by_key["algorithm.pool.pool_sz"].rule
    assert by_key["training.lr"].value == 0 and "must be > 0" in by_key["training.lr"].rule


def test_apply_overrides_returns_the_canonical_dict():
    d = apply_overrides({"algorithm": {"lam": 0.9}}, ["trainer.total_training_steps=7"])
    assert d == {"algorithm": {"lmbda": 0.9}, "training": {"total_training_steps": 7}}
    with pytest.raises(ConfigError):
        apply_overrides({}, ["training.lrr=1"])


# ----------------------------------------------------------------------------- round trip


def test_round_trip():
    cfg = load_config(ARTICLE, ["algorithm.value_clip=null", "algorithm.kl_penalty=low_var_kl",
                                "reward.clip_range=5", "model.num_layers=4"])
    d = config_to_dict(cfg)
    assert d["algorithm"]["pool"]["pool_size"] == PoolConfig().pool_size and d["algorithm"]["value_clip"] is None
    assert load_config_dict(d) == cfg
    text = dump_yaml(cfg)
    assert "  lr: 1.0e-06\n" in text
    assert load_config_dict(yaml.safe_load(text)) == cfg
    assert list(d) == [f.name for f in dataclasses.fields(Config)]


# ----------------------------------------------------------------------------- tree sanity


def test_tree_declarations_are_consistent():
    for path, cls in sections():
        types_ = _field_types(cls)
        for key, allowed in cls.CHOICES.items():
            assert key in types_ and allowed, (path, key)
            default = {f.name: f.default for f in dataclasses.fields(cls)}[key]
            assert default in allowed, (path, key, default)
        for key in cls.VALUE_ALIASES:
            assert key in types_, (path, key)
        for alias, canonical in cls.ALIASES.items():
            assert alias.split(".")[0] not in types_, (path, alias)  # an alias never hides a field
            owner = cls
            for part in canonical.split("."):
                assert part in _field_types(owner), (path, alias, canonical)
                owner = _field_types(owner)[part]
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc"), f"{path}.{f.name} has no doc"
        assert issubclass(cls, Section)


# ----------------------------------------------------------------------------- reference


def test_reference_doc_is_up_to_date():
    out = subprocess.run([sys.executable, "-m", "pfppo_mega.config.reference", "--check",
                          str(ROOT / "docs" / "config_reference.md")],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_reference_lists_every_key_and_alias(tmp_path):
    text = reference.generate_reference()
    for path, cls in sections():
        for f in dataclasses.fields(cls):
            assert f"| `{path + '.' if path else ''}{f.name}` |" in text
    for alias, _, _ in ALIASES:
        assert f"`{alias}`" in text
    assert "`k1`, `k2`, `k3`, `abs`" in text
    stale = tmp_path / "ref.md"
    stale.write_text(text + "edited by hand\n")
    assert reference.main(["--check", str(stale)]) == 1
    assert reference.main(["--write", str(stale)]) == 0 and stale.read_text() == text
    assert reference.main(["--check", str(stale)]) == 0


# ----------------------------------------------------------------------------- pfppo validate


def test_validate_main_ok(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(ARTICLE_TEXT.replace("lmbda:", "lam:"))
    assert validate_main([str(path), "training.lr=2e-6"]) == 0
    out, err = capsys.readouterr()
    assert "note: algorithm.lam read as algorithm.lmbda" in err
    resolved = load_config_dict(yaml.safe_load(out))
    assert resolved == load_config(ARTICLE, ["training.lr=2e-6"])


def test_validate_main_problems(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(ARTICLE_TEXT.replace("clip_ratio: 0.2", "clip_raito: 0.2")
                    .replace("batch_size: 64", "batch_size: 2.0", 1))
    assert validate_main([str(path), "algorithm.gamma=2"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "3 config problem(s)" in err
    assert "algorithm.clip_raito = 0.2: unknown key; did you mean algorithm.clip_ratio?" in err
    assert "training.batch_size = 2.0: expected int, got float" in err
    assert "algorithm.gamma = 2.0: must be >= 0 and <= 1" in err  # the value as read (a float)


def test_validate_main_usage_and_missing_file(tmp_path, capsys):
    assert validate_main([]) == 2
    assert validate_main([str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml': no such file" in capsys.readouterr().err
    assert validate_main(["--help"]) == 0


# ----------------------------------------------------------------------------- hardening (issue 8)


@dataclasses.dataclass
class _Unbounded(Section):
    n: int = opt(0, "An int no rule bounds.")
    x: float = opt(0.0, "A float no rule bounds.")


def test_every_float_must_be_finite_and_every_int_is_bounded():
    with pytest.raises(ConfigError) as info:
        resolve_config_dict({"n": 10**30, "x": "1e400"}, root=_Unbounded)
    assert [(p.key, p.rule) for p in info.value.problems] == [
        ("x", "must be a finite number (not inf or nan)"),
        ("n", "must be >= -2147483647 and <= 2147483647")]
    with pytest.raises(ConfigError, match="lr = inf: must be a finite number"):
        TrainingConfig(lr=float("inf"))  # built directly, not through the loader
    # one problem per key: nan is "not finite", not also "must be > 0"
    p = only_problem(with_base(training={"lr": float("nan")}))
    assert (p.key, p.rule) == ("training.lr", "must be a finite number (not inf or nan)")


def test_two_spellings_in_overrides_conflict_like_in_a_file():
    p = only_problem(BASE, ["algorithm.lam=0.5", "algorithm.lmbda=0.9"])
    assert (p.key, p.value) == ("algorithm.lmbda", 0.9)
    assert p.rule == ("conflicts with the override algorithm.lam=0.5 (both are read as "
                      "algorithm.lmbda); keep one")
    # the same spelling twice: the last wins (scripts append overrides)
    assert load_config_dict(BASE, ["algorithm.lam=0.5", "algorithm.lam=0.9"]).algorithm.lmbda == 0.9


@pytest.mark.parametrize("libyaml", [True, False], ids=["libyaml", "pure_python"])
def test_hostile_yaml_is_refused_fast_with_either_parser(libyaml, tmp_path, monkeypatch):
    import time

    monkeypatch.setattr(yaml, "__with_libyaml__", libyaml and yaml.__with_libyaml__)
    bomb = "a: &a [x,x,x,x,x,x,x,x,x,x]\n" + "".join(
        f"{c}: &{c} [{','.join(['*' + p] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
    assert len(bomb) == 332
    for text, rule in ((bomb, "holds more than 2000 keys, values and lists"),
                       ("[" * 5000 + "]" * 5000, "nests mappings/lists more than 32 deep"),
                       ("a: &x [1, *x]\n", "recursive alias")):
        path = tmp_path / "c.yaml"
        path.write_text(text)
        t0 = time.perf_counter()
        with pytest.raises(ConfigError) as e:
            load_config(path)
        assert time.perf_counter() - t0 < (2.0 if libyaml else 5.0)  # pure Python: deep flow is slower
        assert [p.key for p in e.value.problems] == ["config file"] and rule in e.value.problems[0].rule


def test_constants_are_shared_by_config_math_and_kernels():
    from pfppo_mega import constants, kernels, pool, ppo
    from pfppo_mega.config import tree

    assert tree.AlgorithmConfig.CHOICES["kl_estimator"] is constants.KL_ESTIMATORS is ppo.KL_ESTIMATORS
    assert tree.AlgorithmConfig.CHOICES["loss_agg_mode"] is constants.LOSS_AGG_MODES is ppo.LOSS_AGG_MODES
    assert tree.RewardConfig.CHOICES["scaling"] is constants.REWARD_SCALING is ppo.REWARD_SCALING
    assert tree.PoolConfig.CHOICES["sampling"] is constants.POOL_SAMPLING is pool.SAMPLING_METHODS
    assert tree.PoolConfig.CHOICES["is_mode"] is constants.IS_MODES is pool.IS_MODES
    assert tree.Config.CHOICES["kernels"] is constants.KERNEL_MODES is kernels.KERNEL_MODES
    assert tree.FiltrationConfig.CHOICES["reweight_method"] is constants.REWEIGHT_METHODS
    assert constants.REWEIGHT_METHODS[:3] == ("pow", "max_min", "max_random")  # verl's names
    from pfppo_mega.ppo import kl, losses

    assert kl._LOG_RATIO_LIMIT == losses._LOG_RATIO_LIMIT == constants.LOG_RATIO_LIMIT
    # the C++ / CUDA policy loss share one header that hard-codes it
    for src in ("csrc/policy_loss.h",):
        text = (ROOT / src).read_text()
        assert f"constexpr double kLogRatioLimit = {constants.LOG_RATIO_LIMIT};" in text, src
