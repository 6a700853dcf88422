"""Products of activations, divisions, matrix products and softmax; fused products decomposed."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from relprop._core.kinds import GATE_TAGS, OpKind
from relprop._core.registry import Handler, lookup, op_name, register, torch_and_tensor
from relprop._core.signatures import bind, bind_builtin
from relprop._core.tensors import is_activation, plain_binary, sum_to
from relprop.engine.calls import OpCall
from relprop.engine.nodes import substitute
from relprop.ops.attention import eager_attention, note_scaled, note_scores, note_softmax
from relprop.ops.host import OpHost
from relprop.ops.inplace import _in_place


def _decomposed(names: tuple[str, ...], decompose: Callable[..., Tensor]) -> Handler:
    """An op whose output is its fused kernel's, and whose relevance flows through ``decompose``.

    ``decompose`` computes the same function with ops that carry rules
    (``addcmul(a, b, c, value=v)`` as ``a + v * (b * c)``), each getting its
    rule as if the model had written it out. ``names`` name the op's
    positional arguments.
    """
    def handle(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
        with torch.no_grad():
            out = func(*args, **kwargs)
        with session:  # back in the mode: each op of the decomposition gets its rule
            source = decompose(**bind_builtin(names, args, kwargs))
        return substitute(out, source)
    return handle


def _scaled(value: Tensor, factor: Any) -> Tensor:
    return value if isinstance(factor, (int, float)) and factor == 1 else value * factor


def _beta_plus(input: Tensor, product: Tensor, beta: Any = 1, alpha: Any = 1) -> Tensor:
    """``beta * input + alpha * product``; with ``beta == 0`` the input is ignored, as the fused ops do."""
    product = _scaled(product, alpha)
    return product if isinstance(beta, (int, float)) and beta == 0 else _scaled(input, beta) + product


_ADD_PRODUCTS: dict[str, Handler] = {
    "addcmul": _decomposed(("input", "tensor1", "tensor2"),
                           lambda input, tensor1, tensor2, value=1: input + _scaled(tensor1 * tensor2, value)),
    "addcdiv": _decomposed(("input", "tensor1", "tensor2"),
                           lambda input, tensor1, tensor2, value=1: input + _scaled(tensor1 / tensor2, value)),
    "lerp": _decomposed(("input", "end", "weight"), lambda input, end, weight: input + weight * (end - input)),
    "addmm": _decomposed(("input", "mat1", "mat2"),
                         lambda input, mat1, mat2, **scales: _beta_plus(input, mat1 @ mat2, **scales)),
    "baddbmm": _decomposed(("input", "batch1", "batch2"),
                           lambda input, batch1, batch2, **scales: _beta_plus(input, batch1 @ batch2, **scales)),
    "addbmm": _decomposed(("input", "batch1", "batch2"),
                          lambda input, batch1, batch2, **scales: _beta_plus(input, (batch1 @ batch2).sum(0),
                                                                             **scales)),
    "addmv": _decomposed(("input", "mat", "vec"),
                         lambda input, mat, vec, **scales: _beta_plus(input, mat @ vec, **scales)),
}


def _product(matrix: bool, divide: bool = False) -> Handler:
    """Products of activations, divisions and matrix products.

    One activation factor: a scaling (``x * c``, ``c / x``), relevance passes,
    except that a matrix product with a constant is a linear map (epsilon
    rule). Two factors: the composite decides (uniform split, or the signal
    takes all where one factor is a gate; a divisor counts as a gate).
    """
    def handle(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
        call = ProductCall(func, args, kwargs, session.module_name, matrix, divide, session.aliases.tag)
        fused = eager_attention(session, call, args, kwargs) if matrix else None
        if fused is not None:
            return fused
        if len(call.inputs) > 2 and not matrix:  # (an einsum of k factors is split k ways)
            return session.unknown(func, args, kwargs)
        out = session.run(call)
        if call.scaled is not None:
            session.aliases.set_tag(out, call.scaled)
        if matrix and not kwargs:
            note_scores(session, call, args, out)
        elif len(call.inputs) == 1 and len(args) == 2 and not kwargs and func not in _REFLECTED:
            _note_scaling(session, call, args, divide, out)
        return out
    return handle


#: ``2 / x``: a reflected division divides the number by the activation
_REFLECTED = frozenset({Tensor.__rtruediv__, Tensor.__rdiv__})


def _note_scaling(session: OpHost, call: ProductCall, args: tuple, divide: bool, out: Tensor) -> None:
    """Attention scores times or divided by a number stay scores (``q @ k^T * scale``, ``/ sqrt(d)``)."""
    x, factor = args if isinstance(args[0], Tensor) else args[::-1]
    if divide:
        if x is not args[0] or type(factor) not in (int, float) or factor == 0:
            return
        factor = 1 / factor
    note_scaled(session, call, x, factor, out)


class ProductCall(OpCall):
    """A product of activations, a division or a matrix product, with what each activation factor is.

    Parameters
    ----------
    matrix : bool
        A matrix product: with one activation factor it is a linear map (kind ``sum``).
    divide : bool
        A division: the divisor (the second argument) is a constant scaling of the numerator.
    tag_of : callable
        The tag of an activation (what produced it: ``"sigmoid"``, ``"softmax"``, ...), None if it has none.
    """

    def __init__(self, func: Callable, args: tuple, kwargs: dict, module_name: str, matrix: bool, divide: bool,
                 tag_of: Callable[[Tensor], str | None]) -> None:
        super().__init__(OpKind.PRODUCT, func, args, kwargs, op_name(func), module_name)
        self.matrix = matrix
        #: the tag of an activation scaled by constants: the product's output keeps it (a scaled gate is a gate)
        self.scaled: str | None = None
        if len(self.inputs) == 1 and matrix:
            self.kind = OpKind.SUM
        elif divide:
            self.factors = tuple("divisor" if a is args[1] else None for a in self.activations)
            if self.factors[0] is None:  # a tagged numerator keeps its tag: a renormalised gate is a gate
                self.scaled = tag_of(self.activations[0])
        else:
            self.factors = tuple(tag_of(a) for a in self.activations)
            if len(self.inputs) == 1 and not _gates_a_constant(self.factors[0], args):
                self.scaled, self.factors = self.factors[0], (None,)  # relevance passes
        #: an elementwise product of two activations, or of one and a number (:func:`plain_binary`): its VJP is
        #: closed-form. Not with a constant tensor: the engine does not follow constants, and one modified in place
        #: before the backward pass would go unnoticed (autograd's saved tensor raises then)
        self._elementwise = (func in _MULTIPLY and not kwargs and self._spec is None and plain_binary(args)
                             and len(self._slots) == sum(isinstance(a, Tensor) for a in args))
        self.vjp_reads_inputs = self._elementwise

    def _needs_graph(self) -> bool:
        return not self._elementwise and super()._needs_graph()

    def vjp(self, grad: Tensor) -> tuple[Tensor | None, ...]:
        """For ``a * b``: ``grad * b`` for ``a`` and ``grad * a`` for ``b``, each summed to its input's shape.

        As autograd computes it (bitwise), without a graph kept from the forward pass.
        """
        if not self._elementwise:
            return super().vjp(grad)
        # the other factor of each: an input (or a copy of it) or a number
        return tuple(sum_to(grad * self._leaves[1 - slot], x.shape) for slot, x in zip(self._slots, self.inputs))


#: elementwise products whose VJP :class:`ProductCall` computes in closed form
_MULTIPLY = frozenset({torch.mul, Tensor.mul, torch.multiply, Tensor.multiply})


def _gates_a_constant(tag: str | None, args: tuple) -> bool:
    """Whether a product of one activation tagged ``tag`` with the constants in ``args`` gates a constant signal.

    A number or a one-element tensor only scales the activation (Gemma-2's ``tanh(z / 30) * 30``), and an
    activation output (CP-LRP's gate of gated MLPs) or a softmax times a constant is a scaling too.
    """
    if tag not in GATE_TAGS:  # a gate times a constant tensor gives the relevance to that constant
        return False
    return any(isinstance(a, Tensor) and not is_activation(a) and a.numel() > 1 for a in args)


def _softmax(names: tuple[str, ...] | None) -> Handler:
    """Softmax inside the model; its output is tagged, so that CP-LRP can hold attention weights constant."""
    def handle(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
        bound = bind(func, args, kwargs) if names is None else bind_builtin(names, args, kwargs)
        if bound.get("dim") is None:
            return session.unknown(func, args, kwargs)
        call = SoftmaxCall(func, args, kwargs, session.module_name, bound["dim"])
        if len(call.inputs) != 1:
            return session.unknown(func, args, kwargs)
        out = session.run(call)
        session.aliases.set_tag(out, "softmax")
        note_softmax(session, call, bound["input"], bound["dim"], out)
        return out
    return handle


class SoftmaxCall(OpCall):
    """A softmax along ``dim``."""

    def __init__(self, func: Callable, args: tuple, kwargs: dict, module_name: str, dim: int) -> None:
        super().__init__(OpKind.SOFTMAX, func, args, kwargs, op_name(func), module_name)
        self.dim = dim


register(_product(matrix=False), torch_and_tensor("mul multiply"), lookup(Tensor, "__rmul__"))
register(_product(matrix=False, divide=True), torch_and_tensor("div divide true_divide"),
          lookup(Tensor, "__rdiv__ __rtruediv__ __truediv__"))
_MATRIX = _product(matrix=True)


register(_MATRIX, torch_and_tensor("bmm"), lookup(torch, "einsum"), lookup(Tensor, "__rmatmul__"))
register(_in_place(Tensor.mul, _product(matrix=False)), lookup(Tensor, "mul_ __imul__"))
register(_in_place(Tensor.div, _product(matrix=False, divide=True)), lookup(Tensor, "div_ __itruediv__"))

for _name, _handler in _ADD_PRODUCTS.items():
    if _name != "addmm":  # a dense layer, unless both factors are activations (`_addmm`)
        register(_handler, torch_and_tensor(_name))
    register(_in_place(getattr(Tensor, _name), _handler), lookup(Tensor, f"{_name}_"))


register(_product(matrix=True), lookup(torch, "_grouped_mm"))
register(_softmax(None), [F.softmax])
register(_softmax(("input", "dim", "dtype")), torch_and_tensor("softmax"))
