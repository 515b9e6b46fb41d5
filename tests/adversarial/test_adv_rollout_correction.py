"""algorithm.rollout_correction (verl 0.9.1's rollout correction, bypass mode): every bad value is named
with its key and rule, in our keys and in verl's spellings; the math refuses bad bounds by name."""

import pytest
import torch

from pfppo_mega.config import ConfigError, load_config_dict
from pfppo_mega.ppo import rollout_correction as rc

ON = {"recompute_old_logp": False}


@pytest.mark.parametrize("rc_cfg,key,rule", [
    ({"rollout_is": "tok"}, "rollout_is", "must be one of 'token', 'sequence'"),
    ({"rollout_is": "token", "rollout_is_threshold": 0.0}, "rollout_is_threshold", "must be > 0"),
    ({"rollout_is": "token", "rollout_is_threshold_lower": 3.0}, "rollout_is_threshold_lower", "<= 2.0"),
    ({"rollout_rs": ["token_k4"], "rollout_rs_upper": [1.0]}, "rollout_rs", "must be one of"),
    ({"rollout_rs": ["token_k2", "token_k2"], "rollout_rs_upper": [1.0, 1.0]}, "rollout_rs", "twice"),
    ({"rollout_rs": ["token_k2"], "rollout_rs_upper": []}, "rollout_rs_upper", "one bound per rollout_rs"),
    ({"rollout_rs": ["token_k2"], "rollout_rs_upper": [1.0], "rollout_rs_lower": [0.5]}, "rollout_rs_lower",
     "only the k1 criteria"),
    ({"rollout_rs": ["token_k1"], "rollout_rs_upper": [1.5], "rollout_rs_lower": [2.0]}, "rollout_rs_lower",
     "must be in (0, upper"),
    ({"rollout_rs": ["seq_max_k3"], "rollout_rs_upper": [float("inf")]}, "rollout_rs_upper", "finite number > 0"),
    ({"loss_type": "ppo"}, "loss_type", "must be one of 'ppo_clip', 'reinforce'"),
])
def test_bad_values_are_named(rc_cfg, key, rule):
    with pytest.raises(ConfigError) as e:
        load_config_dict({"algorithm": {**ON, "rollout_correction": rc_cfg}})
    assert f"algorithm.rollout_correction.{key}" in str(e.value) and rule in str(e.value), str(e.value)


@pytest.mark.parametrize("algorithm,key", [
    ({"recompute_old_logp": True}, "algorithm.recompute_old_logp"),
    ({**ON, "policy_loss": "gspo"}, "algorithm.policy_loss"),
    ({**ON, "use_pf_ppo": True}, "algorithm.use_pf_ppo"),
])
def test_what_it_cannot_run_with_is_named(algorithm, key):
    with pytest.raises(ConfigError) as e:
        load_config_dict({"algorithm": {**algorithm, "rollout_correction": {"loss_type": "reinforce"}}})
    assert key in str(e.value) and "rollout_correction" in str(e.value)


BYPASS = ["algorithm.rollout_correction.bypass_mode=true", "actor_rollout_ref.model.path=/m"]


@pytest.mark.parametrize("overrides,rule", [
    (["algorithm.rollout_correction.rollout_is_threshold=a_b"], "must be a number or a 'lower_upper' string"),
    (["algorithm.rollout_correction.rollout_rs=token_k1,token_k2",
      "algorithm.rollout_correction.rollout_rs_threshold='1.5,2,3'"], "one threshold for all 2"),
    (["algorithm.rollout_correction.rollout_rs=token_k2",
      "algorithm.rollout_correction.rollout_rs_threshold='0.5_2'"], "only the k1 criteria"),
    (["algorithm.rollout_correction.rollout_rs=token_k2"], "must be set when rollout_rs is"),
])
def test_verl_spellings_are_named(overrides, rule):
    with pytest.raises(ConfigError) as e:
        load_config_dict({}, BYPASS + overrides)
    assert "algorithm.rollout_correction" in str(e.value) and rule in str(e.value), str(e.value)


def test_the_math_names_bad_bounds():
    d, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="upper=0.0 must be a finite number > 0"):
        rc.is_weights(d, m, level="token", upper=0.0)
    with pytest.raises(ValueError, match="lower=3.0 must be a finite number in"):
        rc.is_weights(d, m, level="token", upper=2.0, lower=3.0)
    with pytest.raises(ValueError, match="level='row' must be one of"):
        rc.is_weights(d, m, level="row", upper=2.0)
    with pytest.raises(ValueError, match="criterion 'token_k9'"):
        rc.rejection_mask(d, m, [("token_k9", None, 1.0)])
    with pytest.raises(ValueError, match="token_k1 needs a lower bound"):
        rc.rejection_mask(d, m, [("token_k1", None, 1.0)])
