"""The two kinds of error refimpl raises, each built in one place.

- **Bad input**: an argument a caller gave breaks a rule. `refuse` raises ValueError
  "argument: expected ..., got ... [RULE]": the argument by the name the caller wrote,
  what the rule admits against what it got, and the SPEC rule, so that every rank that
  checks the same argument says the same words (the style of a validator's `require`).
  `require(condition, ...)` raises it when a condition fails.
- **A broken invariant of refimpl itself**: `InternalError`, an AssertionError: no input
  can cause it, so it names the pass and the rule whose bookkeeping failed, never an
  argument.

Private to refimpl: the SPEC rules say which errors a caller sees.
"""

from __future__ import annotations

__all__ = ["InternalError", "refuse", "require", "require_type", "expected_got"]


class InternalError(AssertionError):
    """A pass's own bookkeeping broke (a bug of refimpl, not of its input)."""


def expected_got(argument: str, expected: str, got, rule: str) -> str:
    """The words of a refusal: `argument: expected E, got G [RULE]`."""
    return f"{argument}: expected {expected}, got {got} [{rule}]"


def refuse(argument: str, expected: str, got, rule: str, error: type = ValueError):
    """Raise `error` (ValueError unless said) for an argument that breaks `rule`."""
    raise error(expected_got(argument, expected, got, rule))


def require(condition: bool, argument: str, expected: str, got, rule: str,
            error: type = ValueError) -> None:
    """Refuse `argument` unless `condition` holds (`got` is formatted only then)."""
    if not condition:
        refuse(argument, expected, got, rule, error)


def require_type(value, types, argument: str, expected: str, rule: str) -> None:
    """Refuse `argument` with a TypeError naming its type unless it is a `types`."""
    if not isinstance(value, types):
        refuse(argument, expected, type(value).__name__, rule, TypeError)
