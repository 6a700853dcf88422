"""What the compiled tier tells its user: each compilation, why it happened and what it cost.

Each line goes to the ``relprop`` logger (``logging.getLogger("relprop")``, level INFO). Where nothing is set up
to show it (no handler anywhere) and standard error is a terminal, it is printed there too, so that a first call
that compiles for a minute does not look like a hang.
"""
from __future__ import annotations

import logging
import sys
from typing import Any

import torch

__all__ = ["LOG", "say", "signature_change"]

#: the logger of the compiled tier's compilations
LOG = logging.getLogger("relprop")


def say(message: str) -> None:
    """``message`` to the ``relprop`` logger, and to a terminal where no logging is set up."""
    LOG.info(message)
    if not LOG.hasHandlers() and getattr(sys.stderr, "isatty", lambda: False)():
        print(message, file=sys.stderr, flush=True)


def _shapes(value: Any) -> list[tuple[int, ...]]:
    """The shapes in an input signature (``relprop.engine.plan.pass_signature``'s), in order."""
    if isinstance(value, torch.Size):
        return [tuple(value)]
    return [shape for item in value for shape in _shapes(item)] if isinstance(value, tuple) else []


def signature_change(old: Any, new: Any) -> str:
    """What differs between two input signatures, in words: a tensor's shape, another argument, or the flags
    (grad mode, autocast, the target's kind)."""
    for what, a, b in zip(("an input", "a further argument", "a keyword argument"), old[:3], new[:3]):
        if a == b:
            continue
        before, after = _shapes(a), _shapes(b)
        changed = [(x, y) for x, y in zip(before, after) if x != y]
        if changed and len(before) == len(after):
            x, y = changed[0]
            return f"{what} of shape {tuple(y)} (compiled for {tuple(x)})"
        return f"{what} of another kind"
    return "another grad mode, autocast or kind of target"
