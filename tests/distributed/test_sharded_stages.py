"""FSDP2 inside pipeline stages on real gloo groups: training equals one process, sharded units migrate.

Four ranks as 2 pipeline positions x 2 data-parallel shards (global rank = replica * 2 + position, as
:class:`~lightning_dynmo.pipeline.placement.layout.RankGrid` numbers them). Every unit is sharded with
``fully_shard`` over its position's data-parallel mesh, each stage's container is made the FSDP root the
schedule drives, and a run with migrations must give the losses, clip norms and weights of single-process
training on the whole batch, in float64:

- under ``Schedule1F1B``: a block moves forward, two move back between backward and optimizer step (so
  their gradients travel too), then a re-pack onto one stage;
- under ``ScheduleInterleavedZeroBubble`` (two stages per rank): two migrations.

Each rank must hold half of its position's parameters, gradients and Adam state in every phase. The
negative control forgets the optimizer state of every unit that arrives and must fail the comparison.

The comparison allows 1e-12: FSDP's reduce-scatter adds the two shards' gradients, which rounds
differently from a single process averaging the whole batch (measured differences are ~1e-16).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleavedZeroBubble
from torch.distributed.tensor import DTensor

from lightning_dynmo.balancing.moves import UnitMove
from lightning_dynmo.pipeline.placement.layout import RankGrid
from lightning_dynmo.pipeline.sharding import (
    ShardedBytes,
    clip_sharded_grad_norm_,
    load_sharded_units,
    local_bytes,
    migrate_sharded_units,
    save_sharded_units,
    shard_stage,
    shard_unit,
)
from lightning_dynmo.profiling.memory import static_memory
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed

WIDTH = 5  # odd: a weight's rows split 3 + 2 over two shards, so the uneven last shard is exercised
BLOCKS = 6
BATCH = 8
MICROBATCHES = 2
LR = 0.05
#: A phase: ``(pipeline positions used, blocks of each stage)``; stage ``v`` runs on ``v % positions``.
Phase = tuple[int, tuple[tuple[int, ...], ...]]
#: Each case trains two steps per phase and migrates between phases.
CASES: dict[str, tuple[Phase, ...]] = {
    # Schedule1F1B: a block moves forward, two move back, then a re-pack onto one stage (positions 1 and 3
    # hand everything to 0 and 2 and sit idle).
    "1f1b": (
        (2, ((0, 1, 2), (3, 4, 5))),
        (2, ((0, 1), (2, 3, 4, 5))),
        (2, ((0, 1, 2, 3), (4, 5))),
        (1, ((0, 1, 2, 3, 4, 5),)),
    ),
    # ScheduleInterleavedZeroBubble, two stages per rank (the weight gradients run apart from the input
    # gradients, so FSDP's reduce-scatter follows a split backward): every move crosses ranks.
    "interleaved_zb": (
        (2, ((0, 1), (2,), (3, 4), (5,))),
        (2, ((0,), (1, 2), (3,), (4, 5))),
        (2, ((0, 1), (2, 3), (4,), (5,))),
    ),
}
STEPS_PER_PHASE = 2
#: Into which phase the units move between backward and optimizer step (their gradients travel with them).
GRADS_MOVE_INTO = {"1f1b": 2}
#: The gradient clip norm of the training tests; most steps' gradients exceed it, some do not.
MAX_NORM = 2.0
TOLERANCE = {"rtol": 0.0, "atol": 1e-12}


class Block(nn.Module):
    """A residual tanh block with a buffer (FSDP2 leaves buffers unsharded; they must travel too)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH, dtype=torch.float64)
        self.register_buffer("gain", torch.full((WIDTH,), 1.0 + 0.1 * index, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x)) * self.gain


def _blocks() -> list[Block]:
    torch.manual_seed(0)
    return [Block(i) for i in range(BLOCKS)]


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64),
            torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64),
        )
        for _ in range(STEPS_PER_PHASE * max(len(c) for c in CASES.values()))
    ]


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _reference(steps: int, norms: list[float]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training clipped to ``MAX_NORM``; the norms before clipping go to ``norms``."""
    losses, weights, _ = _reference_with_state(steps, clip=True, norms=norms)
    return losses, weights


def _reference_with_state(
    steps: int, clip: bool = False, norms: list[float] | None = None
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Single-process losses, weights and Adam state (``<parameter>.<state key>``) after ``steps``."""
    model = nn.Sequential(*_blocks())
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    norms = [] if norms is None else norms
    losses = []
    for x, y in _batches()[:steps]:
        loss = _loss(model(x), y)
        loss.backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    weights = {f"layers.{k}": v.clone() for k, v in model.state_dict().items()}
    state = {
        f"layers.{name}.{key}": value.clone()
        for name, param in model.named_parameters()
        for key, value in opt.state[param].items()
    }
    return losses, weights, state


class Chain(nn.Module):
    """A stage: its sharded units in global order (made an FSDP root by ``shard_stage``, anew each phase)."""

    def __init__(self, units: dict[str, nn.Module]) -> None:
        super().__init__()
        self.units = nn.ModuleList(units[k] for k in sorted(units, key=lambda n: int(n.split(".")[1])))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.units:
            x = unit(x)
        return x


def _held(phase: Phase, position: int) -> tuple[int, ...]:
    """The blocks pipeline position ``position`` holds in ``phase``."""
    positions, stages = phase
    return tuple(b for v, blocks in enumerate(stages) if v % positions == position for b in blocks)


def _moves(grid: RankGrid, before: Phase, after: Phase) -> list[UnitMove]:
    def owner(phase: Phase) -> dict[int, int]:
        positions, stages = phase
        return {b: v % positions for v, blocks in enumerate(stages) for b in blocks}

    src, dst = owner(before), owner(after)
    return [
        UnitMove(f"layers.{b}", grid.global_rank(replica, src[b]), grid.global_rank(replica, dst[b]))
        for replica in range(grid.data_parallel_size)
        for b in range(BLOCKS)
        if src[b] != dst[b]
    ]


def _check_errors(
    units: dict[str, nn.Module], mesh: Any, dp_mesh: Any, grid: RankGrid, opt: torch.optim.Optimizer
) -> None:
    """Bad input fails on every rank with a message naming the rule (nothing hangs)."""
    with pytest.raises(ValueError, match=r"has 2 dimensions.*data-parallel slice"):
        shard_unit(Block(0), mesh)
    with pytest.raises(ValueError, match=r"max_norm=0 must be > 0"):
        clip_sharded_grad_norm_([], 0)
    with pytest.raises(ValueError, match="already sharded"):
        shard_unit(next(iter(units.values())), dp_mesh)
    with pytest.raises(ValueError, match="already an FSDP root; build a new container"):
        shard_stage(next(iter(units.values())), dp_mesh)
    with pytest.raises(ValueError, match=r"parameter 'units.0.lin.weight' is sharded over .* the stage over"):
        shard_stage(Chain(units), mesh["pp"])
    kwargs: dict[str, Any] = {
        "mesh": dp_mesh,
        "build_unit": Block,
        "data_parallel_rank": grid.data_parallel_rank,
    }
    with pytest.raises(ValueError, match="data-parallel index 0 but rank 3 has 1"):
        migrate_sharded_units([UnitMove("layers.1", 0, 3)], units, [opt], **kwargs)
    with pytest.raises(ValueError, match="src == dst"):
        migrate_sharded_units([UnitMove("layers.1", 0, 0)], units, [opt], **kwargs)
    # Ranks 0 and 2 (stage 0) hold layers.0 and layers.1 only: every rank fails, the senders naming the unit.
    rank = dist.get_rank()
    match = "must send unit 'layers.3'" if rank in (0, 2) else "2 rank\\(s\\) could not pack"
    with pytest.raises(ValueError, match=match):
        migrate_sharded_units(
            [UnitMove("layers.3", 0, 1), UnitMove("layers.3", 2, 3)], units, [opt], **kwargs
        )
    plain = {"layers.0": Block(0)} if rank in (0, 2) else units
    match = "is not sharded" if rank in (0, 2) else "2 rank\\(s\\) could not pack"
    with pytest.raises(TypeError if rank in (0, 2) else ValueError, match=match):
        migrate_sharded_units(
            [UnitMove("layers.0", 0, 1), UnitMove("layers.0", 2, 3)], plain, [opt], **kwargs
        )


def _stage_module(units: dict[str, nn.Module], blocks: tuple[int, ...], mesh: Any) -> nn.Module:
    chain = Chain({f"layers.{b}": units[f"layers.{b}"] for b in blocks})
    shard_stage(chain, mesh)
    return chain


def _worker(rank: int, world_size: int, case: str, forget_state: bool, check_errors: bool) -> dict[str, Any]:
    grid = RankGrid(world_size=world_size, pipeline_size=2)
    mesh = init_device_mesh("cpu", (grid.data_parallel_size, grid.pipeline_size), mesh_dim_names=("dp", "pp"))
    dp_mesh, pp_group = mesh["dp"], mesh["pp"].get_group()
    alone = {r: dist.new_group([r]) for r in range(world_size)}  # the one-stage pipelines after the re-pack
    position, replica = grid.pipeline_rank(rank), grid.data_parallel_rank(rank)
    assert dp_mesh.mesh.tolist() == list(grid.data_parallel_ranks(position))
    phases = CASES[case]
    blocks = _blocks()
    units: dict[str, nn.Module] = {f"layers.{b}": blocks[b] for b in _held(phases[0], position)}
    for unit in units.values():
        shard_unit(unit, dp_mesh)
    opt = torch.optim.Adam([p for u in units.values() for p in u.parameters()], lr=LR)
    if check_errors:
        _check_errors(units, mesh, dp_mesh, grid, opt)

    losses: list[float] = []
    norms: list[float] = []
    pending_step = False
    grads_moved: ShardedBytes | None = None
    held: list[dict[str, Any]] = []
    batches = iter(_batches())
    for phase, (ranks, stages) in enumerate(phases):
        if phase > 0:
            moves = _moves(grid, phases[phase - 1], phases[phase])
            received = migrate_sharded_units(
                moves,
                units,
                [opt],
                mesh=dp_mesh,
                build_unit=lambda name: Block(int(name.split(".")[1])).to("meta"),
                data_parallel_rank=grid.data_parallel_rank,
            )
            for move in moves:
                if move.src == rank:
                    del units[move.unit]
            units.update(received)
            if forget_state:  # the negative control
                for unit in received.values():
                    for p in unit.parameters():
                        opt.state.pop(p, None)
            if pending_step:  # the units moved with their gradients: the update runs at the new placement
                grads_moved = local_bytes(units.values(), [opt])
                params = [p for u in units.values() for p in u.parameters()]
                norms.append(float(clip_sharded_grad_norm_(params, MAX_NORM)))
                opt.step()
                opt.zero_grad()
                pending_step = False
        assert sorted(units, key=lambda n: int(n.split(".")[1])) == [
            f"layers.{b}" for b in _held((ranks, stages), position)
        ]
        mine = [v for v in range(len(stages)) if v % ranks == position]
        group = pp_group if ranks == grid.pipeline_size else alone[rank]
        pipes = [
            PipelineStage(
                _stage_module(units, stages[v], dp_mesh), v, len(stages), torch.device("cpu"), group=group
            )
            for v in mine
        ]
        schedule: Any = None
        if len(pipes) == 1:
            schedule = Schedule1F1B(pipes[0], n_microbatches=MICROBATCHES, loss_fn=_loss)
        elif pipes:
            schedule = ScheduleInterleavedZeroBubble(pipes, n_microbatches=MICROBATCHES, loss_fn=_loss)
        for step in range(STEPS_PER_PHASE):
            x, y = next(batches)
            x, y = x.chunk(grid.data_parallel_size)[replica], y.chunk(grid.data_parallel_size)[replica]
            out: list[torch.Tensor] = []
            first, last = 0 in mine, len(stages) - 1 in mine
            if first and last:
                schedule.step(x, target=y, losses=out)
            elif first:
                schedule.step(x)
            elif last:
                schedule.step(target=y, losses=out)
            if step == STEPS_PER_PHASE - 1:  # what this rank holds, gradients included
                got = local_bytes(units.values(), [opt])
                full = sum(p.numel() * p.element_size() for u in units.values() for p in u.parameters())
                bound = sum(
                    math.ceil(p.shape[0] / grid.data_parallel_size)
                    * math.prod(p.shape[1:])
                    * p.element_size()
                    for u in units.values()
                    for p in u.parameters()
                )
                tensors = sum(1 for u in units.values() for _ in u.parameters())
                profiled = [static_memory(u, opt) for u in units.values()]  # what the balancer's caps count
                buffers = sum(b.numel() * b.element_size() for u in units.values() for b in u.buffers())
                held.append(
                    {
                        "bytes": got,
                        "stage_full": full,
                        "bound": bound,
                        "tensors": tensors,
                        "profiled": tuple(map(sum, zip(*profiled, strict=True))) if profiled else (0, 0, 0),
                        "buffers": buffers,
                    }
                )
            if phase + 1 == GRADS_MOVE_INTO.get(case) and step == STEPS_PER_PHASE - 1:
                pending_step = True  # migrate between backward and optimizer step
            else:
                params = [p for u in units.values() for p in u.parameters()]
                norms.append(float(clip_sharded_grad_norm_(params, MAX_NORM)))
                opt.step()
                opt.zero_grad()
            loss = torch.tensor(
                sum(t.item() for t in out) / MICROBATCHES if out else 0.0, dtype=torch.float64
            )
            dist.all_reduce(loss)  # the last stage's shards' losses, each over its share of the batch
            losses.append(loss.item() / grid.data_parallel_size)
    assert all(isinstance(u, FSDPModule) for u in units.values())
    weights = {}
    for name, unit in units.items():
        for key, value in unit.state_dict().items():
            weights[f"{name}.{key}"] = (value.full_tensor() if isinstance(value, DTensor) else value).clone()
    return {
        "losses": losses,
        "weights": weights,
        "held": held,
        "position": position,
        "norms": norms,
        "grads_moved": grads_moved,
    }


def _train(tmp_path: Any, case: str, forget_state: bool, check_errors: bool = False) -> list[dict[str, Any]]:
    return run_distributed(_worker, 4, tmp_path, timeout_s=120, args=(case, forget_state, check_errors))


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_stages_train_and_migrate_like_one_process(tmp_path: Any, case: str) -> None:
    phases = CASES[case]
    steps = STEPS_PER_PHASE * len(phases)
    ref_norms: list[float] = []
    ref_losses, ref_weights = _reference(steps, ref_norms)
    assert min(ref_norms) < MAX_NORM < max(ref_norms)  # clipping acts on some steps and not on others
    results = _train(tmp_path, case, forget_state=False, check_errors=case == "1f1b")
    torch.testing.assert_close(results[0]["losses"], ref_losses, **TOLERANCE)
    for result in results:  # the clip norm over all shards and stages is the single process's, on every rank
        torch.testing.assert_close(result["norms"], ref_norms, **TOLERANCE)
    for result in results:  # every shard gathers its stage's weights; both replicas of a position agree
        for key, value in result["weights"].items():
            torch.testing.assert_close(value, ref_weights[key], **TOLERANCE, msg=key)
    assert set().union(*(r["weights"] for r in results)) == set(ref_weights)

    # Each rank holds 1/dp of what its position holds: the two shards add up to it, neither exceeds its
    # rounded-up half; gradients the same; Adam's two moments twice that plus a scalar step per parameter.
    for phase in range(len(phases)):
        for position in (0, 1):
            held = [r["held"][phase] for r in results if r["position"] == position]
            assert sum(h["bytes"].parameters for h in held) == held[0]["stage_full"]
            if not _held(phases[phase], position):
                assert all(h["bytes"] == ShardedBytes(0, 0, 0) for h in held)  # released by the re-pack
                continue
            for h in held:
                got = h["bytes"]
                assert 0 < got.parameters <= h["bound"] < h["stage_full"], (phase, position, h)
                assert got.gradients == got.parameters
                # The profiler's static memory (memory caps) counts the same shards (plus the buffers).
                assert h["profiled"] == (got.parameters + h["buffers"], got.parameters, got.optimizer_state)
                step_bytes = got.optimizer_state - 2 * got.parameters
                assert 0 < step_bytes <= 8 * h["tensors"], (phase, position, h)
    if case in GRADS_MOVE_INTO:  # right after a migration that carried gradients: all of them, sharded
        phase = GRADS_MOVE_INTO[case]
        for result in results:
            moved = result["grads_moved"]
            assert moved is not None
            assert moved.gradients == moved.parameters == result["held"][phase]["bytes"].parameters


def test_sharded_migration_negative_control(tmp_path: Any) -> None:
    """Forgetting the arrived units' Adam state must break the comparison (so it can fail)."""
    steps = STEPS_PER_PHASE * len(CASES["1f1b"])
    ref_losses, ref_weights = _reference(steps, [])
    results = _train(tmp_path, "1f1b", forget_state=True)
    unspoiled = STEPS_PER_PHASE + 1  # the first migration shows from the update after the next step on
    torch.testing.assert_close(results[0]["losses"][:unspoiled], ref_losses[:unspoiled], **TOLERANCE)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(results[0]["losses"], ref_losses, **TOLERANCE)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(
            results[0]["weights"]["layers.3.lin.weight"], ref_weights["layers.3.lin.weight"], **TOLERANCE
        )


# ----------------------------------------------------------------------------------------------------
# Checkpoints: saved at one placement with 2 shards, loaded at another with 2 shards, exported to one file
# ----------------------------------------------------------------------------------------------------

SAVED_AT: Phase = CASES["1f1b"][0]  # blocks 0-2 | 3-5
LOADED_AT: Phase = CASES["1f1b"][1]  # blocks 0-1 | 2-5


def _train_steps(
    units: dict[str, nn.Module],
    phase: Phase,
    opt: torch.optim.Optimizer,
    batches: list[Any],
    ctx: dict[str, Any],
) -> list[float]:
    _, stages = phase
    position, replica, dp = ctx["position"], ctx["replica"], ctx["dp"]
    chain = _stage_module(units, stages[position], ctx["dp_mesh"])
    pipe = PipelineStage(chain, position, len(stages), torch.device("cpu"), group=ctx["pp_group"])
    schedule = Schedule1F1B(pipe, n_microbatches=MICROBATCHES, loss_fn=_loss)
    losses = []
    for x, y in batches:
        x, y = x.chunk(dp)[replica], y.chunk(dp)[replica]
        out: list[torch.Tensor] = []
        if position == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=out)
        opt.step()
        opt.zero_grad()
        loss = torch.tensor(sum(t.item() for t in out) / MICROBATCHES if out else 0.0, dtype=torch.float64)
        dist.all_reduce(loss)
        losses.append(loss.item() / dp)
    return losses


def _checkpoint_worker(rank: int, world_size: int, directory: str, exported: str) -> dict[str, Any]:
    grid = RankGrid(world_size=world_size, pipeline_size=2)
    mesh = init_device_mesh("cpu", (grid.data_parallel_size, grid.pipeline_size), mesh_dim_names=("dp", "pp"))
    ctx = {
        "position": grid.pipeline_rank(rank),
        "replica": grid.data_parallel_rank(rank),
        "dp": grid.data_parallel_size,
        "dp_mesh": mesh["dp"],
        "pp_group": mesh["pp"].get_group(),
    }
    batches = _batches()
    blocks = _blocks()
    units: dict[str, nn.Module] = {f"layers.{b}": blocks[b] for b in _held(SAVED_AT, ctx["position"])}
    for unit in units.values():
        shard_unit(unit, mesh["dp"])
    opt = torch.optim.Adam([p for u in units.values() for p in u.parameters()], lr=LR)
    losses = _train_steps(units, SAVED_AT, opt, batches[:STEPS_PER_PHASE], ctx)
    save_sharded_units(directory, units, [opt])

    # A fresh model at another placement, initialised differently: everything must come from the checkpoint.
    torch.manual_seed(100 + rank)
    fresh = {f"layers.{b}": Block(b) for b in _held(LOADED_AT, ctx["position"])}
    for unit in fresh.values():
        nn.init.normal_(unit.lin.weight)
        shard_unit(unit, mesh["dp"])
    fresh_opt = torch.optim.Adam([p for u in fresh.values() for p in u.parameters()], lr=LR)
    before = {
        f"{n}.{k}": v.full_tensor().clone()
        for n, u in fresh.items()
        for k, v in u.state_dict().items()
        if isinstance(v, DTensor)
    }
    load_sharded_units(directory, fresh, [fresh_opt])
    loaded = {}
    for name, unit in fresh.items():
        for key, value in unit.state_dict().items():
            loaded[f"{name}.{key}"] = (value.full_tensor() if isinstance(value, DTensor) else value).clone()
        for pname, param in unit.named_parameters():
            for skey, svalue in fresh_opt.state[param].items():
                full = svalue.full_tensor() if isinstance(svalue, DTensor) else svalue
                loaded[f"{name}.{pname}.{skey}"] = full.clone()
    wrong = {"layers.9": Block(9)} if rank == 0 else {}  # every rank fails, rank 0 naming the key
    with pytest.raises(KeyError, match=r"lacks \['state_dict.layers.9" if rank == 0 else "of 1 other rank"):
        load_sharded_units(directory, wrong, [])
    losses += _train_steps(fresh, LOADED_AT, fresh_opt, batches[STEPS_PER_PHASE : 2 * STEPS_PER_PHASE], ctx)
    dist.barrier()
    if rank == 0:
        dcp_to_torch_save(directory, exported)
    dist.barrier()
    return {"before": before, "loaded": loaded, "losses": losses}


def test_sharded_checkpoint_across_placements_and_to_one_file(tmp_path: Any) -> None:
    steps = 2 * STEPS_PER_PHASE
    ref_losses, _, _ = _reference_with_state(steps)
    _, ref_weights, ref_state = _reference_with_state(STEPS_PER_PHASE)  # what the checkpoint holds
    directory, exported = tmp_path / "ckpt", tmp_path / "full.pt"
    results = run_distributed(
        _checkpoint_worker, 4, tmp_path, timeout_s=120, args=(str(directory), str(exported))
    )
    expected = ref_weights | ref_state
    for result in results:
        assert result["loaded"], "every rank holds units at the loading placement"
        for key, value in result["loaded"].items():
            torch.testing.assert_close(value, expected[key], **TOLERANCE, msg=key)
        for key, value in result["before"].items():  # the control: the fresh units really differed
            assert not torch.allclose(value, expected[key]), key
    assert set().union(*(r["loaded"] for r in results)) == set(expected)
    # Training on from the loaded checkpoint continues the single-process run.
    torch.testing.assert_close(results[0]["losses"], ref_losses, **TOLERANCE)

    full = torch.load(exported, weights_only=True)
    for key, value in ref_weights.items():
        torch.testing.assert_close(full[f"state_dict.{key}"], value, **TOLERANCE, msg=key)
    for key, value in ref_state.items():
        torch.testing.assert_close(full[f"optimizer_states.0.state.{key}"], value, **TOLERANCE, msg=key)
