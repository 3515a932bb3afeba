"""The policy counts what real models and clusters cost: first/last-stage parts, slow workers, links."""

from __future__ import annotations

import pytest

from lightning_dynmo.balancing import BalanceProblem, LayerCost, Placement, simulate_pipeline
from lightning_dynmo.balancing.diffusion import diffuse
from lightning_dynmo.balancing.partition import partition
from lightning_dynmo.balancing.policy import BalanceConfig, Hardware, decide, predict

BLOCKS = [LayerCost(fwd_time_s=1.0, bwd_time_s=2.0, memory_bytes=10) for _ in range(8)]
UNIFORM = Placement.from_string("0-3|4-7")
# A large-vocabulary head and its loss: about 2.5 blocks of work (Llama-3's is ~2.4), 25 bytes.
HEAD = LayerCost(fwd_time_s=2.5, bwd_time_s=5.0, memory_bytes=25)
EMBEDDING = LayerCost(fwd_time_s=0.1, bwd_time_s=0.2, memory_bytes=5)
WITH_PARTS = Hardware(first_stage_extra=EMBEDDING, last_stage_extra=HEAD)


def test_the_predicted_step_includes_the_first_and_last_parts():
    step, bubble, imbalance = predict(BalanceProblem(BLOCKS, hardware=WITH_PARTS), UNIFORM, 4, "1F1B")
    # Per micro-batch: stage 0 runs 4 blocks + the embedding, stage 1 4 blocks + the head and loss.
    expected = simulate_pipeline([4.1 / 4, 6.5 / 4], [8.2 / 4, 13.0 / 4], 4, "1f1b")
    assert (step, bubble) == pytest.approx((expected.step_time_s, expected.bubble_ratio))
    assert imbalance == pytest.approx((19.5 - 12.3) / ((19.5 + 12.3) / 2))
    blocks_only = predict(BalanceProblem(BLOCKS), UNIFORM, 4, "1F1B")
    assert blocks_only[0] < step and blocks_only[2] == 0.0  # blind to the head, it sees perfect balance


def test_the_partition_policy_moves_blocks_off_the_stage_with_the_head():
    blind = decide(BalanceProblem(BLOCKS), UNIFORM, BalanceConfig(), 4, "1F1B")
    assert not blind.apply and blind.proposed == UNIFORM  # today's answer: 4 | 4 is the block optimum
    aware = decide(BalanceProblem(BLOCKS, hardware=WITH_PARTS), UNIFORM, BalanceConfig(), 4, "1F1B")
    assert aware.apply
    assert aware.proposed == partition(
        BalanceProblem(BLOCKS, hardware=Hardware(first_stage_extra=EMBEDDING, last_stage_extra=HEAD)), 2
    )
    assert aware.proposed.sizes == (5, 3)  # 5 + 0.1 | 3 + 2.5 blocks of work
    assert aware.predicted_step_before == pytest.approx(
        predict(BalanceProblem(BLOCKS, hardware=WITH_PARTS), UNIFORM, 4, "1F1B")[0]
    )
    assert aware.predicted_step_after < aware.predicted_step_before


def test_the_diffusion_policy_counts_the_parts_too():
    config = BalanceConfig(balancer="diffusion")
    aware = decide(config.problem(BLOCKS, WITH_PARTS), UNIFORM, config, 4, "1F1B")
    expected = diffuse(
        BalanceProblem(BLOCKS, hardware=Hardware(first_stage_extra=EMBEDDING, last_stage_extra=HEAD)), UNIFORM
    ).placement
    assert aware.proposed == expected and expected.sizes == (5, 3)


def test_the_worker_policy_puts_the_parts_on_their_workers():
    # V layout: stages 0 and 3 (embedding and head) both on worker 0.
    current = Placement.from_string("0-1|2-3|4-5|6-7")
    aware = decide(
        BalanceProblem(BLOCKS, hardware=WITH_PARTS),
        current,
        BalanceConfig(),
        4,
        "ZBVZeroBubble",
        stage_workers=[0, 1, 1, 0],
    )
    assert aware.apply
    # Worker 0 carries the parts (2.6 blocks of work): it keeps fewer blocks than worker 1.
    worker0 = len(aware.proposed.layers_of(0)) + len(aware.proposed.layers_of(3))
    assert worker0 < 4
    assert aware.predicted_step_before == pytest.approx(3 * (4 + 2.6))


def test_the_memory_caps_include_the_first_and_last_parts():
    # Blocks take 10 bytes, the embedding 5 and the head 25: caps that the block-only view meets with
    # room to spare bind once the parts are counted, and may leave no split at all.
    config = BalanceConfig(memory_capacity_bytes=60)
    blind = decide(config.problem(BLOCKS), UNIFORM, config, 4, "1F1B")
    assert blind.proposed == UNIFORM
    aware = decide(config.problem(BLOCKS, WITH_PARTS), UNIFORM, config, 4, "1F1B")
    assert aware.proposed.sizes == (5, 3)  # 55 and 55 bytes: the time optimum fits exactly
    tight = BalanceConfig(memory_capacity_bytes=[70, 50])
    assert decide(tight.problem(BLOCKS), UNIFORM, tight, 4, "1F1B").proposed == UNIFORM
    capped = decide(tight.problem(BLOCKS, WITH_PARTS), UNIFORM, tight, 4, "1F1B")
    assert capped.proposed.sizes == (6, 2)  # the head's bytes leave 2 blocks on stage 1 (45 <= 50)
    none_fits = BalanceConfig(memory_capacity_bytes=[65, 40])  # 6 + 1 blocks at most
    assert decide(none_fits.problem(BLOCKS), UNIFORM, none_fits, 4, "1F1B").proposed == UNIFORM
    with pytest.raises(ValueError, match=r"overflows stage 1 by 5 bytes \(needs 45, has 40\)"):
        decide(none_fits.problem(BLOCKS, WITH_PARTS), UNIFORM, none_fits, 4, "1F1B")


def test_a_repack_keeps_room_for_the_head():
    config = BalanceConfig(repack=True, target_num_stages=2, memory_capacity_bytes=1e9, max_slowdown=10.0)
    current = Placement.from_string("0-1|2-3|4-5|6-7")
    blind = decide(config.problem(BLOCKS), current, config, 4, "1F1B")
    aware = decide(config.problem(BLOCKS, WITH_PARTS), current, config, 4, "1F1B")
    assert blind.proposed.sizes == (4, 4)
    assert aware.proposed.sizes == (5, 3)


def test_a_slow_worker_gets_fewer_blocks_and_the_prediction_knows_it():
    slow = Hardware(worker_slowdown=[1.0, 3.0])
    decision = decide(BalanceProblem(BLOCKS, hardware=slow), UNIFORM, BalanceConfig(), 4, "1F1B")
    assert decision.apply
    assert decision.proposed.sizes == (6, 2)  # 6 blocks | 2 blocks 3 times slower: 18 | 18
    before = simulate_pipeline([1.0, 3.0], [2.0, 6.0], 4, "1f1b").step_time_s
    assert decision.predicted_step_before == pytest.approx(before)
    assert decision.predicted_step_after < before


def test_a_slow_link_is_paid_by_its_sender():
    links = Hardware(comm_time_s=[[2.0] * 8])  # one link, 2 s per micro-batch's activation
    decision = decide(BalanceProblem(BLOCKS, hardware=links), UNIFORM, BalanceConfig(), 4, "1F1B")
    # Per step the sender is busy 4 x 2 s: 3 | 5 blocks -> (9 + 8, 15) beats 4 | 4 -> (12 + 8, 12).
    assert decision.proposed.sizes == (3, 5)
    assert decision.proposed == partition(
        BalanceProblem(BLOCKS, hardware=Hardware(comm_time_s=[[8.0] * 8])), 2
    )
    step = predict(BalanceProblem(BLOCKS, hardware=links), UNIFORM, 4, "1F1B")[0]
    # The sender is busy while it sends: its forward op takes 1 + 2 s per micro-batch.
    assert step == pytest.approx(simulate_pipeline([3.0, 1.0], [2.0, 2.0], 4, "1f1b").step_time_s)


@pytest.mark.parametrize(
    ("hardware", "match"),
    [
        (
            {"worker_slowdown": [1.0]},
            r"worker_slowdown has 1 entries but the pipeline has workers up to 1",
        ),
        ({"worker_slowdown": [1.0, 0.0]}, r"worker_slowdown\[1\]=0.0 must be a finite number > 0"),
        ({"comm_time_s": [[1.0] * 8, [1.0] * 8]}, r"comm_time_s has 2 rows but 2 stages have 1 links"),
    ],
)
def test_bad_hardware_is_rejected(hardware, match):
    # Hardware checks what it can alone when it is built; decide checks it against the pipeline.
    with pytest.raises(ValueError, match=match):
        decide(BalanceProblem(BLOCKS, hardware=Hardware(**hardware)), UNIFORM, BalanceConfig(), 4, "1F1B")
