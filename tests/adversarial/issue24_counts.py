"""Issue 24's before / after counts per class, by running the regression tests of its cases.

    .venv/bin/python tests/adversarial/issue24_counts.py [--json PATH]

The issue tried 174 hostile cases on the paths added since issue 8 (prompt files, chat templates,
custom reward functions, reward models, multi-rank kills, resume with edits) and counted 50 that
ended badly, per class: 24 trained silently, 5 hung, 10 ended in a traceback, 5 killed the trainer,
1 lost data, 5 gave a vague message. It did not list all 50; CASES below are the ones it names,
each with the class we read it as and the regression test (a pytest node id, every parameter
of it) that checks the fixed behaviour, or None where no test covers it. A case is `held` when
all of its tests pass, `still bad` when one fails, `skipped` when they skip here (e.g. CUDA),
`not found` when pytest collected no test under its id (renamed or not importable).

The "before" of the custom-reward-worker cases is measured too (the same cases on the tree before
the fix): PFPPO_TREE=<checkout> python tests/adversarial/test_adv_reward_workers.py.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLASSES = ("silent", "hang", "traceback", "killed", "lost_data", "vague")
ISSUE_BEFORE = {"silent": 24, "hang": 5, "traceback": 10, "killed": 5, "lost_data": 1, "vague": 5}

W = "tests/adversarial/test_adv_reward_workers.py::"
T = "tests/test_chat_template_files.py::test_a_template_that_would_train_on_nothing_is_refused_at_start"
RESUME = "tests/test_resume_edits.py::"
R = "tests/adversarial/test_adv_rows_and_templates.py::"
# (issue item, class, case, test node id or None)
CASES = [
    ("24.1", "lost_data", "resume at another TP size restarted from step 0 over metrics.jsonl",
     "tests/test_trainer_parallel.py::test_a_resume_at_another_layout_is_refused_by_name_not_restarted"),
    ("24.2", "silent", "resume: a changed training.lr was dropped",
     RESUME + "test_a_changed_learning_rate_is_applied_and_said"),
    ("24.2", "silent", "resume: a changed training.critic_lr was dropped",
     RESUME + "test_a_changed_learning_rate_is_applied_and_said"),
    ("24.2", "silent", "resume: a changed training.weight_decay was dropped",
     RESUME + "test_a_changed_learning_rate_is_applied_and_said"),
    ("24.2", "silent", "resume: changed prompt files with the same row count accepted",
     "tests/test_data_e2e.py::test_a_resume_on_edited_prompt_files_of_the_same_length_is_refused"),
    ("24.2", "silent", "resume: a changed seed reindexed the saved data position",
     RESUME + "test_a_changed_setting_the_run_depends_on_is_refused"),
    ("24.2", "silent", "resume: another model_path of the same shape (the reference followed it)",
     RESUME + "test_another_model_path_is_refused"),
    ("24.3", "silent", "ground truth: missing / a wrong data.ground_truth_key",
     "tests/adversarial/test_adv_ground_truth.py::test_a_wrong_ground_truth_key_is_refused_at_start"),
    ("24.3", "silent", "ground truth: a list, dict, NaN, bool, empty value",
     "tests/adversarial/test_adv_ground_truth.py::test_an_unusable_ground_truth_is_refused_by_row"),
    ("24.4", "silent", "a forked child returning into the worker loop answered for its parent",
     W + "test_a_forked_child_that_returns_into_the_worker_loop_cannot_answer"),
    ("24.4", "traceback", "a forked child writing to the worker's pipe (IndexError in the trainer)",
     W + "test_an_answer_that_is_not_the_workers_is_refused_and_counted"),
    ("24.4", "hang", "a module ignoring SIGTERM kept the trainer from exiting",
     W + "test_a_module_that_ignores_sigterm_does_not_keep_the_trainer_alive"),
    ("24.4", "killed", "os.killpg(os.getpgid(0), SIGTERM) in the function killed the trainer",
     W + "test_killpg_of_its_own_group_ends_only_the_worker"),
    ("24.4", "killed", "os.kill / os.killpg of the trainer from the function",
     W + "test_signalling_the_trainer_through_os_is_refused_by_name"),
    ("24.4", "killed", "the C library's kill() of the trainer from the function",
     W + "test_a_sigterm_that_reaches_the_trainer_is_refused_or_named"),
    ("24.4", "lost_data", "the function overwrote the run's metrics.jsonl",
     W + "test_the_run_directory_is_not_writable_by_the_workers"),
    ("24.4", "lost_data", "... where the kernel has no landlock: detected, the run stops by name",
     W + "test_a_write_to_the_run_directory_stops_the_run_by_name_without_landlock"),
    ("24.4", "hang", "close() not called on the trainer's failure exits",
     W + "test_pfppo_train_closes_the_reward_workers_on_every_exit"),
    ("24.5", "silent", "a reward beyond float32 (1e39, 2**200) skipped every update",
     "tests/adversarial/test_adv_reward_range.py::test_a_reward_beyond_float32_is_a_counted_bad_reward"),
    ("24.6", "hang", "kill -STOP of one of two TP ranks: the other waited on a futex",
     "tests/test_stalled_rank.py::test_a_stopped_rank_ends_in_an_error_within_the_timeout"),
    ("24.7", "silent", "chat_template.jinja ignored (prompts went untemplated)",
     "tests/test_chat_template_files.py::test_the_template_is_the_one_transformers_uses"),
    ("24.7", "silent", "a template rendering '', only BOS, or ignoring the messages", T + "[-ignores the messages]"),
    ("24.7", "silent", "... only BOS", T + "[{{ bos_token }}-ignores the messages]"),
    ("24.7", "silent", "... a fixed text", T + "[<|user|>hello<|assistant|>-ignores the messages]"),
    ("24.7", "silent", "a template ending every prompt in EOS trained on with no warning",
     R + "test_a_template_that_ends_every_prompt_in_eos_is_said_at_start"),
    ("24.7", "hang", "a template looping for minutes", T + "[{% for i in range(99999) %}"),
    ("24.7", "hang", "a 20 MB template", T + "[source8"),
    ("24.7", "traceback", "ZeroDivisionError from a template", T + "[{{ 1 / 0 }}"),
    ("24.7", "traceback", "OverflowError from a template", T + "[{% for i in range(10**9) %}"),
    ("24.7", "traceback", "RecursionError from a template", T + "[{% macro f(n) %}"),
    ("24.7", "traceback", "SyntaxError from a template", R + "test_a_template_error_names_the_templates_file[{% for %}"),
    ("24.7", "traceback", "a deeply nested JSONL row", R + "test_a_row_nested_too_deep_is_refused_by_file"),
    ("24.7", "traceback", "a lone surrogate in a row", R + "test_a_lone_surrogate_is_refused_by_row"),
    ("24.8", "vague", "'range() arg 3 must not be zero' without the template's file",
     R + "test_a_template_error_names_the_templates_file[{{ range(1, 5, 0)"),
    ("24.8", "vague", "'substring not found' without the template's file",
     R + "test_a_template_error_names_the_templates_file[{{ 'abc'.index('z') }}"),
    ("24.8", "vague", "a reward model's bad hidden_size without its config file",
     "tests/test_reward_model.py::test_bad_reward_models_are_refused_at_start_by_name"),
    ("24.8", "vague", "a reward model's bad vocab_size without its config file",
     "tests/test_reward_model.py::test_bad_reward_models_are_refused_at_start_by_name"),
    ("24.8", "vague", "'reward worker exited at start (exit code 3)' without file and function",
     "tests/adversarial/test_adv_reward_worker_start.py::test_a_module_that_exits_at_import_is_named"),
]


def _functions(cases) -> list[str]:
    """file::function of every case, once (pytest then runs all its parameters)."""
    return sorted({c[3].split("[")[0] for c in cases if c[3]})


def run_tests(node_ids: list[str]) -> dict[str, str]:
    """node id -> passed / failed / skipped, from one pytest run's JUnit XML."""
    with tempfile.TemporaryDirectory() as d:
        xml = Path(d) / "r.xml"
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:warnings", "-p", "no:cacheprovider",
                        f"--junitxml={xml}", *node_ids], cwd=REPO)
        root = ET.parse(xml).getroot()
    out = {}
    for tc in root.iter("testcase"):
        path = tc.get("classname", "").replace(".", "/") + ".py"
        kind = "failed" if tc.find("failure") is not None or tc.find("error") is not None else \
            "skipped" if tc.find("skipped") is not None else "passed"
        out[f"{path}::{tc.get('name')}"] = kind
    return out


def judge(selector: str | None, results: dict[str, str]) -> str:
    if selector is None:
        return "no test"
    got = [k for n, k in results.items() if n == selector or n.startswith(selector if "[" in selector
                                                                            else selector + "[")]
    if not got:
        return "not found"  # not collected: the test is gone, renamed, or does not import
    if "failed" in got:
        return "still bad"
    return "skipped" if all(k == "skipped" for k in got) else "held"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the per-case results here")
    args = ap.parse_args()
    results = run_tests(_functions(CASES))
    per: dict[str, Counter] = defaultdict(Counter)
    rows = []
    for item, cls, case, sel in CASES:
        verdict = judge(sel, results)
        per[cls][verdict] += 1
        rows.append({"item": item, "class": cls, "case": case, "test": sel, "after": verdict})
        print(f"{item:5s} {cls:10s} {verdict:10s} {case}")
    print("\n| class | before (issue) | named cases here | held after | still bad | no regression test | skipped | "
          "test not found |")
    print("|---|---|---|---|---|---|---|---|")
    for cls in CLASSES:
        c = per[cls]
        print(f"| {cls} | {ISSUE_BEFORE[cls]} | {sum(c.values())} | {c['held']} | {c['still bad']} | {c['no test']} "
              f"| {c['skipped']} | {c['not found']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
