"""A custom reward module that ends its worker at import names the file, the function and the
exit code (issue 24.8; the message used to be only 'reward worker exited at start (exit code 3)')."""

import pytest

from pfppo_mega.rewards.base import RewardSetupError
from pfppo_mega.rewards.custom import CustomReward


@pytest.mark.parametrize("body,said", [("import sys\nsys.exit(3)\n", r"importing the file raised SystemExit: 3"),
                                       ("import os\nos._exit(7)\n", r"the reward worker exited at start \(exit code 7\)")])
def test_a_module_that_exits_at_import_is_named(tmp_path, body, said):
    f = tmp_path / "exits.py"
    f.write_text(body + "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    with pytest.raises(RewardSetupError, match=rf"reward.custom_function: 'compute_score' in '{f}': {said}"):
        CustomReward(str(f), "compute_score", num_workers=1, timeout_s=5.0, log=lambda *_: None)


# Issue 40 (vague refusals): "the reward worker exited at start" said the exit code but not what
# the worker said before it ended, nor where a crash was; and a worker that spawn could not start
# (the trainer's script re-run by spawn, no __main__ guard) was blamed on the user's file.

SCORE = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"


@pytest.mark.parametrize("body,said", [
    ("import os, sys\nprint('libfoo.so: cannot open shared object file', file=sys.stderr, flush=True)\nos._exit(7)\n",
     r"\(exit code 7\) while importing the file .*; its last lines on stderr:\n  libfoo.so: cannot open shared object file$"),
    ("import ctypes\nctypes.string_at(0)\n",
     r"\(killed by SIGSEGV\) while importing the file .*; its last lines on stderr:\n  Fatal Python error: "
     r"Segmentation fault\n(.*\n)*    File \"{f}\", line 2 in <module>$"),
    ("import os\nos._exit(0)\n", r"\(exit code 0\) while importing the file .*; it wrote nothing on stderr$"),
], ids=["message_then_exit", "segfault", "silent_exit"])
def test_a_worker_that_dies_at_import_is_refused_with_its_last_words(tmp_path, body, said):
    f = tmp_path / "dies.py"
    f.write_text(body + SCORE)
    with pytest.raises(RewardSetupError, match=rf"^reward.custom_function: 'compute_score' in '{f}': the reward worker "
                                               rf"exited at start {said.format(f=f)}"):
        CustomReward(str(f), "compute_score", num_workers=1, timeout_s=5.0, log=lambda *_: None)


def test_a_worker_spawn_cannot_start_is_not_blamed_on_the_file(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pfppo_mega

    f = tmp_path / "fine.py"
    f.write_text(SCORE)
    script = tmp_path / "train.py"  # starts the workers at import: spawn's re-import of it fails
    script.write_text("from pfppo_mega.rewards.base import RewardSetupError\n"
                      "from pfppo_mega.rewards.custom import CustomReward\n"
                      "try:\n"
                      f"    CustomReward({str(f)!r}, 'compute_score', num_workers=1, timeout_s=5.0)\n"
                      "except RewardSetupError as e:\n"
                      "    print('REFUSED', e)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(  # this checkout's package first
        [str(Path(pfppo_mega.__file__).parents[1])] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    refused = [x for x in out.stdout.splitlines() if x.startswith("REFUSED")]
    assert refused and "the reward worker process ended (exit code 1) before it ran any of pfppo's worker code" \
        in refused[-1] and "__main__" in refused[-1], (out.stdout[-2000:], out.stderr[-2000:])


def test_a_batch_reward_managers_function_is_named_as_such(tmp_path):
    """verl's reward_manager batch passes lists (data_sources, solution_strs, ...) and expects a list;
    here the function is called per sample: the refusal said only that the signature did not bind."""
    f = tmp_path / "batch.py"
    f.write_text("def compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):\n"
                 "    return [1.0 for _ in solution_strs]\n")
    with pytest.raises(RewardSetupError, match=r"it has the batch reward manager's signature \(lists in, a list out: "
                                               r"verl's reward_manager batch\), but here it is called once per sample"):
        CustomReward(str(f), "compute_score", num_workers=1, timeout_s=5.0, log=lambda *_: None)
