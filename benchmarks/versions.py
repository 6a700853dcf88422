"""This checkout's speed against another checkout's, side by side: a refactoring must not slow relprop down.

Each round runs ``bench.py --targets`` once with each source tree (alternating, so that a noisy machine
weighs on both alike) and reads relprop's time over its reference in each case of the targets table; the
verdict is the median over rounds of each tree's ratio, and their quotient::

    python benchmarks/versions.py --other /path/to/old/src --rounds 5

A quotient near 1 (within the spread of the rounds it prints) is no slowdown.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: a row of bench.py's targets table: | case | reference (ms) | relprop (ms) | ratio | target |
ROW = re.compile(r"^\| (?P<case>[^|]+?) \| (?P<reference>[\d.]+) \| (?P<ours>[\d.]+) \|")


def ratios(source: str, rounds: int) -> dict[str, float]:
    """relprop's time over the reference's per target case, from one run of bench.py with ``source`` imported."""
    environment = {**os.environ, "PYTHONPATH": source, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(HERE / "bench.py"), "--models", "--transformers", "--with", "--targets",
               "--rounds", str(rounds)]
    output = subprocess.run(command, env=environment, capture_output=True, text=True, check=True).stdout
    found = {}
    for line in output.splitlines():
        match = ROW.match(line)
        if match and match["case"] != "case":
            found[match["case"]] = float(match["ours"]) / float(match["reference"])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", required=True, help="the other checkout's src folder")
    parser.add_argument("--rounds", type=int, default=5, help="alternating runs of each tree")
    parser.add_argument("--inner-rounds", type=int, default=3, help="bench.py's own rounds per run")
    args = parser.parse_args()
    trees = {"this": str(HERE.parent / "src"), "other": args.other}
    found: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    for _ in range(args.rounds):
        for name, source in trees.items():
            for case, value in ratios(source, args.inner_rounds).items():
                found[name].setdefault(case, []).append(value)
    print("| case | this / reference | other / reference | this / other | spread of this (min-max) |")
    print("| --- | --- | --- | --- | --- |")
    for case, values in found["this"].items():
        this, other = statistics.median(values), statistics.median(found["other"].get(case, [float("nan")]))
        print(f"| {case} | {this:.2f} | {other:.2f} | {this / other:.3f} | {min(values):.2f}-{max(values):.2f} |")


if __name__ == "__main__":
    main()
