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


def test_a_bucket_rounds_the_gathered_rows_and_the_width_up_and_caps_them_at_the_grid() -> None:
    mask = torch.tensor([[1, 0, 1, 1, 0, 0], [0, 1, 0, 0, 0, 0]], dtype=torch.bool)
    sel = select_tokens(mask, bucket=3)
    assert (sel.count, sel.padded_count, sel.width) == (4, 6, 3)
    assert sel.valid.tolist() == [[True, True, True], [True, False, False]]
    hidden = torch.arange(12, dtype=torch.float64).view(2, 6, 1)
    gathered = sel.gather(hidden)
    assert gathered.squeeze(-1).tolist() == [0.0, 2.0, 3.0, 7.0, 0.0, 0.0], "padding repeats the first"
    assert torch.equal(sel.unpad(sel.pad(gathered))[:4], gathered[:4])
    assert sel.fill_padding(gathered, -1.0).squeeze(-1).tolist() == [0.0, 2.0, 3.0, 7.0, -1.0, -1.0]
    assert torch.equal(
        sel.scatter(hidden, gathered + 100), torch.where(mask.unsqueeze(-1), hidden + 100, hidden)
    )
    capped = select_tokens(mask, bucket=5)
    assert (capped.padded_count, capped.width) == (5, 5)
    assert (select_tokens(mask, bucket=64).padded_count, select_tokens(mask, bucket=64).width) == (12, 6)


def test_select_tokens_refuses_a_bad_bucket() -> None:
    with pytest.raises(ValueError, match=r"select_tokens\(bucket\)=0 must be None \(exact token counts\)"):
        select_tokens(torch.ones(2, 3, dtype=torch.bool), bucket=0)
