"""Start-up time: ``import relprop`` and ``relprop --help`` against ``import torch``, each in a fresh process.

Rounds interleave the three commands, so that a noisy machine weighs on all alike; the medians and their
ratios are printed as a Markdown table::

    python benchmarks/startup.py --rounds 7
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = {
    "import torch": [sys.executable, "-c", "import torch"],
    "import relprop": [sys.executable, "-c", "import relprop"],
    "relprop --help": [sys.executable, "-c", "import sys; from relprop.cli import main; sys.argv[1:] = ['--help']; "
                                             "sys.exit(main())"],
}


def seconds(command: list[str]) -> float:
    """Wall-clock time of one run of ``command``."""
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, cwd=Path(__file__).resolve().parent)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    for command in COMMANDS.values():  # warm the file cache: the first import reads every file from disk
        seconds(command)
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.rounds):
        for name, command in COMMANDS.items():
            times[name].append(seconds(command))
    torch_time = statistics.median(times["import torch"])
    print("| command | median (s) | / import torch | range (s) |\n| --- | --- | --- | --- |")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| `{name}` | {median:.2f} | {median / torch_time:.2f} | {min(values):.2f}-{max(values):.2f} |")


if __name__ == "__main__":
    main()
