"""`pfppo doctor RUN_DIR [--json]`: read a run's metrics.jsonl (and config.yaml when present), run
every rule of pfppo_mega/doctor/rules.py, print the findings with their evidence and the remedies
in order.

Exit status: 0 healthy (no finding), 1 at least one finding, 2 the run directory cannot be read
(the error names the file, the line and what is wrong)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import yaml

from pfppo_mega.doctor.rules import RULES, Rule, Series, Verdict, config_value

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"


class RunDirError(ValueError):
    """The run directory cannot be diagnosed; the message names the file and the problem."""


@dataclass(frozen=True)
class RunRecord:
    path: Path
    series: dict[str, Series]
    config: Optional[dict[str, Any]]
    steps: int                 # training steps recorded (records with step >= 1)
    notes: list[str]           # what was skipped while reading (a torn last line, a bad config.yaml)


def read_run(run_dir: str | Path) -> RunRecord:
    """The run's metric series (step order) and its config as a plain mapping; RunDirError when
    the directory, metrics.jsonl or one of its records is unreadable."""
    path = Path(run_dir)
    if not path.is_dir():
        raise RunDirError(f"{path}: {'not a directory' if path.exists() else 'no such directory'} "
                          f"(expected a run directory written by pfppo train: logging.output_dir)")
    mpath = path / METRICS_FILE
    if not mpath.is_file():
        raise RunDirError(f"{mpath}: missing; a run directory holds {METRICS_FILE} (written by pfppo train)")
    try:
        lines = mpath.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise RunDirError(f"{mpath}: unreadable ({e})") from None
    notes: list[str] = []
    records: dict[int, dict] = {}
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            if i == last:  # a writer killed mid-line (trainer/metrics.py drops it the same way)
                notes.append(f"{METRICS_FILE} line {i + 1}: torn last record ignored")
                continue
            raise RunDirError(f"{mpath} line {i + 1}: not a JSON record ({e})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int) or isinstance(rec["step"], bool):
            raise RunDirError(f"{mpath} line {i + 1}: a record must be a JSON object with an integer "
                              f"\"step\", got {line[:80]!r}")
        records.setdefault(rec["step"], {}).update(rec)  # a resumed run re-logging a step: the last wins
    steps = sorted(s for s in records if s >= 1)
    if not steps:
        raise RunDirError(f"{mpath}: no training step recorded ({len(records)} records, none with step >= 1)")
    series: dict[str, Series] = {}
    for step in sorted(records):
        for key, value in records[step].items():
            if key == "step":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise RunDirError(f"{mpath}: step {step}: {key} = {value!r} is not a number")
            s = series.setdefault(key, Series([], []))
            s.steps.append(step)
            s.values.append(float(value))
    return RunRecord(path, series, _read_config(path / CONFIG_FILE, notes), len(steps), notes)


def _read_config(path: Path, notes: list[str]) -> Optional[dict[str, Any]]:
    """config.yaml as a plain mapping (the rules read a few keys; an old or partial config is fine),
    or None with a note."""
    if not path.is_file():
        notes.append(f"{CONFIG_FILE} absent: remedies name keys but not their current values")
        return None
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        notes.append(f"{CONFIG_FILE} unreadable ({type(e).__name__}): ignored")
        return None
    if not isinstance(cfg, dict):
        notes.append(f"{CONFIG_FILE} is not a mapping: ignored")
        return None
    return cfg


@dataclass(frozen=True)
class Diagnosis:
    rule: Rule
    verdict: Verdict


def diagnose(run: RunRecord, rules: Sequence[Rule] = RULES) -> list[Diagnosis]:
    return [Diagnosis(r, r.detect(run.series, run.config)) for r in rules]


def _remedies(rule: Rule, config: Optional[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in rule.remedies:
        item: dict[str, Any] = {"action": r.action, "key": r.key}
        if r.key is not None:
            current = config_value(config, r.key)
            item["current"] = current
            if current is None and r.default_from is not None:  # null, or a run from before the key
                current = config_value(config, r.default_from)
            item["suggested"] = r.suggest(current) if r.suggest is not None else None
        out.append(item)
    return out


# Rules whose finding steps are worth the dumped samples of (trainer/worst_samples.py).
SAMPLE_EVIDENCE_RULES = ("kl_spike", "reward_hacking", "length_collapse", "noisy_reward")
SAMPLE_EVIDENCE_STEPS = 3   # steps quoted per finding
SAMPLE_TEXT_CHARS = 40


def worst_sample_lines(run: RunRecord, step: int) -> list[str]:
    """One line quoting the run's dumped worst samples of `step` (the first of each kind), or []
    when samples_worst.jsonl is absent or holds nothing for that step."""
    from pfppo_mega.trainer import worst_samples

    rows = worst_samples.read(run.path / worst_samples.FILE).get(step, [])
    parts = []
    for kind in worst_samples.KINDS:
        r = next((r for r in rows if r.get("kind") == kind), None)
        if r is None:
            continue
        honest = "" if r.get("honest") is None else f", honest {_fmt_num(r['honest'])}"
        parts.append(f"{kind} {str(r.get('prompt', ''))}{str(r.get('text', ''))[:SAMPLE_TEXT_CHARS]!r} "
                     f"(length {r.get('length')}, repetition {_fmt_num(r.get('repetition'))}, reward "
                     f"{_fmt_num(r.get('reward'))}{honest}, version {r.get('version')})")
    return [f"samples at step {step}: " + "; ".join(parts)] if parts else []


def _fmt_num(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def _evidence(run: RunRecord, d: Diagnosis) -> list[str]:
    """The verdict's evidence, plus the dumped worst samples of its first steps for the rules where
    reading the samples is the first remedy."""
    lines = list(d.verdict.evidence)
    if d.verdict.status == "finding" and d.rule.name in SAMPLE_EVIDENCE_RULES:
        for step in d.verdict.steps[:SAMPLE_EVIDENCE_STEPS]:
            lines += worst_sample_lines(run, step)
    return lines


def to_json(run: RunRecord, diagnoses: Sequence[Diagnosis]) -> dict[str, Any]:
    return {
        "run_dir": str(run.path), "steps": run.steps, "config": run.config is not None, "notes": run.notes,
        "healthy": not any(d.verdict.status == "finding" for d in diagnoses),
        "rules": [{"rule": d.rule.name, "status": d.verdict.status, "symptom": d.rule.symptom,
                   "metrics": list(d.rule.metrics), "evidence": _evidence(run, d), "steps": d.verdict.steps,
                   "likely_cause": d.rule.cause, "key": d.rule.key,
                   "remedies": _remedies(d.rule, run.config) if d.verdict.status == "finding" else []}
                  for d in diagnoses],
    }


def format_text(report: Mapping[str, Any]) -> str:
    found = [r for r in report["rules"] if r["status"] == "finding"]
    unchecked = sum(r["status"] == "not_checked" for r in report["rules"])
    verdict = (f"{len(found)} finding{'s' * (len(found) != 1)}" if found else
               f"no finding ({unchecked} of {len(report['rules'])} rules not checked)" if unchecked else "healthy")
    lines = [f"pfppo doctor {report['run_dir']}: {report['steps']} training steps, {verdict}"]
    lines += [f"  note: {n}" for n in report["notes"]]
    for n, r in enumerate(found, 1):
        lines += ["", f"[{n}] {r['rule']}: {r['symptom']}", f"    metrics: {', '.join(r['metrics'])}",
                  "    evidence:"]
        lines += [f"      {e}" for e in r["evidence"]]
        lines += [f"    likely cause: {r['likely_cause']}", "    remedies, one change at a time, in this order:"]
        for k, rem in enumerate(r["remedies"], 1):
            change = ""
            if rem["key"] is not None:
                # the keys exist in the tree (tests/test_doctor.py): with a config, None is null
                cur = _show(rem["current"]) if report["config"] else "?"
                change = f"  [{rem['key']}: {cur}" + (
                    f" -> {_show(rem['suggested'])}]" if rem.get("suggested") is not None else "]")
            lines.append(f"      {k}. {rem['action']}{change}")
    healthy = [r["rule"] for r in report["rules"] if r["status"] == "healthy"]
    skipped = [r for r in report["rules"] if r["status"] == "not_checked"]
    lines.append("")
    if healthy:
        lines.append(f"healthy: {', '.join(healthy)}")
    for r in skipped:
        lines.append(f"not checked: {r['rule']} ({r['evidence'][0]})")
    return "\n".join(lines) + "\n"


def _show(v: Any) -> str:
    return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pfppo doctor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="a run directory (logging.output_dir of pfppo train)")
    ap.add_argument("--json", action="store_true", help="print the diagnosis as one JSON object")
    try:
        args = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # --help (0) or a usage error (2), already printed by argparse
        return 0 if e.code in (0, None) else 2
    try:
        run = read_run(args.run_dir)
    except RunDirError as e:
        print(f"pfppo doctor: cannot read the run: {e}", file=sys.stderr)
        return 2
    report = to_json(run, diagnose(run))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        sys.stdout.write(format_text(report))
    return 0 if report["healthy"] else 1

