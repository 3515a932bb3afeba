"""The package installs like one: a wheel, installed outside the clone, runs the application.

The wheel is built from a copy of what it is made of (no build files land in the checkout), installed
with ``--no-deps`` into a fresh virtualenv that sees the packages of the environment running the tests
(torch, lightning, hydra: nothing is downloaded), and both entry points print the composed config from a
directory outside the clone. That venv's own site-packages come before the borrowed ones, so it imports the
wheel's copy, not an editable install of the checkout; the test checks that first.

The borrowed packages are this interpreter's site-packages, named in a ``.pth`` file, not
``system_site_packages=True``: a venv made from inside another venv would then see the *base* Python's
packages, which on a fresh machine has none of the dependencies.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
#: What the wheel is built from.
SOURCES = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "lightning_dynmo", "conf")


def _run(argv: list[str], cwd: Path, timeout: float = 300) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{argv}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("wheels")
    pip_wheel = ["-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(out)]
    _run([sys.executable, *pip_wheel, str(src)], cwd=src)
    (built,) = out.glob("lightning_dynmo-*.whl")
    return built


def test_the_wheel_ships_the_config_the_type_marker_the_license_and_the_script(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {f"lightning_dynmo/{p.relative_to(ROOT).as_posix()}" for p in (ROOT / "conf").rglob("*.yaml")}
    assert configs and configs <= names, sorted(configs - names)
    assert "lightning_dynmo/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), sorted(names)[-8:]
    (entry_points,) = (n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "dynmo-train = lightning_dynmo.train:main" in text


def test_the_installed_wheel_runs_the_app_outside_the_clone(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    # The test environment's packages (pip among them: no download), after the venv's own site-packages.
    (venv_site,) = env_dir.glob("lib/python*/site-packages")
    (venv_site / "borrowed.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    install = ["-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", str(wheel)]
    _run([str(python), *install], cwd=elsewhere)

    where = _run([str(python), "-c", "import lightning_dynmo as m; print(m.__file__)"], cwd=elsewhere)
    assert Path(where.strip()).is_relative_to(env_dir), where  # the wheel's copy, not the checkout's

    for argv in ([str(env_dir / "bin" / "dynmo-train")], [str(python), "-m", "lightning_dynmo.train"]):
        printed = _run([*argv, "--cfg", "job"], cwd=elsewhere)
        assert "_target_: lightning_dynmo.models.GPT" in printed, printed[:2000]
        assert "_target_: lightning_dynmo.strategy.DynMoStrategy" in printed
        assert "num_layers: 8" in printed  # the quick start's model (conf/model/gpt_small.yaml)
    assert [p.name for p in elsewhere.iterdir()] == []  # --cfg job prints; it writes nothing
