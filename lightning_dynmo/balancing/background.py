"""Run one pure call at a time in a helper process, so the caller goes on while it runs.

The rebalance decision (:func:`~lightning_dynmo.balancing.policy.decide`) simulates hundreds of steps of
the schedule, longer the larger the pipeline. Taken on the deciding rank while the others wait in its
broadcast, every rank idles for it.
``DynMoCallback(profiling=ProfilingConfig(background_decisions=True))`` hands it to a
:class:`BackgroundCall` instead: the ranks train on while a helper process searches, and apply the
decision at a step boundary once it is ready.

The helper is ``python -m lightning_dynmo.balancing.background``: it imports this package only (no torch,
no Lightning: ``import lightning_dynmo`` skips registering the strategy there), runs each call it reads
on its standard input and writes back the value or the error, at a lower priority than the training
process (``os.nice``). Calls and values travel pickled, so the function must be importable by name
(a module-level function, or a :func:`functools.partial` of one) and its arguments picklable.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

__all__ = ["BackgroundCall", "HelperFailure"]

#: Set in the helper's environment: ``import lightning_dynmo`` then skips registering the strategy.
HELPER_ENV = "_LIGHTNING_DYNMO_HELPER"
#: How much lower the helper's priority is than the training process's (``os.nice`` increment): the
#: lowest, so that on a machine whose cores the ranks keep busy the search takes their idle time first
#: rather than their steps' (the decision may then take longer to be ready); where cores are free it
#: changes nothing.
HELPER_NICENESS = 19
_HEADER = 8  # bytes of a message's length
_REAP_S = 2.0  # how long a failing helper is given to exit before its code is read


class HelperFailure(RuntimeError):
    """The helper process failed: it died, or the call raised an error that could not be sent back."""


@dataclass(frozen=True)
class _Raised:
    """What a call raised in the helper: the exception (when it pickles) and its formatted traceback."""

    error: BaseException | None
    text: str


class BackgroundCall:
    """One helper process running one call at a time (see the module docstring).

    Example::

        helper = BackgroundCall()
        helper.submit(functools.partial(decide, problem, placement, config, 8, order))
        while not helper.ready():
            train_one_step()
        decision = helper.result()   # the call's value, or its error raised here
        helper.close()

    The helper starts at :meth:`start` or the first :meth:`submit`, and lives until :meth:`close`.
    """

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._answer: list[Any] = []  # the reader thread's one answer
        self.busy_s = 0.0  # the last call's seconds in the helper

    @property
    def in_flight(self) -> bool:
        """Whether a call was submitted and its result not yet taken."""
        return self._reader is not None

    def start(self) -> None:
        """Start the helper now rather than at the first :meth:`submit` (its start then costs no wait)."""
        self._started()

    def submit(self, call: Callable[[], Any]) -> None:
        """Start ``call()`` in the helper (started now if needed); one call at a time.

        Raises:
            RuntimeError: a call is already in flight.
            TypeError: ``call`` does not pickle (a lambda, a local function, an unpicklable argument).
        """
        if self.in_flight:
            raise RuntimeError("BackgroundCall.submit(): a call is in flight; take its result() first.")
        try:
            blob = pickle.dumps(call)
        except (pickle.PicklingError, TypeError, AttributeError) as err:
            raise TypeError(
                f"BackgroundCall cannot send {_name(call)} to its helper process: {err}. Pass a module-level "
                "function (or a functools.partial of one) with picklable arguments."
            ) from err
        process = self._started()
        assert process.stdin is not None and process.stdout is not None
        try:
            _write(process.stdin, blob)
        except (BrokenPipeError, OSError) as err:
            raise HelperFailure(self._death(f"it could not be sent the call ({err})")) from err
        self._answer = []
        stdout = process.stdout
        self._reader = threading.Thread(target=self._read, args=(stdout,), name="dynmo-helper", daemon=True)
        self._reader.start()

    def ready(self) -> bool:
        """Whether the call in flight has its answer (or the helper died); never blocks."""
        return self._reader is not None and not self._reader.is_alive()

    def result(self, timeout_s: float | None = None) -> Any:
        """The call's value (waiting for it); its error is raised here, with the helper's traceback.

        Raises:
            RuntimeError: nothing in flight.
            TimeoutError: no answer within ``timeout_s``.
            HelperFailure: the helper died, or sent back an error that did not pickle.
        """
        if self._reader is None:
            raise RuntimeError("BackgroundCall.result(): no call in flight; submit() one first.")
        self._reader.join(timeout_s)
        if self._reader.is_alive():
            raise TimeoutError(f"the helper process gave no answer within {timeout_s} s")
        self._reader = None
        if not self._answer:
            raise HelperFailure(self._death("it closed its output before answering"))
        ok, value, self.busy_s = self._answer[0]
        if ok:
            return value
        assert isinstance(value, _Raised)
        if value.error is None:
            raise HelperFailure(f"DynMo's helper process raised:\n{value.text}")
        value.error.add_note(f"Raised in DynMo's helper process (pid {self.pid}):\n{value.text}")
        raise value.error

    @property
    def pid(self) -> int | None:
        """The helper's process id (``None`` before the first call)."""
        return None if self._process is None else self._process.pid

    def close(self, timeout_s: float = 5.0) -> None:
        """End the helper (a call in flight is dropped); safe to call twice."""
        process, self._process, self._reader = self._process, None, None
        if process is None:
            return
        if process.stdin is not None:
            process.stdin.close()  # the helper's loop ends at the end of its input
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()

    def _started(self) -> subprocess.Popen[bytes]:
        if self._process is not None and self._process.poll() is None:
            return self._process
        if self._process is not None:
            raise HelperFailure(self._death("it is no longer running"))
        env = {**os.environ, HELPER_ENV: "1"}
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        return self._process

    def _read(self, stdout: IO[bytes]) -> None:
        try:
            blob = _read(stdout)
        except (OSError, ValueError):
            return  # closed under the reader (close()): no answer
        if blob is None:
            return
        try:
            self._answer.append(pickle.loads(blob))
        except Exception as err:  # e.g. an exception class that cannot be rebuilt from its pickle
            text = f"its answer did not unpickle here: {type(err).__name__}: {err}"
            self._answer.append((False, _Raised(None, text), 0.0))

    def _death(self, what: str) -> str:
        code = None
        if self._process is not None:
            # Its output closes a moment before the kernel reaps it: give the exit code that moment.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=_REAP_S)
            code = self._process.poll()
        return (
            f"DynMo's helper process (pid {self.pid}) failed: {what}; exit code {code} (negative: killed by "
            "that signal; -9 is what the out-of-memory killer sends). Its error, if any, is on stderr above."
        )


def _name(call: Callable[[], Any]) -> str:
    """A call's short name for messages (a partial's arguments can be long)."""
    func = getattr(call, "func", call)
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', type(func).__name__)}"


def _write(stream: IO[bytes], blob: bytes) -> None:
    stream.write(len(blob).to_bytes(_HEADER, "little") + blob)
    stream.flush()


def _read(stream: IO[bytes]) -> bytes | None:
    """One message, or ``None`` at the end of the stream."""
    header = stream.read(_HEADER)
    if len(header) < _HEADER:
        return None
    size = int.from_bytes(header, "little")
    blob = stream.read(size)
    return blob if len(blob) == size else None


def _answer(call: Callable[[], Any]) -> bytes:
    started = time.perf_counter()
    try:
        value = call()
    except Exception as err:
        raised = _Raised(err, traceback.format_exc())
        try:
            return pickle.dumps((False, raised, time.perf_counter() - started))
        except Exception:  # an exception that does not pickle: its text still does
            return pickle.dumps((False, _Raised(None, raised.text), time.perf_counter() - started))
    return pickle.dumps((True, value, time.perf_counter() - started))


def main() -> None:
    """The helper's loop: answer each call read on standard input until it ends."""
    os.nice(HELPER_NICENESS)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a call's prints must not corrupt the answers
    while (blob := _read(stdin)) is not None:
        _write(stdout, _answer(pickle.loads(blob)))


if __name__ == "__main__":
    # Serve from the module under its own name: what it pickles (``_Raised``) must unpickle in the caller.
    from lightning_dynmo.balancing.background import main as serve

    serve()
