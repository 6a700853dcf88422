"""What a rule may read and call on an op call: the contract between the engine's op calls and the rules.

The engine hands every rule an op call (:class:`relprop.engine.OpCall` or a
subclass); a rule reads it only through these protocols, so the op calls'
other members are the engine's to change. Which protocol a call satisfies
follows from its ``kind`` (:class:`OpKind`): ``"conv"`` and ``"dense"``
calls are :class:`ParametricView`, ``"attention"`` calls
:class:`AttentionView`, ``"product"`` calls :class:`ProductView`,
``"softmax"`` calls :class:`SoftmaxView`, ``"maxpool"`` calls
:class:`PoolView`; every call is a :class:`Call`."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol, TypeGuard, overload

from torch import Tensor


class Call(Protocol):
    """Any op call."""

    @property
    def kind(self) -> str:
        """The op family (see :mod:`relprop.rules`)."""

    @property
    def func(self) -> Callable:
        """The torch function the op called (``torch.conv2d``, ``F.max_pool2d``, ...)."""

    @property
    def inputs(self) -> tuple[Tensor, ...]:
        """The activation inputs, detached."""

    @property
    def output(self) -> Tensor:
        """The op's output; None once the engine has dropped it (the rule's ``needs_output`` is False)."""

    @property
    def prepared(self) -> Tensor:
        """What the rule's :meth:`~relprop.rules.Rule.prepare` returned for this call, for its ``propagate``."""

    @property
    def arguments(self) -> dict[str, Any] | None:
        """The op's arguments other than its activation inputs, by the names its torch function gives them.

        Parametric ops give ``weight`` and ``bias`` (a merged BatchNorm
        included) and their options; other ops their arguments bound to their
        signature, defaults filled in. None where the function has no
        signature to bind to, or the activations are nested in containers.
        """

    @property
    def output_nonnegative(self) -> bool:
        """Whether an in-place ReLU has since written ``relu(output)`` into the output's memory."""

    @property
    def reusable(self) -> bool:
        """Whether the call serves several backward passes: the rule must not write into its inputs, its output
        or what it prepared (:meth:`take_output` then gives None, :attr:`scratch` is empty)."""

    @property
    def scratch(self) -> frozenset[int]:
        """Indices of :attr:`inputs` that are copies only the rule reads: it may write into them."""

    @property
    def vjp_reads_inputs(self) -> bool:
        """Whether :meth:`vjp` reads the values of :attr:`inputs` (a product's closed form reads the other factor);
        else it reads the op's autograd graph or its weight alone."""

    def vjp(self, grad: Tensor) -> tuple[Tensor | None, ...]:
        """The vector-Jacobian product of the (linearised) op with respect to :attr:`inputs`.

        Only where the rule's ``needs_vjp`` is True, or on a ``conv``/``dense`` call that is ``transposable``.
        """

    def take_output(self) -> Tensor | None:
        """:attr:`output` handed over for the rule to write into, where nothing else holds it; else None."""

    def describe(self) -> str:
        """The op and the path of the module that issued it, for messages."""


class ParametricView(Call, Protocol):
    """A parametric linear op ``f(x; weight, bias)`` (``kind`` ``"conv"`` or ``"dense"``) of one activation input."""

    @property
    def weight(self) -> Tensor:
        """The weight, a merged BatchNorm's scale included."""

    @property
    def bias(self) -> Tensor | None:
        """The bias, a merged BatchNorm included."""

    @property
    def evaluate(self) -> Callable[[Tensor, Tensor, Tensor | None], Tensor]:
        """``evaluate(x, weight, bias)``: the op on another input with other parameters."""

    @property
    def input_nonnegative(self) -> bool:
        """Whether the input is known to be ``>= 0`` (a ReLU's output), without a look at it."""

    @property
    def transposable(self) -> bool:
        """Whether :meth:`transpose_with` and the methods built on it are available."""

    def bias_term(self) -> Tensor:
        """The bias shaped to broadcast against the output (where there is a bias)."""

    @overload
    def weight_parts(self, negative: Literal[True]) -> tuple[Tensor, Tensor]: ...
    @overload
    def weight_parts(self, negative: Literal[False]) -> tuple[Tensor, None]: ...

    def weight_parts(self, negative: bool) -> tuple[Tensor, Tensor | None]:
        """``W+`` in the shared workspace (valid while the rule runs) and, if ``negative``, ``W-``."""

    def negative_weight(self, out: Tensor) -> Tensor:
        """``W-`` written into ``out``, a weight-sized tensor the rule is done with."""

    def transpose_with(self, grad: Tensor, weight: Tensor, like: Tensor | None = None) -> Tensor:
        """The VJP of the op with ``weight`` with respect to its input: one transposed product (if transposable)."""

    def vjp_scaled(self, grad: Tensor, scale: Callable[[Tensor, Tensor | None], Tensor]) -> tuple[Tensor | None, ...]:
        """:meth:`vjp` of ``grad * scale(z, b)`` (``z`` the output, ``b`` the bias broadcast against it, or None).

        ``scale`` must work entry by entry: where few rows of a dense layer's ``grad`` hold relevance, it may see
        those rows of the output alone.
        """

    def transpose_beside(self, grad: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        """``W^T grad`` and ``weight^T grad`` from one transposed product (where the weight allows)."""

    def stack_signs(self, x: Tensor) -> tuple[Tensor, Tensor] | None:
        """``x+ | x-`` side by side along the input channels and ``W+ | W-`` to match; None where grouped."""

    def input_channel_axis(self, x: Tensor) -> int:
        """The axis of ``x`` that holds its channels."""

    def scale_input_channels(self, weight: Tensor, scale: Tensor) -> Tensor | None:
        """``weight`` scaled in place per input channel; None (untouched) where the weight does not allow."""

    def routed_image(self, image: float | Tensor) -> Tensor | None:
        """``image`` taken from the model input's space through the routing ops that made the input, or None."""


class ProductView(Call, Protocol):
    """A product of activations and constants (``kind`` ``"product"``)."""

    @property
    def factors(self) -> tuple[str | None, ...]:
        """Per activation factor, the tag of what produced it (``"sigmoid"``, ``"statistic"``, ``"divisor"``,
        ``"exp"``, ``"softmax"``, ``"activation"``; None: nothing of note)."""

    @property
    def matrix(self) -> bool:
        """Whether it is a matrix product (else elementwise)."""


class SoftmaxView(Call, Protocol):
    """A softmax inside the model (``kind`` ``"softmax"``)."""

    @property
    def dim(self) -> int:
        """The softmax dimension."""


class PoolView(Call, Protocol):
    """A max pooling (``kind`` ``"maxpool"``)."""

    @property
    def average(self) -> Callable[[Tensor], Tensor] | None:
        """The average pooling over the same windows; None where there is none (a dilated max pooling)."""


class AttentionView(Call, Protocol):
    """``F.scaled_dot_product_attention`` (``kind`` ``"attention"``)."""

    @property
    def parts(self) -> dict[str, Any]:
        """Its arguments by name (``query``, ``key``, ``value``, ``attn_mask``, ``is_causal``, ``scale``, ...)."""

    @property
    def roles(self) -> tuple[str, ...]:
        """The names of the arguments that are activations, in the order of :attr:`Call.inputs`."""


def is_parametric(call: Call) -> TypeGuard[ParametricView]:
    """Whether ``call`` is a parametric linear op (``conv``, ``dense``)."""
    return call.kind in ("conv", "dense")


def is_product(call: Call) -> TypeGuard[ProductView]:
    """Whether ``call`` is a product of activations."""
    return call.kind == "product"


def is_attention(call: Call) -> TypeGuard[AttentionView]:
    """Whether ``call`` is a fused attention."""
    return call.kind == "attention"
