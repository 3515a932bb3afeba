"""The defaults README's DynMoStrategy and DynMoCallback tables document are the constructors' defaults."""

from __future__ import annotations

import ast
import inspect
import re
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from lightning_dynmo.callback import AutoConfig, DynMoCallback, ProfilingConfig, RepackConfig
from lightning_dynmo.strategy import DynMoStrategy

README = Path(__file__).resolve().parents[2] / "README.md"
# Set by the Trainer, not by users: the table leaves them out.
_SET_BY_TRAINER = {
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
}
# Defaults the table describes in words, and the constructor value each description stands for.
_DESCRIBED = {
    ("pipeline_size", "all devices"): None,
    ("timeout", "Lightning's"): "lightning-default-timeout",
    ("control_timeout", "100 s"): timedelta(seconds=100),
    ("process_group_backend", "gloo on CPU, NCCL on GPU"): None,
}


def _table(text: str, heading: str) -> list[list[str]]:
    """The rows (cells) of the first Markdown table after ``heading``, header and rule excluded."""
    lines = text[text.index(heading) :].splitlines()[1:]
    rows = []
    for line in lines:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    return rows[2:]


# Names a documented default may use beyond literals (the callback's config and clock defaults).
_NAMES = {"ProfilingConfig": ProfilingConfig, "time": time}


def _value(literal: str) -> Any:
    try:
        return ast.literal_eval(literal)
    except ValueError:
        return eval(literal, dict(_NAMES))  # the README's own text, evaluated against _NAMES only


def documented_defaults(text: str, heading: str = "### DynMoStrategy") -> dict[str, Any]:
    """Argument name -> documented default (a Python literal, or what a described default stands for)."""
    out: dict[str, Any] = {}
    for names_cell, default_cell, *_ in _table(text, heading):
        names = re.findall(r"`([a-z_]+)`", names_cell)
        literals = re.findall(r"`([^`]+)`", default_cell)
        if len(literals) == len(names) and re.fullmatch(r"(`[^`]+`(, )?)+", default_cell):
            out.update({n: _value(v) for n, v in zip(names, literals, strict=True)})
            continue
        for name in names:
            key = (name, default_cell)
            if key not in _DESCRIBED:
                raise AssertionError(
                    f"README documents {name!r}'s default as {default_cell!r}: write a Python literal in "
                    "backticks, or add the description to _DESCRIBED with the value it stands for."
                )
            out[name] = _DESCRIBED[key]
    return out


def constructor_defaults() -> dict[str, Any]:
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

    params = inspect.signature(DynMoStrategy.__init__).parameters
    out = {n: p.default for n, p in params.items() if n != "self" and n not in _SET_BY_TRAINER}
    if out.get("timeout") == default_pg_timeout:
        out["timeout"] = "lightning-default-timeout"
    return out


def test_readme_strategy_table_matches_the_constructor_defaults() -> None:
    documented = documented_defaults(README.read_text())
    actual = constructor_defaults()
    assert set(documented) == set(actual), (
        f"undocumented: {sorted(set(actual) - set(documented))}, "
        f"documented but not arguments: {sorted(set(documented) - set(actual))}"
    )
    wrong = {n: (documented[n], actual[n]) for n in actual if documented[n] != actual[n]}
    assert not wrong, f"README default != constructor default: {wrong}"


def test_a_wrong_documented_default_is_caught() -> None:
    # Negative control: the README as it stood (num_microbatches "pipeline size") and a wrong literal.
    text = README.read_text()
    row = re.search(r"^\| `num_microbatches` \| `4` \|", text, flags=re.MULTILINE)
    assert row is not None
    described = text.replace(row.group(0), "| `num_microbatches` | pipeline size |")
    with pytest.raises(AssertionError, match=r"documents 'num_microbatches''s default as 'pipeline size'"):
        documented_defaults(described)
    wrong = documented_defaults(text.replace(row.group(0), "| `num_microbatches` | `2` |"))
    assert wrong["num_microbatches"] != constructor_defaults()["num_microbatches"]


@pytest.mark.parametrize(
    ("heading", "constructor"),
    [
        ("### DynMoCallback", DynMoCallback),
        ("#### ProfilingConfig", ProfilingConfig),
        ("#### AutoConfig", AutoConfig),
        ("#### RepackConfig", RepackConfig),
    ],
)
def test_readme_callback_tables_match_the_constructor_defaults(heading: str, constructor: Any) -> None:
    documented = documented_defaults(README.read_text(), heading)
    params = inspect.signature(constructor).parameters
    actual = {n: p.default for n, p in params.items() if n != "self"}
    assert set(documented) == set(actual), (
        f"undocumented: {sorted(set(actual) - set(documented))}, "
        f"documented but not arguments: {sorted(set(documented) - set(actual))}"
    )
    wrong = {n: (documented[n], actual[n]) for n in actual if documented[n] != actual[n]}
    assert not wrong, f"README default != constructor default: {wrong}"
