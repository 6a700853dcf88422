"""Rules of Relevance Patching (RelP, Jafari et al. 2025): the plain gradient in gradient form, and the
Identity-rule with its stabiliser.

In gradient form (relevance per unit of activation ``G = R / x``, see
``relprop._core.gradient_form``) the plain gradient of an op is a rule like
any other: :class:`PlainGradient` hands each input the op's own VJP of ``G``,
as the reference implementation of RelP does wherever it modifies nothing
(attention without its AH-rule). :class:`Identity` is that implementation's
Identity-rule for activation functions (Jafari et al. 2024): the activation
passes its relevance on as if it were the identity, ``G_x = G * act(x) / x``,
with ``x`` stabilised as there.
"""
from __future__ import annotations

from torch import Tensor

from relprop._core.contract import Call
from relprop._core.kinds import OpKind
from relprop._core.rule import Pass, Reads, Rule, Scaled
from relprop._core.stabilizers import inverse_denominator
from relprop._core.tensors import per_unit, sum_to


class PlainGradient(Rule[Call]):
    """The op's plain gradient in gradient form: ``G_x = VJP_x(G)`` for every activation input, on any op.

    In relevance form this is each input's gradient times input of the relevance per unit of output,
    ``R_x = x * VJP_x(R / z)`` (0 where ``z`` is 0). Unlike :class:`~relprop.rules.Gradient`, which applies the
    VJP to the relevance itself (the engine's fallback for ops without a rule), the two forms agree: under a
    composite in gradient form the op is run as plain autograd.

    Source: RelP's reference implementation (Jafari et al. 2025, FarnoushRJ/RelP) leaves attention to the plain
    gradient unless its AH-rule holds the attention weights.
    """

    kinds = frozenset(OpKind) - {OpKind.UNKNOWN}
    needs_vjp = True

    def propagate(self, call: Call, relevance: Tensor) -> tuple[Tensor | None, ...]:
        """``R_x = x * VJP_x(R / z)`` for each activation input ``x``."""
        grads = call.vjp(per_unit(relevance, call.output))
        return tuple(None if grad is None else grad * x for grad, x in zip(grads, call.inputs))

    def gradient_reads(self, call: Call) -> Reads:
        return Reads(vjp=True, native=True)

    def scaled(self, call: Call) -> Scaled:
        """``G_x = VJP_x(G)``."""
        return Scaled()


class Identity(Rule[Call]):
    """The Identity-rule of activation functions: ``R_x = R * x / (x + eps sign x)``, ``G_x = G * act(x) / (x + eps
    sign x)`` (``sign(0) = +1``).

    The activation passes its relevance on unchanged, up to the stabiliser; with ``epsilon = 0`` this is
    :class:`~relprop.rules.Pass`. An op that scales its input (a ReLU, a product with constants) passes its plain
    gradient, as :class:`~relprop.rules.Pass` does there. It applies where :class:`~relprop.rules.Pass` does.

    Source: Jafari et al. 2024 (MambaLRP), used by RelP (Jafari et al. 2025). The reference implementation's
    activation ``x' * (act(x) / x').detach()`` with ``x' = x + (sign(x) + [x = 0]) 1e-6`` has this gradient form
    with ``epsilon = 1e-6``.

    Parameters
    ----------
    epsilon : float
        The stabiliser added to ``x`` (signed, ``+epsilon`` at 0).
    """

    kinds = Pass.kinds
    needs_output = False  # the relevance form reads x alone

    def __init__(self, epsilon: float = 1e-6):
        self.epsilon = epsilon
        self._pass = Pass()

    def _exact(self, call: Call) -> bool:
        """Whether Pass's own forms apply: no stabiliser, or an op that scales its input (its VJP then)."""
        return self.epsilon == 0 or bool(self._pass.gradient_reads(call).native)

    def accepts(self, call: Call) -> bool:
        return self._pass.accepts(call)

    def propagate(self, call: Call, relevance: Tensor) -> tuple[Tensor | None, ...]:
        """``R * x / (x + eps sign x)``, summed to the input's shape."""
        if self._exact(call):
            return self._pass.propagate(call, relevance)
        (x,) = call.inputs
        return (sum_to(relevance, x.shape) * x * inverse_denominator(x, self.epsilon),)

    def gradient_reads(self, call: Call) -> Reads:
        return self._pass.gradient_reads(call) if self._exact(call) else Reads(output=True, inputs=True)

    def scaled(self, call: Call) -> Scaled:
        """``G * act(x) / (x + eps sign x)``, summed to the input's shape; an op that scales its input: its VJP."""
        return self._pass.scaled(call) if self._exact(call) else Scaled(ratio=True, stabiliser=self.epsilon)

    def conserves(self, call: Call) -> bool:
        return True
