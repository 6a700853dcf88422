"""Pictures of a concept atlas: reference crops, one image per channel, an HTML index, and a glocal figure.

A *reference crop* shows where a channel acts on one of its reference
samples (:func:`relprop.workflows.concepts.reference_samples`): for a layer with
spatial maps, the receptive field of the position where the channel's
relevance (or activation) is largest, found as the input pixels on which
that single value depends (its gradient is non-zero); for a layer without
spatial maps, the box around the pixels that hold at least ``threshold`` of
the largest absolute relevance of the channel's conditional heatmap. Each
crop is shown with the channel's conditional heatmap on that sample
(:meth:`relprop.LayerLRP.attribute_concepts`, for the class explained when
the references were found) over it.
"""
from __future__ import annotations

import html
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from relprop import viz
from relprop._core.modules import evaluation
from relprop.methods.attribution import LRP
from relprop.methods.layer import LayerLRP, resolve_module
from relprop.workflows.concepts import TopSamples, load_reference_samples
from relprop.workflows.dataset import batch_inputs

__all__ = ["Crop", "reference_crops", "render_atlas", "render_glocal"]

_PLT = viz.plt  # matplotlib set up by relprop.viz for files only


@dataclass(frozen=True)
class Crop:
    """One reference sample of a channel: its crop, as an image and as the channel's conditional heatmap.

    ``image`` and ``heatmap`` are (size, size, 3) uint8; ``overlay`` is the heatmap over the image;
    ``box`` is (top, bottom, left, right) in input pixels, bottom and right exclusive.
    """

    sample: int
    value: float
    target: int
    box: tuple[int, int, int, int]
    image: np.ndarray
    heatmap: np.ndarray
    overlay: np.ndarray


def _source(source: str | Path | Mapping, layer: str, mode: str) -> tuple[Mapping[str, Mapping[str, TopSamples]],
                                                                          TopSamples]:
    result: Mapping = load_reference_samples(source) if isinstance(source, (str, Path)) else source
    if not isinstance(result, Mapping) or layer not in result:
        known = ", ".join(map(repr, result)) if isinstance(result, Mapping) else "none"
        raise ValueError(f"relprop: the concept result has no layer {layer!r} (it has {known})")
    if mode not in result[layer]:
        raise ValueError(f"relprop: layer {layer!r} was ranked by {', '.join(result[layer])}, not by {mode!r}")
    return result, result[layer][mode]


def _display(x: Tensor) -> np.ndarray:
    """An input (C, H, W) as an RGB float image in [0, 1], scaled by its own range (any normalisation)."""
    image = x.detach().double().cpu()
    image = (image - image.min()) / (image.max() - image.min()).clamp_min(1e-12)
    array = image.numpy().transpose(1, 2, 0)
    return np.repeat(array, 3, axis=2) if array.shape[2] == 1 else array[..., :3]


def _box(mask: np.ndarray, context: float) -> tuple[int, int, int, int]:
    """The square box around the True pixels of ``mask`` (H, W), at least ``context`` of the image's side,
    within the image; the whole image if no pixel is True."""
    height, width = mask.shape
    rows, columns = np.nonzero(mask.any(1))[0], np.nonzero(mask.any(0))[0]
    if not len(rows):
        return 0, height, 0, width
    top, bottom, left, right = rows[0], rows[-1] + 1, columns[0], columns[-1] + 1
    side = min(max(bottom - top, right - left, round(context * min(height, width))), height, width)
    top = int(np.clip((top + bottom - side) // 2, 0, height - side))
    left = int(np.clip((left + right - side) // 2, 0, width - side))
    return top, top + side, left, left + side


def _resize(array: np.ndarray, size: int) -> np.ndarray:
    """Nearest-neighbour resize of an (h, w, 3) image to (size, size, 3): pixels stay sharp."""
    rows = np.minimum((np.arange(size) * array.shape[0]) // size, array.shape[0] - 1)
    columns = np.minimum((np.arange(size) * array.shape[1]) // size, array.shape[1] - 1)
    return array[rows][:, columns]


def _receptive_masks(model: nn.Module, layer: str, inputs: Tensor, channel: int, positions: Tensor) -> np.ndarray:
    """(N, H, W): the input pixels on which the channel's value at each sample's position depends."""
    module = resolve_module(model, layer)
    outputs: list[Tensor] = []
    handle = module.register_forward_hook(lambda _module, _args, output: outputs.append(output))
    leaf = inputs.detach().requires_grad_()
    try:
        with evaluation(model), torch.enable_grad():
            model(leaf)
            maps = outputs[0].reshape(len(inputs), outputs[0].shape[1], -1)
            picked = maps[torch.arange(len(inputs)), channel, positions.to(maps.device)]
            (gradient,) = torch.autograd.grad(picked.sum(), leaf)
    finally:
        handle.remove()
    return (gradient.abs().reshape(len(inputs), inputs.shape[1], *inputs.shape[2:]).sum(1) > 0).cpu().numpy()


def reference_crops(model: nn.Module, dataset: Any, layer: str, top: TopSamples, channel: int,
                    composite: Any = "epsilon-plus-flat", count: int | None = None, size: int = 64,
                    threshold: float = 0.2, context: float = 0.5) -> list[Crop]:
    """The crops of the first ``count`` reference samples of one channel (see the module docstring).

    ``top`` is ``result[layer][mode]`` of :func:`relprop.workflows.concepts.reference_samples`; ``composite``
    should be the one it was run with. Inputs are images (C, H, W). A crop is square, centred on the
    receptive field (or thresholded heatmap), and at least ``context`` of the image's side, so that a
    small receptive field is seen in its surroundings; it is resized to ``size`` pixels.
    """
    channels = top.ids.shape[0]
    if size < 1 or (count is not None and count < 1) or not 0.0 <= context <= 1.0:
        raise ValueError(f"relprop: reference crops need size >= 1, count >= 1 and 0 <= context <= 1, got "
                         f"size={size}, count={count}, context={context}")
    if not -channels <= channel < channels:
        raise ValueError(f"relprop: layer {layer!r} has {channels} channels, no channel {channel}")
    count = top.ids.shape[1] if count is None else min(count, top.ids.shape[1])
    device = next(model.parameters(), torch.empty(0)).device
    inputs, _ = batch_inputs(dataset, [int(i) for i in top.ids[channel, :count]], device)
    if inputs.dim() != 4:
        raise ValueError(f"relprop: reference crops need image inputs (C, H, W), got samples of shape "
                         f"{tuple(inputs.shape[1:])}")
    targets = top.targets[channel, :count].tolist()
    relevance = LayerLRP(model, layer, composite).attribute_concepts(inputs, [[channel]], target=targets)[0]
    if top.map_shape:
        masks = _receptive_masks(model, layer, inputs, channel, top.positions[channel, :count])
    else:
        heat = relevance.abs().sum(1)
        masks = (heat >= threshold * heat.flatten(1).amax(1).clamp_min(1e-30)[:, None, None]).cpu().numpy()
    crops = []
    for k in range(count):
        box = _box(masks[k], context)
        image = (_display(inputs[k]) * 255).round().astype(np.uint8)
        heatmap = viz.heatmap(relevance[k])
        overlay = viz.overlay(inputs[k], relevance[k])
        top_, bottom, left, right = box
        cut = [_resize(picture[top_:bottom, left:right], size) for picture in (image, heatmap, overlay)]
        crops.append(Crop(int(top.ids[channel, k]), float(top.values[channel, k]), int(targets[k]), box, *cut))
    return crops


def _ranking(result: Mapping[str, Mapping[str, TopSamples]], layer: str, mode: str) -> tuple[str, Tensor]:
    """What channels are sorted by (total relevance when it was computed) and the totals."""
    by = "relevance" if "relevance" in result[layer] else mode
    return by, result[layer][by].totals


def _channel_figure(crops: Sequence[Crop], title: str, path: Path, value_name: str) -> None:
    columns = max(len(crops), 1)
    figure, axes = _PLT.subplots(2, columns, figsize=(1.25 * columns + 0.3, 3.0), squeeze=False)
    for k in range(columns):
        for row in (0, 1):
            axes[row][k].set_xticks([])
            axes[row][k].set_yticks([])
        if k < len(crops):
            axes[0][k].imshow(crops[k].image, interpolation="nearest")
            axes[1][k].imshow(crops[k].heatmap, interpolation="nearest")
            axes[0][k].set_title(f"#{crops[k].sample}\n{value_name}={crops[k].value:.3g}", fontsize=7)
    axes[0][0].set_ylabel("crop", fontsize=8)
    axes[1][0].set_ylabel("conditional\nheatmap", fontsize=8)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    _PLT.close(figure)


def _check_out(out: str | Path) -> Path:
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"relprop: the output {out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    if not os.access(out, os.W_OK):
        raise ValueError(f"relprop: the output folder {out} is not writable")
    return out


def render_atlas(source: str | Path | Mapping, model: nn.Module, dataset: Any, layer: str, out: str | Path,
                 mode: str = "relevance", composite: Any = "epsilon-plus-flat",
                 channels: Sequence[int] | None = None, count: int | None = None, size: int = 64) -> Path:
    """Write the atlas of one layer: ``channel-0007.png`` per channel and ``index.html``, sorted by total relevance.

    Parameters
    ----------
    source : folder of a finished :func:`relprop.workflows.concepts.reference_samples` run, or its result
    model, dataset :
        The model and dataset the references were found on (crops are recomputed from them).
    layer : str
    out : folder
    mode : ``"relevance"`` or ``"activation"``
        Which reference samples to show.
    composite :
        The composite of the run, for the conditional heatmaps.
    channels : list of int, optional
        Only these channels (default: all).
    count : int, optional
        References per channel (default: all the run kept).
    size : int
        Pixels of each crop's side.

    Returns
    -------
    Path of ``index.html``.
    """
    result, top = _source(source, layer, mode)
    out = _check_out(out)
    by, totals = _ranking(result, layer, mode)
    chosen = range(top.ids.shape[0]) if channels is None else [int(c) for c in channels]
    order = sorted(chosen, key=lambda c: (-float(totals[c]), c))
    value_name = "R" if mode == "relevance" else "max"
    rows = []
    for rank, channel in enumerate(order, start=1):
        crops = reference_crops(model, dataset, layer, top, channel, composite, count, size)
        name = f"channel-{channel:04d}.png"
        _channel_figure(crops, f"{layer}, channel {channel}: total {by} {float(totals[channel]):.4g} "
                               f"(rank {rank} of {len(order)}); top samples by {mode}", out / name, value_name)
        rows.append(f"<tr><td>{rank}</td><td>{channel}</td><td>{float(totals[channel]):.4g}</td>"
                    f'<td><img src="{name}" alt="channel {channel}"></td></tr>')
    title = html.escape(f"Concept atlas of {layer}: top samples by {mode}, channels sorted by total {by}")
    page = (f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{title}</title></head><body>\n"
            f"<h1>{title}</h1>\n<table>\n<tr><th>rank</th><th>channel</th><th>total {by}</th>"
            f"<th>reference samples (crop, conditional heatmap)</th></tr>\n" + "\n".join(rows) +
            "\n</table>\n</body></html>\n")
    index = out / "index.html"
    temporary = out / f".index.html.{os.getpid()}.tmp"
    temporary.write_text(page)
    os.replace(temporary, index)
    return index


def render_glocal(model: nn.Module, x: Tensor, source: str | Path | Mapping, dataset: Any, layer: str,
                  out: str | Path, n: int = 4, count: int = 6, mode: str = "relevance",
                  composite: Any = "epsilon-plus-flat", target: int | None = None, size: int = 64) -> Path:
    """A glocal figure for one input: its heatmap, its ``n`` most relevant channels of ``layer`` (their share
    of the layer's relevance), each with its conditional heatmap on the input and ``count`` reference crops.

    ``x`` is one image (C, H, W) or a batch of one; ``target`` the class (default: the prediction).
    ``out`` is the PNG file to write; returned.
    """
    _, top = _source(source, layer, mode)
    if not isinstance(x, Tensor) or x.dim() not in (3, 4) or (x.dim() == 4 and x.shape[0] != 1):
        raise ValueError(f"relprop: the glocal figure explains one image (C, H, W), got "
                         f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    out = Path(out)
    if out.suffix.lower() != ".png":
        raise ValueError(f"relprop: the glocal figure is written as a .png file, got {out}")
    _check_out(out.parent)
    device = next(model.parameters(), torch.empty(0)).device
    x = (x if x.dim() == 4 else x[None]).to(device)
    with torch.no_grad():
        prediction = int(model(x).argmax(1))
    target = prediction if target is None else int(target)
    heatmap = LRP(model, composite).attribute(x, target=target)[0]
    explainer = LayerLRP(model, layer, composite)
    # per-channel sums of the layer's relevance map: channel_relevance's numbers, also for a layer without maps
    maps = explainer.attribute(x, target=target)
    channel_relevance = maps.reshape(maps.shape[0], maps.shape[1], -1).sum(2)[0]
    n = min(n, len(channel_relevance))
    chosen = channel_relevance.argsort(descending=True, stable=True)[:n].tolist()
    conditional = explainer.attribute_concepts(x, [[c] for c in chosen], target=target)[:, 0]
    layer_total = float(channel_relevance.sum())

    # a wide input (a line of text) gets a first column as wide as it, and its heatmap the rest of the first row
    widths = [min(max(x.shape[-1] / x.shape[-2], 1.0), float(count)), *[1.0] * count]
    figure, axes = _PLT.subplots(1 + n, 1 + count, figsize=(1.3 * sum(widths), 1.45 * (1 + n)), squeeze=False,
                                 gridspec_kw={"width_ratios": widths})
    heatmap_axis = axes[0][1]
    if widths[0] > 1.0:
        for axis in axes[0][1:]:
            axis.remove()
        heatmap_axis = figure.add_subplot(axes[0][0].get_gridspec()[0, 1:])
    for axis in [*axes.flat, heatmap_axis]:
        axis.set_xticks([])
        axis.set_yticks([])
        axis.set_frame_on(False)
    axes[0][0].imshow(_display(x[0]), interpolation="nearest")
    axes[0][0].set_title(f"input\npredicted {prediction}", fontsize=7)
    heatmap_axis.imshow(viz.heatmap(heatmap), interpolation="nearest")
    heatmap_axis.set_title(f"heatmap, class {target}\nR={float(heatmap.sum()):.3g}", fontsize=7)
    figure.suptitle(f"{layer}: the {n} channels most relevant for this input (left: conditional heatmap);\n"
                    f"right: their reference samples by {mode}, cropped, with the conditional heatmap over them",
                    fontsize=8)
    for row, channel in enumerate(chosen, start=1):
        share = float(channel_relevance[channel]) / layer_total if layer_total else float("nan")
        axes[row][0].imshow(viz.heatmap(conditional[row - 1]), interpolation="nearest")
        axes[row][0].set_title(f"ch {channel}: R={float(channel_relevance[channel]):.3g}\n({share:.0%} of layer)",
                               fontsize=7)
        axes[row][0].set_frame_on(True)
        for k, crop in enumerate(reference_crops(model, dataset, layer, top, channel, composite, count, size)):
            axes[row][1 + k].imshow(crop.overlay, interpolation="nearest")
            axes[row][1 + k].set_title(f"#{crop.sample}", fontsize=6)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    _PLT.close(figure)
    return out
