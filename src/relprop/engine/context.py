"""Which module issued each op: the module context kept by forward hooks."""
from __future__ import annotations

import functools
import re

from torch import nn

_ACTIVATION_NAME = re.compile(r"(Activation|GELU|Gelu|GeLU|SiLU|Swish|Mish)\w*$")


@functools.cache
def _is_activation_class(cls: type) -> bool:
    return bool(_ACTIVATION_NAME.search(cls.__name__)) and not cls.__module__.startswith("torch.")


def _is_activation_module(module: nn.Module) -> bool:
    """Activation modules of other libraries (Hugging Face's ``NewGELUActivation``) are treated as one op.

    Recognised by name, and only if they are leaves without parameters (not ``Conv2dNormActivation``).
    """
    return (_is_activation_class(type(module))  # type: ignore[arg-type]  # nn.Module's __hash__ stub
            and not module._modules and not module._parameters)


class ModuleContext:
    """Which module issued each op: the stack of module forwards running, kept by forward hooks.

    Parameters
    ----------
    model : nn.Module
        The model whose modules (and their dotted paths) are followed.
    """

    def __init__(self, model: nn.Module) -> None:
        self.names = {module: name for name, module in model.named_modules()}
        self._stack: list[nn.Module] = []
        #: the dotted path of :attr:`module` (``""`` for the root or outside any module); read by every op
        self.module_name = ""
        #: depth inside activation modules run as one elementwise op (their ops are not intercepted one by one)
        self.opaque = 0

    @property
    def module(self) -> nn.Module | None:
        """The innermost module whose forward is running."""
        return self._stack[-1] if self._stack else None

    def enter(self, module: nn.Module) -> None:
        """``module``'s forward starts."""
        self._stack.append(module)
        self.module_name = self.names.get(module, "")
        if self.opaque or _is_activation_module(module):
            self.opaque += 1

    def is_innermost(self, module: nn.Module) -> bool:
        """Whether ``module`` is the innermost module running (its forward hook belongs to this pass)."""
        return bool(self._stack) and self._stack[-1] is module

    def end_opaque(self) -> bool:
        """The innermost module's forward ends: whether it is the outermost of nested activation modules.

        Its output then becomes one op, while the module is still the innermost (:meth:`exit` follows).
        """
        if not self.opaque:
            return False
        self.opaque -= 1
        return not self.opaque

    def exit(self) -> None:
        """The innermost module's forward has ended."""
        self._stack.pop()
        self.module_name = self.names.get(self._stack[-1], "") if self._stack else ""

    def clear(self) -> None:
        self._stack.clear()
        self.opaque = 0
        self.module_name = ""
