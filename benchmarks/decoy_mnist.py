"""Decoy MNIST (Ross et al. 2017): training with a penalty on relevance inside the decoy, against RRR and plain training.

    OMP_NUM_THREADS=1 python benchmarks/decoy_mnist.py [--seeds 0 1 2 3 4] [--epochs 30] [--figure DIR]
    OMP_NUM_THREADS=1 python benchmarks/decoy_mnist.py --cost [--rounds 30]

The MLP of Ross et al. (784-50-30-10, ReLU; Adam with learning rate 1e-3, batches of 64) learns decoy MNIST
(:func:`relprop.workflows.decoy.decoy_mnist`: 4000 digits with a 4 x 4 swatch whose shade is ``255 - 25 y`` in
training, 1000 test digits with random shades) for ``--epochs`` epochs, once per seed (the seed draws the split,
the corners, the test shades, the initial weights and the batches), in each of these ways:

- ``no decoy``: the same digits without swatches (the ceiling);
- ``plain``: cross-entropy alone;
- ``RRR``: cross-entropy + ``weight * mean(penalty)`` with the input gradient of the summed log-probabilities,
  squared and summed on the swatch (:class:`relprop.workflows.guided.Penalty` with ``"gradient"``);
- ``LRP <composite>``: the same with the squared relevance of the true class on the swatch, summed
  (``Penalty(model, composite)``, relevance differentiated in the parameters); ``LRP epsilon, share``: its share
  of the squared relevance instead (``normalize=True``).

The table gives test accuracy on the decoy test set (mean and standard deviation over the seeds), the share of
relevance on the swatch at test (``sum |R|`` on the swatch over ``sum |R|``, LRP ``epsilon`` for the true class,
mean over the test digits and the seeds), the swatch sensitivity (the squared input gradient of the true class's
logit on the swatch, ``sum_i (m_i df_y/dx_i)^2``, mean over the test digits and the seeds: how much the model still
reads the swatch, whatever its shade), dark / light (that sensitivity on the training digits whose swatches are
darkest, labels 6 to 9, over the lightest's, 0 to 3; mean over the seeds) and the time of a training step against a
plain step's (the median over the seeds of the median step's time: a step's own cost, without the first step's
compilation, which each seed's line gives).
``--figure DIR`` writes ``DIR/heatmaps.png``: test digits and their relevance under the models of the first seed.
``--cost`` times one batch of 64 instead, interleaved round by round: a plain attribution, a differentiable one
with the backward pass of its penalty, RRR's double backward, a plain forward and backward pass, and whole training
steps (Adam included): plain, with the compiled LRP penalty, with RRR.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from timing import interleaved
from torch import Tensor, nn

import relprop
from relprop.workflows.decoy import DecoyMNIST, decoy_mnist
from relprop.workflows.guided import GRADIENT, Penalty

#: the explainers a penalty can use, by the name the table gives them; the weight each takes by default, and
#: further arguments of its relprop.LRP
EXPLAINERS: dict[str, tuple[relprop.Composite | str, float, dict[str, Any]]] = {
    "RRR": (GRADIENT, 10.0, {}),
    "LRP epsilon": ("epsilon", 30.0, {}),
    # the same penalty with the relevance and its derivative one Inductor program
    "LRP epsilon, compiled": ("epsilon", 30.0, {"compile": True}),
    # the share of the squared relevance on the swatch instead of its sum (compiled, as the row above)
    "LRP epsilon, share": ("epsilon", 10.0, {"normalize": True, "compile": True}),
    # AttnLRP's preset: LRP-0 on the MLP's dense layers (its rules for attention and norms find none here)
    "LRP attnlrp": ("attnlrp", 30.0, {}),
    # epsilon-gamma-box's first-layer rule (ZBox, bounded by the pixels' range [0, 1]) on the MLP's first layer:
    # its presets differ from epsilon on an MLP only by the first layer, and epsilon-plus-flat's Flat gives every
    # pixel the same share there. ZBox gives the swatch's pixels relevance of their bounds whatever their shade,
    # which puts relevance of the scale of the bounds on the swatch: the share, at a larger weight
    "LRP zbox-epsilon": (relprop.Composite(1e-6, first={"dense": relprop.rules.ZBox(0.0, 1.0)}), 100.0,
                         {"normalize": True}),
}


def mlp(seed: int) -> nn.Module:
    """Ross et al.'s MLP, 784-50-30-10 with ReLU, PyTorch's default initialisation drawn from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 50), nn.ReLU(), nn.Linear(50, 30), nn.ReLU(), nn.Linear(30, 10))


def train(images: Tensor, labels: Tensor, masks: Tensor, seed: int, epochs: int,
          explainer: relprop.Composite | str | None = None, weight: float = 0.0, **options: Any
          ) -> tuple[nn.Module, float, float]:
    """The MLP trained on ``images`` (with the penalty of ``explainer`` on ``masks`` if given, ``options`` its
    relprop.LRP's); the median seconds of a step and the seconds of the first (which compiles, where it does)."""
    model = mlp(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    penalty = Penalty(model, explainer, **options) if explainer is not None else None
    generator = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(epochs):
        for batch in torch.randperm(len(images), generator=generator).split(64):
            start = time.perf_counter()
            loss = F.cross_entropy(model(images[batch]), labels[batch])
            if penalty is not None:
                loss = loss + weight * penalty(images[batch], masks[batch], labels[batch]).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps.append(time.perf_counter() - start)
    return model.eval(), statistics.median(steps), steps[0]


def swatch_share(model: nn.Module, data: DecoyMNIST) -> float:
    """The mean share of LRP epsilon's absolute relevance (true class) on the swatch, over the test digits."""
    relevance = relprop.LRP(model, "epsilon").attribute(data.test_images, data.test_labels).abs().flatten(1)
    inside = (relevance * data.test_masks.flatten(1)).sum(1)
    return (inside / relevance.sum(1).clamp_min(1e-30)).mean().item()


def sensitivity(model: nn.Module, images: Tensor, labels: Tensor, masks: Tensor) -> Tensor:
    """Each digit's squared input gradient of its true class's logit on the swatch, ``sum_i (m_i df_y/dx_i)^2``:
    how much the model still reads the swatch, whatever its shade."""
    leaf = images.detach().requires_grad_(True)
    (gradient,) = torch.autograd.grad(model(leaf).gather(1, labels[:, None]).sum(), leaf)
    return (gradient * masks).pow(2).flatten(1).sum(1)


def swatch_sensitivity(model: nn.Module, data: DecoyMNIST) -> tuple[float, float]:
    """The mean :func:`sensitivity` on the test digits; and in training, that of the darkest swatches' digits
    (labels 6 to 9) over that of the lightest (0 to 3)."""
    test = sensitivity(model, data.test_images, data.test_labels, data.test_masks).mean().item()
    train = sensitivity(model, data.train_images, data.train_labels, data.train_masks)
    dark, light = train[data.train_labels >= 6].mean(), train[data.train_labels <= 3].mean()
    return test, (dark / light.clamp_min(1e-30)).item()


def accuracy(model: nn.Module, data: DecoyMNIST) -> float:
    """Accuracy on the decoy test set."""
    with torch.no_grad():
        return (model(data.test_images).argmax(1) == data.test_labels).double().mean().item()


def ways(weights: dict[str, float]) -> dict[str, Callable[[DecoyMNIST, int, int], tuple[nn.Module, float, float]]]:
    """Each way of training, by its row's name: a function of the data, the seed and the epochs."""
    found: dict[str, Callable[[DecoyMNIST, int, int], tuple[nn.Module, float, float]]] = {
        "no decoy (ceiling)": lambda d, s, e: train(d.clean_train_images, d.train_labels, d.train_masks, s, e),
        "plain": lambda d, s, e: train(d.train_images, d.train_labels, d.train_masks, s, e),
    }
    for name, (explainer, _, options) in EXPLAINERS.items():
        found[f"{name} (weight {weights[name]:g})"] = (
            lambda d, s, e, x=explainer, w=weights[name], o=options: train(d.train_images, d.train_labels,
                                                                           d.train_masks, s, e, x, w, **o))
    return found


def table(seeds: list[int], epochs: int, weights: dict[str, float], figure: Path | None,
          only: list[str] | None) -> None:
    """Train every way (or ``only`` these, and plain) for every seed; print the table and write the figure."""
    results: dict[str, list[tuple[float, float, float, float, float]]] = {}
    chosen = {name: run for name, run in ways(weights).items()
              if only is None or name == "plain" or name.split(" (")[0] in only}
    for seed in seeds:
        data = decoy_mnist(seed)
        models = {}
        for name, run in chosen.items():
            model, step, first = run(data, seed, epochs)
            models[name] = model
            results.setdefault(name, []).append((accuracy(model, data), swatch_share(model, data), step,
                                                 *swatch_sensitivity(model, data)))
            score, share, _, test, dark = results[name][-1]
            print(f"seed {seed}, {name}: accuracy {score:.3f}, swatch share {share:.3f}, sensitivity {test:.1e} "
                  f"(dark / light {dark:.1f}), {1e3 * step:.2f} ms a step (the first {first:.2f} s)", flush=True)
        if figure is not None and seed == seeds[0]:
            heatmaps(models, data, figure)
    plain_step = statistics.median(row[2] for row in results["plain"])
    print("\n| training | test accuracy | relevance on the swatch | swatch sensitivity | dark / light | "
          "time per step / plain |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, rows in results.items():
        scores = [row[0] for row in rows]
        spread = statistics.stdev(scores) if len(scores) > 1 else 0.0
        shares = statistics.mean(row[1] for row in rows)
        print(f"| {name} | {statistics.mean(scores):.3f} ± {spread:.3f} | {shares:.3f} | "
              f"{statistics.mean(row[3] for row in rows):.1e} | {statistics.mean(row[4] for row in rows):.1f} | "
              f"{statistics.median(row[2] for row in rows) / plain_step:.2f}x |")


def heatmaps(models: dict[str, nn.Module], data: DecoyMNIST, folder: Path) -> None:
    """``folder/heatmaps.png``: six test digits, then LRP epsilon's relevance of the true class under each model."""
    from relprop.viz import save_heatmap_grid  # matplotlib only for the figure

    images, labels = data.test_images[:6], data.test_labels[:6]
    maps = {name.split(" (")[0].replace(", ", ",\n"): relprop.LRP(model, "epsilon").attribute(images, labels)
            for name, model in models.items()}
    folder.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        predictions = models["plain"](images).argmax(1).tolist()
    save_heatmap_grid(images, maps, folder / "heatmaps.png", labels=labels.tolist(), predictions=predictions,
                      title="decoy MNIST test digits; LRP epsilon of the true class under each model "
                            "(row titles: the plain model's prediction)")
    print(f"wrote {folder / 'heatmaps.png'}", flush=True)


def cost(rounds: int) -> None:
    """Median times of one batch of 64: attribution, differentiable attribution + backward (eager and compiled),
    RRR, a plain forward and backward pass; then whole training steps (Adam included): plain, with the compiled
    LRP penalty, with RRR."""
    data = decoy_mnist(0)
    images, labels, masks = data.train_images[:64], data.train_labels[:64], data.train_masks[:64]
    model = mlp(0)
    lrp, explained, rrr = relprop.LRP(model, "epsilon"), Penalty(model, "epsilon"), Penalty(model, GRADIENT)
    one_program = Penalty(model, "epsilon", compile=True)

    def forward_backward() -> None:
        F.cross_entropy(model(images), labels).backward()

    def differentiable() -> None:
        explained(images, masks, labels).mean().backward()

    def compiled() -> None:
        one_program(images, masks, labels).mean().backward()

    def double_backward() -> None:
        rrr(images, masks).mean().backward()

    def training_step(penalty: Callable[[nn.Module], Penalty] | None) -> Callable[[], None]:
        """A step of its own model and optimizer (as decoy MNIST trains), with ``penalty`` of that model."""
        trained = mlp(0)
        optimizer = torch.optim.Adam(trained.parameters(), lr=1e-3)
        explains = None if penalty is None else penalty(trained)

        def step() -> None:
            loss = F.cross_entropy(trained(images), labels)
            if explains is not None:
                loss = loss + 30.0 * explains(images, masks, labels).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return step

    found = interleaved({
        "attribution (lrp.attribute)": lambda: lrp.attribute(images, labels),
        "differentiable attribution + backward of its penalty": differentiable,
        "the same, compile=True (one Inductor program)": compiled,
        "RRR: input gradient + backward of its penalty (double backward)": double_backward,
        "plain forward and backward pass of the cross-entropy": forward_backward,
        "training step, plain (cross-entropy, backward, Adam)": training_step(None),
        "training step with the LRP epsilon penalty, compile=True": training_step(
            lambda m: Penalty(m, "epsilon", compile=True)),
        "training step with RRR": training_step(lambda m: Penalty(m, GRADIENT)),
    }, rounds, "cpu")
    base, step = found["attribution (lrp.attribute)"], found["training step, plain (cross-entropy, backward, Adam)"]
    print("\n| batch of 64, MLP 784-50-30-10 | median (ms) | / attribution | / plain training step |")
    print("| --- | --- | --- | --- |")
    for name, seconds in found.items():
        print(f"| {name} | {1e3 * seconds:.2f} | {seconds / base:.2f} | {seconds / step:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--weight", nargs=2, action="append", metavar=("EXPLAINER", "WEIGHT"), default=[],
                        help=f"a penalty's weight, e.g. --weight 'LRP epsilon' 100; explainers: {', '.join(EXPLAINERS)}")
    parser.add_argument("--only", nargs="+", help="train only these rows (names as in the table, before ' (')")
    parser.add_argument("--figure", type=Path, help="write the heatmaps of the first seed's models here")
    parser.add_argument("--cost", action="store_true", help="time one batch instead (see the module's docstring)")
    parser.add_argument("--rounds", type=int, default=30)
    options = parser.parse_args()
    if options.cost:
        cost(options.rounds)
        return
    weights = {name: default for name, (_, default, _) in EXPLAINERS.items()}
    weights.update({name: float(value) for name, value in options.weight})
    table(options.seeds, options.epochs, weights, options.figure, options.only)


if __name__ == "__main__":
    main()
