"""pipeline/ must import with lightning unavailable (DESIGN.md: the runtime is torch.distributed only)."""

import subprocess

from tests.unit.blocked_imports import import_every_module

BLOCKED = {"lightning", "pytorch_lightning", "lightning_utilities", "torchmetrics", "hydra"}


def _import_all(package: str) -> subprocess.CompletedProcess[str]:
    return import_every_module(package, BLOCKED, forbidden={"lightning"}, done="torch only")


def test_every_pipeline_module_imports_without_lightning():
    out = _import_all("lightning_dynmo.pipeline")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "torch only"


def test_the_check_catches_a_package_that_imports_lightning():
    # Negative control: the strategy package is Lightning glue; the same walk over it must fail.
    out = _import_all("lightning_dynmo.strategy")
    assert out.returncode != 0
    assert "blocked import of lightning" in out.stderr
