"""balancing/ must import with torch and lightning unavailable (DESIGN.md: pure Python + numpy)."""

import subprocess
import sys

from tests.unit.blocked_imports import import_every_module, run_blocked

BLOCKED = {"torch", "lightning", "pytorch_lightning", "torchmetrics", "hydra"}


def test_balancing_imports_without_torch_or_lightning():
    out = import_every_module(
        "lightning_dynmo.balancing", BLOCKED, forbidden={"torch", "lightning"}, done="pure"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "pure"


def test_blocker_really_blocks_torch():
    # Negative control: the same blocker must make a torch import fail, or the test above proves nothing.
    out = run_blocked("import torch\n", BLOCKED)
    assert out.returncode != 0
    assert "blocked import of torch" in out.stderr


def test_importing_the_package_registers_the_strategy_name():
    code = (
        "import lightning_dynmo\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "print('dynmo' in StrategyRegistry)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
