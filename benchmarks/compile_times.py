"""What ``compile=True`` costs and when it pays: the first call (compiling), a second process on the same
compile cache (a warm start), later calls against interception, and the compilations of ten prompt lengths.

Each case runs in fresh processes: the first on an empty Inductor cache directory (cold), the second on the
directory the first filled (warm: PyTorch's own FX graph cache serves Inductor's code, so only Dynamo's trace and
relprop's decision pass run again). Prints a Markdown table::

    OMP_NUM_THREADS=1 python benchmarks/compile_times.py
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _models() -> dict:
    import torch
    import transformers
    from torch import nn

    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                        nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(256, 10)).eval()
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128)
    llama = transformers.LlamaForCausalLM(config).eval()
    return {"small CNN, epsilon-plus-flat": (cnn, "epsilon-plus-flat", torch.randn(2, 3, 32, 32), 3),
            "Llama h64, attnlrp": (llama, "attnlrp", torch.randint(0, 256, (1, 16)), (-1, 5))}


def child(case: str) -> dict:
    """One process: the first compiled call, then 5 calls compiled and 5 under interception (median), and ten
    prompt lengths on the language model."""
    import statistics

    import torch

    import relprop

    model, preset, x, target = _models()[case]
    lrp = relprop.LRP(model, preset, compile=True)
    start = time.perf_counter()
    lrp.attribute(x, target=target)
    first = time.perf_counter() - start
    eager = relprop.LRP(model, preset)

    def timed(explainer: relprop.LRP) -> float:
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            explainer.attribute(x, target=target)
            runs.append(time.perf_counter() - start)
        return statistics.median(runs)

    result = {"first": first, "compiled": timed(lrp), "interception": timed(eager), "fallback": lrp.compiled.fallback}
    if x.dtype == torch.long:
        before, start = lrp.compiled.compilations, time.perf_counter()
        for length in (8, 12, 20, 16, 33, 5, 9, 27, 14, 40):
            lrp.attribute(torch.randint(0, 256, (1, length)), target=target)
        result["lengths"] = (lrp.compiled.compilations - before, time.perf_counter() - start)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    print("| case | first call, cold cache | first call, warm cache (2nd process) | later calls: compiled / "
          "interception | 10 prompt lengths: compilations, time |")
    print("|---|---|---|---|---|")
    for case in _models():
        with tempfile.TemporaryDirectory() as cache:
            environment = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
            runs = [json.loads(subprocess.run([sys.executable, __file__, "--child", case], env=environment,
                                              check=True, capture_output=True, text=True).stdout.splitlines()[-1])
                    for _ in range(2)]
        cold, warm = runs
        lengths = (f"{cold['lengths'][0]}, {cold['lengths'][1]:.1f} s" if "lengths" in cold else "")
        print(f"| {case} | {cold['first']:.1f} s | {warm['first']:.1f} s | {1e3 * warm['compiled']:.2f} ms / "
              f"{1e3 * warm['interception']:.2f} ms | {lengths} |")


if __name__ == "__main__":
    main()
