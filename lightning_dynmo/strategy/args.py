"""DynMoStrategy's constructor arguments, checked when it is built (before any process starts)."""

from __future__ import annotations

from typing import Any, Literal

from lightning_dynmo.balancing.placement import Placement

__all__ = ["PLACEMENT_POLICIES", "START_METHODS", "StartMethod", "check_strategy_args"]

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
START_METHODS = ("popen", "spawn", "fork", "forkserver")
PLACEMENT_POLICIES = ("uniform", "parameters")


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
