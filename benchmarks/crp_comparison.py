"""Reference samples of relprop's concept atlas against zennit-crp's ``FeatureVisualization``, on the demo CNN.

    python benchmarks/crp_comparison.py [--digits 5000] [--dtype float64]

Trains the demo's ``SmallCNN`` (4000 digits, seed 0), then finds the top 40 reference samples of every channel
of ``features.3`` (convolution) and ``classifier.1`` (dense) over the first ``--digits`` MNIST digits with
both libraries, and prints per layer and mode how many channels get the same ids in the same order.

The settings that match (zennit-crp 0.6):

- relprop ``modes=("relevance",)`` = zennit-crp ``max_target="sum", abs_norm=False`` (the sum of the
  channel's relevance map; ``abs_norm=True`` divides by the sample's total absolute channel relevance, a
  different ranking);
- relprop ``modes=("activation",)`` = zennit-crp ``max_target="max", abs_norm=False`` (the maximum of the
  channel's activation map; FeatureVisualization takes one ``max_target`` for both modes, so it runs twice);
- relprop ``target="label"``: FeatureVisualization explains each item's label, not the prediction;
- relprop ``composite="epsilon-plus-flat"`` = ``zennit.composites.EpsilonPlusFlat()``.

zennit-crp sorts with an unstable ``argsort``, so samples with equal values (a dense unit whose relevance
is exactly 0 on many samples) may come in another order there; mismatches are reported with whether the
values are tied. zennit-crp is installed without its dependencies (``--no-deps``); it runs here as is.
"""
import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

from relprop.cli import demo
from relprop.workflows.concepts import reference_samples

LAYERS = ["features.3", "classifier.1"]
SETTINGS = {"relevance": ("sum", "RelMax"), "activation": ("max", "ActMax")}


class Digits(torch.utils.data.Dataset):
    """(image, int label) items, as FeatureVisualization reads them."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.labels[index])


def zennit_crp(model: torch.nn.Module, dataset: Digits, mode: str, folder: Path) -> dict[str, np.ndarray]:
    """zennit-crp's top-40 sample ids per layer, (channels, 40), and their values."""
    from crp.attribution import CondAttribution
    from crp.concepts import ChannelConcept
    from crp.visualization import FeatureVisualization
    from zennit.composites import EpsilonPlusFlat

    max_target, prefix = SETTINGS[mode]
    visualization = FeatureVisualization(CondAttribution(model), dataset, {name: ChannelConcept() for name in LAYERS},
                                         max_target=max_target, abs_norm=False, path=str(folder))
    visualization.run(EpsilonPlusFlat(), 0, len(dataset), batch_size=64, checkpoint=500)
    found = {}
    for layer in LAYERS:
        base = folder / f"{prefix}_{max_target}_unnormed" / layer
        found[layer] = (np.load(f"{base}_data.npy").T, np.load(f"{base}_rel.npy").T)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--digits", type=int, default=5000)
    parser.add_argument("--dtype", default="float64", choices=("float64", "float32"))
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    images, labels = demo.load_mnist()
    split = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))  # the demo's split
    model = demo.train(images[split[:4000]], labels[split[:4000]], seed=0).to(dtype)
    dataset = Digits(images[:args.digits].to(dtype), labels[:args.digits])
    ours = reference_samples(model, dataset, LAYERS, composite="epsilon-plus-flat", top_k=40, target="label",
                             batch_size=64)
    print(f"{args.digits} digits, {args.dtype}, top 40 per channel, targets = labels, EpsilonPlusFlat")
    for mode in SETTINGS:
        with tempfile.TemporaryDirectory() as folder:
            theirs = zennit_crp(model, dataset, mode, Path(folder))
        for layer in LAYERS:
            ids, values = ours[layer][mode].ids.numpy(), ours[layer][mode].values.numpy()
            their_ids, their_values = theirs[layer]
            same = (ids == their_ids).all(1)
            tied = [c for c in np.nonzero(~same)[0]
                    if np.allclose(np.sort(values[c]), np.sort(their_values[c]), rtol=1e-6, atol=1e-12)]
            gap = np.abs(values - their_values).max() / max(np.abs(values).max(), 1e-30)
            print(f"{mode:10s} {layer:12s} {int(same.sum())}/{len(same)} channels: same 40 ids in the same order; "
                  f"{len(tied)} others have the same 40 values but other samples among equal values; largest relative "
                  f"difference of the values {gap:.1e}")


if __name__ == "__main__":
    main()
