"""The layer timer reads an FSDP2-sharded unit's backward and weight-gradient time as an unsharded copy's.

Under FSDP2 a unit's parameters are DTensor shards outside its forward and backward; in between, FSDP2
swaps in gathered parameters, and autograd gives the gradients to those. The timer ends a backward whose
input needs no gradient, and splits a zero-bubble weight pass, at parameter-gradient hooks, so it must
hook the gathered parameters (its forward hook does, once per step).

Two gloo ranks shard a stack of two units, each sleeping ``BWD_MS`` in backward (an emulated cost), and
run a stage's backward the ways a pipeline schedule does (as ``PipelineStage`` runs an FSDP stage: no
gradient sync, no re-shard after backward): unsplit with an input that needs no gradient (1F1B's first
stage), the same inside a weight pass (a zero-bubble schedule's first stage), and split into an input
pass and a later weight pass (its other stages). Units are sharded keeping their gathered parameters from
forward to backward (the default) or re-sharding after forward (gathered again for backward, into the
same parameter objects; unsplit backward only). Every unit must read at least its sleep, sharded as
unsharded. The control: with the forward hook's registration switched off (the former behaviour, hooks
only on the shards), the same sharded run reads 0 where the time comes from parameter gradients, and the
hooks put on the shards never fire.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.distributed.tensor import DTensor

from lightning_dynmo.pipeline.model.unit_state import user_hooks
from lightning_dynmo.pipeline.sharding import shard_unit
from lightning_dynmo.pipeline.sharding.apply import shard_stage
from lightning_dynmo.profiling.clock import StepClock
from lightning_dynmo.profiling.layer_timer import LayerTimer
from tests.distributed.harness import run_distributed
from tests.unit.profiling.models import Block, Stack

pytestmark = pytest.mark.distributed

BWD_MS = 40.0
STEPS = 2


def _run(sharding: str, backward: str, control: bool = False) -> dict[str, Any]:
    split = backward == "split"
    sharded = sharding != "none"
    torch.manual_seed(0)
    model = Stack({i: Block(bwd_ms=BWD_MS) for i in range(2)})
    if sharded:
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        for unit in model.layers.values():
            shard_unit(unit, mesh, reshard_after_forward=sharding == "resharded")
        shard_stage(model, mesh)
        model.set_is_last_backward(False)  # type: ignore[operator]  # as PipelineStage runs an FSDP stage
        model.set_reshard_after_backward(False)  # type: ignore[operator]
        model.set_requires_gradient_sync(False)  # type: ignore[operator]
    units = dict(enumerate(model.layers.values()))
    shard_fires: list[int] = []
    if control:  # the former behaviour: parameter hooks only where attach() found the parameters
        for unit in units.values():
            for p in unit.parameters():
                p.register_hook(lambda grad: shard_fires.append(1))  # type: ignore[no-untyped-call]
    baseline = [_hooks(unit) for unit in units.values()]  # FSDP2's own forward hooks, if sharded
    timer = LayerTimer(units, StepClock("cpu"))
    if control:
        timer._hook_gathered_params = lambda *args: None  # type: ignore[method-assign]
    timer.attach()
    steps: list[dict[int, tuple[float, float]]] = []
    step_hooks: list[tuple[bool, list[int]]] = []
    after_step: list[tuple[bool, bool]] = []
    for _ in range(STEPS):
        timer.begin_step()
        x = torch.randn(4, 16, requires_grad=split)  # split: a later stage's input; else data
        loss = model(x).square().mean()
        if split:
            _, groups = stage_backward_input([loss], None, [x], model.parameters())
            with timer.weight_pass():
                stage_backward_weight(model.parameters(), groups)
        elif backward == "in_weight_pass":  # as zero-bubble schedules run a first stage's backward
            with timer.weight_pass():
                loss.backward()
        else:
            loss.backward()
        # The timer's hooks (on the gathered parameters, if sharded) are runtime hooks: migration may
        # leave them behind, whereas it refuses a user's.
        step_hooks.append((_param_hooks(units), [len(user_hooks(unit)) for unit in units.values()]))
        times = timer.end_step()
        steps.append({i: (t.bwd_time_s, t.bwd_weight_time_s) for i, t in times.items()})
        # The parameters the units hold now are the gathered ones (no re-shard after backward).
        params = [p for unit in units.values() for p in unit.parameters()]
        after_step.append((any(isinstance(p, DTensor) for p in params), _param_hooks(units)))
    timer.detach()
    return {
        "steps": steps,
        "step_hooks": step_hooks,
        "after_step": after_step,
        "baseline_user_hooks": [len(user_hooks(unit)) for unit in units.values()],
        "left_after_detach": [
            _hooks(unit) != before for unit, before in zip(units.values(), baseline, strict=True)
        ],
        "shard_fires": len(shard_fires),
    }


def _param_hooks(units: dict[int, nn.Module]) -> bool:
    return any(p._backward_hooks for unit in units.values() for p in unit.parameters())


def _hooks(unit: nn.Module) -> list[int]:
    """The ids of every hook on ``unit``'s modules and on the parameters it holds now."""
    found = []
    for m in unit.modules():
        for table in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks):
            found += [id(hook) for hook in table.values()]
    for p in unit.parameters():
        found += [id(hook) for hook in (p._backward_hooks or {}).values()]
    return sorted(found)


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    return {
        (sharding, backward, control): _run(sharding, backward, control)
        for sharding, backward, control in [
            ("none", "plain", False),
            ("none", "split", False),
            ("none", "in_weight_pass", False),
            ("kept", "plain", False),
            ("kept", "split", False),
            ("kept", "in_weight_pass", False),
            ("resharded", "plain", False),
            ("kept", "plain", True),
            ("kept", "split", True),
            ("kept", "in_weight_pass", True),
        ]
    }


def test_sharded_units_read_their_backward_and_weight_time(tmp_path: Any) -> None:
    bwd_s = BWD_MS / 1e3
    for result in run_distributed(_worker, 2, tmp_path, timeout_s=90):
        for sharding in ("none", "kept", "resharded"):
            sharded = sharding != "none"
            unsplit = result[(sharding, "plain", False)]
            # Split backward with re-sharding after forward is left out: torch's stage_backward_input
            # takes the stage's parameters after forward, i.e. the shards (the strategy keeps them gathered).
            split = result.get((sharding, "split", False), unsplit)
            whole = result.get((sharding, "in_weight_pass", False), unsplit)
            for step in unsplit["steps"]:
                # Unit 0's input is data: its backward ends at its last parameter gradient.
                for i, (bwd, weight) in step.items():
                    assert bwd_s <= bwd < 3 * bwd_s, (sharding, i, unsplit)
                    assert weight == 0.0
            for step in split["steps"] if split is not unsplit else []:
                for i, (bwd, weight) in step.items():
                    assert bwd_s <= bwd < 3 * bwd_s, (sharding, i, split)  # the sleep is in the input pass
                    assert 0.0 < weight < bwd_s, (sharding, i, split)  # each unit's weight gradients
            for step in whole["steps"] if whole is not unsplit else []:
                for i, (bwd, weight) in step.items():  # all of each unit's backward is weight-pass time
                    assert bwd_s <= weight == bwd < 3 * bwd_s, (sharding, i, whole)
            for run in (unsplit, split, whole):
                # In the step, parameters carry the timer's hooks, none of them a user hook; after the
                # step, the parameters the units hold (the gathered ones, if sharded) carry none; after
                # detach, the units carry exactly the hooks they had before attach.
                assert run["step_hooks"] == [(True, run["baseline_user_hooks"])] * STEPS, run
                if sharded:
                    assert run["baseline_user_hooks"] == [2, 2]  # FSDP2's forward pre-hook and hook
                    assert run["after_step"] == [(False, False)] * STEPS, run
                assert run["left_after_detach"] == [False, False], run
        # The control: hooks on the shards never fire, so parameter-gradient times read 0.
        unsplit = result[("kept", "plain", True)]
        split = result[("kept", "split", True)]
        whole = result[("kept", "in_weight_pass", True)]
        assert unsplit["shard_fires"] == split["shard_fires"] == whole["shard_fires"] == 0
        for step in unsplit["steps"]:
            assert step[0] == (0.0, 0.0), unsplit  # no input gradient, no parameter hook: no end
            assert step[1][0] >= bwd_s, unsplit  # its input gradient still ends it
        for step in split["steps"] + whole["steps"]:
            assert all(weight == 0.0 for _, weight in step.values()), (split, whole)
