"""The colocated order of every generation (trainer/colocation/generation.py): offload the trainer's states
but the actor's weights -> wake the engine's weights -> refit -> offload the actor's weights -> wake
the KV cache -> generate -> sleep -> reload. Checked on the real trainer (training, evaluation, the
KL probe) with the trainer's device bytes at every call, and a moved call fails the check."""

import pytest

from pfppo_mega.trainer.colocation.generation import ColocationOrderError, check_colocation_order
from pfppo_mega.trainer.loop import PPOTrainer

from test_trainer import _cfg, sft_dir  # noqa: F401  (the module's SFT checkpoint fixture)

GOOD = ["offload trainer", "wake weights", "refit", "offload actor weights", "wake kv cache", "generate",
        "sleep", "reload trainer"]


def test_the_order_check_accepts_the_order_and_refuses_a_moved_call():
    check_colocation_order(GOOD + GOOD)
    check_colocation_order([c for c in GOOD if c != "refit"])  # the engine held the version already
    check_colocation_order(GOOD[:5] + ["generate", "switch", "generate", "refit", "generate"] + GOOD[6:])
    moved = ["wake weights", "offload trainer"] + GOOD[2:]  # the engine wakes before the trainer leaves
    with pytest.raises(ColocationOrderError, match="expected 'offload trainer' at call 0, got 'wake weights'"):
        check_colocation_order(moved)
    kv_first = GOOD[:1] + ["wake kv cache"] + GOOD[1:4] + GOOD[5:]
    with pytest.raises(ColocationOrderError, match="expected 'wake weights' at call 1, got 'wake kv cache'"):
        check_colocation_order(kv_first)
    with pytest.raises(ColocationOrderError, match="expected 'reload trainer'"):
        check_colocation_order(GOOD[:-1])


@pytest.mark.parametrize("pf_ppo", [False, True])
def test_training_evaluation_and_the_probe_keep_the_order(sft_dir, tmp_path, pf_ppo):  # noqa: F811
    sections = dict(training={"total_training_steps": 2, "offload_during_rollout": True},
                    logging={"kl_probe_size": 8, "eval_interval": 1},
                    algorithm={"use_pf_ppo": pf_ppo, "pool": {"pool_size": 2, "snapshot_interval": 1}})
    tr = PPOTrainer(_cfg(tmp_path, sft_dir, **sections), log=lambda *_: None)
    tr.fit()
    events = tr.run.colocation.gen.events
    names = [name for name, _ in events]
    check_colocation_order(names)
    frames = names.count("offload trainer")
    assert frames == 2 * 3 + 1, names  # per step: rollout, probe, evaluation; + the evaluation before
    actor_bytes = sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                       for p in tr.run.models.actor.parameters()}.values())
    kv = None
    for i, (name, held) in enumerate(events):
        if name == "wake weights":  # only the actor's weights stay for the refit
            kv = next(b for n, b in events[i:] if n == "wake kv cache")
            assert held - kv == actor_bytes, (held, kv, actor_bytes)
        if name == "generate":  # nothing of the trainer came back while the KV cache is awake
            assert held == kv, (i, held, kv)
    full = max(b for n, b in events if n == "reload trainer")
    least = max(b for n, b in events if n == "wake kv cache")
    print(f"PF-PPO {pf_ppo}: {frames} frames; trainer bytes on the device: {full} resident, {least} while the KV "
          f"cache is awake, {actor_bytes} (the actor's weights) while the engine's weights wake and refit")
    assert least < actor_bytes < full
