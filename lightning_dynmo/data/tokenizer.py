"""Tokenizers for the text data module: the :class:`Tokenizer` protocol and the default byte tokenizer.

Why bytes by default. A byte-level tokenizer (UTF-8 bytes, vocabulary 256) needs no training, no
download and no dependency, encodes every text exactly (``decode(encode(t)) == t``) and is a few lines
that cannot drift between machines. A BPE trained on the corpus would pack 3-4 bytes per token, but it
costs a training pass and a second cache entry, and its 8k-50k vocabulary would make the embedding and
the output head the largest units of a small model: the first and last pipeline stages would then be
dominated by vocabulary work instead of by the blocks whose changing cost DynMo balances. Plug another
tokenizer in through :class:`Tokenizer` when that trade-off goes the other way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

__all__ = ["ByteTokenizer", "Tokenizer"]


@runtime_checkable
class Tokenizer(Protocol):
    """What :class:`~lightning_dynmo.data.TextDataModule` needs from a tokenizer.

    Attributes:
        name: Identifies the tokenizer *and its vocabulary* (e.g. ``"bytes-utf8/1"``); it is part of the
            token-cache key, so change it whenever the same text would encode differently.
        vocab_size: Number of token ids; every id is in ``[0, vocab_size)``.
        eos_id: The id appended after every document (so the model sees document boundaries), or
            ``None`` to concatenate documents as they are.
    """

    name: str
    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> npt.NDArray[np.integer]:
        """Token ids of ``text`` as a 1-D integer array."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (the inverse of :meth:`encode`)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, id = byte value; byte 0 (NUL) ends every document.

    NUL does not occur in source code or ordinary text, so it is free to mark document boundaries;
    a text that does contain NUL bytes still round-trips (the marker is only appended, never parsed).
    """

    name = "bytes-utf8/1"
    vocab_size = 256
    eos_id: int | None = 0

    def encode(self, text: str) -> npt.NDArray[np.uint8]:
        """The UTF-8 bytes of ``text`` as a ``uint8`` array."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, ids: Sequence[int]) -> str:
        """Text from byte ids; invalid UTF-8 (a sequence cut mid-character) decodes as U+FFFD."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"
