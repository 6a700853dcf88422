"""The concept atlas: for each channel of a layer, the dataset samples where it is most relevant or most active.

Concept Relevance Propagation (Achtibat et al., "From attribution maps to
human-understandable explanations through Concept Relevance Propagation",
Nature Machine Intelligence 2023) calls a channel of a layer a *concept* and
finds its reference samples by *relevance maximisation* (the samples whose
explanation gives the channel the most relevance) and *activation
maximisation* (the samples that activate it most).

:func:`reference_samples` does both for several layers in one attribution
pass per batch: taps on all the layers record their activations in the
forward pass and their relevance in one backward pass, which stops below the
deepest tapped layer. Per sample and channel it keeps

- ``"relevance"``: the sum of the channel's relevance map for the sample's
  target, and where in the map the relevance is largest;
- ``"activation"``: the maximum of the channel's activation map, and where
  it sits.

It runs on the sharded, resumable, fingerprinted runner of
:func:`relprop.explain_dataset` (same folder layout, ``torchrun`` over
processes): each shard stores its own top-k per channel, and the shards are
merged exactly. Samples are ranked by value, ties broken by the lower sample
id, in every shard and in the merge, so the result is the same for any number
of processes and after any interruption.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from relprop.methods.attribution import LRP
from relprop.methods.layer import Tapper, backward_to_taps, resolve_module
from relprop.methods.targets import output_relevance
from relprop.workflows.dataset import (
    _local,
    _run_shards,
    _save_atomically,
    _shard_name,
    _targets,
    batch_inputs,
    fingerprint,
    load_shard,
)

__all__ = ["MODES", "TopSamples", "reference_samples", "load_reference_samples"]

#: what a channel is ranked by: its relevance (the sum of its map) or its activation (the maximum of its map)
MODES = ("relevance", "activation")
_FIELDS = ("ids", "values", "positions", "targets")


@dataclass(frozen=True)
class TopSamples:
    """The top-k reference samples of every channel of one layer, in one mode.

    Attributes
    ----------
    ids : Tensor (channels, k), int64
        Sample indices into the dataset, best first (ties: lower id first).
    values : Tensor (channels, k)
        The channel's relevance (sum of its map) or activation (maximum of its map) on each sample.
    positions : Tensor (channels, k), int64
        Flat index into the channel's map (of shape ``map_shape``) where its relevance or activation
        is largest; 0 for a layer without spatial dimensions.
    targets : Tensor (channels, k), int64
        The class explained on each sample (its prediction, label or the fixed class).
    totals : Tensor (channels,), float64
        The values summed over the whole dataset: a channel's total relevance, or its summed maxima.
    map_shape : tuple of int
        The shape of one channel's map (``(H, W)`` for a convolution, ``()`` for a dense layer).
    """

    ids: Tensor
    values: Tensor
    positions: Tensor
    targets: Tensor
    totals: Tensor
    map_shape: tuple[int, ...]

    def position(self, channel: int, rank: int) -> tuple[int, ...]:
        """The index in the channel's map of the maximum on its ``rank``-th reference sample."""
        flat = int(self.positions[channel, rank])
        return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), self.map_shape)) if self.map_shape else ()


Result = dict[str, dict[str, TopSamples]]


def _select(ids: Tensor, columns: dict[str, Tensor], k: int) -> tuple[Tensor, dict[str, Tensor]]:
    """Per row (channel), the ``k`` best entries: highest value first, equal values by lower sample id."""
    by_id = ids.argsort(dim=1, stable=True)
    ids = ids.gather(1, by_id)
    columns = {name: column.gather(1, by_id) for name, column in columns.items()}
    best = columns["values"].argsort(dim=1, descending=True, stable=True)[:, :k]
    return ids.gather(1, best), {name: column.gather(1, best) for name, column in columns.items()}


def _layer_values(record: Any, modes: Sequence[str]) -> tuple[dict[str, tuple[Tensor, Tensor]], tuple[int, ...]]:
    """Per mode, the (N, C) values and positions of one tapped layer; and the shape of one channel's map."""
    activation = record.below.detach()
    batch, channels = activation.shape[:2]
    found = {}
    for mode in modes:
        if mode == "relevance":
            maps = record.value().reshape(batch, channels, -1)
            found[mode] = (maps.sum(2), maps.argmax(2))
        else:
            maximum = activation.reshape(batch, channels, -1).max(2)
            found[mode] = (maximum.values, maximum.indices)
    return found, tuple(activation.shape[2:])


class _Pass:
    """One attribution pass per batch with taps on every layer: activations and relevance per channel."""

    def __init__(self, model: nn.Module, names: Sequence[str], composite: Any, modes: Sequence[str],
                 target: int | str | None):
        self.lrp = LRP(model, composite)
        self.names = list(names)
        self.modules = [resolve_module(model, name) for name in self.names]
        self.modes = list(modes)
        self.target = target
        self.device = next(model.parameters(), torch.empty(0)).device

    def batch(self, dataset: Any, ids: range) -> tuple[dict[str, dict[str, tuple[Tensor, Tensor]]], Tensor,
                                                        dict[str, tuple[int, ...]]]:
        """Per layer and mode the (N, C) values and positions; the targets; the channel map shapes."""
        inputs, labels = batch_inputs(dataset, ids, self.device)
        tappers = [Tapper(input=False) for _ in self.modules]
        with torch.inference_mode(False):
            explained = self.lrp.record(inputs, taps=dict(zip(self.modules, tappers)), reusable=False)
            targets = _targets(self.target, explained.logits.detach().argmax(1), labels)
            for name, tapper in zip(self.names, tappers):
                if len(tapper.calls) != 1 or len(tapper.records()) != 1:
                    raise ValueError(f"relprop: layer {name!r} must output one tensor once per forward pass; it "
                                     f"ran {len(tapper.calls)} times with {len(tapper.records())} tensor outputs")
            if "relevance" in self.modes:
                logits = explained.logits
                backward_to_taps(logits, output_relevance(logits, targets), tappers)
        values, shapes = {}, {}
        for name, tapper in zip(self.names, tappers):
            values[name], shapes[name] = _layer_values(tapper.records()[0], self.modes)
            for mode, (value, _) in values[name].items():
                if not torch.isfinite(value).all():
                    raise ValueError(f"relprop: non-finite {mode} at layer {name!r} for samples {list(ids)}")
        return values, torch.tensor(targets), shapes

    def shard(self, dataset: Any, ids: range, batch_size: int, top_k: int,
              tick: Callable[[int], None]) -> dict[str, Tensor]:
        """The top-k per channel among samples ``ids`` and the per-channel totals, as a shard's tensors."""
        parts: list[tuple[dict, Tensor]] = []
        shapes: dict[str, tuple[int, ...]] = {}
        for start in range(0, len(ids), batch_size):
            values, targets, shapes = self.batch(dataset, ids[start:start + batch_size])
            parts.append((values, targets))
            tick(len(targets))
        targets = torch.cat([part[1] for part in parts])
        sample_ids = torch.tensor(list(ids), dtype=torch.long)
        tensors = {}
        for name in self.names:
            tensors[f"{name}|shape"] = torch.tensor(shapes[name], dtype=torch.long)
            for mode in self.modes:
                scores = torch.cat([part[0][name][mode][0] for part in parts]).T  # (C, n)
                positions = torch.cat([part[0][name][mode][1] for part in parts]).T
                channels = scores.shape[0]
                top_ids, top = _select(sample_ids.expand(channels, -1),
                                       {"values": scores, "positions": positions,
                                        "targets": targets.expand(channels, -1)}, top_k)
                tensors.update({f"{name}|{mode}|{field}": column for field, column in top.items()})
                tensors[f"{name}|{mode}|ids"] = top_ids
                tensors[f"{name}|{mode}|totals"] = scores.double().sum(1)
        return {key: value.cpu() for key, value in tensors.items()}


def _merge(shards: Sequence[Mapping[str, Tensor]], names: Sequence[str], modes: Sequence[str], top_k: int) -> Result:
    """The exact top-k over all shards (in shard order, so that the totals add up in the same order)."""
    result: Result = {}
    for name in names:
        shape = tuple(int(size) for size in shards[0][f"{name}|shape"].tolist())
        result[name] = {}
        for mode in modes:
            key = f"{name}|{mode}|"
            ids, top = _select(torch.cat([shard[key + "ids"] for shard in shards], 1),
                               {field: torch.cat([shard[key + field] for shard in shards], 1)
                                for field in _FIELDS[1:]}, top_k)
            totals = torch.zeros_like(shards[0][key + "totals"])
            for shard in shards:
                totals = totals + shard[key + "totals"]
            result[name][mode] = TopSamples(ids, top["values"], top["positions"], top["targets"], totals, shape)
    return result


def _check_arguments(layers: Sequence[str], top_k: int, modes: Sequence[str], target: Any,
                     batch_size: int) -> None:
    if not layers or not all(isinstance(name, str) for name in layers):
        raise ValueError(f"relprop: layers must be one or more dotted module names, got {layers!r}")
    if not modes or any(mode not in MODES for mode in modes):
        raise ValueError(f"relprop: modes must be some of {MODES}, got {tuple(modes)!r}")
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"relprop: top_k must be a positive int, got {top_k!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"relprop: batch_size must be a positive int, got {batch_size!r}")
    _targets(target, torch.zeros(0, dtype=torch.long), ())  # a bad target fails before any work


def reference_samples(model: nn.Module, dataset: Any, layers: str | Sequence[str] = ("layer3", "layer4"),
                      composite: Any = "epsilon-plus-flat", top_k: int = 16, modes: Sequence[str] = MODES,
                      target: int | str | None = None, batch_size: int = 64, out: str | Path | None = None,
                      shard_size: int = 1024, overwrite: bool = False, progress: bool = False,
                      sample_ids: Sequence | None = None) -> Result:
    """The top-k reference samples of every channel of ``layers``, by relevance and by activation.

    Parameters
    ----------
    model : nn.Module
        Explained in eval mode; DDP and FSDP2 models as in :func:`relprop.explain_dataset`.
    dataset : map-style dataset or DataLoader
        Items are input tensors or ``(input, label, ...)`` tuples.
    layers : dotted module name or list of them
        Each must output one tensor, once per forward pass; channels along dimension 1. As with
        :class:`relprop.LayerLRP`, the relevance of a convolution or dense layer that a BatchNorm
        follows is taken at the BatchNorm's output (merged), its activation at the layer's own output;
        name the BatchNorm (or the block) to rank both on the same tensor.
    composite :
        As for :class:`relprop.LRP`.
    top_k : int
    modes : some of ``("relevance", "activation")``
        Activation alone needs no backward pass.
    target : None, int or ``"label"``
        The class whose relevance is propagated: each sample's prediction (None), a fixed class, or
        each item's label.
    batch_size : int
    out : folder, optional
        Run sharded and resumable into this folder (as :func:`relprop.explain_dataset`: ``run.json``,
        ``shard-*.safetensors``, here each holding its samples' top-k per channel, and the merged
        ``concepts.safetensors``, read back by :func:`load_reference_samples`); under ``torchrun``
        the processes share the shards. Without it the run is in memory, on this process alone.
    shard_size, overwrite, progress, sample_ids :
        As for :func:`relprop.explain_dataset`.

    Returns
    -------
    dict: ``result[layer][mode]`` is a :class:`TopSamples`.
    """
    names = [layers] if isinstance(layers, str) else list(layers)
    modes = list(dict.fromkeys(modes))
    _check_arguments(names, top_k, modes, target, batch_size)
    if isinstance(dataset, torch.utils.data.DataLoader):
        dataset = dataset.dataset
    count = len(dataset)
    if count == 0:
        raise ValueError("relprop: the dataset is empty")
    shards = -(-count // shard_size)
    with _local(model) as local:
        runner = _Pass(local, names, composite, modes, target)

        def work(ids: range, tick: Callable[[int], None]) -> dict[str, Tensor]:
            return runner.shard(dataset, ids, batch_size, top_k, tick)

        if out is None:
            parts = [work(range(k * shard_size, min((k + 1) * shard_size, count)), lambda n: None)
                     for k in range(shards)]
            return _merge(parts, names, modes, top_k)
        out = Path(out)
        settings = fingerprint(local, dataset, composite, target, sample_ids, kind="concepts", layers=names,
                               modes=modes, top_k=top_k, batch_size=batch_size, shard_size=shard_size)
        rank, _ = _run_shards(out, settings, count, shard_size, overwrite, work, progress, "concept atlas")
    result = _merge([load_shard(out / _shard_name(k)) for k in range(shards)], names, modes, top_k)
    if rank == 0:
        _save_result(result, out / "concepts.safetensors")
    return result


def _save_result(result: Result, path: Path) -> None:
    tensors = {f"{name}|{mode}|{field}": getattr(top, field) for name, by_mode in result.items()
               for mode, top in by_mode.items() for field in (*_FIELDS, "totals")}
    shapes = {name: list(next(iter(by_mode.values())).map_shape) for name, by_mode in result.items()}
    modes = {name: list(by_mode) for name, by_mode in result.items()}
    _save_atomically(tensors, {"shapes": json.dumps(shapes), "modes": json.dumps(modes)}, path)


def load_reference_samples(out: str | Path) -> Result:
    """The result of a finished :func:`reference_samples` run, read from its folder."""
    from safetensors import safe_open

    path = Path(out) / "concepts.safetensors"
    if not path.is_file():
        raise ValueError(f"relprop: {out} holds no finished concept run (no concepts.safetensors)")
    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata() or {}
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 (safe_open is no dict)
    shapes, modes = json.loads(metadata["shapes"]), json.loads(metadata["modes"])

    def top(name: str, mode: str) -> TopSamples:
        key = f"{name}|{mode}|"
        return TopSamples(ids=tensors[key + "ids"], values=tensors[key + "values"],
                          positions=tensors[key + "positions"], targets=tensors[key + "targets"],
                          totals=tensors[key + "totals"], map_shape=tuple(shapes[name]))

    return {name: {mode: top(name, mode) for mode in modes[name]} for name in shapes}

