"""How close DeepLift's Rescale and RevealCancel rules come to exact Shapley values, against Shapley value sampling.

    OMP_NUM_THREADS=1 python benchmarks/shapley.py [--features 10] [--nets 20] [--examples 8] [--samples 1 4 16]

Small MLPs (``--features`` inputs, two hidden layers of 16, ReLU or tanh; random weights and biases, float64,
``--nets`` seeds each) explain the first output for ``--examples`` inputs drawn from N(0, 1) against the baseline
0. The reference is the exact Shapley value of each input feature for the game ``v(S) = f(x on S, baseline
elsewhere) - f(baseline)``, from all ``2^features`` subsets. For each method and example: the relative error
``sum |phi - exact| / sum |exact|`` and the Pearson correlation with the exact values; the table gives their means
over all examples (and the standard error of the error's mean).

Cost, in rows the model evaluates per explained example: DeepLift runs input and baseline as one batch (2 rows)
and one backward pass (RevealCancel also evaluates each nonlinearity twice more there); captum's
``ShapleyValueSampling`` with ``n_samples = k`` permutations evaluates ``k features + 1`` rows (counted).
One permutation is the least sampling can spend, already more than DeepLift's pass; ``--samples`` sets the
larger budgets shown.
"""
from __future__ import annotations

import argparse
import itertools
import math
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

import relprop

D = torch.float64


def mlp(features: int, activation: type[nn.Module], seed: int) -> nn.Module:
    """``features -> 16 -> 16 -> 2`` with ``activation``; PyTorch's default initialisation, biases too."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, 16), activation(), nn.Linear(16, 16), activation(),
                         nn.Linear(16, 2)).to(D).eval()


def exact_shapley(model: nn.Module, x: Tensor, baseline: Tensor, target: int) -> Tensor:
    """Shapley values of every feature of each row of ``x`` (``(N, d)``), from all ``2^d`` coalitions."""
    d = x.shape[1]
    masks = torch.tensor(list(itertools.product([0.0, 1.0], repeat=d)), dtype=D)  # (2^d, d), coalition by bits
    index = (masks * 2 ** torch.arange(d - 1, -1, -1, dtype=D)).sum(1).long()  # bit pattern of each row
    sizes = masks.sum(1).long()
    weights = torch.tensor([math.factorial(s) * math.factorial(d - s - 1) / math.factorial(d) if s < d else 0.0
                            for s in range(d + 1)], dtype=D)
    found = []
    with torch.no_grad():
        for row in x:
            values = model(masks * row + (1 - masks) * baseline)[:, target]  # v(S) + f(baseline)
            by_pattern = torch.empty_like(values)
            by_pattern[index] = values
            phi = torch.zeros(d, dtype=D)
            for i in range(d):
                bit = 2 ** (d - 1 - i)
                without = masks[:, i] == 0  # coalitions S without i, and S + {i}
                gains = by_pattern[index[without] + bit] - by_pattern[index[without]]
                phi[i] = (weights[sizes[without]] * gains).sum()
            found.append(phi)
    return torch.stack(found)


class Counted(nn.Module):
    """The model, counting the rows it evaluates."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model, self.rows = model, 0

    def forward(self, x: Tensor) -> Tensor:
        self.rows += x.shape[0]
        return self.model(x)


def methods(samples: Sequence[int]) -> dict[str, Callable[[nn.Module, Tensor, Tensor], Tensor]]:
    """Each method as ``explain(model, x, baseline)``, the attributions of output 0."""
    from captum.attr import ShapleyValueSampling

    def deeplift(rule: str) -> Callable[[nn.Module, Tensor, Tensor], Tensor]:
        return lambda model, x, baseline: relprop.DeepLift(model, rule=rule).attribute(x, baseline, target=0)

    def sampling(k: int) -> Callable[[nn.Module, Tensor, Tensor], Tensor]:
        def explain(model: nn.Module, x: Tensor, baseline: Tensor) -> Tensor:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # captum's notes
                return ShapleyValueSampling(model).attribute(x, baseline, target=0, n_samples=k)
        return explain

    found = {"DeepLift RevealCancel": deeplift("reveal_cancel"), "DeepLift Rescale": deeplift("rescale")}
    found.update({f"ShapleyValueSampling, {k} permutation{'s' if k > 1 else ''}": sampling(k) for k in samples})
    return found


def correlation(a: Tensor, b: Tensor) -> Tensor:
    """Pearson correlation of each row of ``a`` with the same row of ``b``."""
    a, b = a - a.mean(1, keepdim=True), b - b.mean(1, keepdim=True)
    return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1)).clamp_min(1e-300)


def run(features: int, nets: int, examples: int, samples: Sequence[int]) -> str:
    explainers = methods(samples)
    errors: dict[str, dict[str, list[Tensor]]] = {}
    rows: dict[str, int] = {name: 0 for name in explainers}
    explained = 0
    for activation in (nn.ReLU, nn.Tanh):
        for seed in range(nets):
            model = mlp(features, activation, seed)
            torch.manual_seed(10_000 + seed)
            x = torch.randn(examples, features, dtype=D)
            baseline = torch.zeros(1, features, dtype=D)
            exact = exact_shapley(model, x, baseline[0], 0)
            explained += examples
            for name, explain in explainers.items():
                counted = Counted(model).eval()
                torch.manual_seed(seed)
                found = explain(counted, x, baseline.expand_as(x)).detach()
                rows[name] += counted.rows
                error = (found - exact).abs().sum(1) / exact.abs().sum(1).clamp_min(1e-300)
                for key in (activation.__name__, "all"):
                    errors.setdefault(name, {}).setdefault(key, []).append(torch.stack([error,
                                                                                       correlation(found, exact)]))
    lines = ["| method | rows evaluated per example | relative error, ReLU | tanh | all | correlation, all |",
             "|---|---|---|---|---|---|"]
    for name in explainers:
        cells = []
        for key in ("ReLU", "Tanh", "all"):
            error = torch.cat(errors[name][key], 1)[0]
            cells.append(f"{error.mean():.3f} ± {error.std() / math.sqrt(len(error)):.3f}")
        together = torch.cat(errors[name]["all"], 1)
        lines.append(f"| {name} | {rows[name] / explained:g} | " + " | ".join(cells) +
                     f" | {together[1].mean():.3f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--features", type=int, default=10)
    parser.add_argument("--nets", type=int, default=20, help="random nets of each activation")
    parser.add_argument("--examples", type=int, default=8, help="inputs explained per net")
    parser.add_argument("--samples", type=int, nargs="+", default=[1, 4, 16], help="permutations of the sampling")
    args = parser.parse_args(argv)
    print(f"MLPs {args.features}-16-16-2, ReLU and tanh, {args.nets} nets each, {args.examples} inputs each, "
          "baseline 0, float64")
    print(run(args.features, args.nets, args.examples, args.samples))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
