"""The benchmark harness: rotated rounds, the held-out comparison, the report header and shared options."""

from __future__ import annotations

import time
from typing import Any

import pytest

from benchmarks._lib import harness
from benchmarks._lib.common import launch


def test_every_job_takes_every_slot_of_a_round_in_turn() -> None:
    names = ["a", "b", "c"]
    orders = [harness.rotated(names, r) for r in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert harness.rotated(names, 3) == names
    assert harness.rotated([], 1) == []


def test_run_rounds_launches_each_job_once_a_round_in_rotated_order(monkeypatch: pytest.MonkeyPatch) -> None:
    launched: list[str] = []

    def fake_launch(body: Any, spec: str, nproc: int, start_method: str) -> dict[str, Any]:
        launched.append(spec)
        return {"step_s": [1.0, 0.1 * len(launched)], "placement": "0-1|2-3"}

    monkeypatch.setattr(harness, "launch", fake_launch)
    runs = harness.run_rounds({"x": "x", "y": "y"}, print, rounds=3, tag="t", log=lambda run: ["noted"])
    assert launched == ["x", "y", "y", "x", "x", "y"]
    assert [len(r) for r in runs.values()] == [3, 3]
    assert harness.step_ms(runs["x"], skip=1) == pytest.approx([100.0, 400.0, 500.0])
    with pytest.raises(ValueError, match=r"rounds=0: a comparison needs at least 1 round"):
        harness.run_rounds({"x": "x"}, print, rounds=0, tag="t")


def test_the_comparison_holds_the_ideal_out_of_the_round_it_judges() -> None:
    # "b" is lucky in round 0 only: held out, round 0 is judged by "a", the fastest of the other rounds.
    per_round = {"a": [100.0, 100.0, 100.0], "b": [80.0, 101.0, 99.0], "DynMo": [100.0, 100.0, 100.0]}
    c = harness.compare_runs(per_round, ["a"], ["DynMo"], ["a", "b"])
    assert c.held_out and c.ideal == ("a", "b", "b") and c.ideal_ms == (100.0, 101.0, 99.0)
    runs = {name: [{"step_s": [t / 1e3], "placement": name} for t in ts] for name, ts in per_round.items()}
    section = harness.comparison_section(runs, per_round, c)
    assert "| DynMo | 100.0 | 1.00 | 100% | `DynMo` | - | - |" in section
    assert "each round's ideal: the candidate fastest in the other rounds" in section
    computed = harness.compare_runs(per_round, ["a"], ["DynMo"], ["b"], held_out=False)
    assert not computed.held_out
    assert "not chosen by measurement here" in harness.verdict(computed)[0][0]


def test_two_stage_splits_around_half() -> None:
    assert harness.two_stage_splits(8, 1) == ["0-2|3-7", "0-3|4-7", "0-4|5-7"]
    assert harness.two_stage_splits(8, 2, below=0) == ["0-3|4-7", "0-4|5-7", "0-5|6-7"]
    assert harness.two_stage_splits(4, 5) == ["0-0|1-3", "0-1|2-3", "0-2|3-3"]  # one block a stage at least


def test_the_header_names_the_command_the_hardware_and_the_kind_of_figures() -> None:
    text = harness.header(
        "Title", "freezing", ["--quick", "--spread", "0"], [harness.REAL, harness.PROJECTED]
    )
    assert text.startswith("## Title (")
    assert "Command: `python -m benchmarks.freezing --quick --spread 0`" in text
    assert "Hardware: " in text and "CPU cores" in text and "load average at start" in text
    assert "Figures: **real compute**, **projected**." in text
    with pytest.raises(ValueError, match=r"each must be one of \('real compute', 'emulated', 'projected'\)"):
        harness.header("Title", "freezing", [], ["measured"])


def test_the_shared_options_parse_and_an_unknown_one_is_refused() -> None:
    parser = harness.argument_parser("doc", "tiny", "rounds", "skip")
    args = parser.parse_args(["--quick", "--rounds", "3", "--force"])
    assert args.quick and args.rounds == 3 and args.skip is None and args.force and args.out is None
    with pytest.raises(ValueError, match=r"options \['laps'\] are not shared ones"):
        harness.argument_parser("doc", "tiny", "laps")


def test_after_move_compares_dynmo_with_the_placement_it_ended_at_in_the_same_round() -> None:
    fixed = {"static uniform": "0-1|2-3", "fixed 0-2|3-3": "0-2|3-3"}
    measuring = {f"{harness.MEASURING}{p}": p for p in fixed.values()}
    per_round = {
        "static uniform": [100.0, 110.0, 90.0],
        "fixed 0-2|3-3": [80.0, 90.0, 70.0],
        f"{harness.MEASURING}0-1|2-3": [101.0, 111.0, 91.0],
        f"{harness.MEASURING}0-2|3-3": [82.0, 92.0, 72.0],
        "DynMo": [84.0, 90.0, 95.0],  # round 3 ended elsewhere: left out
    }
    runs = {name: [{"placement": p} for _ in range(3)] for name, p in {**fixed, **measuring}.items()}
    runs["DynMo"] = [{"placement": "0-2|3-3"}, {"placement": "0-2|3-3"}, {"placement": "0-0|1-3"}]
    lines = harness.after_move_lines(runs, per_round, fixed, ["DynMo"])
    row = lines[-1]
    assert "2 of 3" in row and "1.050, 1.000" in row  # 84/80, 90/90: the round's own fixed run
    assert "| 1.025 |" in row and "1.024, 0.978" in row  # the median; 84/82 and 90/92
    # A DynMo run that never ends at a fixed split is said to, not compared with anything.
    runs["DynMo"] = [{"placement": "0-0|1-3"}] * 3
    assert "none (ended at `0-0|1-3`" in harness.after_move_lines(runs, per_round, fixed, ["DynMo"])[-1]


def _sleep_past(seconds: float) -> dict[str, Any]:
    time.sleep(seconds)
    return {"slept": seconds}


def test_a_job_past_its_timeout_is_stopped_run_again_once_then_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert launch(_sleep_past, 0.1, nproc=1, start_method="fork", timeout_s=60) == {"slept": 0.1}
    started = time.perf_counter()
    with pytest.raises(TimeoutError, match=r"ran past 2 s; its ranks were stopped"):
        launch(_sleep_past, 600.0, nproc=1, start_method="fork", timeout_s=2)
    assert time.perf_counter() - started < 120  # two tries of 2 s and the launcher's shutdown, not 600 s
    assert "a 1-rank job ran past 2 s: stopped, running it again" in capsys.readouterr().err


def test_a_deadline_needs_the_main_thread() -> None:
    import threading

    caught: list[BaseException] = []

    def call() -> None:
        try:
            launch(_sleep_past, 0.1, nproc=1, start_method="fork", timeout_s=60)
        except RuntimeError as err:
            caught.append(err)

    thread = threading.Thread(target=call)
    thread.start()
    thread.join(timeout=60)
    assert len(caught) == 1
    with pytest.raises(RuntimeError, match=r"launch\(timeout_s=\.\.\.\) must be called from the main thread"):
        raise caught[0]


def _store_address(_: Any) -> dict[str, Any]:
    import os

    return {"master_addr": os.environ.get("MASTER_ADDR")}


def test_a_forked_rank_reaches_the_store_by_address_not_by_name() -> None:
    # The elastic agent names the store's host "localhost"; a forked rank resolving it can deadlock in
    # glibc's resolver (a lock held by another thread of the agent at the fork). The rank gets 127.0.0.1.
    assert launch(_store_address, None, nproc=1, start_method="fork") == {"master_addr": "127.0.0.1"}
