"""The float64 comparison of pipelined fits with their reference: losses, parameters and buffers.

``assert_equivalent`` is what every equivalence test asserts; ``assert_differs`` is its negative control
(the same comparison must fail, by far more than the tolerance, when the reference is another model).
Results are the per-rank dicts of :func:`tests.distributed.case_fit.fit_case` (``losses``, ``state``,
optionally ``released``); a reference is a dict with ``losses`` and ``state``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from tests.distributed.fitting import TOL

# A negative control must move the result by far more than the equivalence tolerance.
CONTROL_MARGIN = 1e3 * TOL


def state_diff(results: list[dict[str, Any]], ref: dict[str, Any]) -> float:
    """Largest difference of a tensor in the ranks' merged state; inf if a boolean tensor differs."""
    merged: dict[str, Tensor] = {}
    for res in results:
        merged.update(res["state"])  # data-parallel replicas hold identical copies
    assert set(merged) == set(ref["state"]), set(merged) ^ set(ref["state"])
    worst = 0.0
    for key, want in ref["state"].items():
        if want.dtype == torch.bool:
            if not torch.equal(merged[key], want):
                return float("inf")
        else:
            worst = max(worst, (merged[key].double() - want.double()).abs().max().item())
    return worst


def loss_diff(losses: list[Any], expected: list[Any]) -> float:
    """Largest difference of two equally long series of logged losses (floats or tuples of them)."""
    assert len(losses) == len(expected), f"{len(losses)} steps logged, {len(expected)} expected"

    def flat(x: Any) -> tuple[float, ...]:
        return tuple(x) if isinstance(x, tuple) else (x,)

    pairs = zip(losses, expected, strict=True)
    return max(abs(a - b) for mine, theirs in pairs for a, b in zip(flat(mine), flat(theirs), strict=True))


def assert_equivalent(
    results: list[dict[str, Any]], ref: dict[str, Any], losses: list[Any] | None = None
) -> None:
    """Every rank logged ``losses`` (default: the reference's) and the active ranks hold its state.

    A released rank logged the steps before its release only: those must equal the first ones.
    """
    losses = ref["losses"] if losses is None else losses
    for rank, res in enumerate(results):
        expected = losses[: len(res["losses"])] if res.get("released") else losses
        diff = loss_diff(res["losses"], expected)
        assert diff < TOL, f"rank {rank}: logged losses differ from the reference by {diff:.3e}"
    worst = state_diff([res for res in results if not res.get("released")], ref)
    assert worst < TOL, f"parameters and buffers differ from the reference by up to {worst:.3e}"


def assert_differs(results: list[dict[str, Any]], control: dict[str, Any], what: str, skip: int = 0) -> None:
    """Negative control: the state, or rank 0's losses (against ``control``'s from step ``skip``), differ."""
    differs = max(state_diff(results, control), loss_diff(results[0]["losses"], control["losses"][skip:]))
    assert differs > CONTROL_MARGIN, f"{what} should change the result (it changed it by {differs:.1e})"
