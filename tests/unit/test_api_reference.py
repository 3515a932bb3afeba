"""The API reference (docs/api/index.rst) names every public name of ``lightning_dynmo.__all__``.

The reference itself is generated from the docstrings by Sphinx (``sphinx-build -W docs docs/_build``);
what this test keeps is the hand-written list of top-level names on its first page, which must follow
``__all__``: each name listed by the path of the module that defines it (where autosummary documents it),
and that path must give the very object ``lightning_dynmo.<name>`` gives.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import lightning_dynmo

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "api" / "index.rst"


def autosummary_blocks(text: str) -> list[tuple[list[str], list[str]]]:
    """Each ``.. autosummary::`` directive's (options, entries), entries without a leading ``~``."""
    blocks = []
    for body in re.findall(r"^\.\. autosummary::\n((?:[ \t]+.*\n|\n)*)", text, re.M):
        lines = [line.strip() for line in body.splitlines() if line.strip()]
        options = [line for line in lines if line.startswith(":")]
        entries = [line.lstrip("~") for line in lines if not line.startswith(":")]
        blocks.append((options, entries))
    return blocks


def _resolve(dotted: str) -> object:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def missing_top_level_names(text: str, names: list[str]) -> list[str]:
    """The names of ``names`` (from ``lightning_dynmo.__all__``) that no entry of the reference gives."""
    entries = [entry for _, found in autosummary_blocks(text) for entry in found]
    missing = []
    for name in names:
        candidates = [entry for entry in entries if entry.rpartition(".")[2] == name]
        if not any(_resolve(entry) is getattr(lightning_dynmo, name) for entry in candidates):
            missing.append(name)
    return missing


def test_every_name_of_all_is_in_the_reference() -> None:
    text = REFERENCE.read_text()
    assert len(lightning_dynmo.__all__) >= 5  # guards the loop below against an empty __all__
    missing = missing_top_level_names(text, list(lightning_dynmo.__all__))
    assert not missing, f"docs/api/index.rst does not list {missing} of lightning_dynmo.__all__: add them"


def test_the_whole_package_is_generated_recursively() -> None:
    # The top-level entries point into modules: autosummary documents each module only if the recursive
    # directive covers it, and it skips private modules.
    blocks = autosummary_blocks(REFERENCE.read_text())
    assert any(":recursive:" in options and "lightning_dynmo" in entries for options, entries in blocks)
    for _, entries in blocks:
        for entry in entries:
            assert not any(part.startswith("_") for part in entry.split(".")[:-1]), entry


def test_a_missing_or_wrong_entry_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # Negative controls: a listed name dropped, an entry naming another object, a name added to __all__.
    text = REFERENCE.read_text()
    entry = "   ~lightning_dynmo.app.report.RunReport\n"
    assert entry in text
    assert missing_top_level_names(text.replace(entry, ""), ["RunReport"]) == ["RunReport"]
    wrong = text.replace(entry, "   ~lightning_dynmo.balancing.placement.Placement\n")
    assert missing_top_level_names(wrong, ["RunReport", "Placement"]) == ["RunReport"]
    monkeypatch.setattr(lightning_dynmo, "Undocumented", object(), raising=False)
    assert missing_top_level_names(text, [*lightning_dynmo.__all__, "Undocumented"]) == ["Undocumented"]
