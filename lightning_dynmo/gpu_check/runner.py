"""One part of the GPU check in a child process under a timeout: its result, or its error and log tail.

The child starts its own session, so a timeout kills it together with the ranks it started (Lightning's
launcher, the migration's second rank): nothing is left waiting on a collective that never completes.
In the CPU dry run a one-process part is forked from this process, whose torch and lightning are already
imported (a fresh interpreter spends most of a tiny part importing them); a part that starts processes
of its own (they re-run their command line) always gets a fresh interpreter, and so does every part on a
GPU (a forked CUDA context is unusable).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_dynmo.gpu_check.plan import Part, Sizes

LOG_TAIL_LINES = 30


def run_part(part: Part, sizes: Sizes, device: str, workdir: Path, timeout_s: float) -> dict[str, Any]:
    """Run ``part`` in a child process; never raises for what happens in the child.

    Args:
        part: The part.
        sizes: The model and run sizes.
        device: ``"cuda"`` or ``"cpu"``.
        workdir: Where the part's spec, result and log go (``<name>.json``, ``<name>.result.json``,
            ``<name>.log``).
        timeout_s: Wall-clock limit (the part's own or what is left of the check's budget).

    Returns:
        The worker's result with ``ok``, ``wall_s`` and, on failure, ``error`` and ``log_tail``.
    """
    spec = workdir / f"{part.name}.json"
    result = workdir / f"{part.name}.result.json"
    log = workdir / f"{part.name}.log"
    payload = {
        "kind": part.kind,
        "options": part.options,
        "sizes": dataclasses.asdict(sizes),
        "device": device,
    }
    spec.write_text(json.dumps(payload, indent=1))
    start = time.perf_counter()
    if device == "cpu" and _single_process(part):
        code = _run_forked(spec, result, log, timeout_s)
    else:
        command = [sys.executable, "-m", "lightning_dynmo.gpu_check.worker", str(spec), str(result)]
        with log.open("w") as out:
            child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = child.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_session(child)
                code = None
    wall_s = time.perf_counter() - start
    found = _read(result)
    if found is not None and code == 0:
        return {**found, "wall_s": wall_s}
    error = f"timed out after {timeout_s:.0f} s (killed)" if code is None else f"exit code {code}"
    if found is not None and "error" in found:
        error = f"{error}: {found['error']}"
    return {**(found or {}), "ok": False, "error": error, "wall_s": wall_s, "log_tail": _tail(log)}


def _single_process(part: Part) -> bool:
    """Whether ``part`` runs in one process (no launcher, no peer it starts itself)."""
    return part.kind in ("costs", "stalls") or (part.kind == "train" and part.options.get("devices") == 1)


def _run_forked(spec: Path, result: Path, log: Path, timeout_s: float) -> int | None:
    """Run the worker in a forked child of its own session; its exit code, ``None`` if it timed out."""
    from lightning_dynmo.gpu_check import worker  # torch and lightning: only when forking

    return fork_call(lambda: worker.main([str(spec), str(result)]), log, timeout_s)


def fork_call(call: Callable[[], int], log: Path, timeout_s: float) -> int | None:
    """Run ``call`` in a forked child of its own session, its output written to ``log``.

    The child starts with this process's imports (torch and lightning: seconds a fresh interpreter
    spends) and its state; on a GPU, never (a forked CUDA context is unusable).

    Returns:
        The child's exit code: what ``call`` returned, 1 if it raised (its traceback in ``log``);
        ``None`` if it ran past ``timeout_s`` (then it was killed with every process of its session).
    """
    sys.stdout.flush()  # else the child would write this process's pending output into its log
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: its own session and log, the call, then exit without the parent's cleanup
        code = 1
        try:
            os.setsid()
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            # Python's streams too: a caller (pytest) may have replaced them with its own.
            with open(1, "w", buffering=1, closefd=False) as out, open(2, "w", closefd=False) as err:
                sys.stdout, sys.stderr = out, err
                try:
                    code = call()
                except BaseException:
                    traceback.print_exc()
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def _kill_session(child: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended between the timeout and the kill
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()


def _read(path: Path) -> dict[str, Any] | None:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def _tail(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    except OSError:
        return []
