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

AOT autograd has no double backward ("torch.compile with aot_autograd does not currently support double
backward"). A recorded pass (:meth:`Differentiable.record`), whose relevance pass and derivative are two backward
passes of one graph, runs Dynamo's graph as it is. A whole attribution under ``compile=``
(:meth:`Differentiable.whole`) is compiled with the relevance pass traced into the program
(:func:`~relprop._core.held.relevance_grad`): AOT autograd traces it while the held quantities get no gradient,
and the program's own backward pass afterwards, so that a training step is one program. A model that Dynamo
cannot capture whole, or an op or rule that has no gradient form, raises :class:`~relprop.UnsupportedOpError`
with the reason: interception has no differentiable form to fall back to. Recurrent layers (``nn.LSTM``,
``nn.GRU``, ``nn.RNN``) run unrolled into the ops interception explains them by
(:func:`~relprop.ops.recurrent.unrolled_layers`). Fused attention
(``F.scaled_dot_product_attention``) runs its math kernel: PyTorch's flash kernel on the CPU has no double backward.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, cast

import torch
from torch import Tensor, fx, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from relprop._core.errors import UnsupportedOpError
from relprop._core.held import Holding, holding, relevance_grad
from relprop.engine.session import Session
from relprop.methods.compiled import COMPILERS, Compiled, FiniteCheck
from relprop.methods.forward_pass import ForwardPass
from relprop.ops.recurrent import unrolled_layers
from relprop.methods.targets import model_logits

__all__ = ["Differentiable", "own_leaves"]


#: held while a differentiable forward pass runs (see Differentiable.record)
_FORWARD = threading.Lock()


class Differentiable(Compiled):
    """The program of a differentiable relevance for one :class:`~relprop.LRP` (its model and composite).

    A :class:`~relprop.methods.compiled.Compiled` whose parameters require grad as the user set them, and whose
    failures raise instead of falling back. A recorded pass (:meth:`record`) runs its graph as Dynamo captured
    it, rewritten: its relevance is differentiated by a double backward pass, which AOT autograd does not have. A
    whole attribution (:meth:`whole`) compiles with ``compiler``: the relevance pass is traced into the program,
    whose one backward pass is the derivative.

    Parameters
    ----------
    model : nn.Module
    composite : Composite
    compiler : str
        ``"eager"`` (Dynamo's graph run as it is), or one of :data:`~relprop.methods.compiled.COMPILERS`.
    """

    compilers = ("eager", *COMPILERS)
    #: a program of its own per batch size: a training loop has few (a smaller last batch), and a static program
    #: runs a step of a small model faster than a dynamic one, whose sizes its wrapper computes at every call
    compile_dynamic = False

    def __init__(self, model: nn.Module, composite: Any, compiler: str = "eager"):
        super().__init__(model, composite, compiler)

    def record(self, model: nn.Module, leaves: tuple[Tensor, ...], extra: tuple, keywords: dict[str, Any],
               composite: Any, reusable: bool, strict: bool, guard: bool) -> ForwardPass:
        """One forward pass of the program on ``leaves``: its relevance for any seed is differentiable
        (:meth:`~relprop.methods.ForwardPass.propagate` with ``create_graph=True``)."""
        pass_, (leaves, _) = Holding(), own_leaves(leaves)
        with _differentiable_run(model, pass_):
            found = self.forward(model, leaves, extra, keywords, composite)
        assert found is not None  # _fell_back raised
        output, probes = found
        check = cast(Session, FiniteCheck(strict)) if guard else None
        return ForwardPass(leaves, model_logits(output), {i: [p] for i, p in enumerate(probes)}, reusable, check,
                           True, pass_.relevance_pass, differentiable=True)

    def whole(self, model: nn.Module, leaves: tuple[Tensor, ...], extra: tuple, keywords: dict[str, Any],
              composite: Any, target: Any, totals: bool = False, create_graph: bool = True,
              differentiated: tuple[int, ...] = ()) -> tuple[tuple[Tensor, ...], Tensor | None] | None:
        """The differentiable relevance as one program (:meth:`Compiled.whole` with ``create_graph``); None where
        the target is not indices (:attr:`split` says so): the caller then records a pass. The inputs it is
        differentiated in are those of ``leaves`` that require grad (:func:`own_leaves`), whatever
        ``differentiated`` says."""
        leaves, self._local.differentiated = own_leaves(leaves)
        with _differentiable_run(model, Holding()):
            return super().whole(model, leaves, extra, keywords, composite, target, totals, True,
                                 self._local.differentiated)

    def _compile(self, gm: fx.GraphModule, example_inputs: list[Any], kind: str) -> Any:
        """A recorded pass's graph runs as it is; a whole attribution's relevance pass is traced as the relevance
        pass of the call's :class:`~relprop._core.held.Holding` (its held quantities get no gradient in it), then
        compiled by :attr:`compiler`."""
        if kind == "forward pass":
            return gm.forward  # as Dynamo's "eager" backend runs it
        # the attribution's own pass is the last (a model may differentiate something in its forward pass, as
        # model_nodes reads the graph): that one alone is the relevance pass
        grad = next(reversed(gm.graph.find_nodes(op="call_function", target=torch.autograd.grad)), None)
        if grad is not None:
            grad.target = relevance_grad
            _derivative_needless(gm, self._local.call.leaves, self._local.differentiated)
            gm.recompile()
        return super()._compile(gm, example_inputs, kind)

    def _parameters(self) -> AbstractContextManager:
        return nullcontext()  # the relevance is differentiated with respect to them

    def _fell_back(self, reason: str) -> None:
        raise UnsupportedOpError(f"relprop: create_graph=True cannot write this model's relevance as a "
                                 f"differentiable program: {reason}")


def own_leaves(leaves: tuple[Tensor, ...]) -> tuple[tuple[Tensor, ...], tuple[int, ...]]:
    """The leaves a differentiable program runs on, from :func:`~relprop.methods._inputs.explained_arguments`'
    with ``attached``: each floating-point input that does not require grad (a detached copy, relprop's own)
    made to require it; and the numbers of those that required it already, the inputs that the relevance is
    differentiated in."""
    differentiated = tuple(index for index, x in enumerate(leaves) if x.requires_grad)
    # the caller's own tensors (those that require grad, and token ids) are left untouched
    own = tuple(x.requires_grad_() if x.is_floating_point() and not x.requires_grad else x for x in leaves)
    return own, differentiated


def _derivative_needless(gm: fx.GraphModule, leaves: tuple[Tensor, ...], differentiated: tuple[int, ...]) -> None:
    """In a whole attribution's graph, each input leaf that the relevance is not differentiated in (not
    numbered in ``differentiated``) replaced by a leaf of its own made in the graph: AOT autograd computes the
    derivative of every input that requires grad, whether or not anything reads it, and the input's derivative
    costs as much as a layer's (the first layer's product with the incoming gradient)."""
    needless = [leaf for index, leaf in enumerate(leaves) if index not in differentiated and leaf.requires_grad]
    for n in gm.graph.find_nodes(op="placeholder"):
        graph_arg = n.meta.get("grapharg")
        if graph_arg is None or not any(graph_arg.example is leaf for leaf in needless):
            continue
        with gm.graph.inserting_after(n):
            detached = gm.graph.call_method("detach", (n,))
        with gm.graph.inserting_after(detached):
            leaf = gm.graph.call_method("requires_grad_", (detached,))
        n.replace_all_uses_with(leaf, delete_user_cb=lambda user: user is not detached)


@contextmanager
def _differentiable_run(model: nn.Module, pass_: Holding) -> Iterator[None]:
    """Where a differentiable program runs (and is traced): ``pass_`` holds, fused attention takes its math kernel
    (the CPU's flash kernel has no double backward), and recurrent layers run unrolled."""
    from torch._dynamo import config  # imported already: the program is a torch.compile function

    # Dynamo traces a recurrent layer's forward (allow_rnn) where unrolled_layers wrote it op by op; both change
    # what every thread sees, so one differentiable forward pass runs at a time
    with (_FORWARD, holding(pass_), sdpa_kernel(SDPBackend.MATH), unrolled_layers(model) as layers,
          config.patch(allow_rnn=True) if layers else nullcontext()):  # patching costs more than the check
        yield
