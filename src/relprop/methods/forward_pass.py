"""One forward pass under the engine, kept: the relevance of its inputs for any seed (``lrp.record``)."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor

from relprop._core.errors import ConservationWarning, warn_caller
from relprop._core.tensors import held_rows, per_unit
from relprop.engine.session import Session
from relprop.methods.protocol import eager
from relprop.methods.targets import LOST_SEED

__all__ = ["ForwardPass", "per_input"]


class ForwardPass:
    """One forward pass under the engine: the inputs as it saw them, the logits, the token embeddings.

    Attributes
    ----------
    inputs : tuple of Tensor
        Floating-point inputs as leaves that require grad; integer inputs as given.
    logits : Tensor
    """

    def __init__(self, inputs: tuple[Tensor, ...], logits: Tensor, embeddings: dict[int, list[Tensor]],
                 reusable: bool = False, session: Session | None = None, gradient_form: bool = False,
                 backward: Callable[[], AbstractContextManager] = nullcontext, differentiable: bool = False):
        self.inputs = inputs
        self.logits = logits
        #: whether the pass carries relevance per unit of activation (``Session(gradient_form=True)``)
        self.gradient_form = gradient_form
        #: whether it carries relevance any number of times (see :meth:`LRP.record`)
        self.reusable = reusable
        self._embeddings = embeddings
        #: the session that recorded the pass, if its guard checks the relevance's account (Session.check_pass)
        self._session = session
        self._backward = backward  # the context of its backward passes
        #: whether its relevance is a function of the parameters and inputs (:mod:`relprop.methods.differentiable`)
        self.differentiable = differentiable

    @eager
    def relevance(self, seed: Tensor) -> tuple[Tensor, ...]:
        """Propagate ``seed`` from the logits: the relevance of each input."""
        return self.propagate(seed)

    def propagate(self, seed: Tensor, owned: bool = False, create_graph: bool = False) -> tuple[Tensor, ...]:
        """:meth:`relevance`; ``owned``: the seed is the caller's to overwrite (in gradient form it is, with its
        value per unit of the logits); ``create_graph``: record the backward pass, so that the relevance can be
        differentiated with respect to a seed that requires grad (it is linear in the seed), and on a pass recorded
        with ``create_graph=True`` with respect to the parameters and inputs too."""
        explained = [x for x in self.inputs if x.requires_grad]
        embedded = [leaf for leaves in self._embeddings.values() for leaf in leaves]
        if (explained or embedded) and not self.logits.requires_grad:
            raise RuntimeError("relprop: the model output does not depend on the inputs through autograd: the model "
                               "detached it, or computed it under torch.no_grad()")
        session = self._session
        if not self.reusable:
            self._session = None
        if session is not None and (explained or embedded):
            session.defer_check()  # checked below with the seed and the inputs' relevance, in one read
        with self._backward():
            found = (torch.autograd.grad(self.logits, explained + embedded, self._carried(seed, owned),
                                         allow_unused=True,
                                         retain_graph=self.reusable or (create_graph and self.differentiable),
                                         create_graph=create_graph)
                     if explained or embedded else ())
        if self.gradient_form:  # per unit of each leaf: its relevance is the leaf times that
            attached = self.differentiable and create_graph
            found = tuple(None if g is None else g * (leaf if attached else leaf.detach())
                          for g, leaf in zip(found, explained + embedded))
        if session is not None and (explained or embedded):
            session.check_pass(seed, [g for g in found if g is not None])
        grads = iter(found)
        by_leaf = {id(leaf): next(grads) for leaf in explained + embedded}
        own = {index: by_leaf[id(x)] for index, x in enumerate(self.inputs) if x.requires_grad}
        collected = {index: [by_leaf[id(leaf)] for leaf in leaves] for index, leaves in self._embeddings.items()}
        return per_input(self.inputs, own, collected, seed.dtype)

    def _carried(self, seed: Tensor, owned: bool) -> Tensor:
        """What the backward pass starts from: the seed, or in gradient form the seed per unit of the logits.

        ``owned``: the seed may be overwritten. A seed entry at a logit of exactly 0 has no such form: it is lost,
        with a warning. Where few rows of the seed (along its last dimension) hold entries, those rows alone are
        divided and checked (:func:`~relprop._core.tensors.held_rows`): the others are 0 either way.
        """
        if not self.gradient_form:
            return seed
        # a differentiable pass: per unit of the logits as the parameters make them, written into nothing that
        # autograd saved
        logits, owned = (self.logits, False) if self.differentiable else (self.logits.detach(), owned)
        if seed.dtype != logits.dtype or not seed.is_contiguous():
            seed, owned = seed.to(logits.dtype, memory_format=torch.contiguous_format), not self.differentiable
        rows = held_rows(seed)
        if rows is None:
            lost = ((logits == 0) & (seed != 0)).any()
            carried = per_unit(seed, logits, owned)
        else:  # a few positions explained (a next-token logit of a vocabulary): their rows alone are divided
            width = seed.shape[-1]
            flat, at = seed.view(-1, width), logits.reshape(-1, width)[rows]
            held = flat[rows]
            lost = ((at == 0) & (held != 0)).any()
            carried = (flat if owned else torch.zeros_like(flat)).index_copy_(
                0, rows, per_unit(held, at, owned=not self.differentiable))
        if lost:
            warn_caller(LOST_SEED, ConservationWarning)
        return carried.view_as(self.logits)

    def relevances(self, seeds: Tensor) -> tuple[Tensor, ...]:
        """The relevance of each input for each of ``seeds`` (a leading seed dimension): one backward pass each.

        Each seed is ``seeds[k]``, shaped like the logits; each result has the seed dimension first. The pass
        must be reusable (see :meth:`LRP.record`).
        """
        if not self.reusable:
            raise RuntimeError("relprop: this recorded pass carries relevance once; record it with reusable=True "
                               "to propagate several seeds")
        if seeds.shape[1:] != self.logits.shape:
            raise ValueError(f"relprop: seeds of shape {tuple(seeds.shape)} do not stack seeds of the logits' shape "
                             f"{tuple(self.logits.shape)}")
        found = [self.relevance(seed) for seed in seeds]
        return tuple(torch.stack(per_input) for per_input in zip(*found))


def per_input(inputs: tuple[Tensor, ...], own: Mapping[int, Tensor | None],
              collected: Mapping[int, Sequence[Tensor | None]],
              dtype: torch.dtype) -> tuple[Tensor, ...]:
    """The relevance of each input, by position: a floating-point input's ``own`` (None: 0) plus what its probes
    ``collected`` (rules that fill zeros, in the compiled tier); token ids' the relevance their embeddings'
    probes collected, summed over the last dimension, in ``dtype`` (a probe's is float64)."""
    relevance = []
    for index, x in enumerate(inputs):
        probes = [grad for grad in collected.get(index, ()) if grad is not None]
        if x.requires_grad:
            found = own.get(index)
            total = found if found is not None else torch.zeros_like(x)
            for grad in probes:
                total = total + grad
        else:
            total = torch.zeros(x.shape, dtype=dtype, device=x.device)
            for grad in probes:
                total = total + grad.sum(-1).reshape(x.shape).to(dtype)
        relevance.append(total)
    return tuple(relevance)
