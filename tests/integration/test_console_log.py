"""A user's ``Trainer(strategy="dynmo")`` script shows DynMo's rebalance lines with no logging set up.

Run as users run it (``python script.py``; Lightning's launcher starts rank 1), once with no logging
configuration (the lines reach stderr, once each, from rank 0) and once with the user's own
``logging.basicConfig`` (the lines go where the user sent them, in the user's format, and only there).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.integration.test_strategy_launcher import _clean_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
REBALANCE = "DynMo rebalance at step"

_SCRIPT = textwrap.dedent(
    """
    import logging, sys

    import lightning.pytorch as pl
    import torch

    import lightning_dynmo  # registers "dynmo"
    from lightning_dynmo import DynMoCallback
    from lightning_dynmo.callback import ProfilingConfig
    from lightning_dynmo.demos import DemoGPT
    from tests.distributed.callback.test_callback_rebalance import RUN, SLEEP_MS, PruneFirstHalf

    if sys.argv[1] == "configured":
        logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="USER %(message)s")
    torch.set_num_threads(1)
    trainer = pl.Trainer(
        devices=2, strategy="dynmo", use_distributed_sampler=False,
        callbacks=[PruneFirstHalf(), DynMoCallback(profiling=ProfilingConfig(steps=2))],
        **RUN.trainer_kwargs(),
    )
    model = DemoGPT(num_layers=RUN.num_layers, lr_gamma=RUN.lr_gamma, sleep_ms=[SLEEP_MS] * RUN.num_layers)
    trainer.fit(model, RUN.datamodule())
    """
)


def _run(tmp_path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), mode],
        env=_clean_env(ROOT),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def _lines(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


def test_the_rebalance_line_shows_on_stderr_without_logging_config(tmp_path: Path) -> None:
    done = _run(tmp_path, "plain")
    lines = _lines(done.stderr, REBALANCE)
    assert lines, done.stderr[-4000:]
    assert "0-3|4-7 -> 0-5|6-7" in lines[0]
    assert len(lines) == len(set(lines)), lines  # once each: rank 0 only, one handler
    assert _lines(done.stderr, "rank 0: placement") and not _lines(done.stderr, "rank 1: placement")


def test_the_users_logging_config_is_left_in_charge(tmp_path: Path) -> None:
    # Negative control: with basicConfig the lines follow the user's handler and format, never ours.
    done = _run(tmp_path, "configured")
    assert not _lines(done.stderr, REBALANCE), done.stderr[-4000:]
    lines = _lines(done.stdout, f"USER {REBALANCE}")
    assert lines and len(lines) == len(set(lines)), done.stdout[-4000:]
