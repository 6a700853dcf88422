"""Autograd nodes that carry relevance instead of gradients.

Every intercepted operation becomes one :class:`OpCall` and one node of the
autograd graph (:class:`_Propagate`). The node's forward computes the
original operation, so outputs are bitwise those of the plain model; its
backward hands the incoming relevance to the call's rule. Rules that need the
op's own vector-Jacobian product (epsilon-type rules) get it from a small
private autograd graph recorded during the forward pass, so nothing is re-run
in the backward pass.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeGuard, overload

import torch
from torch import Tensor
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from .contract import OpKind

if TYPE_CHECKING:
    from .rules import Rule

__all__ = ["OpKind", "OpCall", "ParametricCall", "AddCall", "InPlaceSumCall", "Workspace", "is_activation", "propagate",
           "watch", "tap", "substitute", "is_relevance_node", "model_input", "routed_image", "sum_to"]


_Parameter = torch.nn.Parameter  # looked up once: `torch.nn.Parameter` costs three attribute lookups per call


def is_activation(value: Any) -> TypeGuard[Tensor]:
    """An activation: a tensor derived from a model input. Parameters are constants."""
    # isinstance(value, Parameter) in two cheap steps (it runs for every argument of every op): the type, and
    # the flag by which Parameter's own instance check also accepts tensor subclasses
    return (isinstance(value, Tensor) and value.requires_grad and not issubclass(type(value), _Parameter)
            and not getattr(value, "_is_param", False))


_CONTAINERS = (list, tuple, dict)

#: autograd nodes searched for the model input that an activation comes from
_INPUT_SEARCH = 256


def model_input(x: Tensor) -> Tensor | None:
    """The model input that ``x`` is made from by routing ops alone (reshape, pad, ...); None if there is none.

    ``x`` itself if it is the model input. None where an op with a rule lies on
    the way (``x`` is not just the input rearranged) or the graph is too large
    to search.
    """
    if x.grad_fn is None:
        return x if is_activation(x) else None
    stack, seen, found = [x.grad_fn], set[int](), None
    while stack:
        node = stack.pop()
        if is_relevance_node(node) or len(seen) > _INPUT_SEARCH:
            return None
        variable = getattr(node, "variable", None)
        if not node.next_functions and is_activation(variable):
            found = variable  # a model input (parameters are leaves too, but not inputs)
        for parent, _ in node.next_functions:
            if parent is not None and id(parent) not in seen:
                seen.add(id(parent))
                stack.append(parent)
    return found


def routed_image(x: Tensor, image: float | Tensor) -> Tensor | None:
    """``image``, in the space of the model input ``x`` is made from, taken through the same routing ops.

    The routing ops between the input and ``x`` are a linear map ``J`` (a
    space-to-depth, a crop, a zero padding); ``J image`` comes from two
    vector-Jacobian products, ``J^T u`` and its own VJP, on the model's
    graph, which stays as it is. ``image`` broadcasts against the input. None
    where ``x`` is not made from a model input by routing ops alone.
    """
    source = model_input(x)
    if source is None:
        return None
    image = torch.as_tensor(image, dtype=source.dtype, device=source.device).expand_as(source)
    with torch.enable_grad():
        probe = torch.zeros_like(x, requires_grad=True)
        (back,) = torch.autograd.grad(x, source, probe, create_graph=True, retain_graph=True)
        (forward,) = torch.autograd.grad(back, probe, image)
    return forward.detach()


def _holds_activation(value: Any) -> bool:
    """Whether a list, tuple or dict holds an activation, at any depth."""
    for item in value.values() if isinstance(value, dict) else value:
        if is_activation(item) if isinstance(item, Tensor) else (
                isinstance(item, _CONTAINERS) and _holds_activation(item)):
            return True
    return False


def _positional_activations(args: tuple) -> tuple[list, list[int] | None]:
    """``args`` as a list, and the indices of the activations among them; None if a list or tuple holds one."""
    slots = []
    for index, value in enumerate(args):
        if isinstance(value, Tensor):
            if is_activation(value):
                slots.append(index)
        elif isinstance(value, _CONTAINERS) and _holds_activation(value):
            return list(args), None
    return list(args), slots


def sum_to(tensor: Tensor, shape: torch.Size) -> Tensor:
    """``tensor`` summed over the dimensions along which ``shape`` was broadcast (itself where the shapes match)."""
    return tensor if tensor.shape == shape else tensor.sum_to_size(shape)


def _storage_count(tensor: Tensor) -> int:
    """References to ``tensor``'s memory: from tensors (views and aliases included) and from storage objects.

    It asks by address: ``tensor.untyped_storage()`` would make a storage
    object that lives as long as the memory and counts as a reference, and
    autograd then adds every gradient that arrives after a relevance in that
    memory into a new tensor instead of into it.
    """
    return torch._C._storage_Use_Count(torch._C._storage_address(tensor))  # type: ignore[attr-defined]


@functools.cache
def _lone_storage_count() -> int | None:
    """:func:`_storage_count` of a tensor that nothing else references, as this PyTorch version counts it.

    None if PyTorch does not expose the count of a storage's references.
    """
    if not (hasattr(torch._C, "_storage_Use_Count") and hasattr(torch._C, "_storage_address")):
        return None
    return _storage_count(torch.empty(1))


#: op kinds whose autograd backward saves inputs and parameters only, never the op's output (a ``tanh``, a softmax
#: or a fused attention saves its output)
_SAVES_NO_OUTPUT = frozenset({OpKind.CONV, OpKind.DENSE, OpKind.BATCHNORM, OpKind.SUM, OpKind.NORM, OpKind.PRODUCT,
                              OpKind.MAXPOOL})


class OpCall:
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
    #: what the rule's ``prepare`` returned (a ``1 / denominator``), kept from :meth:`prepare` to :meth:`finish`
    prepared: Tensor = None  # type: ignore[assignment]
    #: max pooling: the average pooling over the same windows (None where dilated)
    average: Callable[[Tensor], Tensor] | None

    def __init__(self, kind: OpKind, func: Callable, args: tuple, kwargs: dict, name: str, module_name: str,
                 linearised: Callable | None = None):
        self.kind = kind
        self.func = func
        #: whether ``func`` overwrites its one activation input and returns it (see ``ops._in_place_pass``)
        self.in_place = False
        #: for an op run in place: the call that produced the input it overwrote, which still reads that memory
        self.overwrites: OpCall | None = None
        self.name = name
        self.module_name = module_name
        self.rule: Rule = None  # type: ignore[assignment]  # set by propagate() before the op runs
        #: called as ``audit(call, relevance, input_relevances)`` after each propagation, if set
        self.audit: Callable | None = None
        self._linearised = linearised or func
        leaves, slots = _positional_activations(args)
        self._spec: TreeSpec | None = None
        self._constants: dict = kwargs
        if slots is None or (kwargs and _holds_activation(kwargs)):
            leaves, self._spec = tree_flatten((args, kwargs))
            self._constants = {}
            slots = [i for i, leaf in enumerate(leaves) if is_activation(leaf)]
        # else the common case, activations among the positional arguments only: no pytree needed
        self._slots = slots
        self._outer: tuple[Tensor, ...] | None = tuple([leaves[i] for i in slots])
        inputs = []
        for slot, x in zip(slots, self._outer):
            leaves[slot] = value = x.detach()
            inputs.append(value)
        self.inputs: tuple[Tensor, ...] = tuple(inputs)
        self._leaves = leaves
        #: the inputs' version counters once the op has run (see :meth:`check_inputs`)
        self.versions: tuple[int, ...] = ()
        #: set by :func:`propagate`; None again once no rule reads it (:meth:`settle`, :meth:`take_output`)
        self.output: Tensor = None  # type: ignore[assignment]
        #: whether an in-place ReLU has since overwritten the output in its memory: it holds relu(z) >= 0
        self.output_nonnegative = False
        #: indices of :attr:`inputs` that are copies read by the rule alone: it may write into them
        self.scratch: frozenset[int] = frozenset()
        self._graph: tuple[list[Tensor], Tensor] | None = None
        self._prepared = False
        self._restore = False

    @property
    def activations(self) -> tuple[Tensor, ...]:
        """The activation inputs as the outer autograd graph knows them (until :meth:`release`)."""
        if self._outer is None:
            raise RuntimeError("relprop: the op call no longer holds the model's tensors")
        return self._outer

    def release(self) -> None:
        """Drop the model's own tensors once the node exists: the backward pass needs only detached values.

        Keeping them would close a reference cycle through the autograd graph
        (node -> call -> input -> its later in-place op -> node) that Python's
        garbage collector cannot see.
        """
        self._outer = None

    def _call(self, func: Callable, inputs: Sequence[Tensor]) -> Tensor:
        leaves = list(self._leaves)
        for slot, value in zip(self._slots, inputs):
            leaves[slot] = value
        if self._spec is None:
            return func(*leaves, **self._constants)
        args, kwargs = tree_unflatten(leaves, self._spec)
        return func(*args, **kwargs)

    def keep_inputs_from(self, target: Tensor) -> None:
        """Before ``target`` is overwritten in place: the inputs in its memory become copies, for the rule to read.

        Plain autograd allows ``y = a + 1; a[0] = 0`` as long as no op saved
        ``a``; every rule here reads its inputs, so each op that read ``a``
        keeps a copy instead (:meth:`check_inputs` raises otherwise). An op
        run in place on ``target`` itself reads only the shape of its input.
        """
        if self.inputs is None:  # the backward pass went through this op already
            return
        kept = [i for i, x in enumerate(self.inputs)
                if torch._C._is_alias_of(x, target)  # type: ignore[attr-defined]
                and not (self.in_place and i == 0)]
        if not kept:
            return
        inputs = list(self.inputs)
        for i in kept:
            inputs[i] = inputs[i].clone()
            self._leaves[self._slots[i]] = inputs[i]
        self.inputs = tuple(inputs)
        self.versions = tuple(x._version for x in inputs)
        if self._graph is not None:  # it may have saved the old memory (a product saves its factors)
            self._build_graph()

    def detach_graph(self) -> None:
        """Before the output is modified in place: the kept autograd graph built anew if it may have saved it.

        The output is the kept graph's own output, and the backward of an
        elementwise op (``tanh``, ``sigmoid``, ``exp``), a softmax or an
        attention saves it; linear ops save only their inputs.
        """
        if self._graph is not None and self._linearised is self.func and self.kind not in _SAVES_NO_OUTPUT:
            self._build_graph()

    def _build_graph(self) -> None:
        """The op's private autograd graph, built (or built again) on :attr:`inputs`."""
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_() for x in self.inputs]
            self._graph = (leaves, self._call(self._linearised, leaves))

    def check_inputs(self) -> None:
        """Raise if an input was modified in place after the op read it: the rule would read the new values.

        Plain autograd refuses the same for ops that save their input; every
        rule reads its inputs. An op run in place overwrote its own input, and
        its rule reads only the shape.
        """
        for index, (x, version) in enumerate(zip(self.inputs, self.versions)):
            if x._version != version and not (self.in_place and index == 0):
                raise RuntimeError(f"relprop: input {index} of {self.describe()} was modified in place after the op "
                                   "read it, so its relevance cannot be computed; modify a copy instead "
                                   "(x = x.clone()) or use the out-of-place op")

    def keep_graph(self, leaves: list[Tensor], out: Tensor) -> None:
        """Use an autograd graph of the op built already, from ``leaves`` (one per input) to ``out``."""
        self._graph = (leaves, out)

    def _needs_graph(self) -> bool:
        return self.rule.needs_vjp and self._graph is None

    def run_in_place(self, overwrites: OpCall | None) -> None:
        """Run the op in place on its one activation input, whose producer ``overwrites`` still reads that memory.

        Only for a rule that reads nothing but the input's shape (see ``ops._in_place_pass``).
        """
        self.in_place = True
        self.overwrites = overwrites

    def zeroed_in_place(self) -> None:
        """An in-place ReLU overwrote the output in its memory: it holds ``relu(z) >= 0`` (see :meth:`restore_output`)."""
        self.output_nonnegative = True

    def run(self) -> Tensor:
        """Compute the output; keep the op's gradient graph if the rule needs its VJP."""
        if self._needs_graph():
            self._build_graph()
        if self._graph is not None and self._linearised is self.func:
            return self._graph[1].detach()
        # the model's own tensors (activations flagged requires_grad, parameters as they are): some kernels
        # choose their algorithm by those flags, and the output must be bitwise the plain model's
        return self._call(self.func, self.activations)

    def vjp(self, grad: Tensor) -> tuple[Tensor | None, ...]:
        """Vector-Jacobian product of the op with respect to :attr:`inputs`.

        A rule that sets ``needs_vjp`` finds the op's autograd graph kept from
        the forward pass; for one that does not, it is built here from the
        kept inputs (the op runs once more).
        """
        if self._graph is None:
            self._build_graph()
        if self._graph is None:  # a convolution merged with a BatchNorm keeps no inputs to run it on again
            raise RuntimeError(f"relprop: rule {self.rule!r} takes the VJP of {self.describe()} without setting "
                               "needs_vjp = True; set it on the rule")
        leaves, out = self._graph
        return torch.autograd.grad(out, leaves, grad, allow_unused=True)

    def take_output(self) -> Tensor | None:
        """:attr:`output` for the rule to write into, if no other tensor shares its memory; else None.

        By the time the relevance reaches an op, every op that read its output
        has passed the relevance on and freed its inputs; if the model, the
        user or a hook kept no tensor in the same memory either, nothing can
        read it any more, and the rule may write into it instead of into a
        new tensor of the same size. The call then drops its own reference,
        so the memory is freed as soon as the rule is done with it. The check
        counts the references to the memory (views, aliases and storage
        objects included); where PyTorch does not expose the count, the answer
        is None.
        """
        lone = _lone_storage_count()
        if self.output is None or lone is None or _storage_count(self.output) != lone:
            return None
        output, self.output = self.output, None  # type: ignore[assignment]
        return output

    def restore_output(self) -> None:
        """Have the rule read the true output after all, though an in-place ReLU overwrote it (see ``ops``).

        An op that reads the ReLU's output may give relevance to the entries
        the ReLU set to 0 (its rule is not :attr:`~relprop.rules.Rule.zero_for_zero_input`),
        so ``relu(z)`` no longer serves for ``z`` there: the output is computed
        again from the inputs before the rule prepares (again, if it already has).
        """
        self._restore = True

    def recompute(self) -> Tensor:
        """The output computed again from :attr:`inputs`."""
        inputs = (self.inputs[0].clone(), *self.inputs[1:]) if self.in_place else self.inputs
        with torch.no_grad():
            return self._call(self.func, inputs)

    def prepare(self) -> None:
        """Let the rule precompute from the output, once: in the backward pass, or before the output changes."""
        if self._restore:
            self._restore = self._prepared = self.output_nonnegative = False
            self.output = self.recompute()
        if not self._prepared:
            self._prepared = True
            self.prepared = self.rule.prepare(self)  # type: ignore[assignment]  # None unless the rule prepares
            self.settle()

    def finish(self) -> None:
        """After the backward pass through this op: free what it kept, as autograd frees saved tensors."""
        self.inputs = None  # type: ignore[assignment]
        self.output = None  # type: ignore[assignment]
        self._graph = None
        # the arguments hold the inputs too, and the call lives as long as the autograd graph: to its end
        self._leaves = self._outer = None  # type: ignore[assignment]
        self.overwrites = None
        self.prepared = None  # type: ignore[assignment]

    def settle(self) -> None:
        """Drop the output once nothing will read it: it would keep an activation alive until the backward pass."""
        if not self.rule.needs_output and (self._prepared or not self.rule.prepares):
            self.output = None  # type: ignore[assignment]

    def protect(self, copy: Tensor | None = None) -> None:
        """Before user code modifies the output in place: prepare now, and copy it if the rule reads it later.

        ``copy`` is a copy of the output that nothing will modify: the rule reads
        it when the relevance comes, and nothing more is kept. An op run in
        place passes this on to the call whose output it overwrote.
        """
        if self.overwrites is not None:
            self.overwrites.protect(copy)
        self.detach_graph()
        if self.rule is None or self.output is None:
            return
        if copy is not None:
            self.output = copy.detach()  # no reference into the autograd graph: it would close a cycle
            return
        self.prepare()
        if self.rule.needs_output:
            self.output = self.output.clone()

    def describe(self) -> str:
        return f"{self.name} in module '{self.module_name or '<root>'}'"

    @property
    def arguments(self) -> dict[str, Any] | None:
        """The op's arguments other than its activation inputs, by the names its torch function gives them.

        Bound to the function's signature with its defaults filled in
        (``kernel_size``, ``stride``, ... of ``F.max_pool2d``); None where the
        function has no signature to bind to, or the activations are nested in
        containers (no single input to replace).
        """
        if self._spec is not None:
            return None
        # F.max_pool2d and kin dispatch on return_indices between two functions of one signature
        func = torch._jit_internal.boolean_dispatched.get(self.func, {}).get("if_false", self.func)
        try:
            bound = inspect.signature(func).bind(*self._leaves, **self._constants)
        except (TypeError, ValueError):  # a builtin without a signature, or arguments it does not take
            return None
        bound.apply_defaults()
        return {name: value for name, value in bound.arguments.items() if not any(value is x for x in self.inputs)}


class Workspace:
    """Buffers that the parametric op calls of one forward pass share for a weight-sized tensor each rule
    needs only while it runs (``W+``).

    The backward pass reaches one op at a time on a device, so one buffer per
    device and dtype, the size of the largest such tensor, serves every
    layer. A new tensor per layer would cost as much memory at any moment,
    but on a CPU each is fresh memory from the operating system (it is above
    glibc's mmap threshold), faulted in page by page: 71 MiB of them per
    attribution on ResNet50 (``benchmarks/README.md``).
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, torch.dtype], Tensor] = {}

    def like(self, tensor: Tensor, shape: list[int] | torch.Size | None = None) -> Tensor:
        """An uninitialised tensor shaped like ``tensor`` (or ``shape``), with its device and dtype.

        It is valid until the next call for the same device and dtype.
        """
        shape = tensor.shape if shape is None else torch.Size(shape)
        key = (tensor.device, tensor.dtype)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < shape.numel():
            # a view of the old buffer still alive keeps its memory: replacing never overwrites it
            buffer = self._buffers[key] = torch.empty(shape.numel(), dtype=tensor.dtype, device=tensor.device)
        return buffer[:shape.numel()].view(shape)


class ParametricCall(OpCall):
    """A parametric linear op ``f(x; weight, bias)`` (convolution, dense layer).

    ``weight`` and ``bias`` are constants here; a BatchNorm that directly
    follows the op is merged into them by :meth:`merge_batch_norm`. With
    ``transpose`` (the op's VJP with respect to ``x``, e.g. a transposed
    convolution) no autograd graph is kept for epsilon-type rules; it is
    called as ``transpose(grad, weight, like)``, where ``like`` is an input of
    the shape the op with ``weight`` takes, None for the op's own input (see
    :meth:`stack_signs`).
    """

    def __init__(self, kind: OpKind, func: Callable, args: tuple, kwargs: dict, name: str, module_name: str,
                 weight: Tensor, bias: Tensor | None,
                 evaluate: Callable[[Tensor, Tensor, Tensor | None], Tensor], channel_dim: int | None,
                 transpose: Callable[..., Tensor] | None, workspace: Workspace, is_first: bool = False,
                 input_nonnegative: bool = False):
        super().__init__(kind, func, args, kwargs, name, module_name)
        self.evaluate = evaluate
        self.workspace = workspace
        self.is_first = is_first
        #: whether the input is known to be >= 0 (a ReLU's output), so that rules need not check its sign
        self.input_nonnegative = input_nonnegative
        self._weight, self._bias = weight, bias
        self._channel_dim = channel_dim  # weight dimension that indexes output channels
        self._transpose = transpose
        self._batch_norm: tuple[Tensor, Tensor] | None = None  # merged (scale, shift) per output channel
        self._merged_weight: Tensor | None = None
        self._merged_bias: Tensor | None = None
        self._value: Tensor | None = None

    @property
    def weight(self) -> Tensor:
        """The weight, a merged BatchNorm's scale included (computed on first use, kept until :meth:`finish`)."""
        if self._batch_norm is None:
            return self._weight
        if self._merged_weight is None:  # only rules that modify parameters need it
            self._merged_weight = self._merge_weight()
        return self._merged_weight

    @property
    def bias(self) -> Tensor | None:
        """The bias, a merged BatchNorm's scale and shift included."""
        if self._batch_norm is None:
            return self._bias
        if self._merged_bias is None:
            scale, shift = self._batch_norm
            self._merged_bias = shift if self._bias is None else self._bias * scale + shift
        return self._merged_bias

    @overload
    def weight_parts(self, negative: Literal[True]) -> tuple[Tensor, Tensor]: ...
    @overload
    def weight_parts(self, negative: Literal[False]) -> tuple[Tensor, None]: ...

    def weight_parts(self, negative: bool) -> tuple[Tensor, Tensor | None]:
        """``W+`` and, if ``negative``, ``W-`` of :attr:`weight`.

        ``W+`` is written into the :class:`Workspace`: it is valid while the
        rule runs, until another op call asks for its ``W+``. ``W-`` is a new
        tensor. A merged weight that is not kept already is made for them and
        not kept.
        """
        w_pos = self.workspace.like(self._weight)
        w_neg = torch.empty_like(self._weight) if negative else None
        self._write_signs(w_pos, w_neg)
        return w_pos, w_neg

    def negative_weight(self, out: Tensor) -> Tensor:
        """``W-`` of :attr:`weight`, written into ``out``: a weight-sized tensor the caller is done with (its ``W+``)."""
        return torch.clamp(self._weight_in(out), max=0, out=out)

    def _write_signs(self, w_pos: Tensor, w_neg: Tensor | None) -> None:
        """``W+`` of :attr:`weight` written into ``w_pos`` and, unless None, ``W-`` into ``w_neg``."""
        weight = self._weight_in(w_pos)
        if w_neg is not None:
            torch.clamp(weight, max=0, out=w_neg)
        torch.clamp(weight, min=0, out=w_pos)  # last: `weight` may be `w_pos` itself

    def _weight_in(self, out: Tensor) -> Tensor:
        """:attr:`weight`; where that is a merged weight not kept, made in ``out`` (weight-shaped) for the caller."""
        if self._batch_norm is None or self._merged_weight is not None:
            return self.weight
        return self._merge_weight(out)

    def _merge_weight(self, out: Tensor | None = None) -> Tensor:
        """The weight with the merged BatchNorm's scale on its output channels, in ``out`` or a new tensor."""
        shape = [1] * self._weight.dim()
        shape[self._channel_dim] = -1  # type: ignore[index]  # a merged BatchNorm's op has its channel dimension
        return torch.mul(self._weight, self._batch_norm[0].reshape(shape), out=out)  # type: ignore[index]

    def scale_input_channels(self, weight: Tensor, scale: Tensor) -> Tensor | None:
        """``weight`` (shaped like :attr:`weight`) multiplied in place by ``scale``, one factor per input channel.

        The op with the result equals the op on its input multiplied channel by
        channel by ``scale`` (a vector as long as the input has channels).
        None, and ``weight`` left as it is, where the weight does not index
        the input channels one by one (grouped convolutions).
        """
        dim = self._input_channel_dim(scale.numel())
        if dim is None:
            return None
        shape = [1] * weight.dim()
        shape[dim] = -1
        return weight.mul_(scale.reshape(shape))

    def _input_channel_dim(self, channels: int) -> int | None:
        """The weight dimension that indexes the input's ``channels`` channels one by one; None where none does.

        None for grouped convolutions, whose weight indexes the channels of one group.
        """
        if self._channel_dim is None:
            return None
        dim = 1 - self._channel_dim  # the weight's other leading dimension
        return dim if self._weight.shape[dim] == channels else None

    def stack_signs(self, x: Tensor) -> tuple[Tensor, Tensor] | None:
        """``x+`` and ``x-`` side by side along the input channels, and ``W+`` and ``W-`` of :attr:`weight` to match.

        The op with both (:attr:`evaluate`) is ``W+ x+ + W- x-``, and one
        transposed product with the stacked weight (:meth:`transpose_with`, the
        stacked input as ``like``) gives ``W+^T s`` and ``W-^T s`` side by
        side: one product each way instead of two. On a first layer of three
        colour channels that halves the cost of both, since the kernels
        handle six channels about as fast as three. The stacked weight is
        written into the :class:`Workspace`. None where the weight does not
        index the input channels one by one (grouped convolutions).
        """
        dim = self._input_channel_dim(x.shape[self.input_channel_axis(x)])
        if dim is None:
            return None
        shape = list(self._weight.shape)
        shape[dim] *= 2
        weights = self.workspace.like(self._weight, shape)
        self._write_signs(*weights.chunk(2, dim))
        axis, inputs = self._stacked_input(x)
        x_pos, x_neg = inputs.chunk(2, axis)
        torch.clamp(x, min=0, out=x_pos)
        torch.clamp(x, max=0, out=x_neg)
        return inputs, weights

    def transpose_beside(self, grad: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        """``W^T grad`` (``W``: :attr:`weight`) and ``weight^T grad``, from one transposed product.

        ``W`` and ``weight`` side by side along the input channels make one
        product: on a first layer of three colour channels about the cost of
        one of them. Only where the weight indexes the input channels one by
        one (:meth:`scale_input_channels` is not None).
        """
        x = self.inputs[0]
        axis, like = self._stacked_input(x)
        stacked = torch.cat([self.weight, weight], self._input_channel_dim(x.shape[axis]))  # type: ignore[arg-type]
        # the kernel reads the shape of `like` alone: memory never written is never faulted in
        return self.transpose_with(grad, stacked, like=like).chunk(2, axis)  # type: ignore[return-value]

    def _stacked_input(self, x: Tensor) -> tuple[int, Tensor]:
        """The axis of ``x``'s channels, and an uninitialised input like ``x`` with twice as many channels."""
        axis = self.input_channel_axis(x)
        shape = list(x.shape)
        shape[axis] *= 2
        return axis, x.new_empty(shape)

    def routed_image(self, image: float | Tensor) -> Tensor | None:
        """``image``, in the model input's space, taken through the routing ops that made this op's input.

        None where the input is not the model input rearranged (see :func:`routed_image`).
        """
        return routed_image(self.activations[0], image)

    def input_channel_axis(self, x: Tensor) -> int:
        """The axis of ``x`` (an input of the op) holding its channels: 1 for convolutions, the last for dense ops."""
        return 1 if self.kind == OpKind.CONV else x.dim() - 1

    def _output_shape(self, vector: Tensor) -> Tensor:
        """A per-channel vector shaped to broadcast against the output."""
        shape = [1] * self.output_dim
        shape[1 if self.kind == OpKind.CONV else -1] = -1
        return vector.reshape(shape)

    @property
    def arguments(self) -> dict[str, Any]:
        """``weight`` and ``bias`` (a merged BatchNorm included) and the op's options (``stride``, ``padding``, ...)."""
        return {"weight": self.weight, "bias": self.bias, **self._constants}

    def bias_term(self) -> Tensor:
        """The bias, shaped to broadcast against the output."""
        return self._output_shape(self.bias)  # type: ignore[arg-type]  # called where there is a bias

    def _needs_graph(self) -> bool:
        return self._transpose is None and super()._needs_graph()

    def recompute(self) -> Tensor:
        with torch.no_grad():  # a merged BatchNorm included
            return self.evaluate(self.inputs[0], self.weight, self.bias)

    def release(self) -> None:
        """Keep the data input: a BatchNorm that follows builds its merged node on it."""

    def _build_graph(self) -> None:
        if self._batch_norm is None:  # a merged call's graph ends in the BatchNorm; the op's VJP saves no input
            super()._build_graph()

    def finish(self) -> None:
        super().finish()
        self._merged_weight = None  # a copy of the layer's weights, else kept until the graph is freed
        self._transpose = None  # a transposed convolution holds its input (for the shape)

    def run(self) -> Tensor:
        if self._value is not None:  # a merged call: the output was computed by the BatchNorm itself
            value, self._value = self._value, None
            return value
        return super().run()

    def vjp(self, grad: Tensor) -> tuple[Tensor | None, ...]:
        if self._graph is not None or self._transpose is None:
            return super().vjp(grad)
        if self._batch_norm is None:
            return (self._transpose(grad),)  # type: ignore[misc]  # no graph kept: the op is transposable
        # the merged BatchNorm's scale goes onto the weight or onto the relevance, whichever is smaller
        if self._weight.numel() < grad.numel():
            return (self._transpose(grad, self.weight),)  # type: ignore[misc]
        return (self._transpose(grad * self._output_shape(self._batch_norm[0])),)  # type: ignore[misc]

    @property
    def transposable(self) -> bool:
        """Whether :meth:`transpose_with` is available (no string padding, no private graph needed)."""
        return self._transpose is not None

    def transpose_with(self, grad: Tensor, weight: Tensor, like: Tensor | None = None) -> Tensor:
        """The VJP with respect to the input of the op with another ``weight``: one transposed product.

        ``like``: an input of the shape the op with ``weight`` takes, where that is not the shape of :attr:`inputs`
        (a stacked weight, see :meth:`stack_signs`).
        """
        return self._transpose(grad, weight, like)  # type: ignore[misc]  # rules check transposable first

    def merge_batch_norm(self, batch_norm: Callable[[Tensor], Tensor], scale: Tensor, shift: Tensor,
                         output: Tensor, module_name: str) -> "ParametricCall":
        """A copy of this call with ``batch_norm(f(x)) = f(x; scale*W, scale*b + shift)`` merged in.

        The merged output is ``batch_norm`` applied to ``output``, this call's
        output, so it stays bitwise the plain model's. On a call that has a
        BatchNorm merged already (``conv -> bn -> bn2``) the two compose:
        ``scale * (scale0 * z + shift0) + shift``. This call stays as it is, for
        the other ops that read its output. ``module_name`` names the modules of both.
        """
        if self._batch_norm is not None:
            scale0, shift0 = self._batch_norm
            scale, shift = scale0 * scale, shift0 * scale + shift
        merged = object.__new__(type(self))  # a shallow copy; copy.copy costs as much as a small op
        merged.__dict__.update(self.__dict__)
        merged._batch_norm = (scale, shift)
        merged._merged_weight = merged._merged_bias = None  # this call's, if it made them already
        merged._prepared = False
        merged.name = f"{self.name}+batch_norm"
        merged.module_name = module_name
        merged._value = batch_norm(output.detach())
        if self._graph is not None:
            leaves, out = self._graph
            with torch.enable_grad():
                merged._graph = (leaves, batch_norm(out))
        return merged


class AddCall(OpCall):
    """``x + alpha * y`` or ``x - alpha * y`` (``add``, ``sub``): a sum whose VJP is closed-form.

    The VJP hands ``g`` to ``x`` and ``alpha * g`` (``-alpha * g`` for a
    difference) to ``y``, each summed to its input's shape where it was
    broadcast, as autograd computes it (bitwise), so no autograd graph of the
    sum is kept in the forward pass and none is run in the backward pass.
    Only for two arguments of one floating dtype (or a number): autograd would
    also cast the gradient of an input of another dtype.

    Parameters
    ----------
    alpha : float
        The factor of the second argument, negated for a difference.
    """

    def __init__(self, func: Callable, args: tuple, kwargs: dict, name: str, module_name: str, alpha: float):
        super().__init__(OpKind.SUM, func, args, kwargs, name, module_name)
        #: the factor of each activation input: 1 for the first argument, ``alpha`` for the second
        self._factors = tuple(1 if slot == 0 else alpha for slot in self._slots)

    def _needs_graph(self) -> bool:
        return False

    def vjp(self, grad: Tensor) -> tuple[Tensor, ...]:
        return tuple(sum_to(grad if factor == 1 else grad * factor, x.shape)
                     for factor, x in zip(self._factors, self.inputs))


class InPlaceSumCall(AddCall):
    """``x.add_(y, alpha=a)`` run in place, as in the plain model (a residual connection ``out += identity``).

    The rule reads ``before``, a copy of ``x`` taken before the op, and the
    op's VJP is closed-form (:class:`AddCall`), so no autograd graph of the
    sum is kept and no result is copied back into ``x``. ``producer``, the
    call that computed ``x``, may read the same copy (see :meth:`OpCall.protect`).
    """

    def __init__(self, func: Callable, args: tuple, kwargs: dict, name: str, module_name: str, before: Tensor,
                 alpha: float, producer: OpCall | None):
        super().__init__(func, args, kwargs, name, module_name, alpha)
        self.in_place = True
        self.inputs = (before, *self.inputs[1:])
        self._leaves[self._slots[0]] = before  # no alias of x left here: the output may be writable later
        self._producer = producer

    def prepare(self) -> None:
        """Prepare, and let the producer of ``x`` prepare too.

        The producer may prepare at any time. If it then reads no more of the
        copy of ``x``, the copy is this rule's alone to write into: one
        map-sized tensor fewer on every residual connection.
        """
        super().prepare()
        if self._producer is not None:
            self._producer.prepare()
            if self._producer.output is None:
                self.scratch = frozenset({0})
            self._producer = None


def _unviewed(out: Tensor, call: OpCall) -> Tensor:
    """``out``, a view the op returned, as a tensor of its own.

    A view made inside a custom Function can never be modified in place, and
    models do (timm's NaFlexViT adds its position embedding in place to the
    output of a dense layer, which ``F.linear`` on a 3-D input returns as a view
    of the 2-D matrix product). A view of memory that only the op made (that
    product) becomes a tensor over the same memory (``set_``, no copy; it keeps
    no view relation); a view of an argument is copied, so that modifying it
    in place never modifies the argument behind autograd's back.
    """
    if out.is_conj() or out.is_neg() or any(isinstance(leaf, Tensor)  # lazy conjugates: set_ would drop the flag
                                            and torch._C._is_alias_of(out, leaf)  # type: ignore[attr-defined]
                                            for leaf in call._leaves):
        return out.clone()
    # set_(Tensor) is documented, but missing from the type stubs
    return torch.empty(0, dtype=out.dtype, device=out.device).set_(out)  # type: ignore[call-overload]


class _Propagate(torch.autograd.Function):
    """Autograd node of one op call: original op forward, rule backward."""

    @staticmethod
    def forward(ctx: Any, call: OpCall, *activations: Tensor) -> Tensor:
        ctx.call = call
        ctx.set_materialize_grads(False)  # no relevance arriving stays None: nothing to propagate or report
        out = call.run()
        if call.in_place:  # the op overwrote its input, as in the plain model: this node is its history now
            ctx.mark_dirty(activations[0])
        elif out._is_view():
            out = _unviewed(out, call)
        return out

    @staticmethod
    def backward(ctx: Any, relevance: Tensor | None) -> tuple[Tensor | None, ...]:
        call = ctx.call
        if call.inputs is None:
            raise RuntimeError("relprop: relevance crosses a recorded forward pass once; run the forward again")
        if relevance is None:
            return (None,) * (1 + len(call.inputs))
        call.check_inputs()
        call.prepare()
        result = call.rule.propagate(call, relevance)
        if call.audit is not None:
            call.audit(call, relevance, result)
        call.finish()
        return (None, *result)


def propagate(call: OpCall, rule: Rule, audit: Callable | None = None) -> Tensor:
    """Run ``call`` as a relevance node with ``rule``; returns the (bitwise original) output.

    ``audit`` is called as ``audit(call, relevance, input_relevances)`` after the call propagates.
    """
    call.rule = rule
    call.audit = audit
    out = _Propagate.apply(call, *call.activations)
    call.versions = tuple([x._version for x in call.inputs])
    call.output = out.detach()
    call.output_dim = out.dim()
    call.release()
    return out


class _WriteInto(torch.autograd.Function):
    """``target.copy_(result)`` whose backward hands the relevance to ``result`` alone.

    A plain ``copy_`` under autograd would also send a tensor of zeros to the
    overwritten value, and the engine would add it to that value's relevance:
    two passes over memory for nothing on every in-place op.
    """

    @staticmethod
    def forward(ctx: Any, target: Tensor, result: Tensor) -> Tensor:
        ctx.set_materialize_grads(False)
        ctx.mark_dirty(target)
        return target.copy_(result)

    @staticmethod
    def backward(ctx: Any, relevance: Tensor | None) -> tuple[None, Tensor | None]:
        return None, relevance


def write_into(target: Tensor, result: Tensor) -> Tensor:
    """Write ``result`` into ``target`` in place; in the backward pass ``target``'s relevance goes to ``result``."""
    return _WriteInto.apply(target, result)


class _Watch(torch.autograd.Function):
    """Identity on the output of an op without a rule; reports it if relevance flows through."""

    @staticmethod
    def forward(ctx: Any, report: Callable[[Tensor], None], value: Tensor) -> Tensor:
        ctx.report = report
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor]:
        ctx.report(grad)
        return None, grad


def watch(value: Any, report: Callable[[Tensor], None]) -> Any:
    """Wrap every floating output tensor of an unknown op; ``report(relevance)`` runs when relevance reaches it."""
    if isinstance(value, Tensor):
        return _Watch.apply(report, value) if value.requires_grad else value
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(watch(v, report) for v in value)
    if isinstance(value, list):
        return [watch(v, report) for v in value]
    return value


class _Tap(torch.autograd.Function):
    """Identity that hands the relevance passing through it to ``record``."""

    @staticmethod
    def forward(ctx: Any, record: Callable[[Tensor], None], value: Tensor) -> Tensor:
        ctx.record = record
        return value.clone()  # a fresh tensor, so that later in-place ops on it are allowed

    @staticmethod
    def backward(ctx: Any, relevance: Tensor) -> tuple[None, Tensor]:
        ctx.record(relevance)
        return None, relevance


class _Substitute(torch.autograd.Function):
    """``value`` in the forward pass, ``source``'s graph in the backward pass."""

    @staticmethod
    def forward(ctx: Any, value: Tensor, source: Tensor) -> Tensor:
        return value.clone()

    @staticmethod
    def backward(ctx: Any, relevance: Tensor) -> tuple[None, Tensor]:
        return None, relevance


def substitute(value: Tensor, source: Tensor) -> Tensor:
    """A tensor equal to ``value`` (bitwise) whose relevance flows into ``source``, an equivalent computation."""
    return _Substitute.apply(value.detach(), source)


def tap(value: Tensor, record: Callable[[Tensor], None]) -> Tensor:
    """``value`` behind a node that passes the relevance reaching it to ``record`` during the backward pass."""
    return _Tap.apply(record, value)


_NODE_TYPES = (_Propagate._backward_cls, _Watch._backward_cls)


def is_relevance_node(grad_fn: Any) -> bool:
    """Whether ``grad_fn`` is a node made by :func:`propagate` or :func:`watch`."""
    return isinstance(grad_fn, _NODE_TYPES)
