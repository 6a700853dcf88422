"""Elementwise nonlinearities: the identity rule by default, outputs tagged for the products they gate."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from torch import Tensor

from relprop._core.kinds import OpKind
from relprop._core.registry import Handler, lookup, register, torch_and_tensor
from relprop.ops.host import OpHost
from relprop.ops.inplace import _in_place, _with_inplace_flag


def _elementwise(tag: str | None = None) -> Handler:
    """Elementwise nonlinearities: identity rule by default.

    ``tag`` marks what the output is, for products it later takes part in:
    ``"sigmoid"`` (a gate), ``"activation"`` (gated MLPs: a gate for CP-LRP)
    or ``"statistic"`` (``rsqrt`` of a variance: a constant scaling).
    """
    def handle(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
        call = session.record(OpKind.ELEMENTWISE, func, args, kwargs)
        if len(call.inputs) != 1:
            return session.unknown(func, args, kwargs)
        out = session.run(call)
        if tag is not None:
            session.aliases.set_tag(out, tag)
        return out
    setattr(handle, "tag", tag)  # read by the in-place forms (ops.inplace)
    return handle


#: elementwise ops whose in-place form ``name_`` (``torch`` and ``Tensor``) passes relevance as ``name`` does
#: (``sigmoid_`` and ``exp_`` too, with their tags)
IN_PLACE_NAMES = ("relu", "sqrt", "rsqrt", "abs", "neg", "reciprocal", "pow", "clamp", "clip", "tanh")
#: activations of ``torch.nn.functional`` with an in-place form ``name_``
IN_PLACE_ACTIVATIONS = (F.relu, F.elu, F.leaky_relu, F.hardtanh)
#: activations of ``torch.nn.functional`` with an ``inplace=`` argument (``F.hardsigmoid`` too, a gate)
INPLACE_FLAG_ACTIVATIONS = ("relu", "relu6", "hardtanh", "leaky_relu", "elu", "selu", "celu", "silu", "mish",
                            "hardswish", "rrelu", "threshold")

_elementwise_pass = _elementwise()
_activation = _elementwise("activation")
register(_elementwise_pass, torch_and_tensor("expm1 log log1p log2 sqrt abs neg negative square reciprocal pow "
                                                "clamp clip sin cos erf"),
          lookup(Tensor, "__neg__ __pow__ __abs__"), lookup(F, "normalize"))
register(_activation, torch_and_tensor("relu tanh"),
          lookup(F, "gelu softplus logsigmoid softsign tanhshrink prelu tanh"))
register(_with_inplace_flag(_activation), lookup(F, " ".join(INPLACE_FLAG_ACTIVATIONS)))
register(_elementwise("statistic"), torch_and_tensor("rsqrt"))
# an exponential multiplying a signal weighs it (RWKV's stabilised exp-weighted average, a state space model's
# decay exp(A dt)): relevance carried through exp into a log-domain argument has no reference point
register(_elementwise("exp"), torch_and_tensor("exp exp2"))
register(_in_place(Tensor.exp, _elementwise("exp"), keeps_input=False), torch_and_tensor("exp_"))
register(_elementwise("sigmoid"), torch_and_tensor("sigmoid"), [F.sigmoid])
register(_with_inplace_flag(_elementwise("sigmoid")), [F.hardsigmoid])
for _name in IN_PLACE_NAMES:
    # Tensor.pow_ has no torch.pow_
    register(_in_place(getattr(Tensor, _name), _elementwise_pass, keeps_input=False),
              lookup(Tensor, f"{_name}_") if _name == "pow" else torch_and_tensor(f"{_name}_"))
register(_in_place(Tensor.sigmoid, _elementwise("sigmoid"), keeps_input=False), torch_and_tensor("sigmoid_"))
for _function in IN_PLACE_ACTIVATIONS:
    register(_in_place(_function, _activation, keeps_input=False), lookup(F, f"{_function.__name__}_"))
