"""The public attribution API, compatible with captum's ``LRP`` and its ``Attribution`` protocol."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import Tensor, nn

from relprop import composites
from relprop.engine.plan import PathChanged, Plans, pass_signature
from relprop.engine.session import GradientFormUnavailable, Session
from relprop.methods._inputs import Inputs, Target, explained_arguments
from relprop.methods.adapters import hold_selective_parameters
from relprop.methods.compiled import Compiled, FiniteCheck
from relprop.methods.differentiable import Differentiable
from relprop.methods.forward_pass import ForwardPass
from relprop.methods.protocol import Attribution, cyclic_gc_paused, eager
from relprop.methods.targets import convergence_delta, model_logits, output_relevance

__all__ = ["LRP"]


class LRP(Attribution):
    """Layer-wise relevance propagation for any PyTorch model, with captum's interface.

    Parameters
    ----------
    model : nn.Module
        The model to explain. It is not modified: no parameter, flag, hook or
        mode outlives a call. A model compiled with ``torch.compile`` is explained
        through the module it was compiled from, and calls of this class run eagerly inside
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
        the op's module path (:class:`~relprop.ConservationWarning`).
    compile : bool or str
        Explain through one ``torch.compile`` program per input signature, each op's rule decided once per
        compilation (design notes, section 9; ``"aot_eager"`` compiles without code generation). What it cannot
        compile runs under interception, with one :class:`~relprop.methods.compiled.CompileFallbackWarning`.

    Notes
    -----
    A model in ``nn.DataParallel`` is explained through the module it wraps:
    its replicas run in threads, where the engine's interception is not active.

    Attributes
    ----------
    model : nn.Module
        The module explained (also captum's ``forward_func``).
    replay : bool
        Whether repeated attributions with inputs of one signature follow a
        captured plan (composites that carry relevance per unit of activation:
        AttnLRP, CP-LRP): from the third call on, each op is checked against
        the decision recorded for it and runs it without its op family, with
        the same relevance (design notes, section 7). True by default.

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> import relprop
    >>> model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 10))
    >>> images, labels = torch.randn(2, 3, 8, 8), torch.tensor([3, 7])
    >>> lrp = relprop.LRP(model.eval(), "epsilon-plus-flat")
    >>> relevance = lrp.attribute(images, target=labels)
    >>> relevance.shape
    torch.Size([2, 3, 8, 8])
    """

    multiplies_by_inputs = True
    #: the engine's mode for one forward pass; a method that must see more ops than LRP does subclasses it
    session_class: type[Session] = Session

    def __init__(self, model: nn.Module, composite: composites.Composite | str | None = None, strict: bool = False,
                 guard: bool = True, compile: bool | str = False):
        if not isinstance(model, nn.Module):
            raise TypeError(f"relprop: model must be a torch.nn.Module, got {type(model).__name__}")
        # compiled code runs its ops where no rule can reach them: explain the module it was compiled from
        dynamo = sys.modules.get("torch._dynamo")  # not imported unless something compiled a model
        compiled = dynamo is not None and isinstance(model, dynamo.eval_frame.OptimizedModule)
        self.model: nn.Module = cast(nn.Module, model._orig_mod) if compiled else model
        if isinstance(self.model, nn.DataParallel):  # replicas run in threads, outside the engine's mode
            self.model = self.model.module
        super().__init__(self.model)
        self.composite = composites.get(composite)
        self.strict = strict
        self.guard = guard
        self.replay = True  # see the class's attributes
        self._plans = Plans()
        #: the compiled tier (``compile=True``), None under interception alone
        self.compiled = (Compiled(self.model, self.composite, "inductor" if compile is True else compile)
                         if compile else None)
        self._program: Differentiable | None = None  # of a differentiable relevance, from its first call

    @contextmanager
    def context(self) -> Iterator[Session]:
        """Explain a forward pass you run yourself, with your own output relevance.

        Inside the block, forward passes of the model build relevance graphs;
        afterwards ``torch.autograd.grad(output, x, grad_outputs=R)`` returns
        the relevance of ``x`` (which must require grad) for output relevance ``R``.

        Examples
        --------
        >>> import torch
        >>> from torch import nn
        >>> import relprop
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
        >>> lrp = relprop.LRP(model)
        >>> x = torch.randn(5, 4).requires_grad_(True)
        >>> with lrp.context():
        ...     out = model(x)
        >>> my_relevance = out.detach() * torch.tensor([1.0, 0.0, 0.0])  # explain output 0
        >>> (relevance,) = torch.autograd.grad(out, x, grad_outputs=my_relevance)
        >>> relevance.shape
        torch.Size([5, 4])
        """
        with self._session() as session:
            yield session

    @contextmanager
    def _session(self, taps: Any = None, audit: Any = None, token_inputs: tuple[Tensor, ...] = (),
                 reusable: bool = False, gradient_form: bool = False) -> Iterator[Session]:
        session = self.session_class(self.model, self.composite, self.strict, taps=taps, audit=audit,
                                     token_inputs=token_inputs, guard=self.guard, reusable=reusable,
                                     gradient_form=gradient_form)
        with torch.enable_grad(), session.active(), hold_selective_parameters(self.model):
            yield session

    @eager
    def record(self, inputs: Inputs, additional_forward_args: Any = None, taps: Any = None,
               audit: Any = None, reusable: bool = True, create_graph: bool = False) -> ForwardPass:
        """Run the model once under the engine and keep the pass, for :meth:`~relprop.methods.ForwardPass.relevance`.

        Use it to choose the output relevance after seeing the output, and to
        explain many seeds from one forward pass (per-class maps, every token
        of a generation): a reusable pass carries relevance any number of
        times, each equal to a fresh attribution
        (:meth:`~relprop.methods.ForwardPass.relevances` takes a batch of seeds
        at once). With ``reusable=False`` it carries relevance once, frees what
        it kept along the way and lets its rules write in place: what
        :meth:`attribute` does, for the least time and memory.
        ``additional_forward_args`` may be a tuple of further positional
        arguments or a dict of keyword arguments (``attention_mask=...``).
        ``taps`` and ``audit`` are handed to :class:`~relprop.engine.Session`. With ``create_graph`` the pass's
        relevance (:meth:`~relprop.methods.ForwardPass.propagate` with ``create_graph=True``) is differentiable
        with respect to the parameters and inputs (see :meth:`attribute`).

        Examples
        --------
        >>> import torch
        >>> from torch import nn
        >>> import relprop
        >>> lrp = relprop.LRP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 5)).eval())
        >>> x = torch.randn(2, 4)
        >>> explained = lrp.record(x)
        >>> explained.logits.shape
        torch.Size([2, 5])
        >>> relevance, = explained.relevance(relprop.output_relevance(explained.logits, target=3))
        >>> relevance.shape
        torch.Size([2, 4])
        """
        if create_graph:
            if taps is not None or audit is not None:
                raise ValueError("relprop: a differentiable pass (create_graph=True) takes no taps or audit")
            return self._differentiable(*explained_arguments(inputs, additional_forward_args, attached=True),
                                        reusable=reusable)
        return self._record(*explained_arguments(inputs, additional_forward_args), taps, audit, reusable,
                            compiled=True)

    def _differentiable(self, leaves: tuple[Tensor, ...], extra: tuple, keywords: dict[str, Any],
                        reusable: bool) -> ForwardPass:
        """A pass whose relevance is differentiable (:mod:`relprop.methods.differentiable`)."""
        return self._differentiable_program().record(self.model, leaves, extra, keywords, self.composite, reusable,
                                                     self.strict, self.guard)

    def _differentiable_program(self) -> Differentiable:
        """The program of a differentiable relevance (made at the first call), compiled as the compiled tier's."""
        if self.session_class is not Session:
            raise NotImplementedError(f"relprop: {type(self).__name__} has no differentiable relevance "
                                      "(create_graph=True): it reads ops that LRP's program does not write")
        if self._program is None:
            self._program = Differentiable(self.model, self.composite,
                                           "eager" if self.compiled is None else self.compiled.compiler)
        return self._program

    def _record(self, leaves: tuple[Tensor, ...], extra: tuple, keywords: dict[str, Any], taps: Any, audit: Any,
                reusable: bool, compiled: bool) -> ForwardPass:
        """:meth:`record` of :func:`~relprop.methods._inputs.explained_arguments`' leaves and arguments;
        ``compiled``: through the compiled tier's forward program, where there is one."""
        tokens = tuple(x for x in leaves if not x.is_floating_point())
        if compiled and self.compiled is not None and taps is None and audit is None and self.session_class is Session:
            found = self.compiled.forward(self.model, leaves, extra, keywords, self.composite)  # None: interception
            if found is not None:  # each input's probe collects relevance (methods.compiled)
                guard = cast(Session, FiniteCheck(self.strict)) if self.guard else None  # its checks of the pass
                return ForwardPass(leaves, model_logits(found[0]), {i: [p] for i, p in enumerate(found[1])}, reusable,
                                   guard, True, self.compiled.backward())
        # relevance per unit of activation where the composite's rules are modified gradients (AttnLRP, CP-LRP),
        # and nothing reads the relevance of single ops (taps, the audit)
        gradient_form = (self.composite.gradient_form and taps is None and audit is None
                         and self.session_class is Session)
        signature = (pass_signature(leaves, extra, keywords, reusable, self.guard, self.strict)
                     if gradient_form and self.replay and self.composite.replayable else None)
        entry = self._plans.entry(signature) if signature is not None else None
        while True:
            replay, recording = (entry.next_pass(self.composite, self.model, leaves) if gradient_form and entry
                                 else (None, None))
            try:
                with self._session(taps, audit, tokens, reusable, gradient_form) as session:
                    session.replay, session.recording = replay, recording
                    # the model sees copies, so that in-place ops on its inputs are allowed
                    output = self.model(*(x.clone() if x.requires_grad else x for x in leaves), *extra, **keywords)
                logits = model_logits(output)
                if replay is not None and not replay.finished(logits):
                    raise PathChanged("relprop: the forward pass ended elsewhere than its plan")
                break
            except GradientFormUnavailable:  # once more, carrying relevance itself
                gradient_form = False
            except Exception:
                if replay is None:
                    raise
                # the forward took another path than the plan (or failed on it): once more under interception,
                # where a real error is raised with its op and module
                assert entry is not None
                entry.plan, entry.failures = None, entry.failures + 1
        if recording is not None:
            assert entry is not None
            entry.plan = recording.plan(logits, self.composite, self.model)
        positions = [i for i, x in enumerate(leaves) if not x.is_floating_point()]  # those of the token ids
        embeddings = {positions[i]: found for i, found in session.embeddings.items()}
        return ForwardPass(leaves, logits, embeddings, reusable, session if self.guard else None, gradient_form)

    @eager
    def attribute(self, inputs: Inputs, target: Target = None, additional_forward_args: Any = None,
                  return_convergence_delta: bool = False, create_graph: bool = False) -> Any:
        """Relevance of every input feature for the model's output at ``target``.

        Parameters
        ----------
        inputs : Tensor or tuple of Tensors
            Model inputs, batch first. Each floating-point input gets relevance
            of its shape. Integer inputs (token ids) that the model embeds get
            one relevance per token, in their shape: the relevance of the
            embedded vectors summed over the hidden dimension.
        target : int, tuple, list, Tensor, Contrastive or None
            What to explain (captum's semantics, see :func:`~relprop.methods.target_mask`).
            The output relevance is the selected output value, so relevance
            sums to about ``f_t(x)``.
        additional_forward_args : tuple or dict, optional
            Further positional arguments of the model, or keyword arguments
            (``{"attention_mask": mask}``); they get no relevance.
        return_convergence_delta : bool
            Also return ``seed total - relevance total`` per example (what
            the rules absorbed, see :func:`convergence_delta`).
        create_graph : bool
            Relevance that autograd differentiates with respect to the inputs
            (an input that requires grad is differentiated through whatever
            computed it) and the parameters: the derivative of the relevance
            function itself, for training with explanations and attacks on
            them (:mod:`relprop.methods.differentiable`; the model must be
            captured whole by Dynamo, each op's rule in gradient form, else
            :class:`~relprop.UnsupportedOpError` names what is not).

        Returns
        -------
        Tensor, or tuple of Tensors for tuple inputs; and the delta if asked.
        """
        with torch.inference_mode(False), cyclic_gc_paused():
            arguments = explained_arguments(inputs, additional_forward_args, attached=create_graph)
            compiled = self.compiled is not None and self.session_class is Session
            if compiled:  # as one program, where it runs so
                assert self.compiled is not None
                program = self._differentiable_program() if create_graph else self.compiled
                found = program.whole(self.model, *arguments, self.composite, target, return_convergence_delta)
                if found is not None:
                    relevance, whole = found
                    result = relevance[0] if isinstance(inputs, Tensor) else relevance
                    return result if whole is None else (result, convergence_delta(whole, relevance))
                compiled = self.compiled.records  # a recorded pass through the forward program, or interception
            explained = (self._differentiable(*arguments, reusable=False) if create_graph
                         else self._record(*arguments, None, None, False, compiled))
            seed = output_relevance(explained.logits, target, attached=create_graph)
            # the seed's total per example, before the pass may take the seed over
            total = seed.reshape(seed.shape[0] if seed.dim() else 1, -1).sum(1) if return_convergence_delta else None
            relevance = explained.propagate(seed, owned=True, create_graph=create_graph)
        result = relevance[0] if isinstance(inputs, Tensor) else relevance
        if total is None:
            return result
        return result, convergence_delta(total, relevance)

    def compute_convergence_delta(self, attributions: Inputs, output: Tensor) -> Tensor:
        """``output - attributions' total`` per example, as captum's ``LRP`` computes it.

        ``output`` is the explained output value per example (shape ``(N,)``)
        or the whole output relevance (batch first).
        """
        return convergence_delta(output, attributions)
