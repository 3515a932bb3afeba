"""The configuration guide's reference tables (docs/guides/configuration.md) match ``conf/``.

The tables are written by hand (their "meaning" column is prose), so this test keeps their options, keys and
defaults equal to what ``conf/`` composes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from lightning_dynmo.train import CONF_DIR
from tests.configs.conftest import Compose, group_options

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "configuration.md"


def _table(marker: str, text: str | None = None) -> list[list[str]]:
    """The rows (cells without their backquotes) of the table between ``<!-- marker:start/end -->``."""
    text = GUIDE.read_text() if text is None else text
    found = re.search(rf"<!-- {marker}:start -->\n(.*?)<!-- {marker}:end -->", text, re.S)
    assert found, f"{GUIDE.name} has no {marker} table"
    rows = [
        line.strip().strip("|").split("|") for line in found.group(1).splitlines() if line.startswith("|")
    ]
    return [[cell.strip() for cell in row] for row in rows[2:]]  # header and rule left out


def _lookup(container: Any, key: str) -> Any:
    node = container
    for part in key.split("."):
        assert isinstance(node, dict) and part in node, f"the guide documents {key!r}; conf/ has no {part!r}"
        node = node[part]
    return node


def test_every_group_and_option_is_documented_and_exists() -> None:
    rows = _table("config-groups")
    documented = {row[0].strip("`"): row[1] for row in rows}
    assert set(documented) == {
        "dynamism",
        "model",
        "balancer",
        "strategy",
        "callbacks",
        "trainer",
        "data",
        "logger",
        "experiment",
    }
    for group, cell in documented.items():
        options = set(re.findall(r"`([a-z_]+)`", cell))
        assert options == set(group_options(group)), (group, options, group_options(group))


def test_the_documented_defaults_are_the_composed_ones(compose_train: Compose) -> None:
    train = yaml.safe_load((CONF_DIR / "train.yaml").read_text())
    defaults = {k: v for d in train["defaults"] if isinstance(d, dict) for k, v in d.items()}
    for row in _table("config-groups"):
        group, first = row[0].strip("`"), re.findall(r"`([a-z_]+)`|\(none\)", row[1])[0] or None
        assert defaults[group] == first, (
            f"the guide says {group} defaults to {first}, conf/ to {defaults[group]}"
        )
    container = OmegaConf.to_container(compose_train([]), resolve=False)
    rows = _table("config-reference")
    assert len(rows) >= 20
    for key, default, _ in rows:
        value = _lookup(container, key.strip("`"))
        documented = default.strip("`")
        expected = documented if documented.startswith("${") else yaml.safe_load(documented)
        assert value == expected, f"the guide says {key} = {documented}, conf/ composes {value!r}"


def test_a_wrong_default_in_the_reference_is_caught(compose_train: Compose) -> None:
    # Negative control: the same checks on a reference that documents a key and a default wrongly.
    text = (
        "<!-- config-reference:start -->\n| k | d | m |\n|---|---|---|\n| `trainer.max_steps` | `61` | x |\n"
    )
    row = _table("config-reference", text + "<!-- config-reference:end -->")[0]
    container = OmegaConf.to_container(compose_train([]), resolve=False)
    assert _lookup(container, row[0].strip("`")) != yaml.safe_load(row[1].strip("`"))
    with pytest.raises(AssertionError, match=r"the guide documents 'trainer\.max_stpes'"):
        _lookup(container, "trainer.max_stpes")
