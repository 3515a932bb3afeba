"""The end-to-end benchmark's pure parts: stretching a profile, the projection, the verdict, its guards."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import common, e2e, harness, paired
from lightning_dynmo.balancing import LayerCost, Placement


def _costs(times_ms: list[float], params: list[int] | None = None) -> list[LayerCost]:
    params = params or [100] * len(times_ms)
    return [
        LayerCost(fwd_time_s=t / 3e3, bwd_time_s=2 * t / 3e3, num_params=n)
        for t, n in zip(times_ms, params, strict=True)
    ]


def test_stretch_keeps_the_profile_shape() -> None:
    costs = _costs([1.0, 2.0, 3.0, 4.0])
    stretched = e2e.stretch(costs, 8)
    assert [c.fwd_time_s for c in stretched] == [c.fwd_time_s for c in costs for _ in range(2)]
    assert e2e.stretch(costs, 4) == costs


def test_the_projection_balances_a_profile_that_falls_with_depth() -> None:
    # Early exit's shape: late layers are cheap, so the uniform split overloads the first stages.
    costs = _costs([4.0, 4.0, 2.0, 1.0, 0.5, 0.5, 0.25, 0.25])
    result = e2e.project_case(costs, num_layers=24, num_stages=8)
    rows = result["rows"]
    assert rows["static uniform"]["placement"] == "0-2|3-5|6-8|9-11|12-14|15-17|18-20|21-23"
    assert rows["static params"]["placement"] == rows["static uniform"]["placement"]  # equal parameters
    assert rows["DynMo partition/time"]["placement"] == rows["ideal"]["placement"]
    assert rows["static uniform"]["ms"] / rows["DynMo partition/time"]["ms"] > 1.5
    assert rows["DynMo partition/params"]["ms"] == pytest.approx(rows["static uniform"]["ms"])
    sizes = Placement.from_string(rows["ideal"]["placement"]).sizes
    assert sizes[0] < sizes[-1]


def test_static_params_split_follows_parameter_counts() -> None:
    placements = e2e.static_placements([400, 100, 100, 100, 100], 2)
    assert str(placements["static uniform"]) == "0-2|3-4"
    assert str(placements["static params"]) == "0-0|1-4"


def _comparison(uniform: float, params: float, dynmo: float, ideal: float, rounds: int = 3):
    return paired.compare(
        statics={"static uniform": [uniform] * rounds, "static params": [params] * rounds},
        dynmo={"DynMo partition/time": [dynmo] * rounds},
        candidates={"0-1|2-3": [uniform] * rounds, "0-2|3-3": [ideal] * rounds},
        gap=e2e.IMBALANCE_GAP,
    )


def test_the_verdict_passes_a_balanced_run_and_fails_a_slow_one() -> None:
    lines, ok = harness.verdict(_comparison(uniform=100.0, params=120.0, dynmo=85.0, ideal=80.0))
    assert ok is True and "**1.18x** the better static split" in lines[0]
    assert lines[1].startswith("Per round: better static / ideal 1.25, 1.25, 1.25")
    lines, ok = harness.verdict(_comparison(uniform=100.0, params=120.0, dynmo=95.0, ideal=80.0))
    assert ok is False and "**NO**." in lines[-1]  # 1.05x static but only 84% of the ideal


def test_the_verdict_says_when_a_case_is_not_imbalanced() -> None:
    lines, ok = harness.verdict(_comparison(uniform=100.0, params=100.0, dynmo=101.0, ideal=98.0))
    assert ok is None and lines[-1].startswith("Not imbalanced here")
    assert "slower beyond noise" not in lines[-1]  # 3 rounds are too few to call it
    lines, ok = harness.verdict(_comparison(uniform=100.0, params=100.0, dynmo=110.0, ideal=98.0, rounds=4))
    assert ok is None and lines[-1].endswith("**slower beyond noise**.")


def test_the_table_pairs_rounds_and_the_summary_marks_the_verdict() -> None:
    # Round 1 ran on a machine twice as slow: the paired ratios stay at 1.25, a ratio of medians would not.
    rows = {
        "static uniform": {"ms": 100.0, "placement": "0-1|2-3", "per_round": [100.0, 200.0, 100.0]},
        "static params": {"ms": 100.0, "placement": "0-1|2-3", "per_round": [100.0, 200.0, 100.0]},
        "DynMo partition/time": {"ms": 80.0, "placement": "0-2|3-3", "per_round": [80.0, 160.0, 80.0]},
        "ideal": {"ms": 80.0, "placement": "0-2|3-3", "per_round": [80.0, 160.0, 80.0]},
    }
    c = paired.compare(
        statics={k: rows[k]["per_round"] for k in ("static uniform", "static params")},
        dynmo={"DynMo partition/time": rows["DynMo partition/time"]["per_round"]},
        candidates={"0-1|2-3": [100.0, 200.0, 100.0], "0-2|3-3": [80.0, 160.0, 80.0]},
        gap=e2e.IMBALANCE_GAP,
    )
    line = next(line for line in harness.table(rows, c) if line.startswith("| DynMo"))
    assert "| 80.0 | 1.25 | 100% |" in line
    summary = e2e.summary_table([{"case": "moe", "real": c}])[-1]
    assert summary.startswith("| moe | 1.25x | 100% | - | - |")
    balanced = _comparison(uniform=100.0, params=100.0, dynmo=110.0, ideal=98.0, rounds=4)
    row = e2e.summary_table([{"case": "moe", "real": balanced}])[-1]
    assert row.startswith("| moe | 0.91x (not imbalanced) (slower beyond noise) | 89% |")


def test_a_committed_results_file_is_not_overwritten(tmp_path: Path) -> None:
    out = tmp_path / "e2e.md"
    out.write_text("kept")
    with pytest.raises(SystemExit, match=r"e2e\.md exists; pass --out PATH to write elsewhere or --force"):
        e2e.main(["--mode", "projection", "--out", str(out)])
    assert out.read_text() == "kept"
    assert common.results_path("e2e", out, force=True) == out


def test_bad_options_are_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        e2e.main(["--stages", "1", "--mode", "emulated"])
    assert "every emulated pipeline needs at least 2 stages" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        e2e.main(["--variants", "partition/params"])
    assert "include a time variant" in capsys.readouterr().err


def test_every_case_has_a_model_and_a_trigger() -> None:
    assert set(e2e.CASES) == {"moe", "pruning", "freezing", "sparse_attention", "early_exit", "mod"}
    for case in e2e.CASES.values():
        config = case.model(e2e.QUICK)
        assert config.num_layers == e2e.QUICK.num_layers
        assert case.lead_steps(e2e.QUICK) >= 1


def test_each_projection_column_is_headed_by_the_variant_it_shows() -> None:
    # Early exit's shape: by time both balancers move (faster than static), by params neither does.
    costs = _costs([4.0, 4.0, 2.0, 1.0, 0.5, 0.5, 0.25, 0.25])
    projection = e2e.project_case(costs, num_layers=24, num_stages=8)
    lines, _ = e2e.case_section(e2e.CASES["early_exit"], {"projection": [projection]})
    header = next(line for line in lines if line.startswith("| layers x stages"))
    row = next(line for line in lines if line.startswith("| 24 x 8"))
    cells = dict(zip(header.strip("|").split(" | "), row.strip("|").split(" | "), strict=True))
    rows = projection["rows"]
    static = min(rows["static uniform"]["ms"], rows["static params"]["ms"])
    for b, c in e2e.VARIANTS:
        name = f"DynMo {b}/{c}"
        assert cells[name.strip()] == f"{static / rows[name]['ms']:.2f}x", name
    assert cells["DynMo diffusion/time"] != cells["DynMo partition/params"]  # the pair that was swapped
