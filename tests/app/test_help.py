"""``--help`` lists the groups a user picks from, not the internal ``schema`` group."""

from __future__ import annotations

from hydra import initialize_config_dir

from lightning_dynmo.app.help import user_config_groups
from lightning_dynmo.train import CONF_DIR
from tests.app.test_train_runs import ROOT, _run

#: The groups of ``conf/`` (folders holding options), Hydra's own aside.
GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra")


def _help(*overrides: str) -> list[str]:
    return _run(["-m", "lightning_dynmo.train", *overrides, "--help"], cwd=ROOT, timeout=120).splitlines()


def test_help_lists_every_user_group_and_no_schema_line() -> None:
    lines = _help()
    section = lines[lines.index("== Configuration groups ==") + 2 : lines.index("== Config ==")]
    listed = [line.split(":")[0] for line in section if line.strip()]
    assert listed == GROUPS, listed
    assert not [line for line in lines if line.startswith("schema")]
    options = sorted(p.stem for p in (CONF_DIR / "dynamism").glob("*.yaml"))
    assert f"dynamism: {', '.join(options)}" in lines


def test_hydras_default_help_would_list_the_schema_group() -> None:
    # Negative control: with Hydra's own help template the 24 schemas show; ours leaves them out.
    assert any(line.startswith("schema: ") for line in _help("hydra/help=default"))


def test_the_group_list_is_empty_outside_a_hydra_app_and_hydras_inside_one() -> None:
    assert user_config_groups() == ""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        listed = [line.split(":")[0] for line in user_config_groups().splitlines()]
    assert listed == GROUPS
