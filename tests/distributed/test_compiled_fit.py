"""``DynMoStrategy(compile_blocks=...)`` trains exactly as the uncompiled single process, through migrations
and a re-pack, and recompiles only the blocks that moved.

Float64 on forked gloo ranks, against the plain single-process ``Trainer.fit`` reference (``fitting``).
The backend is ``"aot_eager"``: Dynamo captures each block's forward and AOTAutograd builds its joint
forward/backward graph (the compiled backward is one autograd node, as with inductor), run without code
generation so the test takes seconds, not minutes, on 2 cores. The negative control compiles with a
backend that scales each graph's output by ``1 + 1e-4``: the same comparison then fails, so it would
catch a compiled forward that computes something else, and it shows the compiled forward is the one
that runs.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_dynmo.pipeline.model.compiled import is_compiled_block
from lightning_dynmo.strategy import DynMoStrategy
from tests.distributed import fitting
from tests.distributed.fitting import TOL, Run, local_state, make_strategy, max_param_diff, reference
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed

# Three stages, then a re-pack to two (rank 2 released), then a migration inside the smaller pipeline.
RUN = Run(
    world_size=3, num_layers=6, placement="0-1|2-3|4-5", migrations=((2, "0-2|3-5"), (4, "0-0|1-5")), steps=6
)


class CompiledForwards(pl.Callback):
    """After each batch: which compiled forward function each local block runs (by identity)."""

    def __init__(self) -> None:
        self.steps: list[dict[int, int]] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int
    ) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, DynMoStrategy)
        self.steps.append(
            {k: id(b.forward.__func__) for k, b in strategy.local_layers.items() if is_compiled_block(b)}
        )


def _perturbing_backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    from torch._dynamo.backends.common import aot_autograd

    def scaled(inner: torch.fx.GraphModule, inputs: Any) -> Any:
        def run(*args: Any) -> Any:
            out = inner(*args)
            return type(out)(
                o * (1 + 1e-4) if torch.is_tensor(o) and o.is_floating_point() else o for o in out
            )

        return run

    return aot_autograd(fw_compiler=scaled)(gm, example_inputs)


def compiled_worker(rank: int, world_size: int, run: Run, options: dict[str, Any]) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    recorder, mover, forwards = (
        fitting.LossRecorder(),
        fitting.ForcePlacement(dict(run.migrations)),
        CompiledForwards(),
    )
    strategy = make_strategy(run, compile_blocks=options)
    trainer = pl.Trainer(
        devices=world_size,
        strategy=strategy,
        use_distributed_sampler=False,
        callbacks=[recorder, mover, forwards],
        **run.trainer_kwargs(),
    )
    model = run.model()
    trainer.fit(model, run.datamodule())
    return {
        "losses": recorder.losses,
        "state": local_state(model),
        "released": strategy.is_released,
        "placement": str(strategy.placement),
        "layers": sorted(strategy.local_layers),
        "forwards": forwards.steps,
    }


def _fit(tmp_path: Any, options: dict[str, Any]) -> list[dict[str, Any]]:
    return run_distributed(compiled_worker, RUN.world_size, tmp_path, timeout_s=300, args=(RUN, options))


def test_compiled_blocks_train_as_one_uncompiled_process_through_migrations_and_a_repack(
    tmp_path: Any,
) -> None:
    results = _fit(tmp_path, {"backend": "aot_eager"})
    ref = reference(RUN)
    assert [res["released"] for res in results] == [False, False, True]
    active = results[:2]
    for res in active:
        assert res["placement"] == "0-0|1-5"
        worst = max(abs(a - b) for a, b in zip(res["losses"], ref["losses"], strict=True))
        assert len(res["losses"]) == RUN.steps and worst < TOL, f"losses differ by {worst:.3e}"
    assert max_param_diff(active, ref) < TOL
    # Checkpoint names stay plain: every key of the union is a key of the uncompiled model.
    keys = {k for res in active for k in res["state"]}
    assert keys == set(ref["state"]) and not any("_orig_mod" in k for k in keys)
    for rank, res in enumerate(results):
        steps = res["forwards"]
        assert steps and all(set(step) for step in steps), f"rank {rank} ran uncompiled blocks"
        for before, after in itertools.pairwise(steps):
            for block, fn in after.items():
                if block in before:  # stayed on the rank: the same compiled forward, not recompiled
                    assert fn == before[block], f"rank {rank}: block {block} was recompiled without moving"
                else:  # arrived: compiled anew on this rank
                    assert fn not in before.values(), f"rank {rank}: block {block} arrived uncompiled"
    assert sorted(results[0]["forwards"][-1]) == [0] and sorted(results[1]["forwards"][-1]) == [1, 2, 3, 4, 5]


def test_negative_control_a_backend_that_changes_the_output_fails_the_comparison(tmp_path: Any) -> None:
    results = _fit(tmp_path, {"backend": _perturbing_backend})
    ref = reference(RUN)
    worst = max(abs(a - b) for a, b in zip(results[0]["losses"], ref["losses"], strict=True))
    assert worst > 1e3 * TOL, f"a perturbed compiled forward must show in the losses (differ by {worst:.3e})"
