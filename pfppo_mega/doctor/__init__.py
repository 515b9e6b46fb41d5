"""`pfppo doctor`: diagnose a run directory from its metrics (rules.py: the rules; report.py: the
command; table.py: docs/troubleshooting.md generated from the rules)."""

from pfppo_mega.doctor.report import RunDirError, diagnose, main, read_run, to_json
from pfppo_mega.doctor.rules import RULES, RULES_BY_NAME, Rule, Series

__all__ = ["RULES", "RULES_BY_NAME", "Rule", "RunDirError", "Series", "diagnose", "main", "read_run", "to_json"]
