"""One part of the GPU check in a child process under a timeout: its result, or its error and log tail.

The child starts its own session, so a timeout kills it together with the ranks it started (Lightning's
launcher, the migration's second rank): nothing is left waiting on a collective that never completes.
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
    command = [sys.executable, "-m", "lightning_dynmo.gpu_check.worker", str(spec), str(result)]
    start = time.perf_counter()
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
