"""Token selection: flat and per-row padded indices, gather/scatter/pad round trips, bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dynmo.dynamism.tokens import TokenCounts, select_tokens, token_counts


def test_selection_indexes_flat_and_padded_per_row() -> None:
    mask = torch.tensor(
        [[True, False, True, True], [False, False, False, False], [False, True, False, False]]
    )
    sel = select_tokens(mask)
    assert (sel.count, sel.width) == (4, 3)
    assert sel.flat.tolist() == [0, 2, 3, 9]
    assert sel.slots.tolist() == [0, 1, 2, 6]
    assert sel.positions.tolist() == [[0, 2, 3], [0, 0, 0], [1, 0, 0]]
    assert sel.valid.tolist() == [[True, True, True], [False, False, False], [True, False, False]]
    x = torch.arange(12.0).view(3, 4, 1)
    assert sel.gather(x).flatten().tolist() == [0.0, 2.0, 3.0, 9.0]
    assert torch.equal(sel.unpad(sel.pad(sel.gather(x))), sel.gather(x))
    scattered = sel.scatter(x, -sel.gather(x))
    assert torch.equal(scattered[mask], -x[mask]) and torch.equal(scattered[~mask], x[~mask])


def test_an_empty_selection_has_no_width() -> None:
    sel = select_tokens(torch.zeros(2, 5, dtype=torch.bool))
    assert (sel.count, sel.width) == (0, 0)


def test_select_tokens_refuses_a_non_boolean_mask() -> None:
    with pytest.raises(
        ValueError, match=r"needs a \[batch, seq\] bool mask, got torch.int64 of shape \(2, 3\)"
    ):
        select_tokens(torch.zeros(2, 3, dtype=torch.long))


def test_token_counts_sum_calls_and_refuse_a_model_without_layers() -> None:
    counts = TokenCounts()
    assert counts.fraction == 1.0
    counts.record(3, 8)
    counts.record(1, 8)
    assert (counts.processed, counts.seen, counts.calls, counts.last_processed) == (4, 16, 2, 1)
    assert counts.fraction == 0.25
    counts.reset()
    assert counts == TokenCounts()
    with pytest.raises(TypeError, match=r"needs a model with `layers: nn.ModuleDict`.*got Linear"):
        token_counts(nn.Linear(2, 2))
