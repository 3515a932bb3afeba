"""What a fresh clone promises: CI runs the README's commands verbatim, and the extras hold what is used."""

from __future__ import annotations

import ast
import json
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _quickstart_commands() -> list[str]:
    """The command lines of the README's Quickstart block (comments and blank lines left out)."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quickstart\s+```bash\n(.*?)```", readme, re.S)
    assert block, "the README has no Quickstart bash block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def _ci_lines() -> list[str]:
    return [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]


def test_ci_runs_the_readme_commands_verbatim_and_installs_nothing_else() -> None:
    commands = _quickstart_commands()
    assert commands == [
        'pip install torch==2.13.0 && pip install -e ".[dev]" && python -m lightning_dynmo.train',
        "python -m pytest",
    ]
    ci = _ci_lines()
    missing = [c for c in commands if c not in ci]
    assert not missing, f".ci/run does not run the README's {missing}"
    installs = [line for line in ci if "pip install" in line and not line.startswith("#")]
    assert installs == [commands[0]], f"CI installs what the README does not: {installs}"


def _extra(name: str) -> set[str]:
    """The requirements an extra installs, its references to this project's other extras expanded."""
    found: set[str] = set()
    for requirement in PROJECT["optional-dependencies"][name]:
        self_reference = re.fullmatch(r"lightning-dynmo\[([\w,]+)\]", requirement)
        if self_reference:
            for other in self_reference.group(1).split(","):
                found |= _extra(other)
        else:
            found.add(requirement)
    return found


def test_the_dev_extra_brings_what_the_hugging_face_tests_import() -> None:
    # tests/unit/models/test_huggingface.py and tests/distributed/test_huggingface_fit.py import transformers.
    assert PROJECT["optional-dependencies"]["hf"] == ["transformers==5.23.0"]
    assert "transformers==5.23.0" in _extra("dev")


def _notebook_imports() -> set[str]:
    notebook = json.loads((ROOT / "notebooks" / "quickstart.ipynb").read_text())
    source = "\n".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code")
    tops: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            tops |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            tops.add(node.module.split(".")[0])
    return tops


def test_the_notebook_extra_is_jupyter_and_what_the_notebook_imports() -> None:
    extra = {re.split(r"[<>=\[ ]", r)[0] for r in PROJECT["optional-dependencies"]["notebook"]}
    assert extra - {"jupyter"} <= _notebook_imports(), f"unused: {extra - {'jupyter'} - _notebook_imports()}"
    assert "matplotlib" in extra and "matplotlib" in _notebook_imports()
