"""DynMoCallback without a pipeline: argument checks, defaults, state round trip, wrong strategy."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.callback import AutoConfig, DecisionRecord, DynMoCallback, ProfilingConfig, RepackConfig
from lightning_dynmo.callback.config import MOVED_KEYWORDS
from lightning_dynmo.events import DynamismEvent, EventBus


def test_defaults_listen_to_events_and_partition_by_time():
    callback = DynMoCallback()
    assert callback.balance.balancer == "partition" and callback.balance.cost == "time"
    assert callback.triggers.on_events and not callback.triggers.auto


def test_static_defaults_to_no_triggers():
    callback = DynMoCallback(balancer="static")
    assert not callback.triggers.any_trigger


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"balancer": "greedy"}, r"balancer='greedy' is not a balancer"),
        ({"cost": "flops"}, r"cost='flops' is not a cost view"),
        ({"every_n_steps": 0}, r"every_n_steps=0 must be an integer >= 1"),
        ({"balancer": "static", "every_n_steps": 10}, r"balancer='static' never rebalances"),
        ({"balancer": "static", "on_events": True}, r"triggers are enabled: on_events=True"),
        ({"every_step": True, "auto": True}, r"every_step=True and auto=True contradict"),
        ({"repack": True, "balancer": "static"}, r"repack=True with balancer='static' contradict"),
        ({"repack": RepackConfig(), "balancer": "static"}, r"repack=True with balancer='static' contradict"),
        ({"every_step": True, "auto": AutoConfig()}, r"every_step=True and auto=True contradict"),
        ({"skip_balanced": "yes"}, r"skip_balanced='yes' must be True or False"),
        ({"auto": "yes"}, r"auto='yes' must be True, False or AutoConfig\(\.\.\.\)"),
        ({"repack": 1.0}, r"repack=1.0 must be True, False or RepackConfig\(\.\.\.\)"),
    ],
)
def test_bad_options_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynMoCallback(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"steps": 0}, r"ProfilingConfig\(steps=0\) must be an integer >= 1"),
        ({"warmup_steps": -1}, r"ProfilingConfig\(warmup_steps=-1\) must be an integer >= 0"),
    ],
)
def test_bad_profiling_options_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ProfilingConfig(**kwargs)


@pytest.mark.parametrize(
    ("keyword", "match"),
    [
        (
            "profile_warmup_steps",
            r"profile_warmup_steps moved to DynMoCallback\(profiling=ProfilingConfig\(warmup_steps=",
        ),
        ("profile_steps", r"profile_steps moved to DynMoCallback\(profiling=ProfilingConfig\(steps="),
        (
            "cost_smoothing",
            r"cost_smoothing moved to DynMoCallback\(profiling=ProfilingConfig\(cost_smoothing=",
        ),
        ("measure_comm", r"measure_comm moved to DynMoCallback\(profiling=ProfilingConfig\(measure_comm="),
        ("measure_speed", r"measure_speed moved to DynMoCallback\(profiling=ProfilingConfig\(measure_speed="),
        ("speed_probe", r"speed_probe moved to DynMoCallback\(profiling=ProfilingConfig\(speed_probe="),
        ("auto_threshold", r"auto_threshold moved to DynMoCallback\(auto=AutoConfig\(threshold="),
        (
            "auto_patience_steps",
            r"auto_patience_steps moved to DynMoCallback\(auto=AutoConfig\(patience_steps=",
        ),
        ("auto_horizon_steps", r"auto_horizon_steps moved to DynMoCallback\(auto=AutoConfig\(horizon_steps="),
        (
            "auto_cooldown_steps",
            r"auto_cooldown_steps moved to DynMoCallback\(auto=AutoConfig\(cooldown_steps=",
        ),
        (
            "rebalance_cost_prior_s",
            r"rebalance_cost_prior_s moved to DynMoCallback\(auto=AutoConfig\(rebalance_cost_prior_s=",
        ),
        (
            "target_num_stages",
            r"target_num_stages moved to DynMoCallback\(repack=RepackConfig\(target_num_stages=",
        ),
        ("max_slowdown", r"max_slowdown moved to DynMoCallback\(repack=RepackConfig\(max_slowdown="),
        (
            "retune_microbatches",
            r"retune_microbatches moved to DynMoCallback\(repack=RepackConfig\(retune_microbatches=",
        ),
    ],
)
def test_an_old_keyword_fails_naming_its_new_place(keyword, match):
    with pytest.raises(TypeError, match=match):
        DynMoCallback(**{keyword: 1})


def test_every_moved_keyword_is_tested():
    tested = {p[0] for p in test_an_old_keyword_fails_naming_its_new_place.pytestmark[0].args[1]}
    assert tested == set(MOVED_KEYWORDS)


def test_the_grouped_knobs_reach_the_policy():
    callback = DynMoCallback(
        auto=AutoConfig(
            threshold=0.2, patience_steps=3, horizon_steps=40, cooldown_steps=7, rebalance_cost_prior_s=0.5
        ),
        repack=RepackConfig(target_num_stages=1, max_slowdown=0.5, retune_microbatches=True),
        profiling=ProfilingConfig(warmup_steps=2, steps=4, cost_smoothing=0.5, measure_comm=False),
    )
    t, b = callback.triggers, callback.balance
    assert t.auto == AutoConfig(
        threshold=0.2, patience_steps=3, horizon_steps=40, cooldown_steps=7, rebalance_cost_prior_s=0.5
    )
    assert (b.repack, b.target_num_stages, b.max_slowdown, callback.retune_microbatches) == (
        True,
        1,
        0.5,
        True,
    )
    assert callback.profiling == ProfilingConfig(
        warmup_steps=2, steps=4, cost_smoothing=0.5, measure_comm=False
    )
    off = DynMoCallback(auto=False, repack=False)
    assert off.triggers.auto is None and not off.balance.repack and not off.retune_microbatches
    assert DynMoCallback(auto=True).triggers.auto == AutoConfig()


def test_repack_target_larger_than_the_pipeline_is_rejected_when_training_starts():
    callback = DynMoCallback(repack=RepackConfig(target_num_stages=4), memory_capacity_bytes=1e9)
    with pytest.raises(
        ValueError, match=r"target_num_stages=4 is larger than the current pipeline \(2 stages\)"
    ):
        callback.balance.check_pipeline(2)


def test_wrong_strategy_is_a_type_error():
    trainer = SimpleNamespace(strategy=object())
    with pytest.raises(TypeError, match=r"DynMoCallback drives a DynMoStrategy, but the Trainer uses object"):
        DynMoCallback().setup(trainer, None, "fit")  # type: ignore[arg-type]


def test_state_dict_round_trip_keeps_placement_history_and_trigger():
    callback = DynMoCallback(every_n_steps=5)
    callback.placement = Placement.from_string("0-5|6-7")
    callback._history.add_events([DynamismEvent("pruned", (0, 1), 2, "emulated")])
    callback._history.add(_record(step=6, old="0-3|4-7", new="0-5|6-7", applied=True, migration_s=0.25))
    callback._trigger.record_rebalance(6, extra_cost_s=0.25)
    restored = DynMoCallback(every_n_steps=5)
    restored.load_state_dict(callback.state_dict())
    assert restored.state_dict() == callback.state_dict()
    assert restored.placement == Placement.from_string("0-5|6-7")
    assert restored.rebalances == callback.rebalances and restored.overhead_s == 0.25
    assert restored._restored_placement == "0-5|6-7"  # applied to the strategy when training starts
    assert restored._trigger.history == callback._trigger.history


def test_events_are_collected_from_the_injected_bus_until_teardown():
    bus = EventBus()
    callback = DynMoCallback(event_bus=bus)
    from lightning_dynmo.strategy.dynmo_strategy import DynMoStrategy

    trainer = SimpleNamespace(strategy=DynMoStrategy())
    callback.setup(trainer, None, "fit")  # type: ignore[arg-type]
    bus.publish(DynamismEvent("frozen", (0,)))
    assert callback._inbox.events == [DynamismEvent("frozen", (0,))]
    callback.teardown(trainer, None, "fit")  # type: ignore[arg-type]
    assert bus.num_subscribers == 0


def _fake_trainer(world_size: int, replicas: int) -> SimpleNamespace:
    import torch
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.trainer.states import RunningStage

    return SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device("cpu"), data_parallel_size=replicas),
        world_size=world_size,
        precision_plugin=Precision(),
        enable_validation=False,
        state=SimpleNamespace(stage=RunningStage.TRAINING),
    )


def test_throughput_counts_pipeline_replicas_not_processes():
    from lightning.pytorch.callbacks import ThroughputMonitor

    from lightning_dynmo.throughput import PipelineThroughputMonitor

    # 4 processes = 2 data-parallel replicas of a 2-stage pipeline: samples are seen by 2 processes each.
    plain, ours = ThroughputMonitor(batch_size_fn=len), PipelineThroughputMonitor(batch_size_fn=len)
    for monitor in (plain, ours):
        monitor.setup(_fake_trainer(world_size=4, replicas=2), None, "fit")  # type: ignore[arg-type]
    assert [t.world_size for t in plain._throughputs.values()] == [4]  # overcounts by the pipeline depth
    assert [t.world_size for t in ours._throughputs.values()] == [2]


def _record(**fields: object) -> DecisionRecord:
    base: dict[str, object] = {
        "step": 0,
        "reason": "event",
        "old": "0-3|4-7",
        "new": "0-3|4-7",
        "applied": False,
        "why": "",
        "predicted_gain": 0.0,
        "num_microbatches": 4,
        "profiling_s": 0.0,
        "decision_s": 0.0,
        "migration_s": 0.0,
    }
    return DecisionRecord(**{**base, **fields})  # type: ignore[arg-type]


def test_a_checkpoint_of_flat_dicts_loads_into_records():
    # The checkpoint format of earlier versions, without num_microbatches (recorded since the re-tune)
    # and per_op_s (since predictions pay the runtime's cost per action).
    old = {"step": 6, "reason": "event", "old": "0-3|4-7", "new": "0-5|6-7", "applied": True, "why": "x"}
    old |= {
        "predicted_gain": 0.1,
        "measured_gain": None,
        "profiling_s": 0.1,
        "decision_s": 0.2,
        "migration_s": 0.3,
    }
    state = {"placement": "0-5|6-7", "events": [], "rebalances": [old], "overhead_s": 0.6}
    state["trigger"] = DynMoCallback().state_dict()["trigger"]
    callback = DynMoCallback()
    callback.load_state_dict(state)
    (record,) = callback.rebalances
    assert record == _record(**{**old, "num_microbatches": None, "per_op_s": 0.0})
    assert callback.state_dict()["rebalances"] == [{**old, "num_microbatches": None, "per_op_s": 0.0}]


def test_a_migration_must_pay_back_over_the_placements_expected_life():
    applied = [
        _record(step=10, applied=True, migration_s=0.1),
        _record(step=5, applied=False, migration_s=0),
    ]
    every_step = DynMoCallback(every_step=True)
    assert every_step._min_saving(11) == 0.0  # no migration measured yet
    every_step._history.rebalances = applied
    assert every_step._min_saving(11) == pytest.approx(0.1)  # just moved: the bar is the whole cost
    assert every_step._min_saving(20) == pytest.approx(0.01)  # a placement that lasted falls to noise
    periodic = DynMoCallback(every_n_steps=50)
    periodic._history.rebalances = applied
    assert periodic._min_saving(11) == pytest.approx(0.1 / 50)
    by_params = DynMoCallback(cost="params", every_step=True)
    by_params._history.rebalances = applied
    assert by_params._min_saving(11) == 0.0  # parameter counts are not seconds


def test_every_step_windows_reuse_recent_activation_sizes_only():
    from lightning_dynmo.callback.window import ACTIVATION_REFRESH_STEPS

    callback = DynMoCallback(every_step=True)
    callback._window.activations = {0: (10, 2, 50), 1: (20, 4, 50 - ACTIVATION_REFRESH_STEPS)}
    local = {0: object(), 1: object(), 2: object()}
    # Layer 0 was metered recently on this rank; layer 1 too long ago; layer 2 never (it just arrived).
    assert callback._window.known_activations(local, 50 + 10, "every_step") == {0: (10, 2)}
    # Any other window meters every layer.
    for reason in ("event", "every_n_steps", "auto"):
        assert callback._window.known_activations(local, 60, reason) == {}


def test_resume_restores_a_placement_only_on_the_pipeline_it_was_for():
    from lightning_dynmo.balancing.policy import pipeline_layout, resume_plan

    two = pipeline_layout("1F1B", 2, 2)
    assert resume_plan("0-3|4-7", two, two, "partition") == "restore"
    assert resume_plan("0-3|4-7", two, pipeline_layout("1F1B", 1, 1), "partition") == "repartition"
    assert resume_plan("0-3|4-7", two, pipeline_layout("ZBVZeroBubble", 2, 4), "diffusion") == "repartition"
    assert resume_plan("0-7", pipeline_layout("1F1B", 1, 1), two, "partition") == "repartition"
    assert resume_plan("0-3|4-7", two, pipeline_layout("1F1B", 1, 1), "static") == "keep"
    assert resume_plan(None, None, two, "partition") == "keep"
    # Checkpoints from before layouts were saved: the stage count decides.
    assert resume_plan("0-3|4-7", None, two, "partition") == "restore"
    assert resume_plan("0-7", None, two, "partition") == "repartition"
