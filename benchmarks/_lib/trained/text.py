"""The project's embedded corpus (the standard library's sources) as token blocks of a given tokenizer."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from lightning_dynmo.data import StdlibCorpus

__all__ = ["token_batches"]


def token_batches(
    encode: Callable[[str], list[int]], *, batch_size: int, seq_len: int, num_batches: int
) -> Iterator[Tensor]:
    """``num_batches`` ``[batch_size, seq_len]`` int64 blocks cut in order from the tokenised corpus.

    Only as many documents are tokenised as the blocks need (the whole corpus takes minutes with a
    Hugging Face tokenizer).

    Raises:
        ValueError: The corpus holds fewer tokens than the blocks need.
    """
    need = batch_size * seq_len * num_batches
    tokens: list[int] = []
    for document in StdlibCorpus().documents():
        tokens.extend(encode(document))
        if len(tokens) >= need:
            break
    if len(tokens) < need:
        raise ValueError(
            f"token_batches: the corpus has {len(tokens)} tokens, fewer than the {need} that {num_batches} "
            f"batches of {batch_size} x {seq_len} need; ask for fewer or shorter batches."
        )
    blocks = torch.tensor(tokens[:need], dtype=torch.long).view(num_batches, batch_size, seq_len)
    yield from blocks
