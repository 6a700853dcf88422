"""Op calls: one operation of the forward pass, as its rule sees it.

Every intercepted operation becomes one :class:`OpCall` (or a subclass) and
one node of the autograd graph (``relprop.engine.nodes``). Rules that need the op's
own vector-Jacobian product (epsilon-type rules) get it from a small private
autograd graph recorded during the forward pass, so nothing is re-run in the
backward pass.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Self

import torch
from torch import Tensor

from relprop._core.kinds import OpKind
from relprop._core.rule import Rule
from relprop.engine.memory import CallMemory


class OpCall(CallMemory):
    """One operation of the forward pass, as its rule sees it.

    Parameters
    ----------
    kind : OpKind
        The op family.
    func : callable
        The torch function that computes the output.
    args, kwargs :
        Its arguments. Tensors that require grad are the activation inputs,
        everything else is a constant.
    name : str
        Readable op name, for messages.
    module_name : str
        Dotted path of the module that issued the op.
    linearised : callable, optional
        A function with the same signature whose gradient is the one the rule
        should use (e.g. layer norm with its statistic detached).
    """

    # Fields of calls of some kinds, declared here so that a rule may read them on any call. Each is set by the
    # constructor of the call class of its kind (in relprop.ops), except where said otherwise
    #: a convolution or dense op fed by a model input through routing ops alone (:class:`ParametricCall`)
    is_first: bool = False
    #: products: the tag of each activation factor (``"sigmoid"``, ``"softmax"``, ``"divisor"``, ...; None: none)
    factors: tuple[str | None, ...] = ()
    #: products: a matrix product
    matrix: bool = False
    #: softmax: the dimension it normalises
    dim: int
    #: the number of dimensions of the output (set by :func:`propagate`)
    output_dim: int
    #: whether the call serves several backward passes (a reusable :meth:`relprop.LRP.record`): it then keeps
    #: what it holds after each, and rules leave its inputs, output and ``prepared`` as they are
    reusable: bool = False
    #: whether :meth:`vjp` reads the values of :attr:`inputs`; else the graph kept for ``needs_vjp`` or a weight
    vjp_reads_inputs: bool = False
    #: max pooling: the average pooling over the same windows (None where dilated)
    average: Callable[[Tensor], Tensor] | None

    def __init__(self, kind: OpKind, func: Callable, args: tuple, kwargs: dict, name: str, module_name: str,
                 linearised: Callable | None = None):
        self.kind = kind
        #: whether ``func`` overwrites its one activation input and returns it (see ``relprop.ops.inplace._in_place_pass``)
        self.in_place = False
        #: for an op run in place: the call that produced the input it overwrote, which still reads that memory
        self.overwrites: OpCall | None = None
        self.name = name
        self.module_name = module_name
        self._rule: Rule | None = None  # set by propagate() before the op runs
        self._linearised = linearised or func
        super().__init__(func, args, kwargs)
        self._fresh()

    def _fresh(self) -> None:
        """The state of a call that has not run: what its pass adds from then on."""
        #: called as ``audit(call, relevance, input_relevances)`` after each propagation, if set
        self.audit: Callable | None = None
        #: the inputs' version counters once the op has run (see :meth:`check_inputs`)
        self.versions: tuple[int, ...] = ()
        #: set by :func:`propagate`; None again once no rule reads it (:meth:`settle`, :meth:`take_output`)
        self._output: Tensor | None = None
        #: whether an in-place ReLU has since overwritten the output in its memory: it holds relu(z) >= 0
        self.output_nonnegative = False
        #: indices of :attr:`~relprop.engine.OpCall.inputs` that are copies read by the rule alone: it may write into them
        self.scratch: frozenset[int] = frozenset()
        self._graph: tuple[list[Tensor], Tensor] | None = None
        self._prepared = False
        #: what the rule's ``prepare`` returned (a ``1 / denominator``), kept from :meth:`prepare` to :meth:`finish`
        self._preparation: Tensor | None = None
        #: set by :meth:`finish`: the backward pass went through this op, and it keeps nothing
        self.finished = False
        self._restore = False

    #: whether :meth:`rebound` makes the call anew from its arguments alone; a call class that holds more of its
    #: pass (a tensor it computed, another call) says False
    replays = True

    def rebound(self, args: tuple, kwargs: dict) -> Self:
        """A call that has not run, with this one's decisions (kind, tags, rule), over other arguments of the
        same structure (a captured plan's replay, :mod:`relprop.engine.plan`)."""
        call = copy.copy(self)
        call._bind(args, kwargs)
        call._fresh()
        return call

    @property
    def rule(self) -> Rule:
        """The op's rule, from the moment the op runs (:func:`~relprop.engine.propagate`)."""
        if self._rule is None:
            raise RuntimeError(f"relprop: {self.describe()} has no rule yet: it has not run")
        return self._rule

    @rule.setter
    def rule(self, rule: Rule) -> None:
        self._rule = rule

    @property
    def output(self) -> Tensor:
        """The op's output, while a rule may read it (until :meth:`settle` or :meth:`take_output` drops it)."""
        if self._output is None:
            raise RuntimeError(f"relprop: the output of {self.describe()} is no longer kept: rule {self._rule!r} "
                               "reads it, so it must keep needs_output = True")
        return self._output

    @output.setter
    def output(self, value: Tensor) -> None:
        self._output = self._explained_output(value)

    @property
    def explains_its_output(self) -> bool:
        """Whether the rule explains the output the model got (an attention with dropout is explained without it)."""
        return True

    def _explained_output(self, value: Tensor) -> Tensor:
        """The output the rule reads, given the model's: the same (an op explained without dropout reads another)."""
        return value

    @property
    def kept_output(self) -> Tensor | None:
        """The output where the call still keeps it, else None."""
        return self._output

    @property
    def prepared(self) -> Tensor:
        """What the rule's ``prepare`` returned for this call, for its ``propagate``."""
        if self._preparation is None:
            raise RuntimeError(f"relprop: rule {self._rule!r} reads call.prepared, but its prepare returned nothing "
                               f"for {self.describe()}")
        return self._preparation

    def keep_graph(self, leaves: list[Tensor], out: Tensor) -> None:
        """Use an autograd graph of the op built already, from ``leaves`` (one per input) to ``out``."""
        self._graph = (leaves, out)

    def _needs_graph(self) -> bool:
        return self.rule.needs_vjp and self._graph is None

    def run(self) -> Tensor:
        """Compute the output; keep the op's gradient graph if the rule needs its VJP."""
        if self._needs_graph():
            self._build_graph()
        if self._graph is not None and self._linearised is self.func:
            return self._graph[1].detach()
        # the model's own tensors (activations flagged requires_grad, parameters as they are): some kernels
        # choose their algorithm by those flags, and the output must be bitwise the plain model's
        return self.call_with(self.func, self.activations)

    @property
    def runs_as_autograd(self) -> bool:
        """Whether plain autograd of :attr:`linearised_function` may stand for the call's :meth:`vjp` (a merged
        BatchNorm or a vocabulary head may not: see :class:`~relprop.engine.ParametricCall`)."""
        return True

    @property
    def linearised(self) -> bool:
        """Whether :meth:`vjp` is that of :attr:`linearised_function`, not of the op (a norm, its statistic held)."""
        return self._linearised is not self.func

    @property
    def linearised_function(self) -> Callable:
        """The function whose gradient the rule uses; the op's own unless it is :attr:`linearised`."""
        return self._linearised

    def vjp(self, grad: Tensor) -> tuple[Tensor | None, ...]:
        """Vector-Jacobian product of the op with respect to :attr:`~relprop.engine.OpCall.inputs`.

        A rule that sets ``needs_vjp`` finds the op's autograd graph kept from
        the forward pass; for one that does not, it is built here from the
        kept inputs (the op runs once more). In a backward pass that is itself
        differentiated (``create_graph=True``, grad mode on inside it) the
        product is recorded too: relevance is linear in the seed, and
        differentiating it with respect to the seed gives its transposed map.
        """
        if self._graph is None:
            self._build_graph()
        if self._graph is None:  # a convolution merged with a BatchNorm keeps no inputs to run it on again
            raise RuntimeError(f"relprop: rule {self.rule!r} takes the VJP of {self.describe()} without setting "
                               "needs_vjp = True; set it on the rule")
        leaves, out = self._graph
        return torch.autograd.grad(out, leaves, grad, allow_unused=True, retain_graph=self.reusable,
                                   create_graph=torch.is_grad_enabled())

    def prepare(self) -> None:
        """Let the rule precompute from the output, once: in the backward pass, or before the output changes."""
        if self._restore:
            self._restore = self._prepared = self.output_nonnegative = False
            self.output = self.recompute()
        if not self._prepared:
            self._prepared = True
            self._preparation = self.rule.prepare(self)  # None unless the rule prepares
            self.settle()

    def finish(self) -> None:
        """After the backward pass through this op: free what it kept, as autograd frees saved tensors.

        A reusable call keeps it all for the next backward pass; it is freed with the recorded pass.
        """
        if self.reusable:
            return
        self.finished = True
        self.inputs = ()
        self._output = self._preparation = self._graph = self._outer = self.overwrites = None
        # the arguments hold the inputs too, and the call lives as long as the autograd graph: to its end
        self._leaves = []

    def settle(self) -> None:
        """Drop what no rule will read (it would keep activations alive until the backward pass).

        The output, once neither ``propagate`` nor ``prepare`` reads it; the inputs' values where the rule
        reads their shapes alone (:meth:`keep_input_shapes`).
        """
        rule = self.rule
        if not rule.needs_output and (self._prepared or not rule.prepares_on(self)):
            self._output = None
        if not rule.needs_inputs and self.keeps_inputs:
            self.keep_input_shapes()

    def protect(self, copy: Tensor | None = None) -> None:
        """Before user code modifies the output in place: prepare now, and copy it if the rule reads it later.

        ``copy`` is a copy of the output that nothing will modify: the rule reads
        it when the relevance comes, and nothing more is kept. An op run in
        place passes this on to the call whose output it overwrote.
        """
        if self.overwrites is not None:
            self.overwrites.protect(copy)
        self.detach_graph()
        if self._rule is None or self._output is None:
            return
        if copy is not None:
            self.output = copy.detach()  # no reference into the autograd graph: it would close a cycle
            return
        self.prepare()
        if self.rule.needs_output:
            self.output = self.output.clone()

    def describe(self) -> str:
        return f"{self.name} in module '{self.module_name or '<root>'}'"
