"""balancing/ must import with torch and lightning unavailable (DESIGN.md: pure Python + numpy)."""

import subprocess
import sys

BLOCKER = """
import builtins, sys
_real_import = builtins.__import__
def _blocked(name, *args, **kwargs):
    if name.split(".")[0] in {"torch", "lightning", "pytorch_lightning", "torchmetrics", "hydra"}:
        raise ModuleNotFoundError(f"blocked import of {name}", name=name)
    return _real_import(name, *args, **kwargs)
builtins.__import__ = _blocked
import lightning_dynmo.balancing as b
import pkgutil, importlib
for m in pkgutil.walk_packages(b.__path__, "lightning_dynmo.balancing."):
    importlib.import_module(m.name)
assert not any(k.split(".")[0] in {"torch", "lightning"} for k in sys.modules), sorted(sys.modules)
print("pure")
"""


def test_balancing_imports_without_torch_or_lightning():
    out = subprocess.run([sys.executable, "-c", BLOCKER], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "pure"


def test_blocker_really_blocks_torch():
    # Negative control: the same blocker must make a torch import fail, or the test above proves nothing.
    code = BLOCKER.split("import lightning_dynmo")[0] + "import torch\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
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
