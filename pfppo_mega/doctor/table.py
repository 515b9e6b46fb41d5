"""Generates docs/troubleshooting.md from the doctor's rules (pfppo_mega/doctor/rules.py), so the
table and `pfppo doctor` cannot drift.

    python -m pfppo_mega.doctor.table --write    # docs/troubleshooting.md
    python -m pfppo_mega.doctor.table --check    # exit 1 if stale
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from pfppo_mega.config.reference import write_or_check
from pfppo_mega.doctor.rules import RULES, Remedy, Rule

DEFAULT_PATH = Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md"
COMMAND = "python -m pfppo_mega.doctor.table --write"

INTRO = f"""\
# Troubleshooting: quick table

<!-- Generated from pfppo_mega/doctor/rules.py by `{COMMAND}`.
     Do not edit by hand: tests/test_doctor.py fails when this file is out of date. -->

The PF-PPO article this project follows has a section "常见问题排查表速查" (quick troubleshooting
table) with a heading and nothing under it. This is that table, generated from the rules of
`pfppo doctor RUN_DIR`, which applies them to a run's `metrics.jsonl` (and `config.yaml`) and
prints the steps and values that tripped each rule (exit 0 healthy, 1 findings, 2 unreadable run
directory; `--json` for a machine-readable report).

Change one thing at a time, in the order given, and rerun before the next change.

The thresholds were set on synthetic curves (tests/test_doctor.py) and then run on the 3-seed
runs of configs/experiments, where plain PPO fails the way the article describes (a length-biased,
a phrase-exploit, a noisy and a badly scaled reward, and the honest control):
docs/experiments/hacking/summary.md lists each rule's verdicts there, false alarms included.
"""


def _remedy(n: int, r: Remedy) -> str:
    change = f" (`{r.key}`" + (f": {r.suggest_text}" if r.suggest_text else "") + ")" if r.key else ""
    return f"{n}. {r.action}{change}"


def _row(rule: Rule) -> str:
    cells = [f"`{rule.name}`", rule.symptom, ", ".join(f"`{m}`" for m in rule.metrics), rule.detects,
             rule.cause, "<br>".join(_remedy(n, r) for n, r in enumerate(rule.remedies, 1)),
             f"`{rule.key}`" if rule.key else ""]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def generate_table(rules: Sequence[Rule] = RULES) -> str:
    lines = [INTRO, "| rule | symptom | metric that shows it | detected when | likely cause | "
                    "remedy, in order | key to change first |",
             "|---|---|---|---|---|---|---|"]
    lines += [_row(r) for r in rules]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    return write_or_check(argv, prog="python -m pfppo_mega.doctor.table",
                          description="Generate or check docs/troubleshooting.md.", generate=generate_table,
                          default_path=DEFAULT_PATH, source="pfppo_mega/doctor/rules.py", command=COMMAND)


if __name__ == "__main__":
    sys.exit(main())
