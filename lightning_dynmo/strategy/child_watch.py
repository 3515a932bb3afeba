"""Lightning's script launcher, with a child watch that names a rank that died and how.

Under ``python train.py`` with ``devices=N``, Lightning's :class:`_SubprocessScriptLauncher` runs rank 0 in
the launching process and starts ranks 1..N-1 as child processes; its observer thread polls them every
5 s and, once one exits non-zero, sends ``SIGKILL`` to every process, rank 0 included. Every process then
ends with exit code -9 and its log says only ``terminated with code -9``: nothing says that the child was
*killed* (by the out-of-memory killer, typically, which sends ``SIGKILL``) rather than failed.

:class:`ChildWatch` replaces that observer. It polls every half second and, once a child has ended:

- killed by a signal: logs one line ``DynMo: rank 1 (pid 4242) was killed by SIGKILL (out of memory?)``;
- exited with an error: logs which rank and its exit code (that rank's traceback is in the log above).

Rank 0 often ends first (its own error names the lost peer): the launcher then looks once more at exit.

It then gives rank 0 :data:`REPORT_GRACE_S` to raise its own error (it names the lost peer: see
:mod:`lightning_dynmo.pipeline.faults.guard`) before it stops every process as Lightning's observer does.
"""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from typing_extensions import override

from lightning_dynmo.pipeline.faults.death import death_line

log = logging.getLogger(__name__)

__all__ = ["REPORT_GRACE_S", "ChildWatch", "WatchedScriptLauncher"]

#: After a child rank ended badly, how long rank 0 gets to report its own error before every process is
#: stopped (Lightning's observer took up to 5 s to notice; this watch notices within half a second).
REPORT_GRACE_S = 5.0
_POLL_S = 0.5


class ChildWatch(_ChildProcessObserver):
    """Lightning's child observer, polling faster and logging one line per rank that ended badly.

    Args:
        main_pid: The launching process (rank 0).
        child_processes: Ranks 1..N-1, in rank order.
        grace_s: How long rank 0 gets to report before every process is stopped.
    """

    def __init__(
        self, main_pid: int, child_processes: list[subprocess.Popen[Any]], grace_s: float = REPORT_GRACE_S
    ) -> None:
        super().__init__(main_pid=main_pid, child_processes=child_processes, sleep_period=_POLL_S)  # type: ignore[arg-type]
        self.name = "dynmo-child-watch"
        self._grace_s = grace_s
        self._lock = threading.Lock()
        self._reported: set[int] = set()

    def report_deaths(self) -> bool:
        """Log :func:`death_line` once for each child that ended badly; whether any has."""
        with self._lock:
            failed = False
            for rank, proc in enumerate(self._child_processes, start=1):
                if proc.poll():
                    failed = True
                    if proc.pid not in self._reported:
                        self._reported.add(proc.pid)
                        log.error(death_line(rank, proc.pid, proc.returncode))
            return failed

    @override
    def _run(self) -> bool:
        if not self.report_deaths():
            return all(proc.returncode == 0 for proc in self._child_processes)
        time.sleep(self._grace_s)  # rank 0 raises its own error meanwhile, naming the lost peer, and exits
        log.error("DynMo: stopping every rank (a rank ended badly; see above).")
        self._terminate_all()
        return True


class WatchedScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher with :class:`ChildWatch` in place of its observer."""

    @override
    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            watch = ChildWatch(main_pid=os.getpid(), child_processes=self.procs)
            watch.start()
            # Rank 0 may end (its own error names the lost peer) before the watch's next look: look once more.
            atexit.register(watch.report_deaths)
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)
