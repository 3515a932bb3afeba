"""Nested auxiliary-loss records leave in any order by identity, never by value."""

from __future__ import annotations

import torch

from lightning_dynmo.pipeline.step.aux_loss import add_aux_loss, collect_aux_losses


def test_an_inner_record_equal_in_value_leaves_without_taking_the_outer_one() -> None:
    # A schedule step (outer) whose stage runs torch's shape inference (inner) in the middle of it, as
    # Interleaved1F1B does: both records start alike (same settings, no values yet).
    hidden = torch.zeros(2, requires_grad=True)
    with collect_aux_losses(allowed=("exit_ce",)) as outer:
        with collect_aux_losses(allowed=("exit_ce",)) as inner:
            pass
        add_aux_loss("exit_ce", torch.tensor(2.0), hidden)
    assert [float(v) for v in outer.values["exit_ce"]] == [2.0]
    assert inner.values == {}


def test_records_closed_out_of_order_each_keep_their_values() -> None:
    hidden = torch.zeros(2, requires_grad=True)
    first = collect_aux_losses(allowed=("a",))
    second = collect_aux_losses(allowed=("a",))
    one = first.__enter__()
    two = second.__enter__()
    add_aux_loss("a", torch.tensor(1.0), hidden)  # the innermost (latest) record hears it
    first.__exit__(None, None, None)  # the outer one closes first (stages interleave)
    add_aux_loss("a", torch.tensor(3.0), hidden)
    second.__exit__(None, None, None)
    assert one.values == {} and [float(v) for v in two.values["a"]] == [1.0, 3.0]
