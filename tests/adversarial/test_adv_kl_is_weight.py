"""algorithm.kl_loss_is_weight (docs/async.md, "KL on stale rows") in a combination it cannot serve
is refused at load, naming the key, the value and the rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from pfppo_mega.config import ConfigError, load_config

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "async_tiny.yaml"

REFUSED = [
    (["algorithm.kl_loss_is_weight=true"], "needs use_kl_loss true"),                 # KL as a reward penalty
    (["algorithm.kl_loss_is_weight=true", "algorithm.use_kl_loss=true", "algorithm.kl_coeff=0"],
     "kl_coeff > 0"),
    (["algorithm.kl_loss_is_weight=true", "algorithm.use_kl_loss=true", "algorithm.async_rl.enable=false"],
     "needs use_pf_ppo or async_rl.enable"),
    (["algorithm.kl_loss_is_weight=sometimes"], "bool"),
]


@pytest.mark.parametrize("overrides,rule", REFUSED, ids=[" ".join(c[0])[:70] for c in REFUSED])
def test_bad_kl_loss_is_weight_is_refused_by_key(overrides, rule):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, overrides)
    assert "algorithm.kl_loss_is_weight" in {p.key for p in e.value.problems}, str(e.value)
    assert rule in str(e.value), str(e.value)


@pytest.mark.parametrize("extra", [[], ["algorithm.async_rl.enable=false", "algorithm.use_pf_ppo=true"]])
def test_it_loads_where_rows_carry_weights(extra):
    cfg = load_config(CONFIG, ["algorithm.kl_loss_is_weight=true", "algorithm.use_kl_loss=true", *extra])
    assert cfg.algorithm.kl_loss_is_weight and cfg.algorithm.use_kl_loss


def test_default_is_off():
    assert load_config(CONFIG, []).algorithm.kl_loss_is_weight is False
