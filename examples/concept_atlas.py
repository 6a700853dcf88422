"""A concept atlas of the demo's MNIST CNN over the 5000 real digits, and a glocal figure for one test digit.

    python examples/concept_atlas.py [OUT]          # default OUT: out/atlas

Trains ``SmallCNN`` as the demo does (4000 digits, seed 0), finds the top 12 reference samples of every
channel of ``features.3`` (second convolution, 32 channels) and ``classifier.1`` (dense, 64 units) by
relevance and by activation (``relprop.workflows.concepts.reference_samples``, resumable in ``OUT/run``), and writes

- ``OUT/features.3/index.html`` and ``OUT/classifier.1/index.html``: one PNG per channel (crops of its
  reference samples by relevance, with their conditional heatmaps), sorted by total relevance;
- ``OUT/glocal.png``: a test digit, its heatmap, its four most relevant channels of ``features.3`` with
  their conditional heatmaps and reference crops.
"""
import sys
import time
from pathlib import Path

import torch

from relprop.viz import atlas
from relprop.workflows import mnist as demo
from relprop.workflows.concepts import reference_samples

LAYERS = ["features.3", "classifier.1"]


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "out/atlas")
    images, labels = demo.load_mnist()
    split = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))  # the demo's split
    model = demo.train(images[split[:4000]], labels[split[:4000]], seed=0)
    digits = torch.utils.data.TensorDataset(images, labels)
    started = time.perf_counter()
    result = reference_samples(model, digits, LAYERS, composite="epsilon-plus-flat", top_k=12, batch_size=64,
                               out=out / "run", progress=True)
    print(f"reference samples of {len(digits)} digits: {time.perf_counter() - started:.1f} s")
    for layer in LAYERS:
        index = atlas.render_atlas(result, model, digits, layer, out / layer, count=8, size=56)
        print(f"wrote {index}")
    test_digit = images[split[4003]]
    figure = atlas.render_glocal(model, test_digit, result, digits, "features.3", out / "glocal.png", n=4, count=6)
    print(f"wrote {figure}")


if __name__ == "__main__":
    main()
