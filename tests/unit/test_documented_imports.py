"""Every import path the README and the docs guides document works, and so do the paths documented before they
moved."""

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The prose that names import paths: the README and the guides (the API reference is generated, so it cannot
# name a path that does not import).
DOCUMENTS = [
    ROOT / "README.md",
    ROOT / "docs" / "architecture.md",
    *sorted((ROOT / "docs" / "guides").glob("*.md")),
]

# Paths the README of 0.1 documented whose modules have moved since (issue 18): they must keep working.
MOVED = (
    "lightning_dynmo.pipeline.sharded.export_full_checkpoint",
    "lightning_dynmo.pipeline.aux.add_aux_loss",
    "lightning_dynmo.strategy.DynMoStrategy",
    "lightning_dynmo.callback.DynMoCallback",
)


def _resolve(dotted: str) -> object:
    """The module or attribute a dotted path names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as err:
            if err.name is None or not ".".join(parts[:cut]).startswith(err.name):
                raise  # a module that exists but fails to import is a real failure
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def _documented_paths(text: str) -> list[str]:
    paths = set()
    for module, names in re.findall(r"^from (lightning_dynmo[\w.]*) import ([\w, ]+)$", text, re.M):
        paths.update(f"{module}.{name.strip()}" for name in names.split(","))
    for dotted in re.findall(r"`(lightning_dynmo(?:\.\w+)+)", text):
        paths.add(dotted)
    return sorted(paths)


DOCUMENTED = _documented_paths("\n".join(path.read_text() for path in DOCUMENTS))


def test_the_docs_document_import_paths():
    # Guards the parser: if it found nothing, the parametrised test below would pass vacuously.
    assert len(DOCUMENTED) >= 20
    assert "lightning_dynmo.pipeline.export_full_checkpoint" in DOCUMENTED


@pytest.mark.parametrize("dotted", DOCUMENTED + list(MOVED))
def test_documented_import_path_resolves(dotted):
    assert _resolve(dotted) is not None


def test_an_unknown_path_fails_to_resolve():
    # Negative control: a path nobody defines must not resolve.
    with pytest.raises(AttributeError):
        _resolve("lightning_dynmo.pipeline.no_such_function")
    with pytest.raises(AttributeError):
        _resolve("lightning_dynmo.pipeline.no_such_module.thing")


def test_old_and_new_paths_are_the_same_objects():
    assert _resolve("lightning_dynmo.pipeline.sharded.export_full_checkpoint") is _resolve(
        "lightning_dynmo.pipeline.export_full_checkpoint"
    )
    old, new = "lightning_dynmo.pipeline.aux.add_aux_loss", "lightning_dynmo.pipeline.add_aux_loss"
    assert _resolve(old) is _resolve(new)
