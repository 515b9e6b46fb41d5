"""Hostile inputs to the asynchronous mode (algorithm.async_rl, docs/async.md): every bad value or
combination is refused at load naming its key, the value and the rule; a generator process that
cannot start, or hangs, gets a named error or a restart, never a hang of the trainer.

(The generic float / int extremes of every async_rl key -- inf, nan, 1e400, +-10^30 -- are tried by
test_adv_config_load.py, which reads every key from the tree.)"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from pfppo_mega.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "async_tiny.yaml"

# (overrides, the key named, a fragment of the rule)
REFUSED = [
    (["algorithm.async_rl.max_staleness=0"], "algorithm.async_rl.max_staleness", ">= 1"),
    (["algorithm.async_rl.max_staleness=-3"], "algorithm.async_rl.max_staleness", ">= 1"),
    (["algorithm.async_rl.max_staleness=1000000000000"], "algorithm.async_rl.max_staleness", "<="),
    (["algorithm.async_rl.max_staleness=two"], "algorithm.async_rl.max_staleness", "int"),
    (["algorithm.async_rl.max_staleness=1.5"], "algorithm.async_rl.max_staleness", "int"),
    (["algorithm.async_rl.prefetch_steps=0"], "algorithm.async_rl.prefetch_steps", ">= 1"),
    (["algorithm.async_rl.prefetch_steps=3"], "algorithm.async_rl.prefetch_steps", "at most max_staleness (2)"),
    (["algorithm.async_rl.sampling=oldest"], "algorithm.async_rl.sampling", "newest"),
    (["algorithm.async_rl.sampling=null"], "algorithm.async_rl.sampling", ""),
    (["algorithm.async_rl.sampling_temperature=0"], "algorithm.async_rl.sampling_temperature", "> 0"),
    (["algorithm.async_rl.sampling_temperature=.nan"], "algorithm.async_rl.sampling_temperature", "finite"),
    (["algorithm.async_rl.request_prompts=0"], "algorithm.async_rl.request_prompts", ">= 1"),
    (["algorithm.async_rl.max_restarts=-1"], "algorithm.async_rl.max_restarts", ">= 0"),
    (["algorithm.async_rl.logp_check_interval=-1"], "algorithm.async_rl.logp_check_interval", ">= 0"),
    (["algorithm.async_rl.logp_check_rows=0"], "algorithm.async_rl.logp_check_rows", ">= 1"),
    (["algorithm.async_rl.result_timeout_s=0"], "algorithm.async_rl.result_timeout_s", "> 0"),
    (["algorithm.async_rl.result_timeout_s=.inf"], "algorithm.async_rl.result_timeout_s", "finite"),
    (["algorithm.async_rl.enable=maybe"], "algorithm.async_rl.enable", "bool"),
    (["algorithm.async_rl.max_stalenes=2"], "algorithm.async_rl.max_stalenes", "max_staleness"),
    # combinations the asynchronous mode cannot run with
    (["algorithm.use_pf_ppo=true"], "algorithm.use_pf_ppo", "async_rl.sampling"),
    (["algorithm.recompute_old_logp=false"], "algorithm.recompute_old_logp", "proximal"),
    (["algorithm.filter_groups.enable=true", "actor_rollout.n_samples_per_prompt=2"],
     "algorithm.filter_groups.enable", "asynchronous"),
    (["algorithm.adv_estimator=remax"], "algorithm.adv_estimator", "greedy baseline"),
    (["algorithm.pool.is_mode=tis", "algorithm.policy_loss=gspo"], "algorithm.policy_loss", "tis"),
    (["algorithm.async_rl.partial_rollouts=yes please"], "algorithm.async_rl.partial_rollouts", "bool"),
    (["algorithm.async_rl.partial_rollouts=true", "algorithm.async_rl.sampling=uniform"],
     "algorithm.async_rl.partial_rollouts", "needs sampling newest"),
    # rollout TP (one engine over several ranks) in the generator: not built (the trainer's TP / PP are)
    (['actor_rollout.tensor_model_parallel_size=2', 'actor_rollout.engine=vllm'],
     'actor_rollout.tensor_model_parallel_size', 'one engine in one process'),
    (['actor_rollout.tensor_model_parallel_size=4', 'parallel.tensor_model_parallel_size=2',
      'parallel.pipeline_model_parallel_size=2'], 'actor_rollout.tensor_model_parallel_size', 'must be 1'),
]


@pytest.mark.parametrize("overrides,key,rule", REFUSED, ids=[" ".join(c[0])[:60] for c in REFUSED])
def test_bad_async_values_are_refused_by_key(overrides, key, rule):
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, overrides)
    keys = {p.key for p in e.value.problems}
    assert key in keys, str(e.value)
    assert rule in str(e.value), str(e.value)
    assert time.monotonic() - t0 < 5


def test_partial_rollouts_need_an_engine_that_takes_weights_inside_a_request(monkeypatch):
    """Both engines take them (vLLM since its generate_partial); an engine outside
    PARTIAL_ROLLOUT_ENGINES (one registered by a user) is refused by name."""
    from pfppo_mega import constants

    over = ["algorithm.async_rl.partial_rollouts=true", "actor_rollout.engine=vllm"]
    assert load_config(CONFIG, over).actor_rollout.engine == "vllm"
    monkeypatch.setattr(constants, "PARTIAL_ROLLOUT_ENGINES", ("builtin",))
    with pytest.raises(ConfigError, match=r"needs actor_rollout.engine in \('builtin',\) \(got 'vllm'\)") as e:
        load_config(CONFIG, over)
    assert "algorithm.async_rl.partial_rollouts" in {p.key for p in e.value.problems}


def test_the_same_values_load_without_async():
    """The combinations are refused because of async_rl, not on their own."""
    cfg = load_config(CONFIG, ["algorithm.async_rl.enable=false", "algorithm.use_pf_ppo=true"])
    assert cfg.algorithm.use_pf_ppo and not cfg.algorithm.async_rl.enable
    cfg = load_config(CONFIG, ["algorithm.async_rl.enable=false", "algorithm.recompute_old_logp=false"])
    assert not cfg.algorithm.recompute_old_logp
    cfg = load_config(CONFIG, ["algorithm.async_rl.enable=false", "actor_rollout.tensor_model_parallel_size=2"])
    assert cfg.actor_rollout.tensor_model_parallel_size == 2
    # the trainer's own model parallelism loads with the asynchronous mode (tests/test_async_tp.py runs it)
    cfg = load_config(CONFIG, ["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"])
    assert cfg.algorithm.async_rl.enable and cfg.parallel.tensor_model_parallel_size == 2


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
    from pfppo_mega.sft import run_sft

    out = tmp_path_factory.mktemp("adv_async_sft")
    run_sft(load_config(CONFIG, [f"sft.output_dir={out}", f"actor_rollout.model_path={out}", "sft.steps=20"]),
            log=lambda *_: None)
    return out


def test_a_generator_that_cannot_start_is_a_named_error(sft_dir):
    sys.path.insert(0, str(REPO / "tests"))
    from test_async import _spec  # noqa: E402

    from pfppo_mega.trainer.asynchronous.process import GeneratorFailed, GeneratorProcess

    spec = _spec(sft_dir, hf_cfg={"model_type": "no_such_family"})  # the engine cannot be built from it
    proc = GeneratorProcess(spec, max_restarts=0, result_timeout_s=30, log=lambda *_: None)
    with pytest.raises(GeneratorFailed, match="did not start"):
        proc.start()
    assert proc.pid is None


def test_a_hung_generator_is_killed_and_replaced_within_the_timeout(sft_dir):
    """SIGSTOP: alive but silent. After result_timeout_s the trainer kills it and redoes its request."""
    sys.path.insert(0, str(REPO / "tests"))
    from test_async import _buckets, _request, _spec  # noqa: E402

    from pfppo_mega.trainer.asynchronous.process import GeneratorProcess

    spec = _spec(sft_dir)
    proc = GeneratorProcess(spec, max_restarts=1, result_timeout_s=3, log=lambda *_: None)
    proc.start()
    try:
        hung = proc.pid
        proc.push_weights(2, _buckets(spec, 2))
        os.kill(hung, signal.SIGSTOP)
        proc.submit(_request(0))
        t0 = time.monotonic()
        r = proc.next_result()
        assert (r.rid, r.version) == (0, 2) and proc.restarts == 1 and proc.pid != hung
        assert time.monotonic() - t0 < 120
    finally:
        proc.stop()


# ----------------------------------------------------------------------------- the weight files


def _weight_file(tmp_path, version=3):
    sys.path.insert(0, str(REPO / "tests"))
    from test_async import _fake_buckets  # noqa: E402

    from pfppo_mega.trainer.asynchronous import weightfile

    path = tmp_path / f"v{version}.weights"
    weightfile.write(path, version, _fake_buckets(version))
    return path


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 40])


def _scramble_header(path):
    data = bytearray(path.read_bytes())
    data[20] ^= 0xFF
    path.write_bytes(bytes(data))


def _not_weights(path):
    path.write_bytes(b"hello, not weights at all")


@pytest.mark.parametrize("damage, match", [(_truncate, "torn"), (_scramble_header, "header checksum"),
                                           (_not_weights, "bad magic")])
def test_a_torn_weight_file_is_refused_by_name(tmp_path, damage, match):
    from pfppo_mega.trainer.asynchronous import weightfile

    path = _weight_file(tmp_path)
    damage(path)
    with pytest.raises(weightfile.WeightFileError, match=match) as e:
        weightfile.read(path, 3)
    assert str(path) in str(e.value)


def test_a_stale_or_missing_weight_file_is_refused_by_name(tmp_path):
    from pfppo_mega.trainer.asynchronous import weightfile

    path = _weight_file(tmp_path, version=3)
    with pytest.raises(weightfile.WeightFileError, match="holds version 3, version 4 was announced: stale") as e:
        weightfile.read(path, 4)
    assert str(path) in str(e.value)
    with pytest.raises(weightfile.WeightFileMissing, match="missing"):
        weightfile.read(tmp_path / "v9.weights", 9)


class _CheckingEngine:
    """Verifies every bucket as the real engines do (version, checksum of the bytes)."""

    weight_version = -1

    def update_weights(self, buckets, version):
        for b in buckets:
            b.verify(version)
        self.weight_version = version


def test_the_generator_refuses_a_weight_file_with_corrupt_bytes_naming_it(tmp_path):
    """The header is intact, one weight byte flipped: the engine's check fails, the error names the file."""
    import queue

    from pfppo_mega.trainer.asynchronous import weightfile
    from pfppo_mega.trainer.asynchronous.worker import serve

    sys.path.insert(0, str(REPO / "tests"))
    from test_async import _request  # noqa: E402

    path = _weight_file(tmp_path)
    data = bytearray(path.read_bytes())
    data[-60] ^= 0x01  # inside the last bucket's bytes
    path.write_bytes(bytes(data))
    messages: queue.Queue = queue.Queue()
    messages.put(("weights", 3, str(path)))
    messages.put(("weights", 4, str(tmp_path / "v4.weights")))  # missing: skipped, version 3 still held
    messages.put(("request", _request(0)))
    spec = SimpleNamespace(window=2, rule="newest", temperature=1.0)
    with pytest.raises(weightfile.WeightFileError, match=f"{path}.*checksum"):
        serve(_CheckingEngine(), messages, None, spec)


# ----------------------------------------------------------------------------- the pending-requests file


def _good(tmp_path):
    from pfppo_mega.trainer.asynchronous import pending
    from pfppo_mega.types import Sample

    reqs = [pending.PendingRequest(5, [(0, Sample((1, 2), "addition", 3)), (1, Sample((4,), "addition", 7))],
                                   frozenset({1}))]
    return pending.write(tmp_path, 3, 2, reqs, keep=2)


def _mutate(body, how):
    r = body["requests"][0]
    if how == "format":
        body["format"] = 99
    elif how == "step":
        body["step"] = 4
    elif how == "next_key":
        body["next_key"] = -1
    elif how == "seed":
        r["seed"] = -5
    elif how == "seed_bool":
        r["seed"] = True
    elif how == "keys_beyond":
        r["keys"] = [0, 9]
    elif how == "keys_dup":
        r["keys"] = [1, 1]
    elif how == "pending_empty":
        r["pending"] = []
    elif how == "pending_foreign":
        r["pending"] = [7]
    elif how == "samples_short":
        r["samples"] = r["samples"][:1]
    elif how == "sample_fields":
        del r["samples"][0]["data_source"]
    elif how == "sample_ids":
        r["samples"][0]["prompt_ids"] = ["x"]
    elif how == "sample_messages":
        r["samples"][0]["messages"] = "hello"
    elif how == "extra_key":
        r["extra"] = 1
    elif how == "requests":
        body["requests"] = "all"
    return body


def test_a_pending_file_written_before_samples_had_messages_reads_back(tmp_path):
    import json

    from pfppo_mega.trainer.asynchronous import pending

    path = _good(tmp_path)
    body = json.loads(path.read_text())
    for r in body["requests"]:
        for smp in r["samples"]:
            del smp["messages"]
    path.write_text(json.dumps(body))
    assert pending.read(tmp_path, 3)[0] == 2


@pytest.mark.parametrize("how", ["format", "step", "next_key", "seed", "seed_bool", "keys_beyond", "keys_dup",
                                 "pending_empty", "pending_foreign", "samples_short", "sample_fields", "sample_ids",
                                 "sample_messages", "extra_key", "requests"])
def test_a_malformed_pending_file_is_refused_by_name(tmp_path, how):
    import json

    from pfppo_mega.trainer.asynchronous import pending

    path = _good(tmp_path)
    assert pending.read(tmp_path, 3)[0] == 2  # the file as written reads back
    path.write_text(json.dumps(_mutate(json.loads(path.read_text()), how)))
    with pytest.raises(pending.PendingFileError, match=r"step_00000003\.json"):
        pending.read(tmp_path, 3)


@pytest.mark.parametrize("text", ["", "{", "[]", "null", "\xff\xfe", "1e999999"])
def test_a_pending_file_that_is_not_json_is_refused_by_name(tmp_path, text):
    from pfppo_mega.trainer.asynchronous import pending

    path = _good(tmp_path)
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(pending.PendingFileError, match=r"step_00000003\.json"):
        pending.read(tmp_path, 3)
    path.unlink()
    with pytest.raises(pending.PendingFileError, match="missing"):
        pending.read(tmp_path, 3)


def test_a_data_parallel_rank_without_its_pending_file_is_refused_by_name(tmp_path):
    """DP: each rank reads its own record; rank 1's missing (a checkpoint saved at DP1, resumed at DP2)
    is refused naming its file and the rule, while rank 0's reads."""
    from pfppo_mega.trainer.asynchronous import pending

    _good(tmp_path)
    assert pending.read(tmp_path, 3, rank=0)[0] == 2
    with pytest.raises(pending.PendingFileError, match=r"step_00000003\.rank1\.json: missing .*data-parallel rank 1"):
        pending.read(tmp_path, 3, rank=1)
    # a DP2 checkpoint resumed at DP1: rank 0's own file refuses the size (rank 1's requests would be lost)
    pending.write(tmp_path, 6, 2, [], keep=9, rank=0, dp_size=2)
    with pytest.raises(pending.PendingFileError, match=r"step_00000006\.json: dp_size = 2: .*resumed at 1"):
        pending.read(tmp_path, 6, rank=0, dp_size=1)
    assert pending.read(tmp_path, 6, rank=0, dp_size=2) == (2, [])
    (tmp_path / "async_pending" / "step_00000006.json").unlink()
    # and rank 1's own files are kept apart from rank 0's (keep_last counts each rank's)
    for step in (4, 5):
        pending.write(tmp_path, step, 2, [], keep=1, rank=1)
    names = sorted(p.name for p in (tmp_path / "async_pending").iterdir())
    assert names == ["step_00000003.json", "step_00000005.rank1.json"]


@pytest.mark.parametrize("tp,dp,local,refused", [
    (2, 2, 8, None),          # both leaders (ranks 0, 2) on node 0
    (8, 1, 8, None),          # one replica spanning two nodes (PP2 over 16 ranks): only rank 0 generates
    (8, 2, 8, [1]),           # replica 1's leader is rank 8, on node 1
    (1, 16, 8, list(range(8, 16))),
])
def test_replica_leaders_off_rank_0s_node_are_refused_by_name(tp, dp, local, refused):
    """The weight file lives in rank 0's node-local /dev/shm: a generator on another node could not map it."""
    from pfppo_mega.trainer.build import SetupError, check_async_nodes

    if refused is None:
        check_async_nodes(tp=tp, dp=dp, local_world_size=local)
        return
    with pytest.raises(SetupError, match=r"replicas \[.*\] would run on another node") as e:
        check_async_nodes(tp=tp, dp=dp, local_world_size=local)
    assert str(refused) in str(e.value) and "/dev/shm" in str(e.value)
