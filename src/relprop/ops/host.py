"""What an op handler may use of the engine: the :class:`OpHost` protocol."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from torch import Tensor

from relprop._core.kinds import OpKind
from relprop._core.rule import Rule
from relprop.engine.calls import OpCall
from relprop.engine.sign_parts import Workspace
from relprop.engine.tracking import AliasTracker


class OpHost(Protocol):
    """What an op handler may use of the engine (:class:`relprop.engine.Session` implements it).

    A handler ``handler(host, func, args, kwargs) -> output`` either runs ``func`` as it is or makes an op call
    (:meth:`record`, or a call class of its kind) and runs it with a rule (:meth:`run`).
    """

    #: producers, tags, readers and in-place overwrites of the activations
    aliases: AliasTracker
    #: scratch memory the parametric op calls share
    workspace: Workspace
    #: tap output -> its record (a BatchNorm merged across a tap keeps it)
    tapped: Any
    #: whether relevance per unit of activation flows between the ops (``relprop._core.gradient_form``)
    gradient_form: bool

    @property
    def module_name(self) -> str:
        """The dotted path of the module that issues the op."""

    def record(self, kind: OpKind, func: Callable, args: tuple, kwargs: dict,
               linearised: Callable | None = None) -> OpCall:
        """An op call of ``kind``, issued by the current module."""

    def run(self, call: OpCall, rule: Rule | None = None, source: str = ...) -> Any:
        """Run ``call`` as a relevance node with its rule (``rule``, or the composite's choice)."""

    def routed(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """A routing op, run as it is; a tag of its input carries over to its output."""

    def rule_for(self, call: OpCall) -> tuple[Rule | None, str]:
        """The composite's rule for ``call``, and where it came from."""

    def module_rule(self) -> Rule | None:
        """The rule set on the current module as ``module.rule``, if any."""

    def unknown(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """An op without a rule: its plain gradient, reported if relevance flows through it."""

    def constant_op(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """An op without an activation among its arguments, run as a constant."""

    def fed_by_input(self, x: Tensor) -> bool:
        """Whether ``x`` comes from a model input through routing ops only."""

    def token_embedding(self, ids: Any, vectors: Tensor) -> Tensor:
        """Embedded vectors of an integer model input, as leaves that collect its tokens' relevance."""

    def tap(self, value: Any, record: Any) -> Any:
        """``value`` behind a tap node that hands the relevance reaching it to ``record``."""

    def __enter__(self) -> Any:
        """Back in the mode, inside a handler: the ops of a decomposition get their rules."""

    def __exit__(self, *exc: Any) -> Any: ...
