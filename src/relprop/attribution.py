"""The public attribution API, compatible with captum's ``LRP`` and its ``Attribution`` protocol."""
from __future__ import annotations

import functools
import gc
import numbers
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from . import composites
from .adapters import hold_selective_parameters
from .engine import Session

__all__ = ["Attribution", "LRP", "ForwardPass", "Contrastive", "output_relevance", "target_mask", "model_logits",
           "convergence_delta"]

Target = int | tuple | Sequence | Tensor | None
Inputs = Tensor | Sequence[Tensor]
_F = TypeVar("_F", bound=Callable[..., Any])


def model_logits(output: Any) -> Tensor:
    """The tensor a model's output is explained on: itself, its ``logits``, or its first tensor."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping) or hasattr(output, "keys"):
        if "logits" in output.keys() and isinstance(output["logits"], Tensor):
            return output["logits"]
        values = list(output.values())
    elif isinstance(output, (tuple, list)):
        values = list(output)
    else:
        raise TypeError(f"relprop: the model returned {type(output).__name__}; expected a tensor, a tuple, "
                        "a dict or a ModelOutput holding one")
    for value in values:
        if isinstance(value, Tensor):
            return value
    raise TypeError(f"relprop: the model returned a {type(output).__name__} without any tensor to explain")


def _is_index(value: Any) -> bool:
    if isinstance(value, Tensor):
        return value.dim() == 0 and not value.is_floating_point() and value.dtype != torch.bool
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_index(index: tuple, shape: torch.Size, target: Any) -> tuple[int, ...]:
    if len(index) > len(shape) - 1:
        raise ValueError(f"relprop: target {target!r} has {len(index)} indices, but the model output of shape "
                         f"{tuple(shape)} has only {len(shape) - 1} dimension(s) after the batch dimension")
    checked = []
    for dim, value in enumerate(index, start=1):
        if not _is_index(value):
            raise TypeError(f"relprop: target {target!r} must hold integers, got {type(value).__name__}")
        value, size = int(value), shape[dim]
        if not -size <= value < size:
            raise ValueError(f"relprop: target {target!r} is out of range for the model output of shape "
                             f"{tuple(shape)}: index {value} on dimension {dim} of size {size}")
        checked.append(value)
    return tuple(checked)


def target_mask(output: Tensor, target: Target) -> Tensor:
    """A boolean mask of the output entries that ``target`` selects (captum's semantics).

    ``target`` is None (one output per example), an int (the class along
    dimension 1), a tuple indexing the dimensions after the batch dimension
    (``(-1, token)``), or a list / 1-D integer tensor with one such target per
    example. A list or tensor of one target is used for every example, as
    captum does (``torch.tensor([2])`` for a batch of 4).
    """
    batch = output.shape[0] if output.dim() else 1
    mask = torch.zeros_like(output, dtype=torch.bool)
    if target is None:
        if output.numel() != batch:
            raise ValueError(f"relprop: the model output has shape {tuple(output.shape)}, more than one value per "
                             "example; pass target= to choose which one to explain")
        mask.fill_(True)
    elif _is_index(target) or isinstance(target, tuple):
        index = _check_index(target if isinstance(target, tuple) else (target,), output.shape, target)
        mask[(slice(None), *index)] = True  # type: ignore[index]  # mypy misreads the starred ints
    elif isinstance(target, (list, Tensor)):
        if isinstance(target, Tensor) and target.dim() != 1:
            raise ValueError(f"relprop: a target tensor must be 1-D (one class per example), got shape "
                             f"{tuple(target.shape)}")
        targets = target.tolist() if isinstance(target, Tensor) else list(target)
        if len(targets) == 1:
            targets = targets * batch
        if len(targets) != batch:
            raise ValueError(f"relprop: {len(targets)} targets given for a batch of {batch} examples")
        for example, item in enumerate(targets):
            index = _check_index(item if isinstance(item, tuple) else (item,), output.shape, item)
            mask[(example, *index)] = True
    else:
        raise TypeError(f"relprop: target must be None, an int, a tuple, a list or a tensor, "
                        f"got {type(target).__name__}")
    return mask


class Contrastive:
    """A contrastive target: explain ``f_t - mean of the other outputs`` instead of ``f_t``.

    The output relevance is ``f_t`` at the target and ``-f_j / (C - 1)`` at
    each of the ``C - 1`` other entries along the target's last indexed
    dimension (the classes, or the vocabulary at a position).

    Examples
    --------
    >>> lrp.attribute(x, target=relprop.Contrastive(3))
    >>> lrp.attribute(input_ids, target=relprop.Contrastive((-1, token_id)))
    """

    def __init__(self, target: Target):
        self.target = target

    def relevance(self, output: Tensor) -> Tensor:
        mask = target_mask(output, self.target)
        depth = len(self.target) if isinstance(self.target, tuple) else 1
        if isinstance(self.target, list) and self.target and isinstance(self.target[0], tuple):
            depth = len(self.target[0])
        others = mask.any(depth, keepdim=True).expand_as(mask) & ~mask
        zero = torch.zeros((), dtype=output.dtype, device=output.device)
        return torch.where(mask, output, zero) - torch.where(others, output, zero) / (output.shape[depth] - 1)

    def __repr__(self) -> str:
        return f"Contrastive({self.target!r})"


def output_relevance(output: Tensor, target: Target) -> Tensor:
    """The relevance seeded at the output: ``output`` where ``target`` selects, 0 elsewhere.

    See :func:`target_mask` for ``target``. A floating-point tensor of the
    output's shape is taken as the output relevance itself; a
    :class:`Contrastive` target explains the target against the others.
    """
    if isinstance(target, Contrastive):
        return target.relevance(output.detach())
    if isinstance(target, Tensor) and target.is_floating_point():
        if target.shape != output.shape:
            raise ValueError(f"relprop: output relevance of shape {tuple(target.shape)} does not match the model "
                             f"output of shape {tuple(output.shape)}")
        return target.to(output.dtype).detach()
    value = output.detach()
    return torch.where(target_mask(value, target), value, torch.zeros((), dtype=value.dtype, device=value.device))


def _as_tuple(value: Any) -> tuple:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _eager(method: _F) -> _F:
    """Run ``method`` eagerly also inside ``torch.compile``d code.

    Relevance needs every op of the forward pass intercepted one by one, which a
    compiled graph does not allow: Dynamo breaks the graph here instead of
    failing, and what the caller compiles around an attribution stays compiled.
    The result has captum's ``__wrapped__`` (see :func:`_captum_entry`).
    """
    return torch.compiler.disable(method, recursive=True)


def _captum_entry(method: _F) -> _F:
    """Give an ``attribute`` method the ``__wrapped__`` that captum's ``NoiseTunnel`` calls.

    NoiseTunnel calls ``method.attribute.__wrapped__(method, inputs, ...)`` to
    skip captum's usage logger, so every ``attribute`` must be a wrapper.
    """
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        return method(*args, **kwargs)
    return call  # type: ignore[return-value]


class Attribution:
    """captum's ``Attribution`` protocol, without captum as a dependency.

    What captum's wrappers and metrics read: ``forward_func`` (the model),
    ``multiplies_by_inputs``, ``has_convergence_delta()``,
    ``compute_convergence_delta(...)``, ``get_name()`` and ``attribute``, so
    that ``captum.attr.NoiseTunnel(method)``, ``captum.metrics.infidelity``
    and ``captum.metrics.sensitivity_max`` take relprop's methods.

    Parameters
    ----------
    forward_func : callable
        The model, or any function of the inputs returning its output.
    """

    #: whether the attributions are a local effect times the inputs (captum's flag, used by NoiseTunnel)
    multiplies_by_inputs: bool = False

    def __init__(self, forward_func: Callable[..., Any]) -> None:
        if not callable(forward_func):
            raise TypeError(f"relprop: forward_func must be a model or a function, got {type(forward_func).__name__}")
        self.forward_func = forward_func

    def has_convergence_delta(self) -> bool:
        """Whether :meth:`compute_convergence_delta` (and ``return_convergence_delta=True``) is available."""
        return type(self).compute_convergence_delta is not Attribution.compute_convergence_delta

    def compute_convergence_delta(self, attributions: Inputs, *args: Any) -> Tensor:
        """The method's approximation error per example; see the subclass for its arguments."""
        raise NotImplementedError(f"relprop: {self.get_name()} has no convergence delta")

    @classmethod
    def get_name(cls) -> str:
        """A readable name: ``"Integrated Gradients"``, ``"Layer LRP"``."""
        return re.sub(r"(?<=[a-z])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", " ", cls.__name__)


class LRP(Attribution):
    """Layer-wise relevance propagation for any PyTorch model, with captum's interface.

    Parameters
    ----------
    model : nn.Module
        The model to explain. It is not modified: no parameter, flag, hook or
        mode outlives a call. A ``torch.compile``d model is explained through the
        module it was compiled from, and calls of this class run eagerly inside
        compiled functions (a graph break), so compiling code around an
        attribution works.
    composite : Composite, str or None
        The rules (:mod:`relprop.composites`), a preset name such as
        ``"epsilon-plus-flat"``, or None for ``Epsilon(1e-6)`` on every linear op.
    strict : bool
        Raise instead of warn when relevance reaches an op without a rule, or
        when a rule's relevance cannot be right (see ``guard``).
    guard : bool
        Check every op's relevance as it passes: NaN or infinite relevance, and
        rules that should conserve relevance but create some, are reported with
        the op's module path (:class:`~relprop.engine.ConservationWarning`).

    Notes
    -----
    A model in ``nn.DataParallel`` is explained through the module it wraps:
    its replicas run in threads, where the engine's interception is not active.

    Attributes
    ----------
    model : nn.Module
        The module explained (also captum's ``forward_func``).

    Examples
    --------
    >>> lrp = relprop.LRP(model, "epsilon-plus-flat")
    >>> relevance = lrp.attribute(images, target=labels)
    """

    multiplies_by_inputs = True
    #: the engine's mode for one forward pass; a method that must see more ops than LRP does subclasses it
    session_class: type[Session] = Session

    def __init__(self, model: nn.Module, composite: composites.Composite | str | None = None, strict: bool = False,
                 guard: bool = True):
        if not isinstance(model, nn.Module):
            raise TypeError(f"relprop: model must be a torch.nn.Module, got {type(model).__name__}")
        # compiled code runs its ops where no rule can reach them: explain the module it was compiled from
        compiled = isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
        self.model: nn.Module = model._orig_mod if compiled else model  # type: ignore[assignment]
        if isinstance(self.model, nn.DataParallel):  # replicas run in threads, outside the engine's mode
            self.model = self.model.module
        super().__init__(self.model)
        self.composite = composites.get(composite)
        self.strict = strict
        self.guard = guard

    @contextmanager
    def context(self) -> Iterator[Session]:
        """Explain a forward pass you run yourself, with your own output relevance.

        Inside the block, forward passes of the model build relevance graphs;
        afterwards ``torch.autograd.grad(output, x, grad_outputs=R)`` returns
        the relevance of ``x`` (which must require grad) for output relevance ``R``.

        Examples
        --------
        >>> x.requires_grad_(True)
        >>> with lrp.context():
        ...     out = model(x)
        >>> (relevance,) = torch.autograd.grad(out, x, grad_outputs=my_relevance)
        """
        with self._session() as session:
            yield session

    @contextmanager
    def _session(self, taps: Any = None, audit: Any = None, token_inputs: tuple[Tensor, ...] = ()
                 ) -> Iterator[Session]:
        session = self.session_class(self.model, self.composite, self.strict, taps=taps, audit=audit, token_inputs=token_inputs,
                          guard=self.guard)
        with torch.enable_grad(), session.active(), hold_selective_parameters(self.model):
            yield session

    @_eager
    def record(self, inputs: Inputs, additional_forward_args: Any = None, taps: Any = None,
               audit: Any = None) -> ForwardPass:
        """Run the model once under the engine and keep the pass, for :meth:`ForwardPass.relevance`.

        Use it to choose the output relevance after seeing the output. A
        recorded pass carries relevance once: record again for another seed.
        ``additional_forward_args`` may be a tuple of further positional
        arguments or a dict of keyword arguments (``attention_mask=...``).
        ``taps`` and ``audit`` are handed to :class:`~relprop.engine.Session`.

        Examples
        --------
        >>> explained = lrp.record(x)
        >>> relevance, = explained.relevance(relprop.output_relevance(explained.logits, target=3))
        """
        inputs = _as_tuple(inputs)
        if not inputs or not all(isinstance(x, Tensor) for x in inputs):
            raise TypeError("relprop: inputs must be a tensor or a tuple of tensors")
        extra, keywords = _forward_arguments(additional_forward_args)
        leaves = tuple(x.detach().requires_grad_() if x.is_floating_point() else x for x in inputs)
        tokens = tuple(x for x in leaves if not x.is_floating_point())
        with self._session(taps, audit, tokens) as session:
            # the model sees copies, so that in-place ops on its inputs are allowed
            output = self.model(*(x.clone() if x.requires_grad else x for x in leaves), *extra, **keywords)
        embeddings = {_position(leaves, tokens[i]): found for i, found in session.embeddings.items()}
        return ForwardPass(leaves, model_logits(output), embeddings, session if self.guard else None)

    @_eager
    def attribute(self, inputs: Inputs, target: Target = None, additional_forward_args: Any = None,
                  return_convergence_delta: bool = False) -> Any:
        """Relevance of every input feature for the model's output at ``target``.

        Parameters
        ----------
        inputs : Tensor or tuple of Tensors
            Model inputs, batch first. Each floating-point input gets relevance
            of its shape. Integer inputs (token ids) that the model embeds get
            one relevance per token, in their shape: the relevance of the
            embedded vectors summed over the hidden dimension.
        target : int, tuple, list, Tensor, Contrastive or None
            What to explain (captum's semantics, see :func:`target_mask`).
            The output relevance is the selected output value, so relevance
            sums to about ``f_t(x)``.
        additional_forward_args : tuple or dict, optional
            Further positional arguments of the model, or keyword arguments
            (``{"attention_mask": mask}``); they get no relevance.
        return_convergence_delta : bool
            Also return ``seed total - relevance total`` per example (what
            the rules absorbed, see :func:`convergence_delta`).

        Returns
        -------
        Tensor, or tuple of Tensors for tuple inputs; and the delta if asked.
        """
        with torch.inference_mode(False), cyclic_gc_paused():
            explained = self.record(inputs, additional_forward_args)
            seed = output_relevance(explained.logits, target)
            relevance = explained.relevance(seed)
        result = relevance[0] if isinstance(inputs, Tensor) else relevance
        if not return_convergence_delta:
            return result
        return result, convergence_delta(seed, relevance)

    def compute_convergence_delta(self, attributions: Inputs, output: Tensor) -> Tensor:
        """``output - attributions' total`` per example, as captum's ``LRP`` computes it.

        ``output`` is the explained output value per example (shape ``(N,)``)
        or the whole output relevance (batch first).
        """
        return convergence_delta(output, attributions)


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused inside the block, and enabled again after it if it was before.

    An attribution allocates several Python objects per op (op calls, autograd nodes, tensors) that live until
    its backward pass ends. Collections in the middle of it move them into the older generations, and now and
    then that sets off a full collection of every object of the process, which with torchvision and
    transformers loaded costs several times a small attribution. An attribution makes no reference cycles (its
    objects are freed by reference counting when it ends), so pausing the collector leaves nothing behind.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _position(items: Sequence[Tensor], item: Tensor) -> int:
    return next(i for i, candidate in enumerate(items) if candidate is item)


def _forward_arguments(value: Any) -> tuple[tuple, dict]:
    """Positional and keyword arguments from ``additional_forward_args``; tensors detached."""
    def detach(a: Any) -> Any:
        return a.detach() if isinstance(a, Tensor) else a
    if isinstance(value, Mapping):
        return (), {key: detach(a) for key, a in value.items()}
    return tuple(detach(a) for a in _as_tuple(value)), {}


class ForwardPass:
    """One forward pass under the engine: the inputs as it saw them, the logits, the token embeddings.

    Attributes
    ----------
    inputs : tuple of Tensor
        Floating-point inputs as leaves that require grad; integer inputs as given.
    logits : Tensor
    """

    def __init__(self, inputs: tuple[Tensor, ...], logits: Tensor, embeddings: dict[int, list[Tensor]],
                 session: Session | None = None):
        self.inputs = inputs
        self.logits = logits
        self._embeddings = embeddings
        #: the session that recorded the pass, if its guard checks the relevance's account (Session.check_pass)
        self._session = session

    @_eager
    def relevance(self, seed: Tensor) -> tuple[Tensor, ...]:
        """Propagate ``seed`` from the logits: the relevance of each input."""
        explained = [x for x in self.inputs if x.requires_grad]
        embedded = [leaf for leaves in self._embeddings.values() for leaf in leaves]
        if (explained or embedded) and not self.logits.requires_grad:
            raise RuntimeError("relprop: the model output does not depend on the inputs through autograd: the model "
                               "detached it, or computed it under torch.no_grad()")
        session, self._session = self._session, None
        if session is not None and (explained or embedded):
            session.defer_check()  # checked below with the seed and the inputs' relevance, in one read
        found = (torch.autograd.grad(self.logits, explained + embedded, seed, allow_unused=True)
                 if explained or embedded else ())
        if session is not None and (explained or embedded):
            session.check_pass(seed, [g for g in found if g is not None])
        grads = iter(found)
        by_leaf = {id(leaf): next(grads) for leaf in explained + embedded}
        relevance = []
        for index, x in enumerate(self.inputs):
            if x.requires_grad:
                grad = by_leaf[id(x)]
                relevance.append(grad if grad is not None else torch.zeros_like(x))
                continue
            tokens = torch.zeros(x.shape, dtype=seed.dtype, device=x.device)
            for leaf in self._embeddings.get(index, []):
                grad = by_leaf[id(leaf)]
                if grad is not None:
                    tokens = tokens + grad.sum(-1).reshape(x.shape)
            relevance.append(tokens)
        return tuple(relevance)


def convergence_delta(seed: Tensor, relevance: Tensor | Sequence[Tensor | None] | None) -> Tensor:
    """``seed total - relevance total`` per example: the relevance the rules absorbed (or created).

    The one definition of the delta in relprop (captum's ``LRP`` sign): 0
    where relevance is conserved from the output down to ``relevance``.

    Parameters
    ----------
    seed : Tensor
        The output relevance, or the explained output value per example; batch first.
    relevance : Tensor or sequence of Tensors
        The relevance of the inputs (or of a layer), each batch first; None entries are skipped.

    Returns
    -------
    Tensor of shape (N,)
    """
    parts = [r for r in _as_tuple(relevance) if r is not None]
    batch = seed.shape[0] if seed.dim() else 1
    if any(r.dim() == 0 or r.shape[0] != batch for r in parts):
        raise ValueError("relprop: the convergence delta is per example and needs every input batch first; "
                         f"got input shapes {[tuple(r.shape) for r in parts]} for a seed of shape "
                         f"{tuple(seed.shape)}")
    total = sum((r.reshape(batch, -1).sum(1) for r in parts), torch.zeros(batch, dtype=seed.dtype,
                                                                             device=seed.device))
    return seed.reshape(batch, -1).sum(1) - total
