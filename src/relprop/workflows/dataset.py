"""Explaining whole datasets: batched, sharded to files, resumable, on one or many processes.

Samples are cut into shards of ``shard_size`` consecutive sample ids; shard
``k`` holds samples ``k * shard_size ... (k + 1) * shard_size - 1`` and is
explained by process ``k % world_size``. A shard is one safetensors file
(``shard-000012.safetensors``: relevance, sample ids, targets, predictions,
relevance totals), written to a temporary name and renamed, so a crash never
leaves a truncated file under a shard's name. A run that finds a shard's file
skips it (and says how many it skipped): an interrupted run restarts where it
stopped, with any number of processes. At the end, process 0 writes
``index.jsonl`` with one line per sample: id, shard, row, target, prediction,
relevance total.

A run never reuses shards of another run: ``run.json`` records its
fingerprint (a hash of the model's weights, the composite and its
parameters, the dataset's ``transform``, the target mode, the ``reduce``
function, the shard size and the exact ordered list of samples). Resuming
into a folder with a different fingerprint raises :class:`RunMismatch`
naming what differs; ``overwrite=True`` removes the old run's files first.

Under ``torchrun`` every process takes its shards; the process group (gloo on
CPU, NCCL on GPU) is set up from torchrun's environment if the caller has
not done so. A single process needs no distributed set-up at all.

Models wrapped in ``DistributedDataParallel`` are unwrapped. Models sharded
with FSDP2 (``torch.distributed.fsdp.fully_shard``) have their parameters
gathered once at the start and kept whole on every process for the run, so
that processes never wait for each other: the whole model (and one batch's
activations) must fit on one device. The older ``FullyShardedDataParallel``
wrapper (FSDP1) is refused with an error: it cannot be run on CPU, so it is
untested here.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from relprop.methods.attribution import LRP
from relprop.methods.protocol import cyclic_gc_paused
from relprop.methods.targets import output_relevance
from relprop.workflows.fingerprint import RunMismatch, check_run, describe, fingerprint

__all__ = ["explain_dataset", "explain_batch", "load_shard", "read_index", "RunMismatch", "fingerprint", "describe"]

_log = logging.getLogger("relprop")


def _distributed() -> tuple[int, int]:
    """This process's rank and the world size; joins torchrun's process group if there is one."""
    import torch.distributed as dist

    if not dist.is_available():
        return 0, 1
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


@contextmanager
def _local(model: nn.Module) -> Iterator[nn.Module]:
    """The model with full parameters on this process, so each process explains its own samples alone.

    ``DistributedDataParallel`` holds the whole module: it is unwrapped. A model
    sharded with FSDP2 (``fully_shard``) gets its parameters gathered once,
    collectively, and kept gathered for the whole run with FSDP's resharding and
    gradient reduction switched off. Otherwise every forward would be a collective
    call, and processes with different numbers of batches (a resumed run, a last
    short shard) would wait for each other forever. FSDP's settings and sharding
    are restored at the end, also when an exception flies.
    """
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # a build without distributed support
        yield model
        return
    if isinstance(model, FullyShardedDataParallel):
        raise TypeError("relprop: FullyShardedDataParallel (FSDP1) is not supported; shard the model with "
                        "torch.distributed.fsdp.fully_shard (FSDP2) instead")
    sharded = [module for module in model.modules() if isinstance(module, FSDPModule)]
    groups = [group for group in (module._get_fsdp_state()._fsdp_param_group for module in sharded) if group]
    # FSDP2 keeps these per parameter group and has setters but no getters: save them to restore exactly.
    saved = [(group.post_forward_mesh_info, group.reshard_after_backward, group.reduce_grads) for group in groups]
    training = [module for module in model.modules() if module.training]
    try:
        model.eval()
        for module in sharded:
            module.unshard()
            module.set_reshard_after_forward(False, recurse=False)
            module.set_reshard_after_backward(False, recurse=False)
            module.set_requires_gradient_sync(False, recurse=False)
        yield model
    finally:
        for group, (forward, backward, reduce) in zip(groups, saved):
            group.post_forward_mesh_info, group.reshard_after_backward, group.reduce_grads = forward, backward, reduce
        for module in sharded:
            module.reshard()
        for flagged in training:
            flagged.training = True


#: the files a run writes into its folder; ``overwrite=True`` removes these and nothing else
_RUN_FILES = ("run.json", "index.jsonl", "concepts.safetensors", "shard-*.safetensors", ".*.tmp")


def _claim(out: Path, parts: dict[str, str], overwrite: bool, rank: int, shards: int) -> int:
    """Check (every process), then make ``out`` this run's folder (process 0); the shards already done there."""
    if not overwrite:
        check_run(out, parts)
    _barrier()  # every process has read the old record before process 0 replaces it
    done = 0
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if overwrite:
            for pattern in _RUN_FILES:
                for path in out.glob(pattern):
                    path.unlink()
        temporary = out / f".run.json.{os.getpid()}.tmp"
        temporary.write_text(json.dumps({"fingerprint": parts}, indent=1) + "\n")
        os.replace(temporary, out / "run.json")
        done = sum((out / _shard_name(k)).exists() for k in range(shards))
    _barrier()  # no process looks for finished shards before the folder is claimed
    return done


Work = Callable[[range, Callable[[int], None]], dict[str, Tensor]]


def _run_shards(out: Path, parts: dict[str, str], count: int, shard_size: int, overwrite: bool,
                work: Work, progress: bool, verb: str) -> tuple[int, int]:
    """The sharded, resumable, fingerprinted loop: ``work(ids, tick)`` gives each shard's tensors.

    Returns this process's rank and the world size, after every process has written its shards.
    """
    if shard_size < 1:
        raise ValueError(f"relprop: shard_size must be at least 1, got {shard_size}")
    rank, world = _distributed()
    shards = -(-count // shard_size)
    done = _claim(out, parts, overwrite, rank, shards)
    complete = done == shards
    if done and rank == 0:
        message = (f"relprop: {out} holds this run complete ({done} of {shards} shards done): nothing left to do"
                   if complete else f"relprop: resuming in {out}: {done} of {shards} shards already done, skipped")
        _log.info(message)
        if progress:
            print(message, file=sys.stderr)
    todo = [k for k in range(rank, shards, world) if not (out / _shard_name(k)).exists()]
    bar = None
    if progress and rank == 0 and not complete:  # a finished run shows its line above, not an empty bar
        from tqdm.auto import tqdm
        bar = tqdm(total=sum(min(shard_size, count - k * shard_size) for k in todo) * world, unit="sample",
                   desc=f"{verb} ({world} process{'es' if world > 1 else ''})")

    def tick(samples: int) -> None:
        if bar is not None:
            bar.update(samples * world)

    try:
        for shard in todo:
            tensors = work(range(shard * shard_size, min((shard + 1) * shard_size, count)), tick)
            _save_atomically(tensors, {"shard": str(shard), "shard_size": str(shard_size)}, out / _shard_name(shard))
    finally:
        if bar is not None:
            bar.close()
    _barrier()
    return rank, world


def _sample(dataset: Any, index: int) -> tuple[Tensor, Any]:
    """An item's input and its label (None for a bare tensor); the label is converted only when used."""
    item = dataset[index]
    if isinstance(item, (tuple, list)):
        return item[0], (item[1] if len(item) > 1 else None)
    return item, None


def _save_atomically(tensors: dict[str, Tensor], metadata: dict[str, str], path: Path) -> None:
    from safetensors.torch import save

    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    # written as bytes, so that the shard gets the usual permissions (safetensors' save_file makes files 0600)
    temporary.write_bytes(save({key: value.contiguous().cpu() for key, value in tensors.items()}, metadata))
    os.replace(temporary, path)  # atomic on POSIX: the shard is complete, or absent


def load_shard(path: str | Path) -> dict[str, Tensor]:
    """The tensors of one shard: ``relevance``, ``ids``, ``target``, ``prediction``, ``total``."""
    from safetensors.torch import load_file

    return load_file(str(path))


def read_index(out: str | Path) -> list[dict]:
    """The lines of ``index.jsonl``: one dict per sample."""
    with open(Path(out) / "index.jsonl") as handle:
        return [json.loads(line) for line in handle]


def explain_dataset(model: nn.Module, dataset: Any, out: str | Path, composite: Any = None, batch_size: int = 32,
                    shard_size: int = 256, target: str | int = "prediction",
                    reduce: Callable[[Tensor], Tensor] | None = None, progress: bool = True,
                    overwrite: bool = False, sample_ids: Sequence | None = None, compile: bool | str = False) -> Path:
    """Explain every sample of ``dataset`` and write the relevance to sharded files under ``out``.

    Parameters
    ----------
    model : nn.Module
        Explained in eval mode (its training flags are restored at the end). Also
        wrapped in ``DistributedDataParallel`` or sharded with FSDP2's ``fully_shard``:
        the full parameters are then gathered once and every process explains its
        samples on its own (see the module docstring for memory).
    dataset : map-style dataset or DataLoader
        Each item is an input tensor, or a tuple ``(input, label, ...)`` such as a
        ``TensorDataset(x, y)`` gives; the label is used only with
        ``target="label"``. Of a DataLoader its dataset is used.
    out : folder
    composite, compile :
        As for :class:`relprop.LRP` (``compile=True``: its compiled tier, compiled once for all batches of a shape).
    batch_size, shard_size : int
        Samples per attribution and per file (a multiple of ``batch_size`` works best).
    target : ``"prediction"``, ``"label"`` or a class index
        Explain each sample's predicted class, its label (items must be
        ``(input, label)``), or one class for all.
    reduce : callable, optional
        Applied to each batch of relevance before it is stored (downsampling,
        per-channel totals, top-k tokens), to keep storage small.
    progress : bool
        A progress bar with throughput on process 0, and a line saying how many
        shards a resumed run skipped.
    overwrite : bool
        Remove the files of an earlier run in ``out`` and start afresh. Without
        it, a folder holding a run with another fingerprint (model weights,
        composite, transform, target, reduce, shard size, samples) raises
        :class:`~relprop.workflows.dataset.RunMismatch` saying what differs, and a run with the same
        fingerprint resumes.
    sample_ids : sequence, optional
        One identity per sample (file names, database keys), in dataset order,
        for the fingerprint. By default the dataset's ``paths``, ``samples`` or
        ``imgs`` (folder datasets), else its length and a hash of eight samples.

    Returns
    -------
    Path of ``index.jsonl``.
    """
    if isinstance(dataset, torch.utils.data.DataLoader):
        dataset = dataset.dataset
    _targets(target, torch.zeros(0, dtype=torch.long), ())  # a bad target fails before any work
    out = Path(out)
    total = len(dataset)
    with _local(model) as local:
        parts = fingerprint(local, dataset, composite, target, sample_ids, kind="explain", reduce=reduce,
                            shard_size=shard_size)
        lrp = LRP(local, composite, compile=compile)
        device = next(local.parameters(), torch.empty(0)).device

        def work(ids: range, tick: Callable[[int], None]) -> dict[str, Tensor]:
            columns: dict[str, list[Tensor]] = {key: [] for key in ("relevance", "ids", "target", "prediction",
                                                                   "total")}
            for start in range(0, len(ids), batch_size):
                batch = _explain_batch(lrp, dataset, ids[start:start + batch_size], device, target, reduce)
                for key, value in batch.items():
                    columns[key].append(value)
                tick(len(batch["ids"]))
            return {key: torch.cat(value) for key, value in columns.items()}

        rank, _ = _run_shards(out, parts, total, shard_size, overwrite, work, progress, "explaining")
    index = out / "index.jsonl"
    if rank == 0:
        _write_index(out, -(-total // shard_size), index)
    _barrier()
    return index


def batch_inputs(dataset: Any, ids: Sequence[int], device: torch.device) -> tuple[Tensor, tuple]:
    """The inputs of samples ``ids`` stacked on ``device``, and their labels (None where an item has none)."""
    inputs, labels = zip(*(_sample(dataset, i) for i in ids))
    return torch.stack(inputs).to(device), labels


def explain_batch(lrp: LRP, inputs: Tensor, choose: Callable[[Tensor], list[int]]) -> tuple[Tensor, Tensor, list[int]]:
    """One batch explained from one recorded pass: its relevance, its logits, and the class explained per input.

    ``choose(logits)`` picks the classes, after the forward pass (the prediction, a label, a fixed class).
    """
    with cyclic_gc_paused():  # as LRP.attribute: the batch's op records are freed by reference counting
        explained = lrp.record(inputs, reusable=False)
        logits = explained.logits.detach()
        chosen = choose(logits)
        (relevance,) = explained.relevance(output_relevance(explained.logits, chosen))
    return relevance, logits, chosen


def _explain_batch(lrp: LRP, dataset: Any, ids: range, device: torch.device, target: str | int,
                   reduce: Callable[[Tensor], Tensor] | None) -> dict[str, Tensor]:
    """One batch of samples explained: the tensors a shard stores for them."""
    inputs, labels = batch_inputs(dataset, ids, device)
    relevance, logits, chosen = explain_batch(lrp, inputs, lambda logits: _targets(target, logits.argmax(1), labels))
    return {"relevance": reduce(relevance) if reduce is not None else relevance, "ids": torch.tensor(list(ids)),
            "target": torch.tensor(chosen), "prediction": logits.argmax(1).cpu(),
            "total": relevance.reshape(len(ids), -1).sum(1).cpu()}


def _shard_name(shard: int) -> str:
    return f"shard-{shard:06d}.safetensors"


def _targets(target: str | int | None, prediction: Tensor, labels: tuple) -> list[int]:
    """One class per sample: predicted (``"prediction"`` or None), the item's label (``"label"``), or fixed."""
    if target is None or target == "prediction":
        return prediction.tolist()
    if target == "label":
        if any(label is None for label in labels):
            raise ValueError("relprop: target='label' needs a dataset of (input, label) items")
        return [int(label) for label in labels]
    if isinstance(target, int) and not isinstance(target, bool):
        return [target] * len(prediction)
    raise ValueError(f"relprop: target must be 'prediction', 'label' or a class index, got {target!r}")


def _write_index(out: Path, shards: int, index: Path) -> None:
    lines = []
    for shard in range(shards):
        data = load_shard(out / _shard_name(shard))
        for row, (sample, target, prediction, total) in enumerate(zip(
                data["ids"].tolist(), data["target"].tolist(), data["prediction"].tolist(), data["total"].tolist())):
            lines.append(json.dumps({"id": sample, "shard": _shard_name(shard), "row": row, "target": target,
                                     "prediction": prediction, "relevance_sum": total}))
    temporary = index.with_name(f".{index.name}.{os.getpid()}.tmp")
    temporary.write_text("\n".join(lines) + "\n")
    os.replace(temporary, index)

