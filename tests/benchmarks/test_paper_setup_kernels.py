"""The paper-setup projection from a GPU kernel check's cost curves (``--kernels``): per-case costs are the
curve's interpolated milliseconds x the micro-batch count, out-of-range values are refused (or clamped
when asked), another curve changes the costs, and the quick mode's tables carry the GPU label; the
replay's ``--kernels`` gets the same costs in dense-forward units."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks._lib.gpu_curves import FWD_SHARE, HEADS, gpu_cost_trace, read_kernels, relative_cost_trace
from benchmarks._lib.trace_cases import DENSE_FWD
from benchmarks.paper_replay import main as paper_replay_main
from benchmarks.paper_replay import paper_trace
from benchmarks.paper_setup import main
from benchmarks.replay import main as replay_main
from lightning_dynmo.balancing import LayerCost
from lightning_dynmo.balancing.trace import StatisticTrace

M = 32


def _curve(statistic: str, points: list[tuple[float, float]]) -> dict[str, Any]:
    return {
        "statistic": statistic,
        "points": [{"name": f"p{i}", statistic: x, "median_ms": ms} for i, (x, ms) in enumerate(points)],
        "failed": {},
    }


def _kernels(
    tmp_path: Path, mod: list[tuple[float, float]] | None = None, name: str = "kernels.json"
) -> Path:
    """A hand-made ``kernels.json`` in the schema the kernel check writes (its cost_curves part only)."""
    result = {
        "dense_and_freezing": _curve("trainable_fraction", [(0.0, 4.0), (1.0, 6.0)]),
        "mod": _curve("processed_fraction", mod or [(0.0625, 1.0), (0.5, 3.0), (1.0, 7.0)]),
        "early_exit": _curve("active_fraction", [(0.1, 1.5), (1.0, 6.5)]),
        "sparse_attention": _curve("active_fraction", [(0.1, 2.0), (1.0, 6.0)]),
        "head_loss_and_embedding": {
            "timed": {"head_and_loss": {"median_ms": 9.0}, "embedding": {"median_ms": 0.3}},
            "failed": {},
        },
    }
    report = {
        "command": "python -m lightning_dynmo.gpu_check.kernels",
        "device": {"devices": [{"name": "NVIDIA H200"}]},
        "shape": {"d_model": 1024, "seq_len": 2048, "micro_batch": 2, "dtype": "bfloat16"},
        "parts": {"cost_curves": {"ok": True, "result": result}},
    }
    path = tmp_path / name
    path.write_text(json.dumps(report))
    return path


def _total(cost: LayerCost) -> float:
    return cost.fwd_time_s + cost.bwd_time_s


def _mod(values: tuple[float, ...]) -> StatisticTrace:
    return StatisticTrace("mod", "share", "fraction", (0,), (values,))


def test_costs_are_the_interpolated_curve_times_the_microbatches(tmp_path):
    kernels = read_kernels(_kernels(tmp_path))
    assert kernels.device == "NVIDIA H200" and kernels.dense_ms == 6.0
    # Layers 0, 2: dense blocks between MoD's routed ones; 1, 3: routed at 0.25 and 0.75.
    trace = gpu_cost_trace(_mod((1.0, 0.25, 1.0, 0.75)), kernels, M)
    row = trace.rows[0]
    interpolated = [6.0, 1.0 + 2.0 * (0.25 - 0.0625) / (0.5 - 0.0625), 6.0, 3.0 + 4.0 * 0.25 / 0.5]
    for cost, ms in zip(row.layers, interpolated, strict=True):
        assert cost.fwd_time_s + cost.bwd_time_s == pytest.approx(ms * 1e-3 * M, rel=1e-12)
        assert cost.fwd_time_s == pytest.approx(FWD_SHARE * ms * 1e-3 * M, rel=1e-12)
    assert row.last.fwd_time_s + row.last.bwd_time_s == pytest.approx(9.0e-3 * M)
    assert row.first.fwd_time_s + row.first.bwd_time_s == pytest.approx(0.3e-3 * M)
    assert "GPU curve 'mod' at processed_fraction" in trace.curve_label
    # Freezing: a frozen prefix block runs the dense forward only.
    frozen = gpu_cost_trace(StatisticTrace("freezing", "s", "u", (0,), ((0.0, 1.0),)), kernels, M)
    assert frozen.rows[0].layers[0].bwd_time_s == 0.0
    assert frozen.rows[0].layers[0].fwd_time_s == pytest.approx(FWD_SHARE * 6.0e-3 * M)
    assert _total(frozen.rows[0].layers[1]) == pytest.approx(6.0e-3 * M)


def test_a_value_outside_the_measured_range_is_refused_or_clamped_when_asked(tmp_path):
    kernels = read_kernels(_kernels(tmp_path))
    with pytest.raises(
        ValueError,
        match=r"case 'mod', layer 1, step 0: processed_fraction = 0\.0 is outside .*\[0\.0625, 1\.0\]",
    ):
        gpu_cost_trace(_mod((1.0, 0.0)), kernels, M)
    clamped = gpu_cost_trace(_mod((1.0, 0.0)), kernels, M, clamp=True)
    assert _total(clamped.rows[0].layers[1]) == pytest.approx(1.0e-3 * M)
    assert "1 values clamped" in clamped.curve_label
    with pytest.raises(ValueError, match=r"case 'early_exit' needs the 'early_exit' curve"):
        other = json.loads(_kernels(tmp_path).read_text())
        del other["parts"]["cost_curves"]["result"]["early_exit"]
        (tmp_path / "no_exit.json").write_text(json.dumps(other))
        gpu_cost_trace(
            StatisticTrace("early_exit", "s", "u", (0,), ((1.0,),)),
            read_kernels(tmp_path / "no_exit.json"),
            M,
        )


def test_negative_control_another_curve_changes_the_costs(tmp_path):
    stats = _mod((1.0, 0.25, 1.0, 0.75))
    one = gpu_cost_trace(stats, read_kernels(_kernels(tmp_path)), M)
    steeper = _kernels(tmp_path, mod=[(0.0625, 1.0), (0.5, 5.0), (1.0, 7.0)], name="other.json")
    two = gpu_cost_trace(stats, read_kernels(steeper), M)
    assert one.rows[0].layers[0] == two.rows[0].layers[0]  # the dense layers share the dense curve
    # 0.25 and 0.75 on each curve: 1 + 2 x 0.4286 vs 1 + 4 x 0.4286, and 3 + 4 x 0.5 vs 5 + 2 x 0.5 (ms).
    x = (0.25 - 0.0625) / (0.5 - 0.0625)
    assert _total(one.rows[0].layers[1]) == pytest.approx((1 + 2 * x) * 1e-3 * M)
    assert _total(two.rows[0].layers[1]) == pytest.approx((1 + 4 * x) * 1e-3 * M)
    assert _total(one.rows[0].layers[3]) == pytest.approx(5.0e-3 * M)
    assert _total(two.rows[0].layers[3]) == pytest.approx(6.0e-3 * M)
    assert one.rows[0].total_s != pytest.approx(two.rows[0].total_s, rel=1e-3)


def test_quick_mode_with_kernels_writes_its_tables_with_the_gpu_label(tmp_path):
    path = _kernels(tmp_path)
    out = tmp_path / "paper.md"
    report = main(["--quick", "--kernels", str(path), "--out", str(out)])
    assert out.read_text() == report + "\n"
    assert report.startswith("# The traces at the paper's setup (projected from GPU cost curves)")
    assert f"Costs: GPU cost curves (NVIDIA H200, {path})" in report
    assert "forward : backward = 1 : 2" in report and "scaled" not in report.split("\n")[0]
    for table in ("**(a) Mean step", "**(b) Bubble", "**(c) Best fixed, re-derived independently"):
        assert table in report
    assert "**(d) The policy's decision time" in report
    assert report.count("| synthetic | 8 | 2 x ") == 8  # two shapes in each of the four tables


def test_kernels_options_fail_with_the_fix(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--quick", "--clamp-curves", "--out", str(tmp_path / "x.md")])
    assert "--clamp-curves applies to --kernels PATH only" in capsys.readouterr().err
    failed = json.loads(_kernels(tmp_path).read_text())
    failed["parts"]["cost_curves"] = {"ok": False, "error": "OutOfMemoryError"}
    (tmp_path / "failed.json").write_text(json.dumps(failed))
    with pytest.raises(ValueError, match=r"has no measured cost curves .*OutOfMemoryError"):
        main(["--quick", "--kernels", str(tmp_path / "failed.json"), "--out", str(tmp_path / "y.md")])
    no_head = json.loads(_kernels(tmp_path).read_text())
    del no_head["parts"]["cost_curves"]["result"]["head_loss_and_embedding"]["timed"]["embedding"]
    (tmp_path / "no_head.json").write_text(json.dumps(no_head))
    with pytest.raises(ValueError, match=r"has no timed 'embedding'"):
        read_kernels(tmp_path / "no_head.json")


def test_the_replay_gets_the_same_costs_in_dense_forward_units(tmp_path, capsys):
    kernels = read_kernels(_kernels(tmp_path))
    stats = _mod((1.0, 0.25, 1.0, 0.75))
    per_step = gpu_cost_trace(stats, kernels, M).rows[0]
    units = relative_cost_trace(stats, kernels).rows[0]
    dense_fwd = FWD_SHARE * 6.0e-3 * M  # the GPU dense block's forward over M micro-batches
    assert units.layers[0].fwd_time_s == pytest.approx(DENSE_FWD)  # a dense block: one unit forward
    for got, want in zip(
        (*units.layers, units.first, units.last),
        (*per_step.layers, per_step.first, per_step.last),
        strict=True,
    ):
        assert got.fwd_time_s == pytest.approx(want.fwd_time_s / dense_fwd)
        assert got.bwd_time_s == pytest.approx(want.bwd_time_s / dense_fwd)
    assert units.last.fwd_time_s + units.last.bwd_time_s == pytest.approx(9.0 / (FWD_SHARE * 6.0))
    with pytest.raises(SystemExit):
        replay_main(["--quick", "--clamp-curves", "--out", str(tmp_path / "r.md")])
    assert "--clamp-curves applies to --kernels PATH only" in capsys.readouterr().err


def test_the_padded_vocabulary_head_is_taken_only_when_asked_and_only_if_measured(tmp_path, capsys):
    path = _kernels(tmp_path)
    padded = json.loads(path.read_text())
    timed = padded["parts"]["cost_curves"]["result"]["head_loss_and_embedding"]["timed"]
    timed["head_and_loss_padded_vocab"] = {"median_ms": 3.0}
    padded["shape"]["vocab_size"] = 50257
    (tmp_path / "padded.json").write_text(json.dumps(padded))
    as_measured, taken = (
        read_kernels(tmp_path / "padded.json"),
        read_kernels(tmp_path / "padded.json", HEADS[1]),
    )
    assert (as_measured.head_ms, taken.head_ms) == (9.0, 3.0)
    assert "head + loss 9.000 ms (vocabulary 50257)" in as_measured.label
    assert "head + loss 3.000 ms (vocabulary padded to a multiple of 128, 50257 real)" in taken.label
    row = gpu_cost_trace(_mod((1.0, 0.5)), taken, M).rows[0]
    assert row.last.fwd_time_s + row.last.bwd_time_s == pytest.approx(3.0e-3 * M)
    with pytest.raises(ValueError, match=r"has no timed 'head_and_loss_padded_vocab'"):
        read_kernels(path, HEADS[1])  # a JSON from before the padded head was timed
    with pytest.raises(ValueError, match=r"head='lm_head' is not one of"):
        read_kernels(path, "lm_head")
    for run in (main, paper_replay_main):
        with pytest.raises(SystemExit):
            run(["--quick", "--padded-vocab-head", "--out", str(tmp_path / "z.md")])
        assert "--padded-vocab-head applies to --kernels PATH only" in capsys.readouterr().err


def _early_exit(values: tuple[float, ...]) -> StatisticTrace:
    return StatisticTrace("early_exit", "active", "fraction", (0,), (values,))


def test_early_exits_heads_are_padded_with_the_head_where_the_json_times_them(tmp_path):
    report = json.loads(_kernels(tmp_path).read_text())
    result = report["parts"]["cost_curves"]["result"]
    result["head_loss_and_embedding"]["timed"]["head_and_loss_padded_vocab"] = {"median_ms": 3.0}
    (tmp_path / "old.json").write_text(json.dumps(report))  # padded head, exit heads unpadded only
    result["early_exit_padded_vocab"] = _curve("active_fraction", [(0.1, 1.0), (1.0, 2.5)])
    (tmp_path / "new.json").write_text(json.dumps(report))
    stats = _early_exit((0.55, 1.0))

    def totals(path: Path, head: str) -> tuple[list[float], str]:
        trace = gpu_cost_trace(stats, read_kernels(path, head), M)
        return [round(_total(c) / (1e-3 * M), 9) for c in trace.rows[0].layers], trace.curve_label

    padded, label = totals(tmp_path / "new.json", HEADS[1])
    assert padded == [1.75, 2.5] and "'early_exit_padded_vocab'" in label and "exit heads padded" in label
    # Negative controls: the head as measured keeps the unpadded exit heads, and so does an older JSON
    # with the padded head, which says so.
    unpadded, label = totals(tmp_path / "new.json", HEADS[0])
    assert unpadded == [4.0, 6.5] and "exit heads" not in label
    older, label = totals(tmp_path / "old.json", HEADS[1])
    assert older == [4.0, 6.5] and "exit heads unpadded" in label and "no 'early_exit_padded_vocab'" in label


def test_the_paper_replay_scales_the_gpu_curves_so_a_dense_block_sleeps_block_ms(tmp_path):
    kernels = read_kernels(_kernels(tmp_path))
    stats = _mod((1.0, 0.25, 1.0, 0.75))
    trace = paper_trace(stats, 4, kernels, block_ms=3.0, split=False)
    row, scale = trace.rows[0], 3.0 / (FWD_SHARE * 6.0)  # the dense forward (2 ms) sleeps 3 ms
    assert row.layers[0].fwd_time_s == pytest.approx(3.0e-3 * M)  # per step: block_ms x M micro-batches
    per_step = gpu_cost_trace(stats, kernels, M).rows[0]
    for got, want in zip((*row.layers, row.last), (*per_step.layers, per_step.last), strict=True):
        assert got.fwd_time_s == pytest.approx(want.fwd_time_s * scale)
        assert got.bwd_time_s == pytest.approx(want.bwd_time_s * scale)
    with pytest.raises(ValueError, match=r"outside the 'mod' curve's measured range"):
        paper_trace(_mod((1.0, 0.0)), 2, kernels, block_ms=3.0, split=False)
    clamped = paper_trace(_mod((1.0, 0.0)), 2, kernels, block_ms=3.0, split=False, clamp=True)
    assert "1 values clamped" in clamped.curve_label
