"""fp16's loss-scaler keys (model.loss_scale, initial_loss_scale, min_loss_scale, loss_scale_window,
loss_scale_hysteresis): a bad value is named with its rule; a scaler key without float16 is refused;
the optimizer builder checks the same values when called directly."""

import pytest

from pfppo_mega.config import ConfigError, load_config_dict
from pfppo_mega.models import gpt


@pytest.mark.parametrize("key,value,rule", [
    ("loss_scale", 0.0, "must be > 0"),
    ("initial_loss_scale", float("inf"), "finite"),
    ("min_loss_scale", 2.0 ** 40, "must be <= initial_loss_scale"),
    ("loss_scale_window", 0, ">= 1"),
    ("loss_scale_hysteresis", 0, ">= 1"),
])
def test_bad_scaler_values_are_named(key, value, rule):
    with pytest.raises(ConfigError) as e:
        load_config_dict({"model": {"params_dtype": "float16", key: value}})
    assert f"model.{key}" in str(e.value) and rule in str(e.value)


def test_scaler_keys_without_fp16_are_refused():
    with pytest.raises(ConfigError) as e:
        load_config_dict({"model": {"params_dtype": "bfloat16", "initial_loss_scale": 65536.0}})
    assert "model.initial_loss_scale" in str(e.value) and "only with params_dtype float16" in str(e.value)


@pytest.mark.parametrize("field,value", [("static", -1.0), ("initial", float("nan")), ("min", 2.0 ** 40),
                                         ("window", 0), ("hysteresis", 0)])
def test_the_builder_names_a_bad_scaler_field(field, value):
    with pytest.raises(ValueError, match=f"LossScaling.{field} = "):
        gpt._scaler_fields(gpt.LossScaling(**{field: value}))
