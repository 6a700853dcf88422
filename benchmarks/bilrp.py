"""BiLRP on one sentence pair of all-MiniLM-L6-v2: this checkout against another, side by side.

Each tree runs in a process of its own (``PYTHONPATH`` set to its ``src``), one thread, which loads the
model and explains the pair once as a warm-up; then round by round each process explains it once more,
alternating, so that a noisy machine weighs on both alike. It prints the median time of each tree,
their quotient, and the largest difference of the two trees' pair relevance over its largest value::

    OMP_NUM_THREADS=1 python benchmarks/bilrp.py --other /path/to/old/src --rounds 5

``--max-batch`` and ``--other-max-batch`` set each tree's ``BiLRP(max_batch=...)`` (default: its own
default); ``--double`` runs the model in float64, where equal relevance agrees to far below float32's rounding.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: the prefix of the lines a measuring process answers with (the libraries print lines of their own)
ANSWER = "bilrp-seconds "


def measure(pairs_path: str, max_batch: int | None, double: bool) -> None:
    """The measuring process: load, warm up and save the pair relevance, then time one explanation per line read."""
    import torch

    sys.path.insert(0, str(HERE.parent / "examples"))
    import sentence_similarity as example

    import relprop

    tokenizer, encoder = example.load()
    embed = example.MeanPooled(encoder.double() if double else encoder).eval()
    options = {} if max_batch is None else {"max_batch": max_batch}
    bilrp = relprop.BiLRP(embed, "attnlrp", **options)
    a, b = (tokenizer([text], return_tensors="pt") for text in example.PAIRS[1])
    arguments = (a["input_ids"], b["input_ids"], (a["attention_mask"],), (b["attention_mask"],))
    torch.save(bilrp.attribute(*arguments), pairs_path)
    print(ANSWER + "ready", flush=True)
    for _ in sys.stdin:
        start = time.perf_counter()
        bilrp.attribute(*arguments)
        print(f"{ANSWER}{time.perf_counter() - start:.6f}", flush=True)


def answer(process: subprocess.Popen) -> str:
    """The next answer of a measuring process, past whatever else it prints."""
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith(ANSWER):
            return line[len(ANSWER):].strip()
    raise RuntimeError(f"relprop: the measuring process ended (exit status {process.wait()})")


def start(source: str, pairs_path: str, max_batch: int | None, double: bool) -> subprocess.Popen:
    environment = {**os.environ, "PYTHONPATH": source, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, __file__, "--measure", pairs_path, *(["--double"] if double else []),
               *([] if max_batch is None else ["--max-batch", str(max_batch)])]
    return subprocess.Popen(command, env=environment, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def compare(trees: dict[str, tuple[str, int | None]], rounds: int, double: bool) -> None:
    """Time the trees in alternating rounds; print the medians, their quotient and the relevance's difference."""
    import torch

    with tempfile.TemporaryDirectory() as folder:
        paths = {name: str(Path(folder) / f"{name}.pt") for name in trees}
        processes = {name: start(source, paths[name], max_batch, double)
                     for name, (source, max_batch) in trees.items()}
        for process in processes.values():
            answer(process)  # loaded and warmed up
        times: dict[str, list[float]] = {name: [] for name in trees}
        for _ in range(rounds):
            for name, process in processes.items():
                assert process.stdin is not None
                process.stdin.write("run\n")
                process.stdin.flush()
                times[name].append(float(answer(process)))
        for process in processes.values():
            assert process.stdin is not None
            process.stdin.close()
            process.wait()
        this, other = (torch.load(paths[name]) for name in ("this", "other"))
    difference = ((this - other).abs().max() / other.abs().max()).item()
    print("| tree | max_batch | median (s) | rounds (s) |\n| --- | --- | --- | --- |")
    for name, (_, max_batch) in trees.items():
        rounded = ", ".join(f"{value:.2f}" for value in times[name])
        print(f"| {name} | {max_batch or 'default'} | {statistics.median(times[name]):.3f} | {rounded} |")
    quotient = statistics.median(times["other"]) / statistics.median(times["this"])
    print(f"\nother / this: {quotient:.2f}x; pair relevance: max |this - other| / max |other| = {difference:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", help="the other checkout's src folder")
    parser.add_argument("--rounds", type=int, default=5, help="alternating explanations by each tree")
    parser.add_argument("--max-batch", type=int, help="this tree's max_batch")
    parser.add_argument("--other-max-batch", type=int, help="the other tree's max_batch")
    parser.add_argument("--double", action="store_true", help="the model in float64")
    parser.add_argument("--measure", metavar="PAIRS", help=argparse.SUPPRESS)  # the measuring process
    args = parser.parse_args()
    if args.measure:
        measure(args.measure, args.max_batch, args.double)
    elif args.other is None:
        parser.error("--other is required")
    else:
        compare({"this": (str(HERE.parent / "src"), args.max_batch), "other": (args.other, args.other_max_batch)},
                args.rounds, args.double)


if __name__ == "__main__":
    main()
