"""The errors and warnings relprop raises."""
from __future__ import annotations


class RuleError(ValueError):
    """A rule was assigned to an op it cannot propagate through."""


class UnsupportedOpError(RuntimeError):
    """Relevance reached an op without a rule (raised in strict mode)."""


class UnhandledOpWarning(UserWarning):
    """Relevance reached an op without a rule; its plain gradient was used."""


class ConservationWarning(UserWarning):
    """An op's rule handed on NaN or infinite relevance, or created relevance where it should conserve it."""
