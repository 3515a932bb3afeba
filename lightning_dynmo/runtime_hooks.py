"""A mark on the hooks this package registers (the profiler's), so migration tells them from a user's.

Profiling windows register forward and tensor hooks on the layers they time and remove them when the
window closes. Migration refuses units that carry hooks (hooks do not travel), except these: a layer
moved while a window is open simply leaves the window's hooks behind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

_MARK = "_dynmo_runtime_hook"
F = TypeVar("F", bound=Callable[..., Any])


def runtime_hook(fn: F) -> F:
    """Mark ``fn`` (a hook function this package registers) as instrumentation, not model state."""
    setattr(fn, _MARK, True)
    return fn


def is_runtime_hook(fn: Any) -> bool:
    """Whether ``fn`` was marked by :func:`runtime_hook`."""
    return getattr(fn, _MARK, False) is True
