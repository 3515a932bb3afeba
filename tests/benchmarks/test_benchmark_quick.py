"""The benchmark's --quick mode must keep running (no timing is asserted)."""

from benchmarks.balancing import deepspeed_partition_balanced, main
from lightning_dynmo.balancing import BalanceProblem, LayerCost, solve_partition


def test_quick_benchmark_runs_and_writes_its_report(tmp_path, capsys):
    out = tmp_path / "report.md"
    report = main(["--quick", "--out", str(out)])
    assert out.read_text() == report
    assert "python -m benchmarks.balancing --quick" in report
    assert "| early_exit | 48x24 | partition by time | 1.000 |" in report
    assert "DeepSpeed partition_balanced (ours)" in capsys.readouterr().out
    assert "## Two (virtual) stages per worker" in report
    assert "| early_exit | 48x16 | V |" in report


def test_deepspeed_comparison_is_not_the_min_max_optimum():
    # Known counter-example to DeepSpeed's current DP: it returns sums [20, 4, 3, 5], the optimum is 19.
    weights = [1.0, 19.0, 4.0, 3.0, 5.0, 0.0]
    placement = deepspeed_partition_balanced(weights, 4)
    costs = [LayerCost(fwd_time_s=w) for w in weights]
    assert placement.stage_loads(costs) == (20.0, 4.0, 3.0, 5.0)
    assert solve_partition(BalanceProblem(costs), 4).bottleneck == 19.0
