"""The engine's fixed cost per intercepted op: a recorded forward pass of a model of many tiny ops.

The model is a stack of blocks on a 1 x 8 input (dense layer, in-place ReLU, a residual sum, a layer norm, a
sigmoid gate, a reshape), so that the kernels cost next to nothing and the time is the interception's. It prints
the number of torch functions the model calls, and the CPU time of this process for one recorded forward pass
(``LRP.record``) per call, in microseconds, beside the plain forward pass: the fastest round (on a shared machine
the least disturbed) and the median. Compare two versions of the code by running it alternately with each::

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/dispatch_cost.py
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from bench import CountOps  # the same count as bench.py --per-op (this folder is on sys.path)
from torch import Tensor, nn

import relprop


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.gate = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu_(self.dense(x))
        h = h + x
        h = self.norm(h)
        return (h * torch.sigmoid(self.gate(h))).reshape(x.shape)


def _seconds(run: Callable[[], object], rounds: int) -> tuple[float, float]:
    """The fastest and the median CPU time of ``run`` over ``rounds`` rounds."""
    times = []
    for _ in range(rounds):
        start = time.process_time()
        run()
        times.append(time.process_time() - start)
    return min(times), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(*(Block() for _ in range(args.blocks))).eval()
    x = torch.randn(1, 8)
    counter = CountOps()
    with torch.no_grad(), counter:
        model(x)
    lrp = relprop.LRP(model, "epsilon")
    lrp.record(x)  # warm-up: caches of signatures and bindings
    with torch.no_grad():
        plain = _seconds(lambda: model(x), args.rounds)
    recorded = _seconds(lambda: lrp.record(x), args.rounds)
    print(f"torch functions per forward pass: {counter.count}")
    print("us per call (fastest, median): plain forward " + ", ".join(f"{t / counter.count * 1e6:.1f}" for t in plain)
          + "; recorded (LRP.record) " + ", ".join(f"{t / counter.count * 1e6:.1f}" for t in recorded))


if __name__ == "__main__":
    main()
