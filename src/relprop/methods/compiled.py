"""The compiled tier of :class:`~relprop.LRP` (``compile=True``): one ``torch.compile`` program per input signature.

The model's forward pass is traced by Dynamo (``fullgraph=True``) inside :class:`Explained`, which also takes
a probe per input (ones, whose gradient is the relevance of token ids, and of an input what a first layer's
rule that fills zeros gives it). The backend
(:meth:`Compiled.backend`) has each node's rule decided by interception itself and rewritten into its
gradient form (:mod:`relprop.engine.compiled`), then hands the graph to Inductor, forward and backward. The
relevance is the inputs times the gradient of the compiled program, as in gradient form under interception.
:meth:`Compiled.whole` compiles the whole attribution (:func:`~relprop.methods.compiled_program.attribution`: the seed, ``autograd.grad``
traced into the graph, and the products with the inputs, after the model); :meth:`Compiled.forward` the forward
pass of a recorded pass, whose backward passes run through autograd.

Everything else that decides a rule (the model, its modules, their hooks and ``module.rule``, the composite
and its rules' settings) is a :class:`~relprop.engine.state.RuleState` checked on every call: where it changed,
the wrapper's ``stamp``, which its traced forward reads (so that Dynamo guards it), changes and the graph is
traced and decided again. What a call holds while it runs is its thread's own (:class:`_Call`). Dynamo guards the rest (shapes, dtypes, grad mode and autocast, the modules' flags, Python
values the forward reads; docs/design.md, section 9). A graph break, an op or rule the tier cannot write, or a
forward that Dynamo ran eagerly (past its recompilation limit) falls back to interception, with one warning
naming the reason.
"""
from __future__ import annotations

import functools
import itertools
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import Tensor, fx, nn

from relprop._core.errors import ConservationWarning, UnsupportedOpError, user_location, warn_caller
from relprop._core.modules import evaluation, frozen
from relprop._core.gradient_form import unwrapped
from relprop.engine.compiled import rewrite
from relprop.engine.decide import CannotCompile, decide
from relprop.engine.plan import pass_signature
from relprop.engine.state import RuleState, backward_hooks, opaque
from relprop.methods.adapters import holds_selective_parameters
from relprop.methods.compile_log import say, signature_change
from relprop.methods.compiled_program import (MODEL, Explained, mark_dynamic, model_nodes, probes_of,
                                              program)
from relprop.methods.targets import LOST_SEED, checked_columns, target_indices

#: the compilers the tier hands its rewritten graph to: Inductor, or AOT autograd without code generation
#: (quick to compile: the tests' choice)
COMPILERS = ("inductor", "aot_eager")

#: numbers the programs' code objects, whose names tell them apart (never those of an explainer freed before)
_PROGRAMS = itertools.count()


class CompileFallbackWarning(UserWarning):
    """``compile=True`` could not compile an attribution: it ran under interception (the message says why)."""


class FiniteCheck:
    """What checks the relevance of a recorded compiled pass (in :class:`~relprop.methods.ForwardPass`'s place of
    interception's guard): as in gradient form under interception, relevance per unit of activation has no totals
    an op is held to, so the relevance that reached the inputs is checked for NaN and infinities, in one read after
    the backward pass (``strict``: raised as :class:`~relprop.UnsupportedOpError`, as interception's guard does)."""

    def __init__(self, strict: bool = False):
        self.strict = strict

    def defer_check(self) -> None:
        """Nothing is checked before the pass ends."""

    def check_pass(self, seed: Tensor, found: list[Tensor]) -> None:
        """Warned (or with ``strict`` raised) where the relevance ``found`` is not finite."""
        if found and not bool(torch.stack([g.isfinite().all() for g in found]).all()):
            message = ("relprop: the compiled relevance holds NaN or infinite values (explain without compile= to "
                       "have the guard name the op)")
            if self.strict:
                raise UnsupportedOpError(message)
            warn_caller(message, ConservationWarning)


class _Call:
    """What one call of the compiled tier holds while it runs, for the backend (the inputs and probes it decides
    rules on) and for the caller (whether the compiled program ran; whether its backward graph is to compile):
    each thread's own, so that calls from several threads never read each other's."""

    def __init__(self, leaves: tuple[Tensor, ...], probes: tuple[Tensor, ...], kind: str, signature: Any):
        self.leaves, self.probes = leaves, probes
        #: which program ("whole attribution", "forward pass") and the input signature it runs on
        self.kind, self.signature = kind, signature
        self.ran = False
        self.pending: list[bool] = []


#: held while the compile settings are patched (global flags: patches of two threads must not interleave)
_SETTINGS = threading.RLock()
_TRACING = threading.Lock()
_tracers: dict[str, Any] = {"count": 0, "user": False}  # calls tracing autograd ops now; the flag as it was


@contextmanager
def _autograd_traced() -> Iterator[None]:
    """Dynamo traces ``torch.autograd.grad`` into the program (not as a graph break) inside the block: the flag set
    while any thread's call is in such a block, the user's value put back when the last leaves."""
    flags = torch._dynamo.config
    with _TRACING:
        if _tracers["count"] == 0:
            _tracers["user"] = flags.trace_autograd_ops
        _tracers["count"] += 1
        flags.trace_autograd_ops = True
    try:
        yield
    finally:
        with _TRACING:
            _tracers["count"] -= 1
            if _tracers["count"] == 0:
                flags.trace_autograd_ops = _tracers["user"]


class Compiled:
    """The compiled program of one :class:`~relprop.LRP`, and what it was decided under.

    Parameters
    ----------
    model : nn.Module
    composite : Composite
    compiler : str
        One of :data:`COMPILERS`.
    """

    #: the compilers it takes (:data:`COMPILERS`)
    compilers: tuple[str, ...] = COMPILERS
    #: ``torch.compile``'s ``dynamic``: None, Dynamo's default (a size that changes is traced dynamic from then
    #: on); False, a program of its own for each size
    compile_dynamic: bool | None = None

    def __init__(self, model: nn.Module, composite: Any, compiler: str = "inductor"):
        if compiler not in self.compilers:
            raise ValueError(f"relprop: compile must be True, False or one of {', '.join(COMPILERS)}; got {compiler!r}")
        self.model, self.composite, self.compiler = model, composite, compiler
        self._explained = Explained(model)
        # the forward pass of a recorded pass, and a whole attribution: each a code object of its own (Dynamo keeps
        # its graphs, and counts recompilations, per code object; by a name of its own, as code objects of equal
        # contents compare equal). Dynamo's cache keeps the backend as long as the code: through a weak reference,
        # this object (and its model) is freed with the LRP that holds it
        backend, number = functools.partial(_backend, weakref.ref(self)), next(_PROGRAMS)
        self._program, self._whole = (
            torch.compile(types.FunctionType(program.__code__.replace(co_name=f"relprop_{kind}_{number}"),
                                             program.__globals__), backend=backend, fullgraph=True,
                          dynamic=self.compile_dynamic)
            for kind in ("program", "attribution"))
        self._rules: RuleState | None = None  # of every graph compiled since the last change
        self._changed: dict[str, str] = {}  # by program: what changed since it last compiled
        self._signatures: dict[str, Any] = {}  # by program: the input signature it last compiled for
        self._local = threading.local()  # each thread's call (_Call) and what its last call did
        self._lock = threading.Lock()  # a change of model, composite or rules is taken in once
        #: graphs compiled so far (each trace Dynamo hands the backend)
        self.compilations = 0
        self._warned: set[str] = set()
        #: why each input signature could not compile, since what decides the rules last changed: not traced again
        self._refused: dict[Any, str] = {}
        #: a dimension whose size varies from call to call (a sequence's length): traced dynamic in every tensor
        #: argument from the first call on, so that one program serves every size, rather than one for the first
        #: size and a second, dynamic, one when another comes. None: Dynamo's default (sizes 0 and 1 stay fixed)
        self.dynamic: int | None = None

    @property
    def fallback(self) -> str | None:
        """Why this thread's last call fell back to interception (None: it ran compiled)."""
        return getattr(self._local, "fallback", None)

    @fallback.setter
    def fallback(self, reason: str | None) -> None:
        self._local.fallback = reason

    @property
    def split(self) -> str | None:
        """Why this thread's last :meth:`whole` did not run as one program (None: it did)."""
        return getattr(self._local, "split", None)

    @split.setter
    def split(self, reason: str | None) -> None:
        self._local.split = reason

    def forward(self, model: nn.Module, leaves: tuple[Tensor, ...], extra: tuple, keywords: dict[str, Any],
                composite: Any) -> tuple[Any, tuple[Tensor, ...]] | None:
        """The compiled forward pass of ``model`` under ``composite`` (the explainer's, either may have been
        replaced): the model's output and each input's probe (ones that collect the relevance of token ids'
        embeddings, ``ids.shape + (1,)`` in float64, and of other inputs what rules that fill zeros give them). None
        where it cannot run compiled (:attr:`fallback` says why, warned once)."""
        with torch.enable_grad():  # as interception records a pass, also under torch.no_grad()
            reason = self._refresh(composite, model)
            probes = probes_of(leaves)
            signature = pass_signature(leaves, extra, keywords, True, torch.is_autocast_enabled(), self.dynamic)
            output: Any = None
            reason = reason or self._refused.get(signature)
            if reason is None:
                output, reason = self._run(self._program, "forward pass", signature, leaves, probes, extra,
                                           keywords)
        self.fallback = reason
        if reason is None:
            return output[0], probes
        self._fell_back(reason)
        return None

    def _fell_back(self, reason: str) -> None:
        """Warned once per reason: the call runs under interception."""
        if reason not in self._warned:
            self._warned.add(reason)
            warn_caller(f"relprop: compile=True fell back to interception: {reason}", CompileFallbackWarning)

    def whole(self, model: nn.Module, leaves: tuple[Tensor, ...], extra: tuple, keywords: dict[str, Any],
                  composite: Any, target: Any, totals: bool = False, create_graph: bool = False,
                  differentiated: tuple[int, ...] = ()) -> tuple[tuple[Tensor, ...], Tensor | None] | None:
        """The whole attribution as one program (:func:`~relprop.methods.compiled_program.attribution`: the forward pass, the seed, the backward
        pass and the products with the inputs, which Inductor compiles together): each input's relevance, and
        with ``totals`` the seed's total per example. None where it does not run so, :attr:`split` says why (a
        target that selects otherwise, such as a :class:`~relprop.methods.Contrastive`; a program that does not
        compile): the caller then records a pass, which runs compiled as a forward and a backward program where
        it can, or, where :attr:`records` is False (a relevance that is not finite), under interception. The target is checked against the logits
        (:func:`~relprop.methods.targets.checked_columns`) after the program ran. ``create_graph``: the relevance
        differentiable (:class:`~relprop.methods.differentiable.Differentiable`) in the parameters and the inputs
        numbered in ``differentiated``."""
        selection = target_indices(target)
        self._local.records = True
        if selection is None:
            self.split = "the target is not indices (a Contrastive, an output relevance)"
            return None
        reason = self._refresh(composite, model)
        probes = probes_of(leaves)
        signature = pass_signature(leaves, extra, keywords, torch.is_grad_enabled(), torch.is_autocast_enabled(),
                                   self.dynamic, "whole", tuple(index.shape for index in selection), totals,
                                   create_graph, differentiated)
        self.split = reason or self._refused.get(signature)
        if self.split is None:
            with _autograd_traced():
                found, self.split = self._run(self._whole, "whole attribution", signature, leaves, probes, extra,
                                              keywords, selection, totals, create_graph, differentiated)
        if self.split is None and not bool(found[3]):
            # not finite: a NaN of the model's, or a decision taken when the program was traced that does not hold
            # for these inputs (attention written out). Interception decides again, and its guard names the op
            self.split = ("the compiled relevance is not finite, or a decision taken on the data it was traced with "
                          "(attention written out) does not hold for these inputs")
            self._local.records = False  # the forward program took the same decisions: interception
        self.fallback = self.split
        if self.split is not None:
            self._fell_back(self.split)
            return None
        logits, relevance, lost, _, total = found
        checked_columns(tuple(index.tolist() for index in selection), logits.shape, target)  # raises where out of range
        if bool(lost):
            warn_caller(LOST_SEED, ConservationWarning)
        return relevance, total

    @property
    def records(self) -> bool:
        """Whether this thread's last :meth:`whole` that did not run leaves its caller to record a pass through
        the forward program (False: under interception)."""
        return getattr(self._local, "records", False)

    def _refresh(self, composite: Any, model: nn.Module) -> str | None:
        """Where the model or the composite was replaced, or what decided the rules changed since the last call
        (:class:`~relprop.engine.state.RuleState`): the stamp changes, so that Dynamo traces the program again.
        The reason not to compile at all, where the composite chooses rules by means no snapshot sees."""
        if opaque(composite):
            return (f"the composite {type(composite).__name__} chooses rules by a method of its own and declares no "
                    "state(): what it reads is unknown, so no program decided under it is reused")
        with self._lock:
            changed = ("the composite (replaced)" if composite is not self.composite else
                       "the model explained (replaced)" if model is not self.model else
                       self._rules.changed(composite, model) if self._rules is not None else None)
            if changed is not None:
                self._changed = {kind: changed for kind in ("forward pass", "whole attribution")}
                self.composite, self.model, self._explained.model = composite, model, model
                self._explained.stamp = str(int(self._explained.stamp) + 1)
                self._rules, self._refused = None, {}
        return None

    def _run(self, program: Any, kind: str, signature: Any, leaves: tuple[Tensor, ...], probes: tuple[Tensor, ...],
             extra: tuple, keywords: dict[str, Any], *whole: Any) -> tuple[Any, str | None]:
        """``program``'s output on these arguments, and the reason where it could not run compiled (remembered
        for ``signature`` until what decides the rules changes)."""
        call = self._local.call = _Call(leaves, probes, kind, signature)
        if self.dynamic is not None:
            mark_dynamic((*leaves, *probes, *extra, *keywords.values()), self.dynamic)
        # in eval mode, as interception explains it (Dynamo guards the flags)
        with evaluation(self.model, "relprop: the model is in training mode; it is explained in eval mode (dropout "
                        "off, BatchNorm running statistics) and put back afterwards"), self._parameters():
            try:
                output = program(self._explained, leaves, probes, extra, keywords, *whole)
                reason = None if call.ran else "Dynamo ran the forward pass without the compiled program"
            except Exception as error:  # noqa: BLE001 - any failure to trace or compile falls back
                output, reason = None, _reason(error)
            finally:
                call.leaves = call.probes = ()
        if reason is not None and signature is not None:
            with self._lock:
                self._refused[signature] = reason
                if self._rules is None:  # tried again when the modules, their rules or the composite change
                    self._rules = RuleState(self.composite, self.model, [])
        return output, reason

    def _parameters(self) -> AbstractContextManager:
        """What the parameters are while the program runs: frozen, as relevance needs no gradient of theirs."""
        return frozen(self.model)

    def backward(self) -> Callable[[], AbstractContextManager]:
        """The context of the backward passes of the pass that this thread's last call recorded: :meth:`settings`
        until its graph's backward pass has compiled (at the first of them); after that only the flag that a
        backward pass which keeps its graph reads again at each run, set directly (patching every setting costs
        time)."""
        pending, flags = self._local.call.pending, torch._functorch.config

        @contextmanager
        def context() -> Iterator[None]:
            if pending:
                with self.settings():
                    yield
                pending.clear()  # not where the pass raised: its backward may not have compiled
                return
            with _SETTINGS:
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

        # one thread at a time: patches that interleave would put back each other's values
        with (_SETTINGS, torch._functorch.config.patch(donated_buffer=False),
              config.patch(layout_optimization=False, compile_threads=1)):
            yield

    def backend(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        """The ``torch.compile`` backend: each node decided and rewritten, then compiled by :attr:`compiler`."""
        if holds_selective_parameters(self.model):
            raise CannotCompile("relprop: the pass holds Mamba's selective parameters by replacing the model's "
                                "functions, which the compiled program does not")
        hooked = backward_hooks(self.model)
        if hooked is not None:
            raise CannotCompile(f"relprop: module '{hooked}' has a backward hook, which runs in the backward pass "
                                "where interception explains it")
        leaves, probes = self._local.call.leaves, self._local.call.probes
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
        call, started = self._local.call, time.perf_counter()
        what = (f"the {call.kind} of {type(self.model).__name__} under {type(self.composite).__name__} with "
                f"{self.compiler}")
        say(f"relprop: compiling {what}: {self._why(call)}")
        decisions = decide(gm, self.model, self.composite, values, inputs, leaves, MODEL, model_nodes(gm))
        gm = rewrite(gm, decisions, probe_nodes)
        rules = [unwrapped(d.rule) for d in decisions.values() if d.rule is not None]
        with self._lock:
            rules = list({id(rule): rule for rule in (self._rules.rules if self._rules else []) + rules}.values())
            self._rules = RuleState(self.composite, self.model, rules)
        self.compilations += 1
        program = self._compile(gm, example_inputs, call.kind)
        say(f"relprop: compiled {what} in {time.perf_counter() - started:.1f} s")
        return _flagged(program, weakref.ref(self))

    def _compile(self, gm: fx.GraphModule, example_inputs: list[Any], kind: str) -> Any:
        """The rewritten graph of the program ``kind`` compiled by :attr:`compiler`."""
        with self.settings():  # compiled for backward passes that keep the graph
            return torch._dynamo.lookup_backend(self.compiler)(gm, example_inputs)

    def _why(self, call: _Call) -> str:
        """Why ``call``'s program compiles: the first call, what decides the rules changed, or a new signature."""
        with self._lock:
            changed = self._changed.pop(call.kind, None)
            last, self._signatures[call.kind] = self._signatures.get(call.kind), call.signature
        if changed is not None:
            return f"{changed} changed since it last compiled"
        if last is None or call.signature is None:
            return "the first call"
        if last == call.signature:
            return "Dynamo's guards failed on something else the forward pass reads (a module's flag, a global value)"
        return "a new input signature: " + signature_change(last, call.signature)


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
        call = getattr(flagged._local, "call", None) if flagged is not None else None
        if call is not None:
            call.ran, call.pending = True, pending
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
    where = user_location(str(error))  # Dynamo's messages end with the user's code that stopped the trace
    return f"{type(error).__name__}: {first[:300]}" + (f" (at {where})" if where else "")
