"""The errors and warnings relprop raises."""
from __future__ import annotations

import contextlib
import os
import re
import sys
import warnings
from types import FrameType

import torch


class RuleError(ValueError):
    """A rule was assigned to an op it cannot propagate through."""


class UnsupportedOpError(RuntimeError):
    """Relevance reached an op without a rule (raised in strict mode)."""


class UnhandledOpWarning(UserWarning):
    """Relevance reached an op without a rule; its plain gradient was used."""


class ConservationWarning(UserWarning):
    """An op's rule handed on NaN or infinite relevance, or created relevance where it should conserve it."""


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_LOCATION = re.compile(r'File "([^"]+)", line (\d+)')


def user_location(text: str) -> str | None:
    """The last ``file:line`` that a traceback or stack trace in ``text`` names outside relprop and torch: where
    the user's code did what a message is about (a Dynamo graph break, an op the compiled tier cannot write)."""
    found = [f"{path}:{line}" for path, line in _LOCATION.findall(text)
             if not os.path.abspath(path).startswith((_PACKAGE, _TORCH))]
    return found[-1] if found else None


def warn_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn ``message`` at the first line on the stack outside relprop, ``contextlib`` and Dynamo (which runs
    relprop's calls inside compiled code): the user's call, however many frames lie between it and the warning."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dynamo = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "_dynamo")
    skipped = (package + os.sep, dynamo + os.sep, os.path.abspath(contextlib.__file__))
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(skipped):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)
