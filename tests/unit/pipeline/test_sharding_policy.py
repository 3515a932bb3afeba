"""The FSDP2 mixed-precision policy each Lightning precision name implies (no process group needed)."""

from __future__ import annotations

import pytest
import torch

from lightning_dynmo.pipeline.sharding import mixed_precision_policy


@pytest.mark.parametrize(
    ("precision", "param_dtype", "reduce_dtype"),
    [
        ("64-true", None, None),
        ("32-true", None, None),
        ("bf16-true", None, None),
        ("16-true", None, None),
        ("bf16-mixed", torch.bfloat16, torch.float32),
        ("16-mixed", torch.float16, torch.float32),
    ],
)
def test_policy_of_each_precision(
    precision: str, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None
) -> None:
    policy = mixed_precision_policy(precision)
    assert (policy.param_dtype, policy.reduce_dtype) == (param_dtype, reduce_dtype)


@pytest.mark.parametrize("precision", ["bf16", "32", "transformer-engine"])
def test_unknown_precision_is_refused(precision: str) -> None:
    with pytest.raises(ValueError, match=rf"precision='{precision}' has no FSDP2 mixed-precision policy"):
        mixed_precision_policy(precision)
