"""Recorded stage boundaries (lightning_dynmo/pipeline/step/boundaries.py): what a record holds, when it
may build a placement's stages, and the check a stage built from one runs on its first outputs."""

from __future__ import annotations

import pytest
import torch

from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.demos import DemoGPT
from lightning_dynmo.pipeline.model.contract import check_model_contract
from lightning_dynmo.pipeline.step.boundaries import (
    BoundaryRecord,
    BoundaryRecorder,
    TensorSpec,
    specs_of,
    stage_metadata,
)
from lightning_dynmo.pipeline.step.stage import StageModule

BATCH = (2, (8, 16), (8, 16))
HIDDEN = (TensorSpec((4, 16, 8), (128, 8, 1), torch.float64, True),)
TOKENS = (TensorSpec((4, 16), (16, 1), torch.int64, False),)
LOGITS = (TensorSpec((4, 16, 64), (1024, 64, 1), torch.float64, True),)


def _records(layers: int = 6, split: int = 3, frozen: frozenset[str] = frozenset()) -> list[BoundaryRecord]:
    first = BoundaryRecord(BATCH, frozen, {i: HIDDEN for i in range(split)}, first_inputs=TOKENS)
    last = BoundaryRecord(BATCH, frozenset(), {i: HIDDEN for i in range(split, layers)}, last_outputs=LOGITS)
    return [first, last]


def test_every_stage_of_another_placement_is_read_from_the_records() -> None:
    target = Placement.from_string("0-0|1-4|5-5", num_layers=6)
    got = stage_metadata(_records(), frozenset(), BATCH, target, range(3))
    assert got is not None
    assert got[0] == (TOKENS, HIDDEN)
    assert got[1] == (HIDDEN, HIDDEN)
    assert got[2] == (HIDDEN, LOGITS)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"frozen_now": frozenset({"layers.0.w"})}, "a parameter froze since the record"),
        ({"batch_shape": (4, (8, 16), (8, 16))}, "another micro-batch count"),
        ({"records": [_records()[0], None]}, "a rank without a record"),
        ({"records": [_records(split=3)[0]]}, "layers 3-5 never recorded"),
        (
            {"records": [BoundaryRecord(BATCH, frozenset(), {i: HIDDEN for i in range(6)})]},
            "no stage-0 input",
        ),
    ],
)
def test_a_record_made_under_other_conditions_builds_nothing(change: dict, why: str) -> None:
    args = {"records": _records(), "frozen_now": frozenset(), "batch_shape": BATCH}
    args.update(change)
    target = Placement.from_string("0-1|2-4|5-5", num_layers=6)
    assert (
        stage_metadata(args["records"], args["frozen_now"], args["batch_shape"], target, range(3)) is None
    ), why


def test_frozen_names_are_compared_as_the_union_over_the_ranks() -> None:
    records = _records(frozen=frozenset({"layers.0.w"}))
    target = Placement.from_string("0-2|3-5", num_layers=6)
    assert stage_metadata(records, {"layers.0.w"}, BATCH, target, range(2)) is not None
    assert stage_metadata(records, set(), BATCH, target, range(2)) is None


def test_the_recorder_keeps_nothing_until_a_build_opens_a_record_and_forgets_at_the_next() -> None:
    shapes = iter([BATCH, (4, (8, 16), (8, 16))])
    recorder = BoundaryRecorder(lambda: next(shapes), lambda: {"a"})
    x = torch.zeros(4, 16, 8, dtype=torch.float64, requires_grad=True)
    recorder.record(0, x)
    assert recorder.record_now is None
    recorder.start()
    recorder.record(0, (x, x[..., 0] > 0))
    recorder.record(None, x.sum(), "last")
    record = recorder.record_now
    assert record is not None and record.batch_shape == BATCH and record.frozen == {"a"}
    assert [s.dtype for s in record.after[0]] == [torch.float64, torch.bool]
    assert record.last_outputs == (TensorSpec((), (), torch.float64, True),)
    recorder.start()
    assert recorder.record_now is None


def test_an_example_is_a_meta_tensor_with_the_spec() -> None:
    spec = TensorSpec((2, 3), (3, 1), torch.float32, True)
    t = spec.example()
    assert t.device.type == "meta" and t.requires_grad and specs_of(t) == (spec,)
    mask = TensorSpec((2,), (1,), torch.bool, True).example()  # only floating tensors take gradients
    assert not mask.requires_grad


def _stage(expected: tuple[TensorSpec, ...] | None) -> StageModule:
    model = DemoGPT(num_layers=2, d_model=8, vocab_size=32, seq_len=4)
    spec = check_model_contract(model)
    return StageModule(model, spec, [0], first=True, last=False, expected_outputs=expected)


def test_a_stage_built_from_a_record_checks_its_first_outputs_once() -> None:
    tokens = torch.zeros(2, 4, dtype=torch.long)
    good = specs_of(_stage(None)(tokens))
    stage = _stage(good)
    stage(tokens)
    stage(tokens)  # checked once; a later call is not checked again
    wrong = (good[0]._replace(shape=(2, 4, 9)),)
    with pytest.raises(
        RuntimeError, match=r"sends \(2, 4, 8\) float32 \(grad\) but its stage was built for \(2, 4, 9\)"
    ):
        _stage(wrong)(tokens)


def test_a_stage_records_its_input_and_every_block_in_the_metadata_pass_only() -> None:
    model = DemoGPT(num_layers=3, d_model=8, vocab_size=32, seq_len=4)
    spec = check_model_contract(model)
    recorder = BoundaryRecorder(lambda: BATCH, frozenset)
    recorder.start()
    stage = StageModule(model, spec, [0, 1, 2], first=True, last=True, recorder=recorder)
    tokens = torch.zeros(2, 4, dtype=torch.long)
    stage(tokens)
    assert recorder.record_now is None  # a real forward records nothing
    with stage.shape_inference():
        stage(tokens)
    record = recorder.record_now
    assert record is not None
    assert sorted(record.after) == [0, 1, 2] and record.first_inputs == specs_of(tokens)
    assert record.after[2] == specs_of(torch.zeros(2, 4, 8, requires_grad=True))
    assert record.last_outputs is not None and record.last_outputs[0].shape == (2, 4, 32)
