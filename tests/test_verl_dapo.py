"""verl's DAPO recipe read unchanged: data.gen_batch_size > train_batch_size is dynamic sampling's
prompts per round (algorithm.filter_groups.gen_batch_size), reward_model.overlong_buffer.* is the
overlong buffer, and a tiny DAPO-shaped run in verl's layout trains on the CPU."""

import json

import pytest

from pfppo_mega.config import ConfigError, load_config_dict, resolve_config_dict
from pfppo_mega.trainer.collect import agreeing_groups
from pfppo_mega.trainer.loop import PPOTrainer

from test_trainer import TINY, sft_dir  # noqa: F401  (the module's SFT checkpoint fixture)

A = "actor_rollout_ref.actor"
# verl's recipe/dapo/run_dapo_qwen2.5_32b.sh (python3 -m recipe.dapo.main_dapo), its variables filled in:
# train_prompt_bsz=512, gen_prompt_bsz=train_prompt_bsz*3, n_resp_per_prompt=16, train_prompt_mini_bsz=32,
# max_prompt_length=2048, max_response_length=20480, overlong_buffer_len=4096.
DAPO_RECIPE = [
    "data.train_files=/data/dapo-math-17k.parquet", "data.val_files=/data/aime-2024.parquet",
    "data.prompt_key=prompt", "data.truncation=left", "data.max_prompt_length=2048",
    "data.max_response_length=20480", "data.gen_batch_size=1536", "data.train_batch_size=512",
    "actor_rollout_ref.rollout.n=16", "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
    "algorithm.kl_ctrl.kl_coef=0.0", f"{A}.use_kl_loss=False", f"{A}.kl_loss_coef=0.0",
    f"{A}.clip_ratio_low=0.2", f"{A}.clip_ratio_high=0.28", f"{A}.clip_ratio_c=10.0",
    "algorithm.filter_groups.enable=True", "algorithm.filter_groups.max_num_gen_batches=10",
    "algorithm.filter_groups.metric=acc", f"{A}.optim.lr=1e-6", f"{A}.optim.lr_warmup_steps=10",
    f"{A}.optim.weight_decay=0.1", f"{A}.ppo_mini_batch_size=32", f"{A}.loss_agg_mode=token-mean",
    "actor_rollout_ref.model.path=/models/Qwen2.5-32B", "reward_model.reward_manager=dapo",
    "reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=4096",
    "reward_model.overlong_buffer.penalty_factor=1.0", "trainer.total_training_steps=100",
]


def test_the_dapo_recipe_loads_unchanged():
    res = resolve_config_dict({}, DAPO_RECIPE)
    c = res.config
    fg, ob = c.algorithm.filter_groups, c.reward.overlong_buffer
    assert (fg.enable, fg.gen_batch_size, fg.max_num_gen_batches) == (True, 1536, 10)
    assert (c.training.rollout_batch_size, c.training.batch_size) == (512, 32 * 16)
    assert (ob.enable, ob.len, ob.penalty_factor) == (True, 4096, 1.0)
    assert (c.training.lr_warmup_steps, c.data.overlong_prompts) == (10, "left")
    assert res.verl.counts()["refused"] == 0


@pytest.mark.parametrize("overrides, why", [
    (["data.gen_batch_size=24", "data.train_batch_size=8"], "without algorithm.filter_groups.enable"),
    (["data.gen_batch_size=4", "data.train_batch_size=8", "algorithm.filter_groups.enable=True",
      "actor_rollout_ref.rollout.n=2"], "fewer prompts generated per round (4)"),
])
def test_gen_batch_size_without_its_meaning_is_refused(overrides, why):
    with pytest.raises(ConfigError) as e:
        resolve_config_dict({}, ["actor_rollout_ref.model.path=/m", *overrides])
    p = next(p for p in e.value.problems if p.key == "data.gen_batch_size")
    assert "refused (verl layout)" in p.rule and why in p.rule, p


def test_native_gen_batch_size_is_checked():
    base = {"actor_rollout": {"model_path": "/m", "n_samples_per_prompt": 2}, "training": {"rollout_batch_size": 8}}
    with pytest.raises(ConfigError, match=r"algorithm.filter_groups.gen_batch_size = 16: differs from "
                                          r"training.rollout_batch_size \(8\) with algorithm.filter_groups.enable false"):
        load_config_dict({**base, "algorithm": {"filter_groups": {"gen_batch_size": 16}}})
    with pytest.raises(ConfigError, match=r"gen_batch_size = 4: must be >= training.rollout_batch_size \(8\)"):
        load_config_dict({**base, "algorithm": {"filter_groups": {"enable": True, "gen_batch_size": 4}}})


def test_a_dapo_shaped_verl_config_trains(sft_dir, tmp_path):  # noqa: F811
    native = json.loads(json.dumps(TINY))
    for key in ("rollout_batch_size", "batch_size", "lr", "total_training_steps"):
        del native["training"][key]
    del native["algorithm"]  # KL and lengths come from verl's keys
    native["logging"]["output_dir"] = str(tmp_path)
    overrides = [f"actor_rollout_ref.model.path={sft_dir}", "data.train_batch_size=8", "data.gen_batch_size=24",
                 "actor_rollout_ref.rollout.n=4", f"{A}.ppo_mini_batch_size=8", "algorithm.adv_estimator=grpo",
                 "algorithm.filter_groups.enable=True", "algorithm.filter_groups.max_num_gen_batches=3",
                 "algorithm.filter_groups.metric=acc", "data.max_response_length=5", "data.truncation=left",
                 "reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=True",
                 "reward_model.overlong_buffer.len=2", "reward_model.overlong_buffer.penalty_factor=1.0",
                 f"{A}.optim.lr=3e-4", f"{A}.optim.lr_warmup_steps=1", f"{A}.clip_ratio_high=0.28",
                 "trainer.total_training_steps=2"]
    cfg = resolve_config_dict(native, overrides).config
    tr = PPOTrainer(cfg, log=lambda *_: None)
    rounds, trained = [], []
    rollout, filt = tr.rollout, tr.filter
    tr.rollout = lambda samples: (rounds.append(len(samples)), rollout(samples))[1]
    tr.filter = lambda sb: (trained.append(sb), filt(sb))[1]
    before = [p.detach().clone() for p in tr.run.models.actor.parameters()]
    metrics = []
    for step in range(2):
        n = len(rounds)
        metrics.append(tr.train_step())
        m = metrics[-1]
        assert rounds[n:] == [24] * int(m["dapo/rounds"])           # gen_batch_size prompts every round
        sb = trained[-1]
        assert len(sb.scores) == 8 * 4 and sorted(set(sb.rollout.group_ids.tolist())) == list(range(8))
        assert m["dapo/kept_groups"] + m["dapo/filled_groups"] == 8
        assert m["dapo/dropped_groups"] + m["dapo/kept_groups"] <= 24 * m["dapo/rounds"]
        lengths = sb.rollout.response_mask.sum(1)
        assert bool(((sb.scores < sb.raw_scores) == (lengths > 3)).all())  # the buffer: lengths 4, 5 of 5
    assert metrics[0]["optim/actor_lr"] == 0.0 and metrics[1]["optim/actor_lr"] == pytest.approx(3e-4)
    assert any(not (p == q).all() for p, q in zip(tr.run.models.actor.parameters(), before))  # the 2nd step trained
    last = metrics[-1]  # seeded: this step dropped agreeing groups and kept enough others to fill the batch
    assert last["dapo/dropped_groups"] > 0 and last["dapo/filled_groups"] == 0
    assert not agreeing_groups(trained[-1]).any()
    print({k: v for k, v in metrics[-1].items() if k.startswith("dapo/")})
