"""The compiled tier of :class:`~relprop.LRP` (``compile=True``): one ``torch.compile`` program per input signature.

The model's forward pass is traced by Dynamo (``fullgraph=True``) inside :class:`_Explained`, which also takes
a probe per input (ones, whose gradient is the relevance of token ids, and of an input what a first layer's
rule that fills zeros gives it). The backend
(:meth:`Compiled.backend`) has each node's rule decided by interception itself and rewritten into its
gradient form (:mod:`relprop.engine.compiled`), then hands the graph to Inductor, forward and backward. The
relevance is the inputs times the gradient of the compiled program, as in gradient form under interception.

Everything else that decides a rule (the composite and its rules' settings, ``module.rule``, the modules
themselves) is a :class:`~relprop.engine.compiled.Key` checked on every call: where it changed, the wrapper's
``stamp``, which its traced forward reads (so that Dynamo guards it), changes and the graph is traced and
decided again. Dynamo guards the rest (shapes, dtypes, grad mode and autocast, the modules' flags, Python
values the forward reads; docs/design.md, section 9). A graph break, an op or rule the tier cannot write, or a
forward that Dynamo ran eagerly (past its recompilation limit) falls back to interception, with one warning
naming the reason.
"""
from __future__ import annotations

import types
import warnings
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor, fx, nn

from relprop._core.errors import ConservationWarning
from relprop._core.modules import evaluation
from relprop.engine.compiled import CannotCompile, Key, decide, rewrite

#: the compilers the tier hands its rewritten graph to: Inductor, or AOT autograd without code generation
#: (quick to compile: the tests' choice)
COMPILERS = ("inductor", "aot_eager")


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
                keywords: dict[str, Any]) -> Any:
        if self.stamp == "":  # never: the comparison makes Dynamo guard the stamp's value
            return None
        output = self.model(*(x.clone() if x.requires_grad else x for x in inputs), *extra, **keywords)
        # used, so that they are inputs of the graph, for the embeddings to read (a tensor returned as it is is not)
        return output, tuple(probe * 1 for probe in probes)


def _program(explained: _Explained, inputs: tuple[Tensor, ...], probes: tuple[Tensor, ...], extra: tuple,
             keywords: dict[str, Any]) -> Any:
    """What each :class:`Compiled` compiles, through a copy of this code of its own (Dynamo's cache is per code)."""
    return explained(inputs, probes, extra, keywords)


class Guard:
    """The conservation guard of a compiled pass (in :class:`~relprop.methods.ForwardPass`'s place of a session):
    as in gradient form under interception, relevance per unit of activation has no totals an op is held to, so
    the relevance that reached the inputs is checked for NaN and infinities, in one read after the backward pass."""

    def defer_check(self) -> None:
        """Nothing is checked before the pass ends."""

    def check_pass(self, seed: Tensor, found: list[Tensor]) -> None:
        if found and not bool(torch.stack([g.isfinite().all() for g in found]).all()):
            warnings.warn("relprop: the compiled relevance holds NaN or infinite values (explain without compile= "
                          "to have the guard name the op)", ConservationWarning, stacklevel=5)


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
        # a code object of its own: Dynamo keeps its graphs, and counts recompilations, per code object
        program = types.FunctionType(_program.__code__.replace(), _program.__globals__, "relprop_program")
        self._program = torch.compile(program, backend=self.backend, fullgraph=True)
        self._key: Key | None = None  # of every graph compiled since the last change
        self._current: tuple[tuple[Tensor, ...], tuple[Tensor, ...]] = ((), ())
        self._ran = False
        #: why the last call fell back to interception (None: it ran compiled); read by tests and by users
        self.fallback: str | None = None
        #: graphs compiled so far (each trace Dynamo hands the backend)
        self.compilations = 0
        self._warned: set[str] = set()
        self.guard = Guard()

    def forward(self, leaves: tuple[Tensor, ...], extra: tuple,
                keywords: dict[str, Any]) -> tuple[Any, tuple[Tensor, ...]] | None:
        """The compiled forward pass: the model's output and each input's probe (ones that collect the relevance
        of token ids' embeddings, ``ids.shape + (1,)``, and of other inputs what rules that fill zeros give them).
        None where it cannot run compiled (:attr:`fallback` says why, warned once)."""
        probes = tuple(torch.ones(x.shape, dtype=x.dtype, device=x.device, requires_grad=True)
                       if x.is_floating_point() else torch.ones(*x.shape, 1, device=x.device, requires_grad=True)
                       for x in leaves)
        if self._key is not None and not self._key.holds(self.composite, self.model):
            self._explained.stamp = str(int(self._explained.stamp) + 1)
            self._key = None
        self._current, self._ran = (leaves, probes), False
        # in eval mode, as interception explains it (Dynamo guards the flags); the warning names the caller's caller
        with evaluation(self.model, "relprop: the model is in training mode; it is explained in eval mode (dropout "
                        "off, BatchNorm running statistics) and put back afterwards", stacklevel=6):
            try:
                output, _ = self._program(self._explained, leaves, probes, extra, keywords)
                reason = None if self._ran else "Dynamo ran the forward pass without the compiled program"
            except Exception as error:  # noqa: BLE001 - any failure to trace or compile falls back
                reason = _reason(error)
            finally:
                self._current = ((), ())
        self.fallback = reason
        if reason is None:
            return output, probes
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"relprop: compile=True fell back to interception: {reason}", CompileFallbackWarning,
                          stacklevel=4)
        return None

    @staticmethod
    def backward() -> AbstractContextManager:
        """The context of a backward pass of the program: a reusable pass (many seeds) keeps its graph, so none of
        its buffers may have been donated to the backward (AOT autograd checks that flag again there)."""
        return torch._functorch.config.patch(donated_buffer=False)

    def backend(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        """The ``torch.compile`` backend: each node decided and rewritten, then compiled by :attr:`compiler`."""
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
        decisions = decide(gm, self.model, self.composite, values, inputs, leaves, "L['explained'].model")
        gm = rewrite(gm, decisions, probe_nodes)
        rules = [getattr(d.rule, "rule", d.rule) for d in decisions.values() if d.rule is not None]
        rules = list({id(rule): rule for rule in (self._key.rules if self._key is not None else []) + rules}.values())
        self._key = Key(self.composite, self.model, rules)
        self.compilations += 1
        with self.backward():  # compiled for backward passes that keep the graph
            return _flagged(torch._dynamo.lookup_backend(self.compiler)(gm, example_inputs), self)


def _flagged(compiled: Any, owner: Compiled) -> Any:
    """``compiled``, telling ``owner`` that it ran (Dynamo runs a forward eagerly past its recompilation limit)."""
    first = [True]

    def run(*args: Any) -> Any:
        owner._ran = True
        if first:  # AOT autograd may compile here: see Compiled.backward
            first.clear()
            with owner.backward():
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
