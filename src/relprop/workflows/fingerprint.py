"""A run's fingerprint: what decides a dataset explanation's results (the model's weights, the composite and its
parameters, the dataset's transform, the target mode, the reduce function, the shard size and the ordered list
of samples), as digests that ``run.json`` records, and the check that a folder holds the same run
(:class:`RunMismatch` naming what differs)."""
from __future__ import annotations

import hashlib
import json
import types
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from relprop import composites

__all__ = ["RunMismatch", "check_run", "describe", "fingerprint"]


class RunMismatch(ValueError):
    """The output folder holds the files of a different run (see :func:`~relprop.explain_dataset`'s ``overwrite``)."""


#: what each part of a run's fingerprint is, for the message when it differs
_PARTS = {"kind": "the kind of run", "model": "the model (class and weights)",
          "composite": "the composite (rules and their parameters)", "transform": "the dataset's transform",
          "target": "the target mode", "reduce": "the reduce function", "shard_size": "the shard size",
          "samples": "the list of samples"}

def _digest(chunks: Iterable[bytes]) -> str:
    hasher = hashlib.sha256()
    for chunk in chunks:
        hasher.update(chunk)
    return hasher.hexdigest()[:16]


def _lines_digest(lines: list[str]) -> str:
    return _digest(line.encode() + b"\n" for line in lines)


def _tensor_bytes(tensor: Tensor) -> bytes:
    if hasattr(tensor, "full_tensor"):  # a DTensor (FSDP2): its whole value, gathered on every process
        tensor = tensor.full_tensor()
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return f"{flat.dtype}{tuple(tensor.shape)}".encode() + flat.view(torch.uint8).numpy().tobytes()


def describe(value: Any, depth: int = 0) -> str:
    """A text that changes exactly when a setting changes: tensors by hash, functions by code and captured values.

    Used for the fingerprint of a run. Objects are described by their class and attributes (``vars``) down
    to a few levels, modules (such as torchvision transforms) by their ``repr``, Python modules by name.
    """
    if isinstance(value, Tensor):
        return f"tensor(sha256:{_digest([_tensor_bytes(value)])})"
    if value is None or isinstance(value, (str, int, float, bool, complex)):
        return repr(value)
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}"
    if isinstance(value, (type, types.BuiltinFunctionType)):  # a class; torch.matmul, whose repr holds an address
        return f"{value.__module__}.{value.__qualname__}"
    if depth > 4:
        return type(value).__qualname__
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return "[" + ", ".join(describe(item, depth + 1) for item in items) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{key!s}: {describe(item, depth + 1)}"
                               for key, item in sorted(value.items(), key=lambda pair: str(pair[0]))) + "}"
    if isinstance(value, nn.Module):
        return repr(value)
    if isinstance(value, types.MethodType):
        return f"{describe(value.__func__, depth)} of {describe(value.__self__, depth + 1)}"
    if isinstance(value, types.FunctionType):  # its code, constants and the values it captured
        captured = [cell.cell_contents for cell in (value.__closure__ or ())]
        return (f"{value.__qualname__}(code sha256:{_digest(_code_bytes(value.__code__))}, "
                f"captured {describe(captured, depth + 1)})")
    if hasattr(value, "__dict__"):
        return f"{type(value).__qualname__}({describe(vars(value), depth + 1)})"
    return repr(value)


def _code_bytes(code: types.CodeType) -> Iterator[bytes]:
    """The bytecode and constants of a function, nested functions included (their repr holds an address)."""
    yield code.co_code
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _code_bytes(constant)
        else:
            yield repr(constant).encode()


def _model_hash(model: nn.Module) -> str:
    def chunks() -> Iterator[bytes]:
        yield type(model).__qualname__.encode()
        for name, tensor in model.state_dict().items():
            yield name.encode()
            yield _tensor_bytes(tensor)
    return f"{type(model).__qualname__}, state_dict sha256:{_digest(chunks())}"


def _samples(dataset: Any, sample_ids: Sequence | None) -> str:
    """The identity of the ordered list of samples: ids given, file paths, or a hash of a few samples."""
    count = len(dataset)
    if sample_ids is not None:
        names = [str(item) for item in sample_ids]
        if len(names) != count:
            raise ValueError(f"relprop: sample_ids has {len(names)} entries for a dataset of {count} samples")
        return f"{count} samples, sample_ids sha256:{_lines_digest(names)}"
    for attribute in ("paths", "samples", "imgs", "files"):  # folder datasets (relprop's CLI, torchvision)
        found = getattr(dataset, attribute, None)
        if isinstance(found, (list, tuple)) and found and len(found) == count:
            names = [str(item[0] if isinstance(item, (tuple, list)) else item) for item in found]
            return f"{count} samples, {attribute} sha256:{_lines_digest(names)}"
    picked = sorted({round(i * (count - 1) / 7) for i in range(8)}) if count else []
    return f"{count} samples, items {picked} sha256:{_digest(describe(dataset[i]).encode() for i in picked)}"


def fingerprint(model: nn.Module, dataset: Any, composite: Any, target: Any, sample_ids: Sequence | None = None,
                **settings: Any) -> dict[str, str]:
    """The fingerprint of a dataset run: one text per part (see the module docstring); ``settings`` add parts."""
    built = composites.get(composite)  # named as written, and a digest of all in it (rules, maps, tensors)
    named = f"{composite!r} = {built!r}" if isinstance(composite, str) else repr(built)
    parts = {"model": _model_hash(model), "composite": f"{named}{_SETTINGS}{_digest([describe(built).encode()])}",
             "transform": describe(getattr(dataset, "transform", None)), "target": describe(target),
             "samples": _samples(dataset, sample_ids)}
    parts.update({name: describe(value) for name, value in settings.items()})
    return parts


_SETTINGS = "; settings sha256:"  # between a composite's name and the digest of all its settings


def _short(text: str | None) -> str:
    return "absent" if text is None else (text if len(text) <= 60 else text[:57] + "...")


def _difference(name: str, before: str | None, now: str | None) -> str:
    """One part that differs, as the message shows it: composites by their names, the rest shortened."""
    if name != "composite" or before is None or now is None or _SETTINGS not in now:
        return f"{_PARTS.get(name, name)} (was {_short(before)}, now {_short(now)})"
    old, new = before.partition(_SETTINGS)[0], now.partition(_SETTINGS)[0]
    if old == new:
        return f"{_PARTS[name]} ({new}, with other rules or parameters inside than before)"
    return f"{_PARTS[name]} (was {old if _SETTINGS in before else _short(old)}, now {new})"


def check_run(out: Path, parts: dict[str, str]) -> None:
    """Raise RunMismatch if ``out`` holds files of a run with another fingerprint."""
    record = out / "run.json"
    if not record.exists():
        if any(out.glob("shard-*.safetensors")):
            raise RunMismatch(f"relprop: {out} holds shards but no run.json (a run of an older relprop?); "
                              "pass overwrite=True to start afresh")
        return
    try:
        before = json.loads(record.read_text())["fingerprint"]
    except (ValueError, KeyError, TypeError) as error:
        raise RunMismatch(f"relprop: {record} is not a run record ({error}); pass overwrite=True to start afresh")
    differ = [name for name in {**before, **parts} if before.get(name) != parts.get(name)]
    if differ:
        what = "; ".join(_difference(name, before.get(name), parts.get(name)) for name in differ)
        raise RunMismatch(f"relprop: {out} holds a different run: {what}; pass overwrite=True to start afresh, "
                          "or use another folder")
