"""Compare the metrics.jsonl of two sets of runs value by value (timings left out).

    python scripts/compare_metrics.py DIR_A DIR_B [--ignore PREFIX ...]   # exit 1 unless identical

Each DIR holds one sub-folder per run (as scripts/bit_identity.sh writes them). Keys under time/,
perf/ and pool/switch_s are wall-clock measurements and are not compared; everything else must be
equal to the bit, in the same order. --ignore leaves out more key prefixes (metrics one side adds,
e.g. work/).
"""

import json
import sys
from pathlib import Path

TIMINGS = ("time/", "perf/", "pool/switch_s")


def records(path: Path, skip: tuple[str, ...]) -> list[list[tuple[str, object]]]:
    return [[(k, v) for k, v in json.loads(line).items() if not k.startswith(skip)] for line in open(path)]


def main(a: Path, b: Path, ignore: tuple[str, ...] = ()) -> int:
    skip = TIMINGS + ignore
    same_all = True
    for run in sorted(p.name for p in a.iterdir() if (p / "metrics.jsonl").is_file()):
        ra, rb = records(a / run / "metrics.jsonl", skip), records(b / run / "metrics.jsonl", skip)
        same = ra == rb
        same_all &= same
        where = "" if same else next((f" (first difference at record {i})" for i, (x, y) in enumerate(zip(ra, rb))
                                      if x != y), f" ({len(ra)} vs {len(rb)} records)")
        print(f"{run}: {len(ra)} records, {sum(map(len, ra))} values: {'IDENTICAL' if same else 'DIFFERENT'}{where}")
    return 0 if same_all else 1


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--ignore", action="append", default=[], help="a key prefix left out (repeatable)")
    args = ap.parse_args()
    sys.exit(main(args.a, args.b, tuple(args.ignore)))
