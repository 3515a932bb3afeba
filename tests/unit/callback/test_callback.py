"""DynMoCallback without a pipeline: argument checks, defaults, state round trip, wrong strategy."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lightning_dynmo.callback import DynMoCallback
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
        ({"target_num_stages": 2}, r"target_num_stages=2 is only used when re-packing"),
        ({"balancer": "static", "every_n_steps": 10}, r"balancer='static' never rebalances"),
        ({"balancer": "static", "on_events": True}, r"triggers are enabled: on_events=True"),
        ({"every_step": True, "auto": True}, r"every_step=True and auto=True contradict"),
        ({"repack": True, "balancer": "static"}, r"repack=True with balancer='static' contradict"),
        ({"profile_steps": 0}, r"profile_steps=0 must be an integer >= 1"),
        ({"profile_warmup_steps": -1}, r"profile_warmup_steps=-1 must be an integer >= 0"),
        ({"skip_balanced": "yes"}, r"skip_balanced='yes' must be True or False"),
    ],
)
def test_bad_options_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynMoCallback(**kwargs)


def test_repack_target_larger_than_the_pipeline_is_rejected_when_training_starts():
    callback = DynMoCallback(repack=True, target_num_stages=4, memory_capacity_bytes=1e9)
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
    callback.placement = "0-5|6-7"
    callback.events = [DynamismEvent("pruned", (0, 1), 2, "emulated")]
    callback.rebalances = [{"step": 6, "old": "0-3|4-7", "new": "0-5|6-7", "applied": True}]
    callback.overhead_s = 0.25
    callback._trigger.record_rebalance(6, extra_cost_s=0.25)
    restored = DynMoCallback(every_n_steps=5)
    restored.load_state_dict(callback.state_dict())
    assert restored.state_dict() == callback.state_dict()
    assert restored.placement == "0-5|6-7"
    assert restored._restored_placement == "0-5|6-7"  # applied to the strategy when training starts
    assert restored._trigger.history == callback._trigger.history


def test_events_are_collected_from_the_injected_bus_until_teardown():
    bus = EventBus()
    callback = DynMoCallback(event_bus=bus)
    from lightning_dynmo.strategy.dynmo_strategy import DynMoStrategy

    trainer = SimpleNamespace(strategy=DynMoStrategy())
    callback.setup(trainer, None, "fit")  # type: ignore[arg-type]
    bus.publish(DynamismEvent("frozen", (0,)))
    assert callback._new_events == [DynamismEvent("frozen", (0,))]
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


def test_a_migration_must_pay_back_over_the_placements_expected_life():
    applied = [
        {"step": 10, "applied": True, "migration_s": 0.1},
        {"step": 5, "applied": False, "migration_s": 0},
    ]
    every_step = DynMoCallback(every_step=True)
    assert every_step._min_saving(11) == 0.0  # no migration measured yet
    every_step.rebalances = applied
    assert every_step._min_saving(11) == pytest.approx(0.1)  # just moved: the bar is the whole cost
    assert every_step._min_saving(20) == pytest.approx(0.01)  # a placement that lasted falls to noise
    periodic = DynMoCallback(every_n_steps=50)
    periodic.rebalances = applied
    assert periodic._min_saving(11) == pytest.approx(0.1 / 50)
    by_params = DynMoCallback(cost="params", every_step=True)
    by_params.rebalances = applied
    assert by_params._min_saving(11) == 0.0  # parameter counts are not seconds


def test_every_step_windows_reuse_recent_activation_sizes_only():
    from lightning_dynmo.callback.dynmo_callback import ACTIVATION_REFRESH_STEPS

    callback = DynMoCallback(every_step=True)
    callback._activations = {0: (10, 2, 50), 1: (20, 4, 50 - ACTIVATION_REFRESH_STEPS)}
    local = {0: object(), 1: object(), 2: object()}
    # Layer 0 was metered recently on this rank; layer 1 too long ago; layer 2 never (it just arrived).
    assert callback._known_activations(local, 50 + 10, "every_step") == {0: (10, 2)}
    # Any other window meters every layer.
    for reason in ("event", "every_n_steps", "auto"):
        assert callback._known_activations(local, 60, reason) == {}


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
