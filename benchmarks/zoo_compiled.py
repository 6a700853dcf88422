"""The zoo of tests/zoo.py (one smallest timm model per family, tiny Hugging Face configs) through the compiled tier.

For each model: ``relprop.LRP(model, preset, compile="aot_eager")`` (Epsilon on timm's models, AttnLRP on Hugging
Face's, with SDPA attention where the family has it, else eager), once; whether it ran compiled as one program
(``compiled``), as a recorded pass's forward program (and why not as one) or fell back, and why; and where it ran
compiled, how far its relevance is from interception's, relative to the largest entry. Prints a
line per model and a count of the reasons::

    OMP_NUM_THREADS=1 python benchmarks/zoo_compiled.py [--only FAMILY ...] [--max-side PIXELS] [--seconds LIMIT]
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
import warnings
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

import relprop  # noqa: E402
from test_zoo import TIMM, hf_call, hf_model, timm_model  # noqa: E402
from zoo import HF  # noqa: E402


def one(model: torch.nn.Module, x: torch.Tensor, target: object, kwargs: dict, preset: str) -> tuple[str, float]:
    """The fallback reason (``"compiled"`` where it ran compiled) and the relative difference to interception."""
    lrp = relprop.LRP(model, preset, compile="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = lrp.attribute(x, target=target, additional_forward_args=kwargs or None)
        if lrp.compiled.fallback is not None:
            return lrp.compiled.fallback, float("nan")
        outcome = "compiled" if lrp.compiled.split is None else f"compiled as a recorded pass: {lrp.compiled.split}"
        reference = relprop.LRP(model, preset).attribute(x, target=target, additional_forward_args=kwargs or None)
    scale = reference.abs().max().clamp(min=1e-300)
    return outcome, float((found - reference).abs().max() / scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", nargs="*", default=None, help="families (timm's or Hugging Face's) to run")
    parser.add_argument("--max-side", type=int, default=256, help="leave out timm models with larger images")
    parser.add_argument("--seconds", type=float, default=float("inf"), help="stop starting models after this")
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    reasons: collections.Counter[str] = collections.Counter()
    cases = [("timm", family) for family in TIMM] + [("hf", family) for family in HF]
    for source, family in cases:
        if (args.only is not None and family not in args.only) or (source == "timm"
                                                                    and TIMM[family][2] > args.max_side):
            continue
        if time.perf_counter() - start > args.seconds:
            break
        try:
            if source == "timm":
                model, x = timm_model(family)
                target, kwargs, preset = 1, {}, "epsilon"
            else:
                try:
                    model = hf_model(family, "sdpa")
                except ValueError:  # a family without SDPA attention: written out
                    model = hf_model(family, "eager")
                x, target, kwargs = hf_call(family)
                preset = "attnlrp"
            reason, difference = one(model, x, target, kwargs, preset)
        except Exception as error:  # noqa: BLE001 - a model that fails under interception too is reported so
            reason, difference = f"error: {type(error).__name__}: {str(error).splitlines()[0][:120]}", float("nan")
        reasons[reason if reason == "compiled" else reason.split(":")[0][:90]] += 1
        print(f"| {source} | {family} | {reason[:160]} | {difference:.1e} |", flush=True)
    print("\n| outcome | models |\n| --- | --- |")
    for reason, count in reasons.most_common():
        print(f"| {reason} | {count} |")


if __name__ == "__main__":
    main()
