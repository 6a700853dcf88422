"""Max pooling: winner-take-all unless a rule asks otherwise, with the average pooling over its windows."""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from torch import Tensor

from relprop._core.kinds import OpKind
from relprop._core.registry import Handler, op_name, register
from relprop._core.signatures import bind
from relprop.engine.calls import OpCall
from relprop.ops.host import OpHost


def _max_pool(signature: Callable, average: Callable[[dict], Callable[[Tensor], Tensor] | None]) -> Handler:
    """Max pooling: winner-take-all (the gradient) unless a rule asks otherwise.

    ``signature`` is the plain function behind ``F.max_pool2d``'s dispatch, to bind arguments by name.
    """
    def handle(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
        bound = bind(signature, args, kwargs)
        if bound.get("return_indices"):
            return func(*args, **kwargs)
        return session.run(MaxPoolCall(func, args, kwargs, session.module_name, average(bound)))
    return handle


class MaxPoolCall(OpCall):
    """Max pooling, with the average pooling over the same windows (for proportional rules; None if dilated)."""

    def __init__(self, func: Callable, args: tuple, kwargs: dict, module_name: str,
                 average: Callable[[Tensor], Tensor] | None) -> None:
        super().__init__(OpKind.MAXPOOL, func, args, kwargs, op_name(func), module_name)
        self.average = average


def _window_average(pool: Callable) -> Callable[[dict], Callable[[Tensor], Tensor] | None]:
    def make(bound: dict) -> Callable[[Tensor], Tensor] | None:
        if bound.get("dilation", 1) not in (1, (1,), (1, 1), (1, 1, 1)):
            return None  # average pooling has no dilation: rules that need the average do not apply
        stride = bound.get("stride") or bound["kernel_size"]
        return functools.partial(pool, kernel_size=bound["kernel_size"], stride=stride, padding=bound["padding"],
                                 ceil_mode=bound["ceil_mode"], count_include_pad=True)
    return make


def _adaptive_average(pool: Callable) -> Callable[[dict], Callable[[Tensor], Tensor]]:
    def make(bound: dict) -> Callable[[Tensor], Tensor]:
        return functools.partial(pool, output_size=bound["output_size"])
    return make


for _dims in (1, 2, 3):
    register(_max_pool(getattr(F, f"_max_pool{_dims}d"), _window_average(getattr(F, f"avg_pool{_dims}d"))),
              [getattr(F, f"max_pool{_dims}d")])
    register(_max_pool(getattr(F, f"_adaptive_max_pool{_dims}d"),
                        _adaptive_average(getattr(F, f"adaptive_avg_pool{_dims}d"))),
              [getattr(F, f"adaptive_max_pool{_dims}d")])
