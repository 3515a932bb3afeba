"""The calibration models' shared pieces (benchmarks/_lib/calibration.py): candidates, the parts line."""

from benchmarks._lib.calibration import candidates, parts_line


def test_candidates_are_every_2_stage_split_or_the_uniform_split_and_its_one_move_neighbours():
    assert candidates("1F1B", 4) == ["0-0|1-3", "0-1|2-3", "0-2|3-3"]
    zbv = candidates("ZBVZeroBubble", 8)
    assert zbv[0] == "0-1|2-3|4-5|6-7" and len(zbv) == 7 == len(set(zbv))  # 3 boundaries x 2 moves + 1
    assert "0-0|1-3|4-5|6-7" in zbv and "0-1|2-3|4-6|7-7" in zbv


def test_the_parts_line_says_the_head_and_the_embedding_in_median_blocks():
    from lightning_dynmo.balancing import Hardware, LayerCost

    costs = [LayerCost(fwd_time_s=1.0, bwd_time_s=2.0)] * 3 + [LayerCost(fwd_time_s=2.0, bwd_time_s=4.0)]
    hardware = Hardware(
        first_stage_extra=LayerCost(fwd_time_s=0.5, bwd_time_s=1.0),
        last_stage_extra=LayerCost(fwd_time_s=4.0, bwd_time_s=8.0),
    )
    line = parts_line([{"costs": costs, "hardware": hardware}])
    assert "head + loss = 4.00 blocks (per round 4.00-4.00), embedding = 0.50 blocks" in line  # block 3 s
    assert "run whole" not in line  # nothing measured whole: no ratio to report
    # Two rounds under a split-backward schedule: alike blocks (10 parameters) measured whole (bwd/fwd 1.5)
    # and split (2.0 and 2.5, their weight-gradient halves timed): 0.75 and 0.6.
    alike = [LayerCost(fwd_time_s=2.0, bwd_time_s=3.0, bwd_weight_time_s=3.0, num_params=10)]

    def split(bwd: float) -> LayerCost:
        return LayerCost(fwd_time_s=1.0, bwd_time_s=bwd, bwd_weight_time_s=bwd / 2, num_params=10)

    rounds = [{"costs": [*alike, split(b)], "hardware": hardware} for b in (2.0, 2.5)]
    assert "costs 0.68x its split one (per round 0.60-0.75)" in parts_line(rounds)
