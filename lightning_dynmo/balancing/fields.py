"""Config fields that declare their own rule, checked in one place (pure Python).

A frozen config dataclass declares each plain numeric field with :func:`int_field` (an integer >= a
minimum), :func:`number_field` (a finite number >= 0, or > 0) or :func:`fraction_field` (in ``[0, 1)``),
and its ``__post_init__`` calls :func:`check_fields` next to the checks that relate fields to each other.
A bad value fails naming the class and field, the value, the rule and, where the field says it, what the
field means (e.g. ``PruningSchedule.frequency=0 must be an integer >= 1; the optimizer steps ...``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from lightning_dynmo.balancing._checks import check_int, check_positive

# check_int is the rule of int_field, for a value that is not a field (an argument, e.g. of a classmethod).
__all__ = ["check_fields", "check_int", "fraction_field", "int_field", "number_field"]

#: The field metadata key holding a field's check: ``check(value, name)`` raises ``ValueError``.
_RULE = "lightning_dynmo_rule"

Rule = Callable[[object, str], None]


def _declared(default: object, rule: Rule) -> Any:
    # Any, as dataclasses.field's own overloads give it: the field's annotation types the attribute.
    return dataclasses.field(default=default, metadata={_RULE: rule})


def int_field(default: int | None, minimum: int, hint: str = "", *, optional: bool = False) -> Any:
    """A field holding an integer >= ``minimum``, or ``None`` too if ``optional``.

    ``hint`` says what the field means; it is shown when the value is wrong.
    """
    if optional:
        return _declared(default, functools.partial(_check_int_or_none, minimum=minimum, hint=hint))
    return _declared(default, functools.partial(check_int, minimum=minimum, hint=hint))


def number_field(default: float, *, allow_zero: bool = True) -> Any:
    """A field holding a finite number >= 0 (> 0 without ``allow_zero``)."""
    return _declared(default, functools.partial(check_positive, allow_zero=allow_zero))


def fraction_field(default: float, hint: str) -> Any:
    """A field holding a fraction in ``[0, 1)`` (``hint``: what it means, shown when it is wrong)."""
    return _declared(default, functools.partial(_check_fraction, hint=hint))


def check_fields(config: Any) -> None:
    """Check every field of the dataclass ``config`` that declares a rule, in declaration order.

    Raises:
        ValueError: naming ``ClassName.field``, the value and its rule.
    """
    owner = type(config).__name__
    for f in dataclasses.fields(config):
        rule = f.metadata.get(_RULE)
        if rule is not None:
            rule(getattr(config, f.name), f"{owner}.{f.name}")


def _check_fraction(value: object, name: str, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name}={value!r} must be a fraction in [0, 1); {hint}.")


def _check_int_or_none(value: object, name: str, minimum: int, hint: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        fix = f"; {hint}" if hint else ""
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum} or None{fix}.")
