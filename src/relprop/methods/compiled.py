"""The compiled tier of :class:`~relprop.LRP` (``compile=True``): one ``torch.compile`` program per input signature.

The model's forward pass is traced by Dynamo (``fullgraph=True``) inside :class:`_Explained`, which also takes
a probe per input (ones, whose gradient is the relevance of token ids, and of an input what a first layer's
rule that fills zeros gives it). The backend
(:meth:`Compiled.backend`) has each node's rule decided by interception itself and rewritten into its
gradient form (:mod:`relprop.engine.compiled`), then hands the graph to Inductor, forward and backward. The
relevance is the inputs times the gradient of the compiled program, as in gradient form under interception.
:meth:`Compiled.attribute` compiles the whole attribution (:func:`_attribution`: the seed, ``autograd.grad``
traced into the graph, and the products with the inputs, after the model); :meth:`Compiled.forward` the forward
pass of a recorded pass, whose backward passes run through autograd.

Everything else that decides a rule (the composite and its rules' settings, ``module.rule``, the modules
themselves) is a :class:`~relprop.engine.compiled.Key` checked on every call: where it changed, the wrapper's
``stamp``, which its traced forward reads (so that Dynamo guards it), changes and the graph is traced and
decided again. Dynamo guards the rest (shapes, dtypes, grad mode and autocast, the modules' flags, Python
values the forward reads; docs/design.md, section 9). A graph break, an op or rule the tier cannot write, or a
forward that Dynamo ran eagerly (past its recompilation limit) falls back to interception, with one warning
naming the reason.
"""
from __future__ import annotations

import functools
import itertools
import types
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import Tensor, fx, nn

from relprop._core.errors import ConservationWarning, UnsupportedOpError, warn_caller
from relprop._core.modules import evaluation, frozen
from relprop.engine.compiled import CannotCompile, Key, decide, rewrite
from relprop.engine.plan import pass_signature
from relprop.methods.adapters import holds_selective_parameters
from relprop.methods.targets import LOST_SEED, model_logits, selection_mask, target_indices, target_mask

#: the compilers the tier hands its rewritten graph to: Inductor, or AOT autograd without code generation
#: (quick to compile: the tests' choice)
COMPILERS = ("inductor", "aot_eager")


#: how Dynamo's graphs name the explained model (the prefix of its modules' paths in ``nn_module_stack``)
MODEL = "L['explained'].model"
#: numbers the programs' code objects, whose names tell them apart (never those of an explainer freed before)
_PROGRAMS = itertools.count()


class CompileFallbackWarning(UserWarning):
    """``compile=True`` could not compile an attribution: it ran under interception (the message says why)."""


class _Explained(nn.Module):
    """The traced program: the model on copies of its inputs, and the probes (read by the rewritten graph)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        #: changes where the decisions' key changed: read in the traced forward, so Dynamo guards it
        self.stamp = "0"

    def forward(self, inputs: tuple[Tensor, ...], probes: tuple[Tensor, ...], extra: tuple,
                keywords: dict[str, Any], selection: tuple[Tensor, ...] | None = None, totals: bool = False) -> Any:
        """The model's output and the probes; with ``selection``, the whole attribution (:func:`_attribution`)."""
        if self.stamp == "":  # never: the comparison makes Dynamo guard the stamp's value
            return None
        output = self.model(*(x.clone() if x.requires_grad else x for x in inputs), *extra, **keywords)
        if selection is not None:
            return _attribution(model_logits(output), inputs, probes, selection, totals)
        # used, so that they are inputs of the graph, for the embeddings to read (a tensor returned as it is is not)
        return output, tuple(probe * 1 for probe in probes)


def _attribution(logits: Tensor, inputs: tuple[Tensor, ...], probes: tuple[Tensor, ...],
                 selection: tuple[Tensor, ...], totals: bool) -> tuple:
    """The relevance of each input for the logits that ``selection`` selects (:func:`selection_mask`), as
    :meth:`~relprop.methods.ForwardPass.propagate` gives it in gradient form: the logits, the relevance, whether
    a selected logit is 0 (its relevance per unit is lost), whether the relevance is finite, and with ``totals``
    the seed's total per example (else None)."""
    mask = selection_mask(logits, selection)
    leaves = [x for x in inputs if x.requires_grad] + list(probes)
    # each leaf reaches what is differentiated, by 0 outside the model: as Dynamo traces the plain forward pass,
    # a model of token ids reaches its probes only through the forms that the backend writes in afterwards
    reached = logits + sum(leaf.sum().to(logits.dtype) for leaf in leaves) * 0
    grads = torch.autograd.grad(reached, leaves, (mask & (logits != 0)).to(logits.dtype))
    explained, collected = iter(grads[:len(leaves) - len(probes)]), iter(grads[len(leaves) - len(probes):])
    relevance = []
    for x in inputs:
        if x.requires_grad:  # a probe of a floating-point input collects what rules that fill zeros give it
            relevance.append((next(explained) * x.detach() + next(collected)).detach())
        else:
            relevance.append(next(collected).sum(-1).reshape(x.shape).to(logits.dtype).detach())
    finite = torch.stack([r.isfinite().all() for r in relevance]).all() if relevance else torch.tensor(True)
    total = torch.where(mask, logits, 0).reshape(len(logits), -1).sum(1).detach() if totals else None
    return logits.detach(), tuple(relevance), (mask & (logits == 0)).any(), finite, total


def _program(explained: _Explained, inputs: tuple[Tensor, ...], probes: tuple[Tensor, ...], extra: tuple,
             keywords: dict[str, Any], *whole: Any) -> Any:
    """What each :class:`Compiled` compiles, through a copy of this code of its own (Dynamo's cache is per code)."""
    return explained(inputs, probes, extra, keywords, *whole)


class Guard:
    """The conservation guard of a compiled pass (in :class:`~relprop.methods.ForwardPass`'s place of a session):
    as in gradient form under interception, relevance per unit of activation has no totals an op is held to, so
    the relevance that reached the inputs is checked for NaN and infinities, in one read after the backward pass
    (``strict``: raised as :class:`~relprop.UnsupportedOpError`, as interception's guard does)."""

    def __init__(self, strict: bool = False):
        self.strict = strict

    def defer_check(self) -> None:
        """Nothing is checked before the pass ends."""

    def check_pass(self, seed: Tensor, found: list[Tensor]) -> None:
        self.check_finite(not found or bool(torch.stack([g.isfinite().all() for g in found]).all()))

    def check_finite(self, finite: bool) -> None:
        """Warned (or with ``strict`` raised) where the relevance is not ``finite``."""
        if not finite:
            message = ("relprop: the compiled relevance holds NaN or infinite values (explain without compile= to "
                       "have the guard name the op)")
            if self.strict:
                raise UnsupportedOpError(message)
            warn_caller(message, ConservationWarning)


class Compiled:
    """The compiled program of one :class:`~relprop.LRP`, and what it was decided under.

    Parameters
    ----------
    model : nn.Module
    composite : Composite
    compiler : str
        One of :data:`COMPILERS`.
    """

    def __init__(self, model: nn.Module, composite: Any, compiler: str = "inductor"):
        if compiler not in COMPILERS:
            raise ValueError(f"relprop: compile must be True, False or one of {', '.join(COMPILERS)}; got {compiler!r}")
        self.model, self.composite, self.compiler = model, composite, compiler
        self._explained = _Explained(model)
        # the forward pass of a recorded pass, and a whole attribution: each a code object of its own (Dynamo keeps
        # its graphs, and counts recompilations, per code object; by a name of its own, as code objects of equal
        # contents compare equal). Dynamo's cache keeps the backend as long as the code: through a weak reference,
        # this object (and its model) is freed with the LRP that holds it
        backend, number = functools.partial(_backend, weakref.ref(self)), next(_PROGRAMS)
        self._program, self._whole = (
            torch.compile(types.FunctionType(_program.__code__.replace(co_name=f"relprop_{kind}_{number}"),
                                             _program.__globals__), backend=backend, fullgraph=True)
            for kind in ("program", "attribution"))
        #: why the last :meth:`attribute` did not run as one program (None: it did)
        self.split: str | None = None
        self._key: Key | None = None  # of every graph compiled since the last change
        self._current: tuple[tuple[Tensor, ...], tuple[Tensor, ...]] = ((), ())
        self._ran = False
        self._pending: list[bool] = []  # whether the backward graph of the graph that ran last is still to compile
        #: why the last call fell back to interception (None: it ran compiled); read by tests and by users
        self.fallback: str | None = None
        #: graphs compiled so far (each trace Dynamo hands the backend)
        self.compilations = 0
        self._warned: set[str] = set()
        #: why each input signature could not compile, since the decisions' key last changed: not traced again
        self._refused: dict[Any, str] = {}
        #: a dimension whose size varies from call to call (a sequence's length): traced dynamic in every tensor
        #: argument from the first call on, so that one program serves every size, rather than one for the first
        #: size and a second, dynamic, one when another comes. None: Dynamo's default (sizes 0 and 1 stay fixed)
        self.dynamic: int | None = None

    def forward(self, leaves: tuple[Tensor, ...], extra: tuple, keywords: dict[str, Any],
                composite: Any) -> tuple[Any, tuple[Tensor, ...]] | None:
        """The compiled forward pass under ``composite`` (the explainer's, which may have been replaced): the
        model's output and each input's probe (ones that collect the relevance of token ids' embeddings, ``ids.shape
        + (1,)`` in float64, and of other inputs what rules that fill zeros give them). None where it cannot run
        compiled (:attr:`fallback` says why, warned once)."""
        self._refresh(composite)
        probes = _probes(leaves)
        signature = pass_signature(leaves, extra, keywords, torch.is_grad_enabled(), torch.is_autocast_enabled(),
                                   self.dynamic)
        output: Any = None
        reason = self._refused.get(signature)
        if reason is None:
            output, reason = self._run(self._program, signature, leaves, probes, extra, keywords)
        self.fallback = reason
        if reason is None:
            return output[0], probes
        if reason not in self._warned:
            self._warned.add(reason)
            warn_caller(f"relprop: compile=True fell back to interception: {reason}", CompileFallbackWarning)
        return None

    def attribute(self, leaves: tuple[Tensor, ...], extra: tuple, keywords: dict[str, Any], composite: Any,
                  target: Any, totals: bool = False, guard: Guard | None = None
                  ) -> tuple[tuple[Tensor, ...], Tensor | None] | None:
        """The whole attribution as one program (:func:`_attribution`: the forward pass, the seed, the backward
        pass and the products with the inputs, which Inductor compiles together): each input's relevance, and
        with ``totals`` the seed's total per example. None where it does not run so (a target that selects
        otherwise, such as a :class:`~relprop.methods.Contrastive`; a program that does not compile,
        :attr:`split` says why): the caller then records a pass, which runs compiled as a forward and a backward
        program where it can. The target is checked against the logits as :func:`~relprop.methods.target_mask`
        checks it, after the program ran; ``guard`` checks the relevance."""
        selection = target_indices(target)
        if selection is None:
            self.split = "the target is not indices (a Contrastive, an output relevance)"
            return None
        self._refresh(composite)
        probes = _probes(leaves)
        signature = pass_signature(leaves, extra, keywords, torch.is_grad_enabled(), torch.is_autocast_enabled(),
                                   self.dynamic, "whole", tuple(index.shape for index in selection), totals)
        self.split = self._refused.get(signature)
        if self.split is not None:
            return None
        flags = torch._dynamo.config  # Dynamo traces the backward pass in the program, not as a graph break
        traced, flags.trace_autograd_ops = flags.trace_autograd_ops, True
        try:
            found, self.split = self._run(self._whole, signature, leaves, probes, extra, keywords, selection, totals)
        finally:
            flags.trace_autograd_ops = traced
        if self.split is not None:
            return None
        self.fallback = None
        logits, relevance, lost, finite, total = found
        target_mask(torch.empty(logits.shape, device="meta"), target)  # raises where it is out of range
        if bool(lost):
            warn_caller(LOST_SEED, ConservationWarning)
        if guard is not None:
            guard.check_finite(bool(finite))
        return relevance, total

    def _refresh(self, composite: Any) -> None:
        """Where the composite was replaced, or what decided the rules changed since the last call (the
        :class:`~relprop.engine.compiled.Key`): the stamp changes, so that Dynamo traces the program again."""
        if composite is not self.composite or (self._key is not None
                                               and not self._key.holds(self.composite, self.model)):
            self.composite = composite
            self._explained.stamp = str(int(self._explained.stamp) + 1)
            self._key, self._refused = None, {}

    def _run(self, program: Any, signature: Any, leaves: tuple[Tensor, ...], probes: tuple[Tensor, ...], extra: tuple,
             keywords: dict[str, Any], *whole: Any) -> tuple[Any, str | None]:
        """``program``'s output on these arguments, and the reason where it could not run compiled (remembered
        for ``signature`` until the key changes)."""
        self._current, self._ran = (leaves, probes), False
        if self.dynamic is not None:
            _mark_dynamic((*leaves, *probes, *extra, *keywords.values()), self.dynamic)
        # in eval mode, as interception explains it (Dynamo guards the flags)
        with evaluation(self.model, "relprop: the model is in training mode; it is explained in eval mode (dropout "
                        "off, BatchNorm running statistics) and put back afterwards"), frozen(self.model):
            try:
                output = program(self._explained, leaves, probes, extra, keywords, *whole)
                reason = None if self._ran else "Dynamo ran the forward pass without the compiled program"
            except Exception as error:  # noqa: BLE001 - any failure to trace or compile falls back
                output, reason = None, _reason(error)
            finally:
                self._current = ((), ())
        if reason is not None and signature is not None:
            self._refused[signature] = reason
            if self._key is None:  # tried again when the modules, their rules or the composite change
                self._key = Key(self.composite, self.model, [])
        return output, reason

    def backward(self) -> Callable[[], AbstractContextManager]:
        """The context of the backward passes of the pass that the last call recorded: :meth:`settings` until its
        graph's backward pass has compiled (at the first of them); after that only the flag that a backward pass
        which keeps its graph reads again at each run, set directly (patching every setting costs time)."""
        pending, flags = self._pending, torch._functorch.config

        @contextmanager
        def context() -> Iterator[None]:
            if pending:
                with self.settings():
                    yield
                pending.clear()  # not where the pass raised: its backward may not have compiled
                return
            donated, flags.donated_buffer = flags.donated_buffer, False
            try:
                yield
            finally:
                flags.donated_buffer = donated
        return context

    @staticmethod
    @contextmanager
    def settings() -> Iterator[None]:
        """The settings the program is compiled and its first backward pass runs under (AOT autograd and Inductor
        read them again when they compile the backward graph, at the first backward pass).

        A reusable pass (many seeds) keeps its graph, so none of its buffers may have been donated to the backward.
        Inductor keeps the memory layout of the model's tensors: it would convert convolutions on the CPU to
        channels-last, which oneDNN runs slower in float32 than the layout the eager gradient uses; a user who
        wants channels-last gives the model and its inputs that layout. Inductor compiles in this process: its
        pool of compile workers, once closed by an earlier compilation, fails every later one.
        """
        from torch._inductor import config  # imports Dynamo: only where something compiles

        with (torch._functorch.config.patch(donated_buffer=False),
              config.patch(layout_optimization=False, compile_threads=1)):
            yield

    def backend(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        """The ``torch.compile`` backend: each node decided and rewritten, then compiled by :attr:`compiler`."""
        if holds_selective_parameters(self.model):
            raise CannotCompile("relprop: the pass holds Mamba's selective parameters by replacing the model's "
                                "functions, which the compiled program does not")
        leaves, probes = self._current
        values, inputs, probe_nodes = [], {}, {}
        for n in gm.graph.find_nodes(op="placeholder"):
            graph_arg = n.meta.get("grapharg")
            if graph_arg is None:
                raise CannotCompile("relprop: Dynamo's graph does not name the values of its inputs")
            value = graph_arg.example
            if isinstance(value, torch.SymInt):  # a dynamic size: decided at the size it was traced with
                value = value.node.hint
            for index, (leaf, probe) in enumerate(zip(leaves, probes)):
                if value is leaf:
                    inputs[n] = index
                elif value is probe:
                    probe_nodes[index] = n
            values.append(value)
        decisions = decide(gm, self.model, self.composite, values, inputs, leaves, MODEL, _model_nodes(gm))
        gm = rewrite(gm, decisions, probe_nodes)
        rules = [getattr(d.rule, "rule", d.rule) for d in decisions.values() if d.rule is not None]
        rules = list({id(rule): rule for rule in (self._key.rules if self._key is not None else []) + rules}.values())
        self._key = Key(self.composite, self.model, rules)
        self.compilations += 1
        with self.settings():  # compiled for backward passes that keep the graph
            return _flagged(torch._dynamo.lookup_backend(self.compiler)(gm, example_inputs), weakref.ref(self))


def _model_nodes(gm: fx.GraphModule) -> set[fx.Node] | None:
    """In the graph of a whole attribution (:func:`_attribution`), the nodes of the model's forward pass: each
    node up to the logits (what the backward pass differentiates is ``logits + ...``), and any later one issued
    inside the model (an op after its logits, which may write into them). None in the graph of a forward pass."""
    # the last: a model may differentiate something of its own in its forward pass
    grad = next(reversed(gm.graph.find_nodes(op="call_function", target=torch.autograd.grad)), None)
    if grad is None:
        return None
    differentiated = grad.args[0]
    if not (isinstance(differentiated, fx.Node) and isinstance(differentiated.args[0], fx.Node)):
        raise CannotCompile("relprop: the graph of the attribution does not name the model's logits")
    logits, found, before = differentiated.args[0], set(), True
    for n in gm.graph.nodes:
        stack = (n.meta.get("nn_module_stack") or {}).values()
        if before or any(path.startswith(MODEL) for path, _ in stack):
            found.add(n)
        before = before and n is not logits
    return found


def _probes(leaves: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """A probe per input (ones that require grad): of an input's shape, ``ids.shape + (1,)`` in float64 for token
    ids."""
    return tuple(torch.ones(x.shape, dtype=x.dtype, device=x.device, requires_grad=True) if x.is_floating_point()
                 else torch.ones(*x.shape, 1, dtype=torch.float64, device=x.device, requires_grad=True)
                 for x in leaves)


def _mark_dynamic(values: tuple[Any, ...], dim: int) -> None:
    """Dimension ``dim`` of each tensor among ``values`` that has it, dynamic (where it can be)."""
    from torch._dynamo import maybe_mark_dynamic  # imports Dynamo: only where something compiles

    for x in values:
        if isinstance(x, Tensor) and x.dim() > dim:
            maybe_mark_dynamic(x, dim)


def _backend(owner: weakref.ref[Compiled], gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
    """``Compiled.backend`` of ``owner``, which runs its program (so it is alive)."""
    compiled = owner()
    assert compiled is not None
    return compiled.backend(gm, example_inputs)


def _flagged(compiled: Any, owner: weakref.ref[Compiled]) -> Any:
    """``compiled``, telling ``owner`` that it ran (Dynamo runs a forward eagerly past its recompilation limit), and
    whether its backward graph is still to compile (a list, emptied when it has)."""
    first, pending = [True], [True]

    def run(*args: Any) -> Any:
        flagged = owner()
        if flagged is not None:
            flagged._ran, flagged._pending = True, pending
        if first:  # AOT autograd may compile here: see Compiled.settings
            first.clear()
            with Compiled.settings():
                return compiled(*args)
        return compiled(*args)
    run._boxed_call = getattr(compiled, "_boxed_call", False)  # type: ignore[attr-defined]  # called as it is
    return run


def _reason(error: BaseException) -> str:
    """The reason a call cannot run compiled: the :class:`CannotCompile` behind ``error``, else its first line."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, CannotCompile):
            return str(seen.args[0]).strip().splitlines()[0].removeprefix("relprop: ")
        inner = getattr(seen, "inner_exception", None)  # Dynamo's BackendCompilerFailed
        if isinstance(inner, BaseException) and not isinstance(inner, CannotCompile):
            error = inner
        seen = inner or seen.__cause__ or seen.__context__
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {first}"[:300]
