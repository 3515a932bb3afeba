"""BackgroundCall runs a pure call in a helper process: its value or error comes back, it never hangs."""

from __future__ import annotations

import functools
import operator
import os
import signal
import time

import pytest

from lightning_dynmo.balancing.background import BackgroundCall, HelperFailure


class _Unpicklable(Exception):
    """An error whose pickle cannot be rebuilt (two required arguments, one given to Exception)."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"{a} {b}")


def _raise_unpicklable() -> None:
    raise _Unpicklable(1, 2)


class _HoldsALambda(Exception):
    """An error that cannot even be pickled in the helper: it holds a lambda."""

    def __init__(self) -> None:
        super().__init__("holds a lambda")
        self.hook = lambda: None


def _raise_holding_a_lambda() -> None:
    raise _HoldsALambda()


def _modules_loaded() -> list[str]:
    import sys

    return sorted(m for m in ("torch", "lightning") if m in sys.modules)


@pytest.fixture
def helper():
    h = BackgroundCall()
    yield h
    h.close()


def test_a_call_returns_its_value_while_the_caller_goes_on(helper):
    helper.submit(functools.partial(time.sleep, 0.4))
    assert helper.in_flight and not helper.ready()  # answered in 0.4 s at the earliest
    assert helper.result(timeout_s=30) is None
    assert not helper.in_flight and helper.busy_s >= 0.4
    helper.submit(functools.partial(operator.add, 2, 3))  # the same helper answers the next call
    assert helper.result(timeout_s=30) == 5
    # The helper runs without torch and Lightning: the strategy is not registered there.
    helper.submit(_modules_loaded)
    assert helper.result(timeout_s=30) == []


def test_errors_come_back_as_errors_with_the_helpers_traceback(helper):
    helper.submit(functools.partial(int, "x"))
    with pytest.raises(ValueError, match="invalid literal") as info:
        helper.result(timeout_s=30)
    assert "Raised in DynMo's helper process" in info.value.__notes__[0]
    helper.submit(_raise_unpicklable)
    with pytest.raises(HelperFailure, match=r"its answer did not unpickle here: .*_Unpicklable"):
        helper.result(timeout_s=30)
    # Not picklable in the helper at all: its traceback's text still comes back.
    helper.submit(_raise_holding_a_lambda)
    with pytest.raises(HelperFailure, match=r"(?s)helper process raised:\n.*_HoldsALambda: holds a lambda"):
        helper.result(timeout_s=30)


def test_misuse_is_refused(helper):
    with pytest.raises(RuntimeError, match=r"no call in flight"):
        helper.result()
    with pytest.raises(TypeError, match=r"cannot send .*<lambda>.* Pass a module-level function"):
        helper.submit(lambda: 1)
    helper.submit(functools.partial(time.sleep, 5))
    with pytest.raises(RuntimeError, match=r"a call is in flight"):
        helper.submit(functools.partial(time.sleep, 0))
    with pytest.raises(TimeoutError, match=r"no answer within 0.1 s"):
        helper.result(timeout_s=0.1)


def test_a_killed_helper_is_an_error_that_names_it_never_a_hang(helper):
    helper.submit(functools.partial(time.sleep, 60))
    assert helper.pid is not None
    os.kill(helper.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(HelperFailure, match=r"closed its output before answering; exit code -9"):
        helper.result(timeout_s=30)
    assert time.monotonic() - started < 10
    with pytest.raises(HelperFailure, match=r"no longer running"):
        helper.submit(functools.partial(operator.add, 1, 1))
