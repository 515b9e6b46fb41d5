"""Memory and layout planning for large runs: `pfppo plan` (see docs/scaling.md).

shapes  megatron's layout rules as arithmetic (rank coordinates, groups, parameter shapes)
memory  per-GPU / per-node memory of a colocated PPO / PF-PPO run, read off the device-memory
        ledger (pfppo_mega/ledger.py: the arithmetic the trainer checks too)
dryrun  megatron's real groups and meta-device models for one rank of the full world (fake PG)
cli     `pfppo plan` (also `python -m pfppo_mega.planning`)
"""

from pfppo_mega.planning.cli import main
from pfppo_mega.planning.memory import Hardware, Knobs, Plan, RunShape, make_plan

__all__ = ["Hardware", "Knobs", "Plan", "RunShape", "main", "make_plan"]
