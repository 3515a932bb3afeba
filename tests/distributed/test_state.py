"""gather_full_state / load_local_state: save at one placement, resume at another (or on one process).

The uninterrupted 2-rank run is the reference. Saving after 3 steps and resuming into a different
placement must continue bitwise identically; resuming into a single process (which computes the same
micro-batch gradients without a pipeline) must continue within 1e-12.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch

from lightning_dynmo.pipeline.checkpoint.state import (
    FULL_STATE_FORMAT,
    gather_full_state,
    load_local_state,
    local_full_state,
)
from tests.distributed import toy_model as tm
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed

NUM_LAYERS, SAVE_AT, STEPS = 4, 3, 6
STAGES_A = [["embed", "layers.0", "layers.1"], ["layers.2", "layers.3", "head"]]
STAGES_B = [["embed", "layers.0", "layers.1", "layers.2", "layers.3"], ["head"]]


def _save_and_continue(rank: int, world_size: int, dst: int) -> dict[str, Any]:
    """Uninterrupted run at placement A, gathering the full state on ``dst`` after SAVE_AT steps."""
    torch.set_default_dtype(torch.float64)
    units = tm.local_units(STAGES_A, rank, NUM_LAYERS, seed=0)
    optimizer = tm.make_optimizer(units)
    schedule = tm.make_schedule(units, stage_index=rank, num_stages=world_size)
    losses, full = [], None
    for step, batch in enumerate(tm.batches(STEPS)):
        if step == SAVE_AT:
            full = gather_full_state(units, [optimizer], dst=dst)
            saved_snapshot = tm.snapshot(units, [optimizer])
        losses.append(tm.pipeline_step(schedule, optimizer, batch))
    return {"full": full, "saved": saved_snapshot, "losses": losses, "final": tm.snapshot(units, [optimizer])}


def _resume(
    rank: int, world_size: int, full: Mapping[str, Any], stages: Sequence[Sequence[str]]
) -> dict[str, Any]:
    """Fresh model with a different seed (the load must overwrite everything), placement ``stages``."""
    torch.set_default_dtype(torch.float64)
    units = tm.local_units(stages, rank, NUM_LAYERS, seed=123)
    optimizer = tm.make_optimizer(units)
    load_local_state(full, units, [optimizer])
    loaded = tm.snapshot(units, [optimizer])
    schedule = tm.make_schedule(units, stage_index=rank, num_stages=world_size)
    losses = [tm.pipeline_step(schedule, optimizer, b) for b in tm.batches(STEPS)[SAVE_AT:]]
    return {"loaded": loaded, "losses": losses, "final": tm.snapshot(units, [optimizer])}


def _merge(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)
    return merged


def _flat(state: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    return {f"{fqn}:{key}": value for fqn, entry in state.items() for key, value in entry.items()}


def _without_grads(snapshot: Mapping[str, Any]) -> dict[str, Any]:
    """Checkpoints do not carry gradients (they are recomputed by the next step)."""
    return {k: v for k, v in snapshot.items() if not k.startswith("grad:")}


@pytest.fixture
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    return run_distributed(_save_and_continue, 2, tmp_path_factory.mktemp("save"), args=(1,))


def test_gathered_state_has_single_process_keys_and_fqn_optimizer_state(saved_run, float64):
    assert saved_run[0]["full"] is None
    full = saved_run[1]["full"]
    reference = tm.build_model(NUM_LAYERS)
    assert full["format"] == FULL_STATE_FORMAT
    assert sorted(full["model"]) == sorted(reference.state_dict())
    assert full["units"] == ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    (opt,) = full["optimizer"]
    trainable = {n for n, p in reference.named_parameters() if p.requires_grad}
    assert set(opt["state"]) == set(opt["param_group_of"]) == trainable
    assert opt["param_group_of"]["layers.2.fc1.weight"] == 0 and opt["param_group_of"]["head.out.bias"] == 1
    assert [g["lr"] for g in opt["param_groups"]] == [1e-2, 2e-2]
    assert all(t.device.type == "cpu" for t in full["model"].values() if isinstance(t, torch.Tensor))
    # The gathered values are exactly the live ones at the save point.
    saved = _merge([r["saved"] for r in saved_run])
    for fqn in trainable:
        assert torch.equal(full["model"][fqn], saved[f"param:{fqn}"])
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt["state"][fqn][key], saved[f"opt0:{fqn}:{key}"])
    assert full["model"]["layers.3._extra_state"]["calls"] == 2 * SAVE_AT  # two micro-batches per step


@pytest.mark.parametrize("stages", [STAGES_A, STAGES_B], ids=["same-placement", "other-placement"])
def test_resume_at_any_placement_continues_bitwise(saved_run, tmp_path, stages):
    full = saved_run[1]["full"]
    resumed = run_distributed(_resume, 2, tmp_path, args=(full, stages))

    tm.assert_same(
        _without_grads(_merge([r["loaded"] for r in resumed])),
        _without_grads(_merge([r["saved"] for r in saved_run])),
    )
    assert resumed[1]["losses"] == saved_run[1]["losses"][SAVE_AT:]
    tm.assert_same(_merge([r["final"] for r in resumed]), _merge([r["final"] for r in saved_run]))


def test_resume_on_one_process_reproduces_state_dict_and_training(saved_run, float64):
    full = saved_run[1]["full"]
    model = tm.build_model(NUM_LAYERS, seed=123)
    optimizer = tm.make_optimizer(model.units())
    load_local_state(full, model.units(), [optimizer])

    state = model.state_dict()
    assert sorted(state) == sorted(full["model"])
    for key, value in full["model"].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(state[key], value), key
        else:
            assert value.keys() == state[key].keys() and value["calls"] == state[key]["calls"]
            assert torch.equal(value["router_stats"], state[key]["router_stats"]), key
    loaded_opt = local_full_state(model.units(), [optimizer])["optimizer"][0]["state"]
    tm.assert_same(_flat(loaded_opt), _flat(full["optimizer"][0]["state"]))

    losses = [tm.reference_step(model, optimizer, b) for b in tm.batches(STEPS)[SAVE_AT:]]
    assert losses == pytest.approx(saved_run[1]["losses"][SAVE_AT:], abs=1e-12, rel=0)
    final = _merge([r["final"] for r in saved_run])
    for name, p in model.named_parameters():
        assert torch.allclose(p, final[f"param:{name}"], atol=1e-12, rtol=0), name


def test_checkpoint_survives_torch_save(saved_run, tmp_path, float64):
    full = saved_run[1]["full"]
    path = tmp_path / "full.pt"
    torch.save({"dynmo_full_state": full}, path)
    reloaded = torch.load(path, weights_only=True)["dynmo_full_state"]
    model = tm.build_model(NUM_LAYERS, seed=7)
    optimizer = tm.make_optimizer(model.units())
    load_local_state(reloaded, model.units(), [optimizer])
    assert torch.equal(model.layers["1"].fc2.bias, full["model"]["layers.1.fc2.bias"])
    assert model.layers["1"].calls == 2 * SAVE_AT and model.layers["1"].frozen is False


def _gather_to_missing_rank(rank: int, world_size: int) -> str:
    with pytest.raises(ValueError, match=r"dst=5 is not in the process group \(ranks \[0, 1\]\)"):
        gather_full_state({}, [], dst=5)
    return "raised"


def test_gather_to_a_rank_outside_the_group_is_rejected(tmp_path):
    assert run_distributed(_gather_to_missing_rank, 2, tmp_path) == ["raised", "raised"]
