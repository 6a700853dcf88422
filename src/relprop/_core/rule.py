"""The base class of rules, and the two rules the engine itself needs (:class:`Pass`, :class:`Gradient`).

The other rules live in :mod:`relprop.rules`, which exports these too.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, NamedTuple, TypeVar

import torch
from torch import Tensor

from relprop._core.contract import Call, is_parametric, is_product
from relprop._core.kinds import OpKind
from relprop._core.stabilizers import inverse_denominator
from relprop._core.tensors import per_unit, sum_to


class Reads(NamedTuple):
    """What a rule's gradient form reads of an op call (:meth:`Rule.gradient_reads`): the engine keeps that alone."""

    #: the op's VJP (``call.vjp``)
    vjp: bool = False
    #: the op's output
    output: bool = False
    #: the values of the op's inputs
    inputs: bool = False
    #: whether the gradient form is ``call.vjp(G)`` and nothing else: where that is the op's own autograd VJP,
    #: the engine runs the op as plain autograd, with no relevance node ...
    native: bool = False
    #: ... with these inputs held constant (detached): gates, which get no relevance (one flag per input)
    held: tuple[bool, ...] = ()


class Scaled(NamedTuple):
    """A rule's gradient form as the op's own VJP rescaled (:meth:`Rule.scaled`): traceable, for a compiled pass.

    ``G_x = share_x * VJP_x(G * output(z))``, or with ``ratio`` ``G_x = G * out / x``. A traced pass writes it as
    detach-and-scale: the op's value unchanged, its gradient that (``relprop.engine.compiled``).
    """

    #: the factor on ``G`` at the output, from the op's output ``z`` (``z / (z + eps sign z)``); None: 1
    output: Callable[[Tensor], Tensor] | None = None
    #: each activation input's share of its VJP, in the order of ``call.inputs`` (0: held, a gate); (): all 1
    shares: tuple[float, ...] = ()
    #: ``G_x = G * out / x``: the op's ratio of output to input (Pass on an op that does not scale its input)
    ratio: bool = False
    #: with ``ratio``: ``x`` stabilised as ``x + stabiliser * sign x`` (``sign 0 = +1``; the Identity-rule)
    stabiliser: float = 0.0
    #: a parametric rule's modified products instead: ``modified(evaluate, x, weight, bias, z, probe)`` is a
    #: tensor whose VJP at ``x`` (and at ``probe``, ones that stand in for the input of a rule that fills zeros)
    #: is the rule's, ``evaluate(x, weight, bias)`` the op, ``z`` its output (:class:`~relprop.rules.BasicRule`)
    modified: Callable[..., Tensor] | None = None


def scaled_gradient(call: Call, form: Scaled, grad: Tensor) -> tuple[Tensor | None, ...]:
    """What ``form`` makes of ``G`` at ``call``'s output: ``share_x * VJP_x(G * output(z))`` for each input, or with
    ``ratio`` ``G * out / x`` (``x`` stabilised where the form says). On a dense or convolution layer the VJP is
    the call's ``vjp_scaled`` (a vocabulary head transposes the rows that hold relevance alone)."""
    if form.ratio:
        (x,) = call.inputs
        if form.stabiliser:
            return (sum_to(grad * call.output, x.shape) * inverse_denominator(x, form.stabiliser),)
        return (per_unit(sum_to(grad * call.output, x.shape), x, owned=True),)
    output = form.output
    if output is None:
        grads = call.vjp(grad)
    elif is_parametric(call):
        grads = call.vjp_scaled(grad, lambda z, bias: output(z))
    else:
        grads = call.vjp(grad * output(call.output))
    if not form.shares:
        return grads
    return tuple(None if c is None or share == 0 else c if share == 1 else c * share
                 for c, share in zip(grads, form.shares))


#: the view of an op call that a rule reads (:mod:`relprop.rules`)
C_contra = TypeVar("C_contra", bound=Call, contravariant=True)


class Rule(Generic[C_contra]):
    """Base class of all rules.

    Subclasses set :attr:`kinds` (the op kinds they apply to) and implement
    :meth:`propagate`. ``C_contra`` is the view of the op call the rule reads
    (:mod:`relprop.rules`): ``Rule[ParametricView]`` for a rule of
    convolutions and dense layers.

    The flags below tell the engine what to keep for the rule. Each defaults
    to the safe value, so that a rule that sets none is correct; setting one
    only saves memory or time.
    """

    #: op kinds this rule applies to
    kinds: frozenset[str] = frozenset()
    #: whether :meth:`propagate` calls ``call.vjp``: the engine then keeps the op's autograd graph from the forward
    #: pass (without it, ``call.vjp`` runs the op once more on its inputs)
    needs_vjp: bool = False
    #: whether :meth:`propagate` reads ``call.output``; False lets the engine drop the output after the forward pass
    needs_output: bool = True
    #: whether :meth:`propagate` reads the values of ``call.inputs``; False (it reads their shapes and dtypes
    #: alone) lets the engine drop them after the forward pass and keep stand-ins without memory
    needs_inputs: bool = True
    #: whether :meth:`prepare` reads ``call.output``; True wherever a subclass overrides :meth:`prepare`
    prepares: bool = False
    #: whether an input entry that is 0 gets relevance 0, whatever relevance arrives (``R_i = x_i * c_i``). Only
    #: then may the op that computed the input read ``relu(z)`` for ``z`` after an in-place ReLU overwrote it
    #: (the engine computes ``z`` again otherwise). False unless a rule says so.
    zero_for_zero_input: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "prepare" in vars(cls) and "prepares" not in vars(cls):  # a rule that prepares reads the output there
            cls.prepares = True

    @property
    def fills_zeros(self) -> bool:
        """Whether the rule may give an input entry of value 0 relevance of its own (Flat, WSquare, ZBox's bounds).

        Where that entry is padding (``F.pad`` before a first layer), the relevance reaches a constant and is
        lost out of any op's account: the guard does not account for such a pass.
        """
        return False

    def accepts(self, call: C_contra) -> bool:
        """Whether this rule can propagate through ``call`` (a call of any kind)."""
        return call.kind in self.kinds

    def conserves(self, call: C_contra) -> bool:
        """Whether the relevance this rule hands to ``call``'s inputs adds up to what arrived, up to a stabiliser.

        Such a rule hands on ``sum_k R_k z_k / (z_k + eps)``, never more than
        ``sum_k |R_k|``; the engine reports an op whose rule says so but hands on
        more (:class:`~relprop.ConservationWarning`). False unless a rule
        says so: biases and bounds take or give relevance by design.
        """
        return False

    def prepares_on(self, call: C_contra) -> bool:
        """Whether :meth:`prepare` reads ``call.output`` for this call: :attr:`prepares`, unless a rule narrows it.

        A rule that prepares for some calls only (a matrix product, not the
        elementwise one) says so here: the engine then drops the other calls'
        outputs after the forward pass, as for a rule that never prepares.
        """
        return self.prepares

    def prepare(self, call: C_contra) -> Tensor | None:
        """Precompute from ``call.output`` what :meth:`propagate` needs; it reads that as ``call.prepared``.

        Called once per call, at the start of the backward pass, or earlier if
        the output is about to be modified in place. The op call keeps what this
        returns until its backward pass is done.
        """
        return None

    def propagate(self, call: C_contra, relevance: Tensor) -> tuple[Tensor | None, ...]:
        """Return the relevance of each of ``call.inputs`` given the output relevance."""
        raise NotImplementedError

    def gradient_reads(self, call: C_contra) -> Reads | None:
        """What the rule's gradient form reads of ``call``; None where it has none (the default).

        A rule whose input relevance is ``x * c`` may carry relevance per unit
        of activation, ``G = R / x``, instead (:mod:`relprop._core.gradient_form`):
        then :meth:`gradient` maps ``G`` at the output to ``G`` at each input.
        """
        return None

    def gradient(self, call: C_contra, grad: Tensor) -> tuple[Tensor | None, ...]:
        """The rule in gradient form: ``G = R / out`` at the output to ``R_x / x`` at each input.

        Only where :meth:`gradient_reads` says the rule has one. Derived from :meth:`scaled`
        (:func:`scaled_gradient`), the form a compiled pass traces too: a rule states its gradient form once, as
        a :class:`Scaled`, and overrides this only where that cannot say it.
        """
        form = self.scaled(call)
        if form is None or form.modified is not None:
            raise NotImplementedError(f"relprop: rule {self!r} states no gradient form of {call.describe()}")
        return scaled_gradient(call, form, grad)

    def scaled(self, call: C_contra) -> Scaled | None:
        """The rule's gradient form as the op's VJP rescaled (:class:`Scaled`), or None where it has none that a
        :class:`Scaled` can say. :meth:`gradient` runs it under interception; a compiled pass traces it."""
        return None

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({params})"


class Pass(Rule[Call]):
    """Pass the output relevance unchanged to the op's single activation input.

    Applies to any op with one activation input whose shape the output can be
    summed back to (elementwise ops, scaling by constants); it cannot apply
    to a shape-changing op such as a convolution with other channels.
    """

    needs_output = False
    needs_inputs = False  # their shapes alone

    #: every kind but the ones with several activation inputs or without a rule (where passing it on is a guess)
    kinds = frozenset(OpKind) - {OpKind.ATTENTION, OpKind.UNKNOWN}

    def accepts(self, call: Call) -> bool:
        if call.kind not in self.kinds or len(call.inputs) != 1:
            return False
        return broadcasts_to(call.inputs[0].shape, call.output.shape)

    def propagate(self, call: Call, relevance: Tensor) -> tuple[Tensor | None, ...]:
        return (sum_to(relevance, call.inputs[0].shape),)

    def gradient_reads(self, call: Call) -> Reads:
        # an op that scales its input (f(x) = f'(x) x) has the identity rule as its VJP: out / x is f'(x)
        return Reads(vjp=True, native=True) if _scales(call) else Reads(output=True, inputs=True)

    def scaled(self, call: Call) -> Scaled:
        """``G_x = G * out / x``, the ratio of the output to the input; for an op that scales its input, its VJP."""
        return Scaled() if _scales(call) else Scaled(ratio=True)

    def conserves(self, call: Call) -> bool:
        return True


#: elementwise functions with ``f(x) = f'(x) x`` wherever differentiable (positively homogeneous of degree 1)
_HOMOGENEOUS = frozenset({"neg", "negative", "__neg__", "relu", "abs", "absolute", "__abs__", "leaky_relu", "prelu",
                          "neg_", "negative_", "relu_", "abs_", "absolute_", "leaky_relu_"})


def _scales(call: Call) -> bool:
    """Whether ``call`` scales its one activation input: ``f(x) = f'(x) x`` (a product with constants, a ReLU)."""
    if is_product(call):
        return call.factors[:1] != ("divisor",)
    return call.kind == OpKind.ELEMENTWISE and getattr(call.func, "__name__", "") in _HOMOGENEOUS


def broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
    if len(shape) > len(target):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))


class Gradient(Rule[Call]):
    """The op's plain gradient applied to the relevance.

    Exact for ops that only move values (max pooling is winner-take-all this
    way); for other ops relevance is not what comes out. The engine uses it,
    with a warning, for ops it has no rule for.
    """

    kinds = frozenset(OpKind)
    needs_vjp = True
    needs_output = False

    def propagate(self, call: Call, relevance: Tensor) -> tuple[Tensor | None, ...]:
        return call.vjp(relevance)
