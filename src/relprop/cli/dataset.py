"""``relprop explain-dataset`` and ``relprop atlas``: folders of images, shards on disk."""
from __future__ import annotations

import importlib
from pathlib import Path

import click
import torch
from torch import Tensor

from relprop.cli.app import (
    IMAGE_SUFFIXES,
    CommandError,
    _write_json,
    app,
    example,
    image_options,
    model_options,
    out_option,
    preset_option,
)
from relprop.cli.inputs import _composite, crops, load_images, load_model


class _ImageFolder(torch.utils.data.Dataset):
    """The images below a folder, sorted by path, prepared like ``explain``'s inputs.

    Items are ``(input, label)`` when the images sit in class subfolders (``FOLDER/CLASS/IMAGE``): a subfolder
    named by an integer is that class; otherwise classes are numbered in the sorted order of the subfolder names,
    as torchvision's ``ImageFolder`` does. Images directly in ``FOLDER`` give items without a label.
    """

    def __init__(self, folder: str, size: int, normalize: str | None, channels: int, whole: bool | None = None):
        root = Path(folder)
        if not root.is_dir():
            raise CommandError(f"no such folder: {folder}")
        files = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
        self.paths = _openable([str(p) for p in files])
        if not self.paths:
            raise CommandError(f"no readable images in {folder}")
        self.labels = _class_labels([Path(p).relative_to(root).parts for p in self.paths])
        self.size, self.normalize, self.channels, self.whole = size, normalize, channels, whole
        # the preprocessing, for the fingerprint that keeps a resumed run from mixing with another one (a
        # centre crop is named; a run of whole images keeps the fingerprint it had before crops existed)
        self.transform = {"size": size, "channels": channels, "normalize": normalize,
                          **({"crop": True} if crops(normalize, channels, whole) else {})}

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> Tensor | tuple[Tensor, int]:
        image = load_images([self.paths[index]], self.size, self.normalize, self.channels, self.whole)[0][0]
        return image if self.labels is None else (image, self.labels[index])


def _class_labels(parts: list[tuple[str, ...]]) -> list[int] | None:
    """Each image's class from its first subfolder (see :class:`_ImageFolder`); None unless all have one."""
    if any(len(part) == 1 for part in parts):
        return None
    classes = sorted({part[0] for part in parts})
    numbers = {name: int(name) if all(c.isdigit() for c in classes) else index for index, name in enumerate(classes)}
    return [numbers[part[0]] for part in parts]


def _openable(paths: list[str]) -> list[str]:
    """The paths whose header PIL recognises (no decoding: a large folder is checked in seconds)."""
    from PIL import Image

    good = []
    for path in paths:
        try:
            with Image.open(path):
                good.append(path)
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
            click.echo(f"relprop: warning: skipping {path}: not a readable image", err=True)
    return good


def _dataset_target(_: click.Context, __: click.Parameter, value: str) -> int | str:
    if value in ("prediction", "label"):
        return value
    if not value.isdigit():
        raise click.BadParameter(f"{value!r}: give prediction, label or a class index (0 or more)")
    return int(value)


@app.command("explain-dataset", short_help="Relevance of a folder of images into resumable shards.",
             epilog=example("relprop explain-dataset images/ --model resnet18 --weights resnet18.pth --target label "
                            "--out shards"))
@click.argument("folder", type=click.Path())
@model_options
@preset_option
@image_options
@out_option("shards")
@click.option("--target", default="prediction", callback=_dataset_target,
              help="prediction (each image's top class), label (its class subfolder: FOLDER/CLASS/IMAGE) or a "
                   "class index.")
@click.option("--batch-size", type=click.IntRange(min=1), default=32, help="Images explained together.")
@click.option("--shard-size", type=click.IntRange(min=1), default=256, help="Images per shard file.")
@click.option("--downsample", type=click.IntRange(min=1), default=1,
              help="Store relevance summed over channels and average-pooled by this factor.")
@click.option("--overwrite", is_flag=True, help="Start afresh instead of resuming a run in --out.")
@click.option("--compile", "compiled", is_flag=True, help="Explain through one torch.compile program per batch shape.")
def explain_dataset_command(folder: str, model: str, weights: str | None, random_weights: bool, preset: str,
                            size: int, channels: int, normalize: str | None, whole: bool | None, out: Path,
                            target: int | str, batch_size: int, shard_size: int, downsample: int,
                            overwrite: bool, compiled: bool) -> None:
    """Explain the images below FOLDER into resumable shards (also under torchrun).

    Images are taken in sorted path order; files.json lists them (sample id = position).
    A file whose header cannot be read is skipped with a warning before the run; an
    image that fails to decode later stops the run with its name (finished shards are
    kept). A rerun into the same --out resumes, skipping finished shards.
    """
    importlib.import_module("safetensors")  # shards need it: fail before any work, naming the extra
    dataset = _ImageFolder(folder, size, normalize, channels, whole)
    if target == "label" and dataset.labels is None:
        raise CommandError(f"--target label needs every image in a class subfolder (FOLDER/CLASS/IMAGE); {folder} "
                           "has images directly in it")
    network = load_model(model, weights, random_weights)
    from relprop.workflows.dataset import RunMismatch, explain_dataset
    reduce = None
    if downsample > 1:
        def reduce(relevance: Tensor) -> Tensor:
            return torch.nn.functional.avg_pool2d(relevance.sum(1, keepdim=True), downsample)
    if overwrite:
        (out / "files.json").unlink(missing_ok=True)  # the old run's list must not outlive its shards
    try:
        index = explain_dataset(network, dataset, out, composite=_composite(preset, normalize, channels),
                                batch_size=batch_size, shard_size=shard_size, target=target, reduce=reduce,
                                overwrite=overwrite, compile=compiled)
    except RunMismatch as error:
        raise CommandError(f"{str(error).removeprefix('relprop: ')} (on the command line: --overwrite)") from None
    _write_json(dataset.paths, out / "files.json")
    click.echo(f"{len(dataset)} images -> {index}")


@app.command("atlas", short_help="Concept atlas of a layer: index.html and top images.",
             epilog=example("relprop atlas images/ --model resnet18 --weights resnet18.pth --layer layer4 --out atlas"))
@click.argument("folder", type=click.Path())
@model_options
@preset_option
@image_options
@out_option("atlas")
@click.option("--layer", required=True, help="Module path of the layer whose channels are the concepts.")
@click.option("--mode", type=click.Choice(["relevance", "activation"]), default="relevance", show_default=True,
              help="Reference samples by a channel's relevance (RelMax) or its activation (ActMax).")
@click.option("--top-k", type=click.IntRange(min=1), default=8, show_default=True,
              help="Reference samples kept per channel.")
@click.option("--target", default="prediction", callback=_dataset_target,
              help="prediction (each image's top class), label (its class subfolder) or a class index.")
@click.option("--batch-size", type=click.IntRange(min=1), default=32, show_default=True,
              help="Images explained together.")
@click.option("--overwrite", is_flag=True, help="Start afresh instead of resuming a run in --out.")
def atlas_command(folder: str, model: str, weights: str | None, random_weights: bool, preset: str, size: int,
                  channels: int, normalize: str | None, whole: bool | None, out: Path, layer: str, mode: str,
                  top_k: int, target: int | str, batch_size: int, overwrite: bool) -> None:
    """A concept atlas of one layer over the images below FOLDER: the top-k images of every channel.

    The reference samples are found resumably in --out/run (the fingerprinted runner of
    explain-dataset); --out/index.html lists the channels by total relevance, each with
    its top images, cropped where the channel acts, and their values.
    """
    importlib.import_module("safetensors")  # the run's shards need it: fail before any work, naming the extra
    dataset = _ImageFolder(folder, size, normalize, channels, whole)
    if target == "label" and dataset.labels is None:
        raise CommandError(f"--target label needs every image in a class subfolder (FOLDER/CLASS/IMAGE); {folder} "
                           "has images directly in it")
    network = load_model(model, weights, random_weights)
    if layer not in dict(network.named_modules()):
        raise CommandError(f"no module {layer!r} in the model; its top-level modules: "
                           f"{', '.join(name for name, _ in network.named_children())}")
    from relprop.viz.atlas import render_atlas
    from relprop.workflows.concepts import reference_samples
    from relprop.workflows.dataset import RunMismatch
    composite = _composite(preset, normalize, channels)
    try:
        reference_samples(network, dataset, layers=[layer], composite=composite, top_k=top_k, modes=(mode,),
                          target=None if target == "prediction" else target, batch_size=batch_size,
                          out=out / "run", overwrite=overwrite)
    except RunMismatch as error:
        raise CommandError(f"{str(error).removeprefix('relprop: ')} (on the command line: --overwrite)") from None
    index = render_atlas(out / "run", network, dataset, layer, out, mode=mode, composite=composite)
    click.echo(f"{len(dataset)} images -> {index}")
