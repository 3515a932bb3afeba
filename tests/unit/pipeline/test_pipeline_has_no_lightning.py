"""pipeline/ must import with lightning unavailable (DESIGN.md: the runtime is torch.distributed only)."""

import subprocess
import sys

BLOCKER = """
import builtins, sys
_real_import = builtins.__import__
_absent = {"lightning", "pytorch_lightning", "lightning_utilities", "torchmetrics", "hydra"}
def _blocked(name, *args, **kwargs):
    if name.split(".")[0] in _absent:
        raise ModuleNotFoundError(f"blocked import of {name}", name=name)
    return _real_import(name, *args, **kwargs)
builtins.__import__ = _blocked
import importlib, pkgutil
package = importlib.import_module(PACKAGE)
for m in pkgutil.walk_packages(package.__path__, PACKAGE + "."):
    importlib.import_module(m.name)
assert not any(k.split(".")[0] == "lightning" for k in sys.modules), sorted(sys.modules)
print("torch only")
"""


def _import_all(package: str) -> subprocess.CompletedProcess[str]:
    code = f"PACKAGE = {package!r}\n" + BLOCKER
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_every_pipeline_module_imports_without_lightning():
    out = _import_all("lightning_dynmo.pipeline")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "torch only"


def test_the_check_catches_a_package_that_imports_lightning():
    # Negative control: the strategy package is Lightning glue; the same walk over it must fail.
    out = _import_all("lightning_dynmo.strategy")
    assert out.returncode != 0
    assert "blocked import of lightning" in out.stderr
