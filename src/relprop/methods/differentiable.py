"""Relevance that autograd differentiates with respect to the inputs and the parameters (``create_graph=True``).

Interception computes relevance in a backward pass of its own, on detached copies of the activations and with the
parameters frozen: its relevance is a number, not a function autograd can differentiate. A differentiable
relevance runs the model's forward pass as the compiled tier writes it (:mod:`relprop.engine.compiled`): traced by
Dynamo, each op's rule decided by interception itself and written as its gradient form (the op's value, the
rule's gradient), with the parameters as they are. The relevance is then the inputs times the gradient of that
program, taken with ``create_graph=True``, and is a function of the parameters and inputs like any other.

What a rule holds constant in its gradient form (the epsilon rule's ``z / (z + eps sign z)``, a Gamma rule's
shares, a norm's statistic) is held only while the relevance is computed, and differentiated afterwards
(:mod:`relprop._core.held`): the derivative is that of the relevance function itself, what finite differences of
:meth:`~relprop.LRP.attribute` measure, not one with the held quantities taken as constants.

The program runs without AOT autograd, under compile=True too: AOT autograd has no double backward ("torch.compile
with aot_autograd does not currently support double backward"), so the training step is Dynamo's captured graph
run eagerly, not one Inductor program. A model that Dynamo cannot capture whole, or an op or rule that has no
gradient form, raises :class:`~relprop.UnsupportedOpError` with the reason: interception has no differentiable form
to fall back to. Recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) run unrolled into the ops interception
explains them by (:func:`~relprop.ops.recurrent.unrolled_layers`). Fused attention
(``F.scaled_dot_product_attention``) runs its math kernel: PyTorch's flash kernel on the CPU has no double backward.
"""
from __future__ import annotations

import threading
from contextlib import AbstractContextManager, nullcontext
from typing import Any, cast

from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from relprop._core.errors import UnsupportedOpError
from relprop._core.held import Holding, holding
from relprop.engine.session import Session
from relprop.methods.compiled import Compiled, FiniteCheck
from relprop.methods.forward_pass import ForwardPass
from relprop.ops.recurrent import unrolled_layers
from relprop.methods.targets import model_logits

__all__ = ["Differentiable"]


#: held while a differentiable forward pass runs (see Differentiable.record)
_FORWARD = threading.Lock()


class Differentiable(Compiled):
    """The program of a differentiable relevance for one :class:`~relprop.LRP` (its model and composite).

    A :class:`~relprop.methods.compiled.Compiled` whose graph runs as Dynamo captured it, rewritten (no AOT
    autograd, which has no double backward), with the parameters requiring grad as the user set them, and whose
    failures raise instead of falling back.
    """

    compilers = ("eager",)

    def __init__(self, model: nn.Module, composite: Any):
        super().__init__(model, composite, "eager")

    def record(self, model: nn.Module, leaves: tuple[Tensor, ...], extra: tuple, keywords: dict[str, Any],
               composite: Any, reusable: bool, strict: bool, guard: bool) -> ForwardPass:
        """One forward pass of the program on ``leaves``: its relevance for any seed is differentiable
        (:meth:`~relprop.methods.ForwardPass.propagate` with ``create_graph=True``)."""
        pass_ = Holding()
        # the math kernel of fused attention: the CPU's flash kernel has no double backward
        from torch._dynamo import config  # imported already: the program is a torch.compile function

        # Dynamo traces a recurrent layer's forward (allow_rnn) where unrolled_layers wrote it op by op; both
        # change what every thread sees, so one differentiable forward pass runs at a time
        with (_FORWARD, holding(pass_), sdpa_kernel(SDPBackend.MATH), unrolled_layers(model),
              config.patch(allow_rnn=True)):
            found = self.forward(model, leaves, extra, keywords, composite)
        assert found is not None  # _fell_back raised
        output, probes = found
        check = cast(Session, FiniteCheck(strict)) if guard else None
        return ForwardPass(leaves, model_logits(output), {i: [p] for i, p in enumerate(probes)}, reusable, check,
                           True, pass_.relevance_pass, differentiable=True)

    def _parameters(self) -> AbstractContextManager:
        return nullcontext()  # the relevance is differentiated with respect to them

    def _fell_back(self, reason: str) -> None:
        raise UnsupportedOpError(f"relprop: create_graph=True cannot write this model's relevance as a "
                                 f"differentiable program: {reason}")

