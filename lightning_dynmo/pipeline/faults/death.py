"""One line naming how a rank's process ended, for the process that launched it.

A rank killed by a signal leaves no traceback: ``SIGKILL`` from the out-of-memory killer ends it between
two instructions, and its launcher only sees exit code -9. :func:`death_line` turns that into a sentence
(Lightning's script launcher: :mod:`lightning_dynmo.strategy.child_watch`; the application's launcher:
:func:`lightning_dynmo.app.launch.start_local_ranks`).
"""

from __future__ import annotations

import signal

__all__ = ["death_line"]


def death_line(rank: int, pid: int | None, returncode: int) -> str:
    """How rank ``rank`` ended; a negative ``returncode`` is the signal that killed it (as ``Popen`` has it).

    Examples:
        ``DynMo: rank 1 (pid 4242) was killed by SIGKILL (out of memory?).``
        ``DynMo: rank 1 (pid 4242) exited with code 1; its error is in its log above.``
    """
    who = f"rank {rank}" + (f" (pid {pid})" if pid is not None else "")
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        oom = " (out of memory?)" if -returncode == signal.SIGKILL else ""
        return f"DynMo: {who} was killed by {name}{oom}."
    return f"DynMo: {who} exited with code {returncode}; its error is in its log above."
