"""Explaining whole datasets: batched, sharded to files, resumable, on one or many processes.

Samples are cut into shards of ``shard_size`` consecutive sample ids; shard
``k`` holds samples ``k * shard_size ... (k + 1) * shard_size - 1`` and is
explained by process ``k % world_size``. A shard is one safetensors file
(``shard-000012.safetensors``: relevance, sample ids, targets, predictions,
relevance totals), written to a temporary name and renamed, so a crash never
leaves a truncated file under a shard's name. A run that finds a shard's file
skips it: an interrupted run restarts where it stopped, with any number of
processes. At the end, process 0 writes ``index.jsonl`` with one line per
sample: id, shard, row, target, prediction, relevance total.

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
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .attribution import LRP, target_mask

__all__ = ["explain_dataset", "load_shard", "read_index"]


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
        for module in training:
            module.training = True


def _sample(dataset: Any, index: int) -> tuple[Tensor, int | None]:
    item = dataset[index]
    if isinstance(item, (tuple, list)):
        return item[0], (int(item[1]) if len(item) > 1 else None)
    return item, None


def _save_atomically(tensors: dict[str, Tensor], metadata: dict[str, str], path: Path) -> None:
    from safetensors.torch import save_file

    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file({key: value.contiguous().cpu() for key, value in tensors.items()}, str(temporary), metadata)
    os.replace(temporary, path)  # atomic on POSIX: the shard is complete, or absent


def load_shard(path: str | Path) -> dict[str, Tensor]:
    """The tensors of one shard: ``relevance``, ``ids``, ``target``, ``prediction``, ``total``."""
    from safetensors.torch import load_file

    return load_file(str(path))


def read_index(out: str | Path) -> list[dict]:
    """The lines of ``index.jsonl``: one dict per sample."""
    with open(Path(out) / "index.jsonl") as handle:
        return [json.loads(line) for line in handle]


def explain_dataset(model: nn.Module, dataset: Any, out: str | Path, composite=None, batch_size: int = 32,
                    shard_size: int = 256, target: str | int = "prediction",
                    reduce: Callable[[Tensor], Tensor] | None = None, progress: bool = True) -> Path:
    """Explain every sample of ``dataset`` and write the relevance to sharded files under ``out``.

    Parameters
    ----------
    model : nn.Module
        Explained in eval mode (its training flags are restored at the end). Also
        wrapped in ``DistributedDataParallel`` or sharded with FSDP2's ``fully_shard``:
        the full parameters are then gathered once and every process explains its
        samples on its own (see the module docstring for memory).
    dataset : map-style dataset or DataLoader
        Items are inputs or ``(input, label, ...)``; of a DataLoader its dataset is used.
    out : folder
    composite :
        As for :class:`relprop.LRP`.
    batch_size, shard_size : int
        Samples per attribution and per file (a multiple of ``batch_size`` works best).
    target : ``"prediction"``, ``"label"`` or a class index
    reduce : callable, optional
        Applied to each batch of relevance before it is stored (downsampling,
        per-channel totals, top-k tokens), to keep storage small.
    progress : bool
        A progress bar with throughput on process 0.

    Returns
    -------
    Path of ``index.jsonl``.
    """
    if isinstance(dataset, torch.utils.data.DataLoader):
        dataset = dataset.dataset
    rank, world = _distributed()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    total = len(dataset)
    todo = [k for k in range(rank, -(-total // shard_size), world) if not (out / _shard_name(k)).exists()]
    bar = None
    if progress and rank == 0:
        from tqdm.auto import tqdm
        bar = tqdm(total=sum(min(shard_size, total - k * shard_size) for k in todo) * world, unit="sample",
                   desc=f"explaining ({world} process{'es' if world > 1 else ''})")
    with _local(model) as local:
        lrp = LRP(local, composite)
        device = next(local.parameters(), torch.empty(0)).device
        for shard in todo:
            ids = range(shard * shard_size, min((shard + 1) * shard_size, total))
            parts: dict[str, list[Tensor]] = {key: [] for key in ("relevance", "ids", "target", "prediction", "total")}
            for start in range(0, len(ids), batch_size):
                batch = _explain_batch(lrp, dataset, ids[start:start + batch_size], device, target, reduce)
                for key, value in batch.items():
                    parts[key].append(value)
                if bar is not None:
                    bar.update(len(batch["ids"]) * world)
            _save_atomically({key: torch.cat(value) for key, value in parts.items()},
                             {"shard": str(shard), "shard_size": str(shard_size)}, out / _shard_name(shard))
    if bar is not None:
        bar.close()
    _barrier()
    index = out / "index.jsonl"
    if rank == 0:
        _write_index(out, -(-total // shard_size), index)
    _barrier()
    return index


def _explain_batch(lrp: LRP, dataset: Any, ids: range, device: torch.device, target: str | int,
                   reduce: Callable[[Tensor], Tensor] | None) -> dict[str, Tensor]:
    """One batch of samples explained: the tensors a shard stores for them."""
    inputs, labels = zip(*(_sample(dataset, i) for i in ids))
    explained = lrp.forward(torch.stack(inputs).to(device))
    prediction = explained.logits.detach().argmax(1)
    chosen = _targets(target, prediction, labels)
    seed = torch.where(target_mask(explained.logits, chosen), explained.logits.detach(), 0.0)
    (relevance,) = explained.relevance(seed)
    return {"relevance": reduce(relevance) if reduce is not None else relevance, "ids": torch.tensor(list(ids)),
            "target": torch.tensor(chosen), "prediction": prediction.cpu(),
            "total": relevance.reshape(len(ids), -1).sum(1).cpu()}


def _shard_name(shard: int) -> str:
    return f"shard-{shard:06d}.safetensors"


def _targets(target: str | int, prediction: Tensor, labels: tuple) -> list[int]:
    if target == "prediction":
        return prediction.tolist()
    if target == "label":
        if any(label is None for label in labels):
            raise ValueError("relprop: target='label' needs a dataset of (input, label) pairs")
        return list(labels)
    if isinstance(target, int):
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

