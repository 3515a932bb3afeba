"""DynMoStrategy's constructor arguments, checked when it is built (before any process starts)."""

from __future__ import annotations

from typing import Any, Literal

from lightning_dynmo.balancing.placement import Placement

__all__ = [
    "DATA_PARALLEL_SHARDINGS",
    "PLACEMENT_POLICIES",
    "START_METHODS",
    "DataParallelSharding",
    "StartMethod",
    "check_data_parallel_sharding",
    "check_sharding_fits",
    "check_strategy_args",
]

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
START_METHODS = ("popen", "spawn", "fork", "forkserver")
PLACEMENT_POLICIES = ("uniform", "parameters")
DataParallelSharding = Literal["replicate", "fsdp"]
DATA_PARALLEL_SHARDINGS = ("replicate", "fsdp")


def check_strategy_args(
    *,
    pipeline_size: Any,
    num_microbatches: Any,
    start_method: Any,
    placement: Any,
    on_release: Any,
    val_loss_log_name: Any,
    test_loss_log_name: Any,
) -> tuple[str | Placement, dict[str, str | None]]:
    """Check the arguments (see :class:`~lightning_dynmo.DynMoStrategy`).

    Returns:
        The placement argument, and the evaluation log names by phase (``"validate"``, ``"test"``).

    Raises:
        ValueError: naming the argument, the bad value and what to pass instead.
        TypeError: if ``on_release`` is not callable.
    """
    _check_positive_int("pipeline_size", pipeline_size, allow_none=True)
    _check_positive_int("num_microbatches", num_microbatches)
    if start_method not in START_METHODS:
        raise ValueError(f"start_method={start_method!r} is not one of {START_METHODS}.")
    if on_release is not None and not callable(on_release):
        raise TypeError(
            f"on_release={on_release!r} is not callable; pass a function taking one ReleaseEvent, e.g. "
            "on_release=lambda event: print(event.released_ranks), or None."
        )
    log_names = {
        "validate": _check_log_name("val_loss_log_name", val_loss_log_name),
        "test": _check_log_name("test_loss_log_name", test_loss_log_name),
    }
    return _check_placement_arg(placement), log_names


def _check_positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1{' or None' if allow_none else ''}.")


def _check_log_name(name: str, value: Any) -> str | None:
    if value is None or (isinstance(value, str) and value):
        return value
    raise ValueError(
        f"{name}={value!r} must be a non-empty metric name such as 'val_loss', or None to not log it."
    )


def _check_placement_arg(placement: Any) -> str | Placement:
    if isinstance(placement, Placement) or placement in PLACEMENT_POLICIES:
        return placement  # type: ignore[no-any-return]
    if not isinstance(placement, str):
        raise ValueError(
            f"placement={placement!r} must be 'uniform', 'parameters', a placement string like '0-3|4-7' or "
            "a Placement."
        )
    Placement.from_string(placement)  # malformed strings fail here, before any process starts
    return placement


def check_data_parallel_sharding(
    value: Any, save_distributed_checkpoint: bool, compile_blocks: Any
) -> DataParallelSharding:
    """Check ``data_parallel_sharding`` and the arguments it cannot go with.

    Raises:
        ValueError: naming the argument, the bad value and what to pass instead.
    """
    if value not in DATA_PARALLEL_SHARDINGS:
        raise ValueError(
            f"data_parallel_sharding={value!r} is not one of {DATA_PARALLEL_SHARDINGS}: 'replicate' keeps a "
            "whole copy of its stage on every data-parallel rank, 'fsdp' shards each stage's layers over "
            "them (FSDP2)."
        )
    if value == "fsdp" and not save_distributed_checkpoint:
        raise ValueError(
            "data_parallel_sharding='fsdp' with save_distributed_checkpoint=False: every data-parallel rank "
            "holds only its shards, so checkpoints are sharded directories. Keep "
            "save_distributed_checkpoint=True and make one file with "
            "lightning_dynmo.pipeline.export_full_checkpoint."
        )
    if value == "fsdp" and compile_blocks not in (False, None):
        raise ValueError(
            f"data_parallel_sharding='fsdp' with compile_blocks={compile_blocks!r}: compiled blocks are not "
            "sharded yet. Pass compile_blocks=False, or data_parallel_sharding='replicate'."
        )
    return value  # type: ignore[no-any-return]


def check_sharding_fits(sharding: DataParallelSharding, world_size: int, pipeline_size: int) -> None:
    """Refuse ``data_parallel_sharding="fsdp"`` without data-parallel replicas to shard over.

    Raises:
        ValueError: naming the sizes and the fix.
    """
    if sharding == "fsdp" and world_size // pipeline_size < 2:
        raise ValueError(
            f"data_parallel_sharding='fsdp' shards each stage over its data-parallel replicas, but "
            f"world_size={world_size} with pipeline_size={pipeline_size} runs "
            f"{world_size // pipeline_size} replica. Use a pipeline_size of at most world_size // 2 "
            "(e.g. devices=4, pipeline_size=2), or data_parallel_sharding='replicate'."
        )
