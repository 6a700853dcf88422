"""LRP rules: how the relevance of one operation's output reaches its inputs.

A rule is a small object with parameters. The engine hands it an *op call*
(one operation of the forward pass) and the relevance arriving at that
operation's output; the rule returns the relevance of each of the
operation's activation inputs. What a rule may read and call on an op call is
the contract of :mod:`relprop.contract`; the call's ``kind`` is its op family,
a member of :class:`relprop.contract.OpKind`, whose members say what each
family holds.

Linear rules follow the general form of docs/design.md, section 2: with modified
parameters ``rho`` the modified output ``z'`` is computed, ``s = R / (z' +
eps * sign(z'))`` and ``R_in = x * VJP(s)``. :class:`BasicRule` defines such a
rule by its terms; :mod:`relprop.kernels` holds fused forms of the built-in ones.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

from .contract import (AttentionView, Call, OpKind, ParametricView, PoolView, ProductView, SoftmaxView, is_attention,
                       is_parametric, is_product)
from .graph import sum_to

if TYPE_CHECKING:
    from .graph import OpCall
    from .kernels import Kernel

__all__ = [
    "Rule", "Epsilon", "Norm", "BasicRule", "Term", "Shares", "ZPlus", "AlphaBeta", "Gamma", "ZBox",
    "Flat", "WSquare", "Pass", "Gradient", "UniformProduct", "SignalTakesAll", "Softmax", "AsFunction", "Proportional",
    "SmoothStride",
    "denominator", "inverse_denominator", "LINEAR_KINDS", "PARAMETRIC_KINDS",
]

#: the view of an op call that a rule reads (:mod:`relprop.contract`)
C_contra = TypeVar("C_contra", bound=Call, contravariant=True)

#: Op kinds that are linear in their activation inputs.
LINEAR_KINDS = frozenset({OpKind.CONV, OpKind.DENSE, OpKind.BATCHNORM, OpKind.SUM, OpKind.NORM})
#: Op kinds with a weight and a bias that rules may modify.
PARAMETRIC_KINDS = frozenset({OpKind.CONV, OpKind.DENSE})


def _stabilizer(epsilon: float, dtype: torch.dtype) -> float:
    """In float16 and bfloat16 the stabiliser is at least the dtype's machine epsilon, so that 1/eps stays finite."""
    if dtype in (torch.float16, torch.bfloat16):
        return max(epsilon, torch.finfo(dtype).eps)
    return epsilon


def denominator(z: Tensor, epsilon: float) -> Tensor:
    """Stabilise ``z`` for a division: ``z + epsilon * sign(z)`` with ``sign(0) = +1``.

    With ``epsilon == 0`` the zeros of ``z`` become ``inf``, so that dividing by
    the result gives 0 there instead of NaN. In float16 and bfloat16 ``epsilon``
    is at least the dtype's machine epsilon.
    """
    epsilon = _stabilizer(epsilon, z.dtype)
    if epsilon == 0:
        return torch.where(z == 0, math.inf, z)
    # eps * (1 - 2 [z < 0]) + z, bitwise z + eps or z - eps, with one new tensor: torch.where costs
    # several passes over memory on CPU, and every fresh tensor page faults
    return torch.lt(z, 0, out=torch.empty_like(z)).mul_(-2 * epsilon).add_(epsilon).add_(z)


def inverse_denominator(z: Tensor, epsilon: float, in_place: bool = False) -> Tensor:
    """``1 / denominator(z, epsilon)``, in as few passes over memory as possible.

    ``in_place``: ``z >= 0`` (an in-place ReLU's output) is the caller's to
    overwrite, and the result is written into it. With ``epsilon == 0`` the
    inverse is 0 where ``1 / z`` is infinite: at ``z = 0``, and at subnormal
    ``z`` (``1 / z`` overflows there; ``denominator`` keeps them).
    """
    epsilon = _stabilizer(epsilon, z.dtype)
    if epsilon == 0:
        # one pass in place instead of `where(z == 0, 0, 1 / z)`: 6x faster on a transformer's small tensors,
        # where LRP-0 (AttnLRP) takes an inverse per linear layer
        inverse = z.reciprocal_() if in_place else z.reciprocal()
        return inverse.nan_to_num_(nan=math.nan, posinf=0.0, neginf=0.0)
    if in_place:
        return z.add_(epsilon).reciprocal_()
    # copysign(eps, 0.0) = +eps; the rare -0.0 gets -eps, the same magnitude. One new tensor, written in place:
    # on large tensors every fresh allocation costs page faults
    return torch.copysign(z.new_full((), epsilon), z).add_(z).reciprocal_()


class Rule(Generic[C_contra]):
    """Base class of all rules.

    Subclasses set :attr:`kinds` (the op kinds they apply to) and implement
    :meth:`propagate`. ``C_contra`` is the view of the op call the rule reads
    (:mod:`relprop.contract`): ``Rule[ParametricView]`` for a rule of
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

    def accepts(self, call: C_contra) -> bool:
        """Whether this rule can propagate through ``call`` (a call of any kind)."""
        return call.kind in self.kinds

    def conserves(self, call: C_contra) -> bool:
        """Whether the relevance this rule hands to ``call``'s inputs adds up to what arrived, up to a stabiliser.

        Such a rule hands on ``sum_k R_k z_k / (z_k + eps)``, never more than
        ``sum_k |R_k|``; the engine reports an op whose rule says so but hands on
        more (:class:`~relprop.engine.ConservationWarning`). False unless a rule
        says so: biases and bounds take or give relevance by design.
        """
        return False

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

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({params})"


class Epsilon(Rule[Call]):
    """LRP-epsilon: ``R_j = a_j * sum_k w_jk R_k / (z_k + eps * sign(z_k))``.

    ``epsilon=0`` gives LRP-0. Applies to every linear op, parametric or not
    (sums and average pooling are then shared in proportion to the inputs).
    It reuses the gradient graph of the forward pass: no layer is re-run.

    Parameters
    ----------
    epsilon : float
        Stabiliser added to the denominator with the sign of ``z``.
    zero_bias : bool
        Leave the bias out of the denominator, so that it absorbs no relevance.
    """

    kinds = LINEAR_KINDS
    needs_vjp = True
    needs_output = False  # propagate() reads only the inverse that prepare() makes of it
    prepares = True
    zero_for_zero_input = True

    def __init__(self, epsilon: float = 1e-6, zero_bias: bool = False):
        self.epsilon = epsilon
        self.zero_bias = zero_bias

    def accepts(self, call: Call) -> bool:
        return super().accepts(call) and (not self.zero_bias or is_parametric(call))

    def prepare(self, call: Call) -> Tensor:
        """``1 / (z + eps sign z)``, with ``z`` the output (less the bias with ``zero_bias``)."""
        if self.zero_bias and is_parametric(call) and call.bias is not None:
            return inverse_denominator(call.output - call.bias_term(), self.epsilon)
        z = call.take_output() if call.output_nonnegative else None
        return inverse_denominator(call.output if z is None else z, self.epsilon, in_place=z is not None)

    def propagate(self, call: Call, relevance: Tensor) -> tuple[Tensor | None, ...]:
        inverse = call.prepared
        scaled = torch.mul(relevance, inverse, out=inverse)  # the inverse is read once
        grads = call.vjp(scaled)
        if call.kind in PARAMETRIC_KINDS:  # fresh tensors from a transposed product: scaled in place
            return tuple(None if c is None else c.mul_(x) for x, c in zip(call.inputs, grads))
        # a sum hands `scaled` itself to its inputs: ours, so the last input to read it may write into it; an
        # input copy that only this rule reads takes its own relevance
        last = max((i for i, c in enumerate(grads) if c is not None), default=None)
        owned = last is not None and grads[last] is scaled and scaled.shape == call.inputs[last].shape
        return tuple(None if c is None else c.mul_(x) if owned and i == last else
                     x.mul_(c) if i in call.scratch and c.shape == x.shape else x * c
                     for i, (x, c) in enumerate(zip(call.inputs, grads)))


class Norm(Epsilon):
    """zennit's name for the epsilon rule on parameter-free ops (sum and average pooling).

    Identical to :class:`Epsilon` with ``epsilon=stabilizer``.
    """

    def __init__(self, stabilizer: float = 1e-6):
        super().__init__(epsilon=stabilizer)


def _identity(tensor: Tensor) -> Tensor:
    return tensor


def _positive(tensor: Tensor) -> Tensor:
    return tensor.clamp(min=0)


def _negative(tensor: Tensor) -> Tensor:
    return tensor.clamp(max=0)


def _ones(tensor: Tensor) -> Tensor:
    return torch.ones_like(tensor)


def _square(tensor: Tensor) -> Tensor:
    return tensor * tensor


#: input modifiers that map 0 to 0: a rule made of them alone gives an input entry of 0 relevance 0
_KEEP_ZERO = (_identity, _positive, _negative)


@dataclass(frozen=True)
class _Lift:
    """Parameter modifier ``w -> w + gamma * part(w)`` (``part``: the positive or the negative part)."""

    gamma: float
    part: Callable[[Tensor], Tensor]

    def __call__(self, tensor: Tensor) -> Tensor:
        return tensor + self.gamma * self.part(tensor)


@dataclass(frozen=True, eq=False)
class _Bound:
    """Input modifier ``x -> `` the bound ``value`` as an image of ``x``'s shape (padded alike by the op)."""

    value: float | Tensor

    def __call__(self, tensor: Tensor) -> Tensor:
        return _bound_image(self.value, tensor).expand_as(tensor)


def _bound_image(value: float | Tensor, x: Tensor) -> Tensor:
    """A bound as an input image: of one example where it is the same for every example, else of the batch."""
    bound = torch.as_tensor(value, dtype=x.dtype, device=x.device)
    per_example = bound.dim() == x.dim() and bound.shape[0] != 1
    return bound.expand_as(x if per_example else x[:1])


@dataclass(frozen=True)
class Term:
    """One product ``input(x) * param(W)`` of a :class:`BasicRule`.

    Parameters
    ----------
    input : callable
        Input modifier, ``x -> x'``.
    param : callable
        Parameter modifier, applied to the weight and to the bias.
    bias : bool
        Whether this term carries the (modified) bias.
    """

    input: Callable[[Tensor], Tensor] = _identity
    param: Callable[[Tensor], Tensor] = _identity
    bias: bool = True


@dataclass(frozen=True)
class Shares:
    """The gradient mapper of the rules of docs/design.md, section 2: relevance shared in proportion to outputs.

    The terms form groups of consecutive terms (``groups``: their sizes). Term
    ``t`` of group ``g`` gets ``s_t = sign_t * weight_g * R / denominator(z_g,
    stabilizer)`` with ``z_g = sum_{t in g} sign_t z_t``, on the entries where
    the op's output has the sign ``where_g`` (+1, -1; 0: everywhere) and 0
    elsewhere.

    Parameters
    ----------
    stabilizer : float
    groups : tuple of int
        Sizes of the groups, in the order of the terms; they add up to the number of terms.
    weights : tuple of float, optional
        One per group (default: 1 each).
    signs : tuple of int, optional
        One per term, +1 or -1 (default: +1 each).
    where : tuple of int, optional
        One per group (default: 0 each, everywhere).
    """

    stabilizer: float
    groups: tuple[int, ...] = (1,)
    weights: tuple[float, ...] = ()
    signs: tuple[int, ...] = ()
    where: tuple[int, ...] = ()

    def __post_init__(self) -> None:  # the defaults spelled out: kernels recognise a mapper by its fields
        for name, default, count in (("weights", 1.0, len(self.groups)), ("signs", 1, sum(self.groups)),
                                     ("where", 0, len(self.groups))):
            if not getattr(self, name):
                object.__setattr__(self, name, (default,) * count)
        if len(self.weights) != len(self.groups) or len(self.where) != len(self.groups) or \
                len(self.signs) != sum(self.groups):
            raise ValueError(f"relprop: Shares needs one weight and one `where` per group and one sign per term, got "
                             f"groups={self.groups}, weights={self.weights}, signs={self.signs}, where={self.where}")

    @property
    def reads_output(self) -> bool:
        """Whether it reads the op's output (for ``where``)."""
        return any(self.where)

    def __call__(self, relevance: Tensor, outputs: list[Tensor], z: Tensor) -> list[Tensor]:
        grads: list[Tensor] = []
        start = 0
        for size, weight, where in zip(self.groups, self.weights, self.where):
            signs = self.signs[start:start + size]
            total = outputs[start]
            for sign, out in zip(signs[1:], outputs[start + 1:start + size]):
                total = total + out if sign > 0 else total - out
            shared = relevance if where == 0 else relevance * (z > 0 if where > 0 else z < 0)
            shared = shared / denominator(total, self.stabilizer)
            if weight != 1:
                shared = weight * shared
            grads.extend(shared if sign > 0 else -shared for sign in signs)
            start += size
        return grads


class BasicRule(Rule[ParametricView]):
    """A rule for parametric linear ops built from its parts: its single definition.

    For each :class:`Term` ``t`` the op is evaluated as ``z_t = f(input_t(x);
    param_t(W), param_t(b))``. ``gradient_mapper(R, outputs, z)`` turns the
    output relevance into one tensor ``s_t`` per term (typically ``R``
    divided by a stabilised sum of outputs, :class:`Shares`);
    ``reducer(inputs, grads)`` combines the modified inputs with the VJPs
    ``c_t = VJP_t(s_t)`` (default: ``sum_t input_t * c_t``).

    That is the rule's reference form. Where :mod:`relprop.kernels` has a fused
    form for these terms and this mapper (z+, alpha-beta, gamma, z^B, flat, w^2), it
    computes the same relevance with fewer passes over memory on the calls it
    serves; everything else takes the reference form.

    The engine's flags follow from the parts: the output is kept unless the
    mapper is a :class:`Shares` that does not read it (and no fused form
    does); an input of 0 gets relevance 0 (``zero_for_zero_input``) where
    every term's input modifier is the identity or a sign part and the
    reducer is the default. A subclass may still set them as class
    attributes.

    Parameters
    ----------
    terms : sequence of Term
    gradient_mapper : callable ``(relevance, outputs, z) -> list[Tensor]``
    reducer : callable ``(inputs, grads) -> Tensor``, optional
    zero_bias : bool
        Drop the bias from every term.
    """

    kinds = PARAMETRIC_KINDS

    def __init__(
        self,
        terms: Sequence[Term],
        gradient_mapper: Callable[[Tensor, list[Tensor], Tensor], list[Tensor]],
        reducer: Callable[[list[Tensor], list[Tensor]], Tensor] | None = None,
        zero_bias: bool = False,
    ):
        from .kernels import fused  # kernels reads the rules' vocabulary: imported once both exist

        self._terms = tuple(terms)
        self._gradient_mapper = gradient_mapper
        self._reducer = reducer
        self.zero_bias = zero_bias
        self._kernel = None if reducer is not None else fused(self._terms, gradient_mapper, zero_bias)
        self._needs_output: bool | None = None  # set: the flag as given, instead of as the parts say
        self._zero_for_zero_input: bool | None = None

    @property
    def kernel(self) -> Kernel | None:
        """The fused form chosen for these terms (:mod:`relprop.kernels`), or None: the reference form serves."""
        return self._kernel

    @property
    def needs_output(self) -> bool:
        """Whether the gradient mapper or the fused form may read the output."""
        if self._needs_output is not None:
            return self._needs_output
        reads = not isinstance(self._gradient_mapper, Shares) or self._gradient_mapper.reads_output
        return reads or (self._kernel is not None and self._kernel.reads_output)

    @needs_output.setter
    def needs_output(self, value: bool) -> None:
        self._needs_output = value

    @property
    def zero_for_zero_input(self) -> bool:
        """Whether an input of 0 gets relevance 0: every input modifier keeps 0, and the reducer is the default."""
        if self._zero_for_zero_input is not None:
            return self._zero_for_zero_input
        return self._reducer is None and all(term.input in _KEEP_ZERO for term in self._terms)

    @zero_for_zero_input.setter
    def zero_for_zero_input(self, value: bool) -> None:
        self._zero_for_zero_input = value

    def propagate(self, call: ParametricView, relevance: Tensor) -> tuple[Tensor]:
        if self._kernel is not None:
            fast = self._kernel(call, relevance)
            if fast is not None:
                return (fast,)
        return (self.reference(call, relevance),)

    def reference(self, call: ParametricView, relevance: Tensor) -> Tensor:
        """The relevance of the input from the terms, one modified forward and one VJP per term."""
        (x,) = call.inputs
        inputs: list[Tensor] = []
        outputs: list[Tensor | None] = []
        live: list[int] = []
        with torch.enable_grad():
            for term in self._terms:
                modified = term.input(x).detach()
                bias = term.param(call.bias) if term.bias and not self.zero_bias and call.bias is not None else None
                inputs.append(modified)
                # x- of a non-negative input (after a ReLU) is all zeros: its term is the bias alone, no product
                if bias is None and not modified.any():
                    outputs.append(None)
                    continue
                modified.requires_grad_()
                outputs.append(call.evaluate(modified, term.param(call.weight), bias))
                live.append(len(outputs) - 1)
        if not live:  # every term vanished: no input, no bias, no relevance
            return torch.zeros_like(x)
        shape = next(out for out in outputs if out is not None)
        full = [torch.zeros_like(shape) if out is None else out for out in outputs]
        mapped = self._gradient_mapper(relevance, full, call.output)
        found = torch.autograd.grad([full[i] for i in live], [inputs[i] for i in live], [mapped[i] for i in live])
        grads = [torch.zeros_like(x) for x in inputs]
        for i, grad in zip(live, found):
            grads[i] = grad
        if self._reducer is not None:
            return self._reducer(inputs, grads)
        total = inputs[0] * grads[0]
        for modified, grad in zip(inputs[1:], grads[1:]):
            total = total + modified * grad
        return total


#: the positive contributions ``x+ W+ + x- W-`` (bias ``b+``), and the negative ones ``x+ W- + x- W+`` (``b-``)
POSITIVE_SHARE = (Term(_positive, _positive), Term(_negative, _negative, bias=False))
NEGATIVE_SHARE = (Term(_positive, _negative), Term(_negative, _positive, bias=False))


class ZPlus(BasicRule):
    """LRP-z+: only positive contributions (``x+ w+`` and ``x- w-``, bias ``b+``).

    Equals :class:`AlphaBeta` with ``alpha=1, beta=0``.
    """

    def __init__(self, stabilizer: float = 1e-6, zero_bias: bool = False):
        self.stabilizer = stabilizer
        super().__init__(POSITIVE_SHARE, Shares(stabilizer, groups=(2,)), zero_bias=zero_bias)


class AlphaBeta(BasicRule):
    """LRP-alpha-beta: ``alpha`` times the positive share minus ``beta`` times the negative share.

    Positive part: ``x+ w+`` and ``x- w-`` with ``b+``; negative part: ``x+ w-``
    and ``x- w+`` with ``b-``. Requires ``alpha - beta = 1``.
    """

    def __init__(self, alpha: float = 2.0, beta: float = 1.0, stabilizer: float = 1e-6, zero_bias: bool = False):
        if alpha < 0 or beta < 0 or not math.isclose(alpha - beta, 1.0):
            raise ValueError(f"AlphaBeta needs alpha, beta >= 0 and alpha - beta = 1, got alpha={alpha}, beta={beta}")
        self.alpha, self.beta, self.stabilizer = alpha, beta, stabilizer
        super().__init__(POSITIVE_SHARE + NEGATIVE_SHARE, Shares(stabilizer, groups=(2, 2), weights=(alpha, -beta)),
                         zero_bias=zero_bias)


class Gamma(BasicRule):
    """LRP-gamma in its generalised form for signed inputs.

    Where ``z > 0`` the relevance is shared by ``x+ (w + gamma w+)`` and
    ``x- (w + gamma w-)`` (bias ``b + gamma b+``); where ``z < 0`` by ``x+ (w +
    gamma w-)`` and ``x- (w + gamma w+)`` (bias ``b + gamma b-``). On
    non-negative inputs this is the original gamma rule.
    """

    def __init__(self, gamma: float = 0.25, stabilizer: float = 1e-6, zero_bias: bool = False):
        self.gamma, self.stabilizer = gamma, stabilizer
        up, down = _Lift(gamma, _positive), _Lift(gamma, _negative)
        super().__init__(
            [Term(_positive, up), Term(_negative, down, bias=False),
             Term(_positive, down), Term(_negative, up, bias=False)],
            Shares(stabilizer, groups=(2, 2), where=(1, -1)),
            zero_bias=zero_bias,
        )


class ZBox(BasicRule):
    """LRP-z^B for a first layer on bounded input (pixels).

    Numerator ``x w - l w+ - h w-``, no bias. ``low`` and ``high`` are the
    smallest and largest possible input values, as scalars or tensors that
    broadcast against the layer's input (e.g. ``(1, 3, 1, 1)`` per channel).
    The bound images are padded exactly like the input. Where routing ops (a
    space-to-depth) sit between the model input and the layer, bounds of the
    model input's shape are taken through them.
    """

    def __init__(self, low: float | Tensor, high: float | Tensor, stabilizer: float = 1e-6):
        self.low, self.high, self.stabilizer = low, high, stabilizer
        super().__init__(
            [Term(_identity, _identity, bias=False), Term(_Bound(low), _positive, bias=False),
             Term(_Bound(high), _negative, bias=False)],
            Shares(stabilizer, groups=(3,), signs=(1, -1, -1)),
        )


class WSquare(BasicRule):
    """LRP-w^2: ``R_i = sum_j w_ij^2 / sum_i' w_i'j^2 R_j``, independent of the input."""

    def __init__(self, stabilizer: float = 1e-6, zero_bias: bool = False):
        self.stabilizer = stabilizer
        super().__init__([Term(_ones, _square)], Shares(stabilizer), zero_bias=zero_bias)


class Flat(BasicRule):
    """LRP-flat: every weight 1, no bias: relevance spread uniformly over the receptive field."""

    def __init__(self, stabilizer: float = 1e-6):
        self.stabilizer = stabilizer
        super().__init__([Term(_ones, _ones)], Shares(stabilizer), zero_bias=True)

    def conserves(self, call: ParametricView) -> bool:
        return True


class Pass(Rule[Call]):
    """Pass the output relevance unchanged to the op's single activation input.

    Applies to any op with one activation input whose shape the output can be
    summed back to (elementwise ops, scaling by constants); it cannot apply
    to a shape-changing op such as a convolution with other channels.
    """

    needs_output = False

    #: every kind but the ones with several activation inputs or without a rule (where passing it on is a guess)
    kinds = frozenset(OpKind) - {OpKind.ATTENTION, OpKind.UNKNOWN}

    def accepts(self, call: Call) -> bool:
        if call.kind not in self.kinds or len(call.inputs) != 1:
            return False
        return _broadcasts_to(call.inputs[0].shape, call.output.shape)

    def propagate(self, call: Call, relevance: Tensor) -> tuple[Tensor | None, ...]:
        return (sum_to(relevance, call.inputs[0].shape),)

    def conserves(self, call: Call) -> bool:
        return True


def _broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
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


def attention_relevance(call: AttentionView, relevance: Tensor, epsilon: float,
                        values_only: bool) -> tuple[Tensor | None, ...]:
    """Relevance of a fused attention's activation inputs: ``softmax(q k^T * scale + mask) @ v`` recomputed.

    ``values_only`` (CP-LRP): the values take all of it. Else (AttnLRP) the
    product ``weights @ v`` splits it evenly between the weights and ``v``
    (each with the epsilon rule of a product, ``eps`` the stabiliser), the
    softmax takes its rule (:class:`Softmax`), and ``q k^T`` splits its share
    evenly between ``q`` and ``k``; an activation mask gets its own share of
    each score. Grouped-query heads sum back onto their key and value heads.
    """
    parts, roles = call.parts, call.roles
    q, k, v = (parts[key] for key in ("query", "key", "value"))
    groups = q.shape[-3] // k.shape[-3] if parts["enable_gqa"] else 1
    k_, v_ = (k.repeat_interleave(groups, -3), v.repeat_interleave(groups, -3)) if groups > 1 else (k, v)
    scale = parts["scale"] if parts["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ k_.transpose(-2, -1)) * scale
    mask = parts["attn_mask"]
    if parts["is_causal"]:
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, -math.inf)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask
    weights = torch.softmax(scores, -1)
    scaled = relevance * inverse_denominator(weights @ v_, epsilon)
    # each product splits its relevance over its activation factors: q or k alone (a decoder's query made
    # from constants, in cross-attention) takes all of q k^T's, and values next to constant weights all
    factors = [role for role in ("query", "key") if role in roles]
    values_only = values_only or not (factors or "attn_mask" in roles)
    found = {"value": (1.0 if values_only else 0.5) * v_ * (weights.transpose(-2, -1) @ scaled)}
    if not values_only:
        r_weights = 0.5 * weights * (scaled @ v_.transpose(-2, -1))
        # softmax rule, then the scale and the mask as constants: relevance per score over q k^T
        per_score = r_weights - weights * r_weights.sum(-1, keepdim=True)  # times a score: its relevance
        taylor = scale * per_score / max(len(factors), 1)
        found["query"] = q * (taylor @ k_)
        found["key"] = k_ * (taylor.transpose(-2, -1) @ q)
        if "attn_mask" in roles:  # the mask's own share of each score, as the sum `scores + mask` gives
            found["attn_mask"] = (mask * per_score).sum_to_size(mask.shape)
    if groups > 1:
        for key in ("key", "value"):
            if key in found:
                found[key] = found[key].unflatten(-3, (k.shape[-3], groups)).sum(-3)
    return tuple(found.get(role) for role in roles)


class UniformProduct(Rule[Call]):
    """Products of activations (``a * b``, ``a @ b``): each of the k factors gets 1/k.

    ``R_i = (1/k) * x_i * VJP_i(R / (z + eps sign z))`` (the AttnLRP rule for
    multiplicative interactions). On fused attention (``kind == "attention"``)
    both matrix products are split this way and the softmax takes its
    :class:`Softmax` rule, so that q and k share half and v gets half.
    """

    zero_for_zero_input = True
    kinds = frozenset({"product", "attention"})
    needs_vjp = True
    needs_output = False

    def __init__(self, epsilon: float = 1e-6):
        self.epsilon = epsilon

    def prepare(self, call: Call) -> Tensor | None:
        """``1 / (k (z + eps sign z))`` of a product of k factors."""
        return inverse_denominator(call.output, self.epsilon).div_(len(call.inputs)) if is_product(call) else None

    def conserves(self, call: Call) -> bool:
        return is_product(call)  # a product of k activations is k-linear: x * grad sums to k z

    def propagate(self, call: Call, relevance: Tensor) -> tuple[Tensor | None, ...]:
        if is_attention(call):
            return attention_relevance(call, relevance, self.epsilon, values_only=False)
        return tuple(None if c is None else x * c for x, c in zip(call.inputs, call.vjp(relevance * call.prepared)))


class SignalTakesAll(Rule[Call]):
    """Gated products ``gate * signal``: the signal gets all relevance, the gate none.

    A factor is a gate when its tag (what produced it, :attr:`ProductView.factors
    <relprop.contract.ProductView.factors>`) is one of ``gate_kinds``: by default
    a sigmoid (LSTM gates, Arras et al. 2017; squeeze-and-excitation), a
    normalising statistic (``x * rsqrt(var)``), a divisor and an exponential
    weight; CP-LRP adds attention weights (``"softmax"``) and activations of
    gated MLPs (``"activation"``). On fused attention all relevance goes to the
    values (CP-LRP).

    Parameters
    ----------
    epsilon : float
        Stabiliser of the epsilon rule of a matrix product's signal.
    gate_kinds : iterable of str
        The factor tags that make a factor a gate.
    """

    #: the factor tags that make a factor a gate unless a composite says otherwise (AttnLRP's)
    GATE_KINDS = frozenset({"sigmoid", "statistic", "divisor", "exp"})

    kinds = frozenset({"product", "attention"})
    needs_vjp = True  # for matrix products: the linear map of the signal, with the gate held constant
    needs_output = False

    def __init__(self, epsilon: float = 1e-6, gate_kinds: Iterable[str] = GATE_KINDS):
        self.epsilon = epsilon
        self.gate_kinds = frozenset(gate_kinds)

    def gates(self, call: ProductView) -> tuple[bool, ...]:
        """Which factors of the product ``call`` are gates that take no relevance.

        Where every factor would be one, an activation output gated by a
        sigmoid or a softmax is the signal (CP-LRP on squeeze-and-excitation:
        ``relu(h) * sigmoid(s)``); gates alone share the relevance uniformly
        (none is a gate). Never may all of it vanish.
        """
        factors = call.factors
        if call.matrix and "softmax" in factors and any(factor != "softmax" for factor in factors):
            # attention weights times values: the values are no gate, even where a sigmoid made them (timm's
            # iformer), as in a fused attention
            return tuple(factor == "softmax" and factor in self.gate_kinds for factor in factors)
        gates = tuple(factor in self.gate_kinds for factor in factors)
        if len(gates) > 1 and all(gates):
            gates = tuple(factor != "activation" for factor in factors)
            if all(gates):
                gates = (False,) * len(gates)
        return gates

    def accepts(self, call: Call) -> bool:
        """Fused attention, or a product with a gate and at most one other activation factor.

        A gate times a constant (``r * b_hn`` at the first step of a GRU): the
        relevance belongs to the constant, and is absorbed.
        """
        if is_attention(call):
            return True
        if not is_product(call):
            return False
        gates = self.gates(call)
        return any(gates) and len(gates) - sum(gates) <= 1

    def prepare(self, call: Call) -> Tensor | None:
        """A matrix product's ``1 / (z + eps sign z)``."""
        return inverse_denominator(call.output, self.epsilon) if is_product(call) and call.matrix else None

    def conserves(self, call: Call) -> bool:
        """A gate times a constant gives the constant the relevance; else the signal takes all of it."""
        return is_attention(call) or (is_product(call) and not all(self.gates(call)))

    def propagate(self, call: Call, relevance: Tensor) -> tuple[Tensor | None, ...]:
        if is_attention(call):
            return attention_relevance(call, relevance, self.epsilon, values_only=True)
        assert is_product(call)  # accepts() took only products and attention
        gates = self.gates(call)
        if call.matrix:  # attn @ v: epsilon rule of v's linear map
            grads = call.vjp(relevance * call.prepared)
            return tuple(None if gate or c is None else x * c for x, c, gate in zip(call.inputs, grads, gates))
        # gate * signal elementwise: the signal's share is all of it
        return tuple(None if gate else sum_to(relevance, x.shape) for x, gate in zip(call.inputs, gates))


class Softmax(Rule[SoftmaxView]):
    """Softmax inside the model (AttnLRP): ``R_x = x * (R - s * sum(R))`` along the softmax dimension.

    This equals Gradient x Input through the softmax. It is not conservative:
    the softmax absorbs what its input's shift does not explain. Masked
    entries (``x = -inf``) get 0, never NaN.
    """

    zero_for_zero_input = True
    kinds = frozenset({"softmax"})
    needs_output = True

    def propagate(self, call: SoftmaxView, relevance: Tensor) -> tuple[Tensor | None, ...]:
        (x,) = call.inputs
        s = call.output
        taylor = relevance.to(s.dtype) - s * relevance.to(s.dtype).sum(call.dim, keepdim=True)
        out = torch.where(torch.isfinite(x), x * taylor.to(x.dtype), 0.0)
        return (out,)


class AsFunction(Rule[C_contra]):
    """The op's relevance propagated as if it computed ``surrogate``, by the epsilon rule on the surrogate.

    The forward pass keeps the op's real output; only the backward pass
    reads the surrogate: ``z = surrogate(x, **arguments)``, ``s = R / (z +
    eps * sign(z))``, ``R_x = x * VJP_surrogate(s)``. The surrogate must give
    an output of the op's output shape. With the op itself as surrogate
    (``AsFunction(torch.conv2d)``) this is the op's plain :class:`Epsilon`.

    Parameters
    ----------
    surrogate : callable ``(x, **arguments) -> Tensor``
        A function of the op's one activation input ``x``. ``arguments`` are
        the op's other arguments by the names its torch function gives them:
        for convolutions and dense layers ``weight`` and ``bias`` (with a
        merged BatchNorm's scale and shift) and the options (``stride``,
        ``padding``, ``dilation``, ``groups``); for ``F.max_pool2d``
        ``kernel_size``, ``stride``, ``padding``, ``dilation``, ``ceil_mode``,
        ``return_indices``; for ``F.adaptive_max_pool2d`` ``output_size``.
        Take ``**_`` for those it does not read.
    epsilon : float
        Stabiliser of the denominator.
    kinds : iterable of str
        Op kinds (see :mod:`relprop.rules`) the rule is about: max pooling,
        convolutions and dense layers unless given.

    Examples
    --------
    Max pooling propagated like the average pooling of its windows (this is
    :class:`Proportional`)::

        AsFunction(lambda x, kernel_size, stride, padding, **_: F.avg_pool2d(x, kernel_size, stride, padding))
    """

    zero_for_zero_input = True
    needs_output = False

    def __init__(self, surrogate: Callable[..., Tensor], epsilon: float = 1e-6,
                 kinds: Iterable[str] = ("maxpool", "conv", "dense")):
        self.surrogate = surrogate
        self.epsilon = epsilon
        self.kinds = frozenset(kinds)

    def accepts(self, call: C_contra) -> bool:
        """An op of the rule's kinds with one activation input and arguments the surrogate can be given."""
        return call.kind in self.kinds and len(call.inputs) == 1 and call.arguments is not None

    def surrogate_output(self, call: C_contra, x: Tensor) -> Tensor:
        """The surrogate at ``x`` with ``call``'s arguments; rules that build it from the call override this."""
        return self.surrogate(x, **call.arguments)  # type: ignore[arg-type]  # accepts() checked the arguments

    def propagate(self, call: C_contra, relevance: Tensor) -> tuple[Tensor | None, ...]:
        (x,) = call.inputs
        with torch.enable_grad():
            leaf = x.detach().requires_grad_()
            z = self.surrogate_output(call, leaf)
        if z.shape != relevance.shape:
            raise ValueError(f"relprop: the surrogate of {self!r} gives shape {tuple(z.shape)} on {call.describe()}, "
                             f"whose output has shape {tuple(relevance.shape)}; it must give the op's output shape")
        (c,) = torch.autograd.grad(z, leaf, relevance / denominator(z.detach(), self.epsilon))
        return (c.mul_(x),)

    def __repr__(self) -> str:
        if type(self) is AsFunction:
            return f"AsFunction({getattr(self.surrogate, '__name__', self.surrogate)}, epsilon={self.epsilon!r})"
        return f"{type(self).__name__}(epsilon={self.epsilon!r})"  # the surrogate is the rule's own


class Proportional(AsFunction[PoolView]):
    """Max pooling propagated like the average pooling over the same windows: :class:`AsFunction` of it.

    Each window's relevance is shared in proportion to its inputs instead of
    going to the winner alone (winner-take-all is the default). Padding
    counts as zeros in the average; ``F.adaptive_max_pool*`` is propagated
    like ``F.adaptive_avg_pool*`` of the same output size.

    Parameters
    ----------
    epsilon : float
        Stabiliser of the denominator.
    """

    def __init__(self, epsilon: float = 1e-6):
        super().__init__(_no_surrogate, epsilon, kinds=("maxpool",))

    def accepts(self, call: PoolView) -> bool:
        return call.kind in self.kinds and len(call.inputs) == 1 and call.average is not None

    def conserves(self, call: PoolView) -> bool:
        return True

    def surrogate_output(self, call: PoolView, x: Tensor) -> Tensor:
        return call.average(x)  # type: ignore[misc]  # accepts() checked there is one  # the op family's average pooling over the op's own windows (relprop.ops)


class SmoothStride(AsFunction):
    """A strided window op propagated as its stride-1 form followed by a stride x stride average.

    A convolution or max pooling with stride ``s`` covers some input pixels
    with more of its windows than others (a 1x1 convolution with stride 2,
    ResNet's downsampling shortcut, reads one pixel of every 2x2 block; a 7x7
    one with stride 2 covers a pixel with 4 windows along a dimension at one
    parity and 3 at the other), so the plain rules leave a lattice in the
    heatmap. This rule propagates the op as if it computed its stride-1 form
    and then the average of each ``s x s`` block of that: for a convolution
    with kernel ``W``, the convolution with the kernel ``W * box_s / s**d``
    (``W``, dilated if the op is, convolved with an ``s x s`` box of ones; size
    ``k + s - 1``), stride ``s``, the op's own left padding and the bias kept.
    Every input pixel then has the same total weight of windows over it along
    each dimension (the polyphase sums of a kernel convolved with an ``s``-box
    are equal). For a 1x1 kernel that is an ``s x s`` kernel of ``W / s**2``.
    Max pooling is propagated as the same smoothing of the average over its
    windows (padding counts as zeros, as in
    :class:`Proportional`): a 3x3 window with stride 2 as the 4x4 kernel
    ``[1, 2, 2, 1]^T [1, 2, 2, 1] / 36``. Windows that run over the input's far
    end read zeros there, as padding, so that the output keeps the op's size.
    The forward pass is unchanged.

    By default the smoothed op takes the epsilon rule (this is
    :class:`AsFunction` of it); ``rule`` gives a smoothed convolution another
    rule for convolutions, as the presets do with ``smooth_stride=True``. The
    rule's modifiers act on ``W`` before the box: ZPlus propagates through
    ``W+ * box``, Flat through ``ones * box``, ZBox through ``W * box`` and its
    bounds through ``W+ * box`` and ``W- * box``: the rule on the stride-1 form,
    followed by each block's average shared in proportion to the rule's own
    contributions. Max pooling always takes the epsilon rule. With
    :class:`Epsilon`, :class:`ZPlus` or :class:`Flat` and no bias (a merged
    BatchNorm's shift included), it conserves.

    Applies to ``conv1d``, ``conv2d`` and ``conv3d`` (numeric padding) and to
    ``max_pool1d``, ``max_pool2d`` and ``max_pool3d`` with a stride above 1
    along some dimension.

    Parameters
    ----------
    epsilon : float
        Stabiliser of the epsilon rule's denominator (without ``rule``, and on
        max pooling).
    rule : BasicRule, optional
        The rule of a smoothed convolution (:class:`ZPlus`,
        :class:`AlphaBeta`, :class:`Gamma`, :class:`Flat`, :class:`WSquare`,
        :class:`ZBox`), in its term form; None for the epsilon rule.
    any_stride : bool
        Also accept a convolution it does not smooth (no stride above 1, a
        transposed convolution, string padding) and propagate it as it is, by
        ``rule`` (by the epsilon rule without one): for a preset's first
        layer, which may or may not be strided.
    """

    def __init__(self, epsilon: float = 1e-6, rule: BasicRule | None = None, any_stride: bool = False):
        if rule is not None and not isinstance(rule, BasicRule):
            raise TypeError(f"relprop: SmoothStride's rule is None (epsilon) or a rule for convolutions built from "
                            f"terms (ZPlus, AlphaBeta, Gamma, Flat, WSquare, ZBox), got {rule!r}")
        super().__init__(_no_surrogate, epsilon, kinds=("conv", "maxpool"))
        self.rule = rule
        self.any_stride = any_stride
        # what the engine keeps: the smoothed forms compute their own output; an op left as it is, the rule's needs
        self.needs_output = any_stride and rule is not None and rule.needs_output
        self.zero_for_zero_input = rule is None or rule.zero_for_zero_input

    def accepts(self, call: OpCall) -> bool:
        """A strided convolution or max pooling (answered before it runs); with ``any_stride`` any convolution."""
        if call.kind not in self.kinds or len(call.inputs) != 1:
            return False
        window = _Window.of(call)
        if window is not None and window.strided:
            return True
        if not self.any_stride or call.kind != "conv":
            return False
        if self.rule is not None:
            return self.rule.accepts(call)  # type: ignore[arg-type]  # a conv call is parametric
        return call.arguments is not None

    def conserves(self, call: OpCall) -> bool:
        if call.kind == "maxpool":
            return True
        if self.rule is not None:
            return self.rule.conserves(call)  # type: ignore[arg-type]  # convolutions are parametric
        return call.bias is None  # type: ignore[attr-defined]

    def surrogate_output(self, call: OpCall, x: Tensor) -> Tensor:
        window = _Window.of(call)
        if window is None or not window.strided:  # an op left as it is (any_stride): the epsilon rule on the op
            return call.func(x, **call.arguments)  # type: ignore[arg-type]  # accepts() checked the arguments
        smoothed = _SmoothedConv.of(call, window)
        return smoothed.evaluate(x, smoothed.weight, smoothed.bias)

    def propagate(self, call: OpCall, relevance: Tensor) -> tuple[Tensor | None, ...]:
        if self.rule is None or call.kind == "maxpool":
            return super().propagate(call, relevance)
        window = _Window.of(call)
        if window is None or not window.strided:
            return self.rule.propagate(call, relevance)  # type: ignore[arg-type]  # convolutions are parametric
        return self.rule.propagate(_SmoothedConv.of(call, window), relevance)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        extra = ", any_stride=True" if self.any_stride else ""
        return f"SmoothStride(epsilon={self.epsilon!r}, rule={self.rule!r}{extra})"


#: max pooling functions and their number of spatial dimensions
_MAX_POOLS = {F.max_pool1d: 1, F.max_pool2d: 2, F.max_pool3d: 3}


@dataclass(frozen=True)
class _Window:
    """Where a convolution or max pooling reads its input, one value per spatial dimension."""

    kernel: tuple[int, ...]  # taps, before dilation
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    ceil_mode: bool = False

    @classmethod
    def of(cls, call: OpCall) -> _Window | None:
        """The window of a ``conv1d``..``conv3d`` with numeric padding or of a ``max_pool1d``..``max_pool3d``, else
        None."""
        options = call.arguments
        if options is None:
            return None
        if call.kind == "conv" and call.func in _CONVOLUTIONS:
            weight = call.weight  # type: ignore[attr-defined]  # convolutions are parametric
            dims, padding = weight.dim() - 2, options.get("padding", 0)
            if isinstance(padding, str):
                return None
            return cls(tuple(weight.shape[2:]), _per_dim(options.get("stride", 1), dims), _per_dim(padding, dims),
                       _per_dim(options.get("dilation", 1), dims))
        dims = _MAX_POOLS.get(call.func, 0) if call.kind == "maxpool" else 0
        if not dims:
            return None
        kernel = _per_dim(options["kernel_size"], dims)
        stride = _per_dim(options["stride"], dims) if options["stride"] else kernel  # None or []: the kernel size
        return cls(kernel, stride, _per_dim(options["padding"], dims), _per_dim(options["dilation"], dims),
                   bool(options["ceil_mode"]))

    @property
    def strided(self) -> bool:
        return any(step > 1 for step in self.stride)

    @property
    def extent(self) -> tuple[int, ...]:
        """The span of a window in input pixels, dilation included."""
        return tuple((k - 1) * d + 1 for k, d in zip(self.kernel, self.dilation))

    def outputs(self, size: int, axis: int) -> int:
        """The op's output size along spatial ``axis`` for an input of ``size`` (torch's rule, ceil mode included)."""
        step, pad = self.stride[axis], self.padding[axis]
        span = size + 2 * pad - self.extent[axis] + (step - 1 if self.ceil_mode else 0)
        count = span // step + 1
        return count - 1 if self.ceil_mode and (count - 1) * step >= size + pad else count


def _boxed(weight: Tensor, stride: tuple[int, ...], dilation: tuple[int, ...]) -> Tensor:
    """``weight`` (dilated) convolved with a box of ones of size ``stride``, over the box's size.

    The kernel of a window op's stride-1 form followed by the average of each
    ``stride`` block; built from shifted copies, out of place.
    """
    if any(d > 1 for d in dilation):
        spread = weight.new_zeros(*weight.shape[:2], *((k - 1) * d + 1 for k, d in zip(weight.shape[2:], dilation)))
        spread[(slice(None), slice(None), *(slice(None, None, d) for d in dilation))] = weight
        weight = spread
    dims = len(stride)
    for axis, step in enumerate(stride):
        if step > 1:  # F.pad lists the last dimension first
            weight = torch.stack([F.pad(weight, [0, 0] * (dims - 1 - axis) + [shift, step - 1 - shift])
                                  for shift in range(step)]).sum(0)
    return weight / math.prod(stride)


@dataclass
class _SmoothedConv:
    """A strided window op's stride-1 form followed by the stride x stride average, as a rule for convolutions sees
    an op call: a convolution (depthwise with an averaging kernel for max pooling).

    It offers what the term form of a :class:`BasicRule` reads (``inputs``,
    ``weight``, ``bias``, ``evaluate``, ``output``); ``weight`` is the op's
    own, and :meth:`evaluate` smooths whatever weight a rule gives it, so that
    the rule's modifiers act before the box. It is not transposable, so the
    fused forms do not apply.
    """

    call: OpCall
    window: _Window
    weight: Tensor
    bias: Tensor | None
    groups: int
    func: Callable[..., Tensor]
    kind: str = "conv"
    transposable: bool = False  # no fused form: the rule takes its reference form

    @classmethod
    def of(cls, call: OpCall, window: _Window) -> _SmoothedConv:
        dims = len(window.kernel)
        func = _CONVOLUTIONS[dims - 1]
        if call.kind == "maxpool":  # the average over each window: a depthwise convolution with a constant kernel
            (x,) = call.inputs
            channels = x.shape[-dims - 1]
            weight = x.new_full((channels, 1, *window.kernel), 1.0 / math.prod(window.kernel))
            return cls(call, window, weight, None, channels, func)
        options = call.arguments
        return cls(call, window, options["weight"], options["bias"], options.get("groups", 1), func)  # type: ignore

    @property
    def inputs(self) -> tuple[Tensor, ...]:
        return self.call.inputs

    @property
    def output(self) -> Tensor:
        with torch.no_grad():
            return self.evaluate(self.call.inputs[0], self.weight, self.bias)

    def evaluate(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """The convolution with ``weight`` smoothed (:func:`_boxed`): output n reads ``x[s n - p : s n - p + k+s-1]``.

        The far end is padded with zeros so that there are as many outputs as
        the op gives (F.pad lists the last dimension first).
        """
        window = self.window
        sizes = x.shape[-len(window.kernel):]
        far = [(window.outputs(size, axis) - 1) * step + extent + step - 1 - (size + 2 * pad)
               for axis, (size, step, pad, extent) in enumerate(zip(sizes, window.stride, window.padding,
                                                                     window.extent))]
        if any(far):
            x = F.pad(x, [value for extra in reversed(far) for value in (0, extra)])
        return self.func(x, _boxed(weight, window.stride, window.dilation), bias, stride=window.stride,
                         padding=window.padding, groups=self.groups)

    def routed_image(self, value: Tensor | float) -> Tensor | None:
        """ZBox's bounds taken through the routing ops before the op (:meth:`ParametricView.routed_image`)."""
        return self.call.routed_image(value)  # type: ignore[attr-defined]  # convolutions are parametric

    def describe(self) -> str:
        return f"the smoothed stride-1 form of {self.call.describe()}"


def _no_surrogate(x: Tensor, **arguments: Any) -> Tensor:
    """The surrogate of rules that build theirs from the op call (:meth:`AsFunction.surrogate_output`)."""
    raise NotImplementedError("relprop: this rule builds its surrogate from the op call")


def _per_dim(value: int | Sequence[int], dims: int) -> tuple[int, ...]:
    """A convolution option (an int or one value per dimension) as one value per dimension."""
    return (value,) * dims if isinstance(value, int) else tuple(value)


_CONVOLUTIONS = (torch.conv1d, torch.conv2d, torch.conv3d)
