"""Run code in a fresh interpreter in which some top-level packages cannot be imported (layering tests)."""

from __future__ import annotations

import subprocess
import sys

_BLOCKER = """
import builtins, importlib, pkgutil, sys
_real_import = builtins.__import__
def _blocked(name, *args, **kwargs):
    if name.split(".")[0] in BLOCKED:
        raise ModuleNotFoundError(f"blocked import of {name}", name=name)
    return _real_import(name, *args, **kwargs)
builtins.__import__ = _blocked
"""

_WALK = """
package = importlib.import_module(PACKAGE)
for m in pkgutil.walk_packages(package.__path__, PACKAGE + "."):
    importlib.import_module(m.name)
assert not any(k.split(".")[0] in FORBIDDEN for k in sys.modules), sorted(sys.modules)
print(DONE)
"""


def run_blocked(code: str, blocked: set[str]) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a new interpreter where importing any package in ``blocked`` raises."""
    program = f"BLOCKED = {sorted(blocked)!r}\n" + _BLOCKER + code
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)


def import_every_module(
    package: str, blocked: set[str], forbidden: set[str], done: str
) -> subprocess.CompletedProcess[str]:
    """Import ``package`` and all its modules with ``blocked`` unavailable; print ``done`` if none of
    ``forbidden`` was loaded after all."""
    header = f"PACKAGE = {package!r}\nFORBIDDEN = {sorted(forbidden)!r}\nDONE = {done!r}\n"
    return run_blocked(header + _WALK, blocked)
