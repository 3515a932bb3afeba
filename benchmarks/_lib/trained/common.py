"""What every case recorder receives: the model, its encoder, the run's sizes and the trace header."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks._lib.trained.smollm import PretrainedModel
from benchmarks._lib.trained.traces import Trace, hardware

__all__ = ["CaseRun", "encoder"]


def encoder(pretrained: PretrainedModel) -> Callable[[str], list[int]]:
    """The model's tokenizer as ``text -> ids``; bytes for a model without one (:func:`tiny_llama`)."""
    if pretrained.tokenizer is None:
        return lambda text: list(text.encode("utf-8"))
    tokenizer = pretrained.tokenizer
    return lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass(frozen=True)
class CaseRun:
    """One recording's inputs.

    Attributes:
        pretrained: The model (it is changed in place by cases that train).
        quick: Quick mode: 2-3 steps at tiny sizes (tests), not the recording of record.
        command: The exact command line, stored in the trace.
    """

    pretrained: PretrainedModel
    quick: bool
    command: str

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        return encoder(self.pretrained)(text)

    def trace(self, case: str, statistic: str, unit: str, recipe: str) -> Trace:
        """An empty trace with this run's header."""
        date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
        return Trace(case, statistic, unit, self.pretrained.name, recipe, self.command, date, hardware())
