"""The early-exit / Mixture-of-Depths benchmark runs end to end in its smoke mode; no timing is asserted."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.early_exit_mod import LayerTime, Projection, project_early_exit
from lightning_dynmo.balancing import LayerCost, Placement


@pytest.mark.distributed
@pytest.mark.slow
def test_the_quick_mode_writes_every_part_of_both_cases(tmp_path: Path) -> None:
    from benchmarks import early_exit_mod

    out = tmp_path / "early_exit_mod.md"
    early_exit_mod.main(["--quick", "--out", str(out)])
    text = out.read_text()
    assert "python -m benchmarks.early_exit_mod --quick" in text
    for heading in ("### Early exit", "### Mixture of Depths"):
        assert heading in text
    assert text.count("| DynMo |") == 2 and text.count("= static uniform |") == 2
    assert text.count("of the ideal (medians over 1 round(s)") == 2  # the paired comparison of each case
    assert "Figures: **real compute**, **projected**." in text
    assert text.count("Projection, 32 layers on 8 stages") == 2
    assert "| 3 | EarlyExitBlock |" in text and "| 1 | MoDBlock |" in text


def test_the_early_exit_projection_balances_cheaper_late_layers() -> None:
    # Layer time falls with the share of active tokens: DynMo gives the late stages more layers.
    layers = [LayerTime("DenseBlock", 1.0, 2.0, 1.0)] + [
        LayerTime("EarlyExitBlock", 0.2 + 0.8 * a, 0.4 + 1.6 * a, a) for a in (1.0, 0.7, 0.5, 0.3)
    ]
    extras = (LayerCost(), LayerCost())
    result = project_early_exit(layers, extras, exit_rate=0.3, projection=Projection())
    assert result["static"] == "0-3|4-7|8-11|12-15|16-19|20-23|24-27|28-31"
    assert result["speedup"] > 1.5
    sizes = Placement.from_string(result["dynmo"]).sizes
    assert sizes[0] < sizes[-1], "the stages of cheap late layers hold more of them"
