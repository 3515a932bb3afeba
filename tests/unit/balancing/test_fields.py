"""Config fields that declare their rule: one check, messages naming the class and field."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from lightning_dynmo.balancing.fields import check_fields, fraction_field, int_field, number_field


@dataclass(frozen=True, kw_only=True)
class Knobs:
    steps: int = int_field(3, minimum=1, hint="the steps per window, e.g. 3")
    rows: int | None = int_field(None, minimum=1, optional=True)
    cost_s: float = number_field(0.5)
    rate: float = number_field(1.0, allow_zero=False)
    share: float = fraction_field(0.25, "the share kept, e.g. 0.25")
    free: str = "anything"  # no rule: not checked

    def __post_init__(self) -> None:
        check_fields(self)


def test_defaults_and_good_values_pass_and_the_fields_keep_their_defaults() -> None:
    assert Knobs() == Knobs(steps=3, rows=None, cost_s=0.5, rate=1.0, share=0.25)
    Knobs(steps=1, rows=7, cost_s=0, rate=1e-9, share=0.0, free="")
    assert [f.default for f in dataclasses.fields(Knobs)] == [3, None, 0.5, 1.0, 0.25, "anything"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"steps": 0}, r"^Knobs\.steps=0 must be an integer >= 1; the steps per window, e.g\. 3\.$"),
        ({"steps": True}, r"^Knobs\.steps=True must be an integer >= 1"),
        ({"steps": 2.0}, r"^Knobs\.steps=2\.0 must be an integer >= 1"),
        ({"rows": 0}, r"^Knobs\.rows=0 must be an integer >= 1 or None\.$"),
        ({"cost_s": -1.0}, r"^Knobs\.cost_s=-1\.0 must be a finite number >= 0\.$"),
        ({"cost_s": float("inf")}, r"^Knobs\.cost_s=inf must be a finite number >= 0\.$"),
        ({"rate": 0.0}, r"^Knobs\.rate=0\.0 must be a finite number > 0\.$"),
        (
            {"share": 1.0},
            r"^Knobs\.share=1\.0 must be a fraction in \[0, 1\); the share kept, e\.g\. 0\.25\.$",
        ),
        ({"share": False}, r"^Knobs\.share=False must be a fraction in \[0, 1\)"),
    ],
)
def test_a_bad_value_fails_naming_class_field_value_and_rule(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Knobs(**kwargs)  # type: ignore[arg-type]
