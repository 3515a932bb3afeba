"""TextDataModule: a tokenised corpus cut into fixed-length next-token blocks, with a train/val split.

Read in this order: :class:`TextDataModule` (what a user configures), :func:`split_blocks` (how the token
stream becomes training and validation blocks), :class:`TokenBlocks` (the dataset), :func:`tokenize`.

Batches are ``LongTensor[batch_size, seq_len + 1]``: row ``r`` holds ``seq_len + 1`` consecutive tokens,
the model's inputs are ``row[:-1]`` and its next-token targets ``row[1:]`` (the format of
:class:`~lightning_dynmo.demos.RandomTokenDataModule`, which ``GPT.pipeline_batch`` splits). Block ``i``
starts at token ``i * seq_len``, so consecutive blocks share one token and every token after the first is a
target exactly once. The first blocks train, the last ``val_fraction`` validate (and test: ``Trainer.test``
reads the same held-out blocks); the two sets share at most one input token and no target.

Every batch is full (``drop_last``), so a pipeline can always cut it into its micro-batches when
``batch_size`` is a multiple of ``num_microbatches``. Training order: a permutation drawn from a generator
seeded with ``seed`` (the same on every rank). Under a distributed strategy (DDP or
:class:`~lightning_dynmo.DynMoStrategy`) Lightning replaces the sampler by a ``DistributedSampler`` that
shards by data-parallel replica (``distributed_sampler_kwargs``); its order then follows
``seed_everything`` instead.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_dynmo.data.cache import TokenCache, cache_key
from lightning_dynmo.data.corpus import Corpus, StdlibCorpus
from lightning_dynmo.data.tokenizer import ByteTokenizer, Tokenizer

log = logging.getLogger(__name__)

__all__ = ["BlockSplit", "TextDataModule", "TokenBlocks", "split_blocks", "tokenize"]


class TextDataModule(pl.LightningDataModule):
    """Language-model batches from a corpus: the standard library's sources by default, no download.

    Args:
        corpus: Where the text comes from (:class:`~lightning_dynmo.data.StdlibCorpus`,
            :class:`~lightning_dynmo.data.TextFileCorpus`, :class:`~lightning_dynmo.data.HFDatasetCorpus` or
            your own :class:`~lightning_dynmo.data.Corpus`); ``None`` is ``StdlibCorpus()``.
        tokenizer: ``None`` is :class:`~lightning_dynmo.data.ByteTokenizer` (vocabulary 256).
        seq_len: Input tokens per sequence (each row has ``seq_len + 1`` tokens).
        batch_size: Sequences per batch (per data-parallel replica); training and validation.
        val_fraction: Share of the blocks, taken from the end of the corpus, used for validation.
        shuffle: Draw the training blocks in a seeded random order (else corpus order).
        seed: Seed of the training order.
        num_workers: DataLoader worker processes.
        cache_dir: Directory of the token cache; ``None`` uses the user cache directory (see
            :mod:`lightning_dynmo.data.cache`).
        use_cache: Save tokens once and reuse them; ``False`` tokenises in memory on every setup.
    """

    def __init__(
        self,
        *,
        corpus: Corpus | None = None,
        tokenizer: Tokenizer | None = None,
        seq_len: int = 128,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        cache_dir: str | Path | None = None,
        use_cache: bool = True,
    ):
        super().__init__()
        _check_int("seq_len", seq_len, minimum=1)
        _check_int("batch_size", batch_size, minimum=1)
        _check_int("num_workers", num_workers, minimum=0)
        if not isinstance(val_fraction, (int, float)) or not 0.0 < val_fraction < 1.0:
            raise ValueError(
                f"val_fraction={val_fraction!r} must be a number strictly between 0 and 1 (e.g. 0.05). To "
                "skip validation keep a small fraction and pass Trainer(limit_val_batches=0)."
            )
        self.corpus: Corpus = corpus if corpus is not None else StdlibCorpus()
        self.tokenizer: Tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = float(val_fraction)
        self.shuffle = shuffle
        self.seed = seed
        self.num_workers = num_workers
        self.cache = TokenCache(cache_dir) if use_cache else None
        self._tokens: npt.NDArray[np.integer] | None = None
        self._split: BlockSplit | None = None

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary size (what ``GPTConfig.vocab_size`` must be)."""
        return int(self.tokenizer.vocab_size)

    @property
    def tokens(self) -> npt.NDArray[np.integer]:
        """The whole tokenised corpus (loaded on first access)."""
        return self._set_up()[0]

    @property
    def split(self) -> BlockSplit:
        """How the tokens are cut into training and validation blocks."""
        return self._set_up()[1]

    def _set_up(self) -> tuple[npt.NDArray[np.integer], BlockSplit]:
        # setup() sets both or neither; a property read before the Trainer's setup loads them.
        if self._tokens is None or self._split is None:
            self.setup()
        assert self._tokens is not None and self._split is not None
        return self._tokens, self._split

    @override
    def prepare_data(self) -> None:
        """Tokenise the corpus into the cache (Lightning calls this on one process per node)."""
        if self.cache is not None:
            self._load_tokens()

    @override
    def setup(self, stage: str | None = None) -> None:
        """Load the tokens (from the cache, or tokenise) and check they give full batches."""
        if self._split is not None:
            return
        tokens = self._load_tokens()
        self._split = split_blocks(
            int(tokens.shape[0]),
            self.seq_len,
            self.val_fraction,
            self.batch_size,
            what=self.corpus.describe(),
        )
        self._tokens = tokens

    @property
    def train_dataset(self) -> TokenBlocks:
        """The training blocks, in corpus order."""
        split = self.split
        return TokenBlocks(self.tokens, self.seq_len, start=0, num_blocks=split.train_blocks)

    @property
    def val_dataset(self) -> TokenBlocks:
        """The validation blocks, in corpus order."""
        split = self.split
        return TokenBlocks(self.tokens, self.seq_len, start=split.val_start, num_blocks=split.val_blocks)

    @override
    def train_dataloader(self) -> DataLoader[Tensor]:
        """Full batches of training blocks, in a seeded order when ``shuffle``."""
        return self._loader(self.train_dataset, shuffle=self.shuffle)

    @override
    def val_dataloader(self) -> DataLoader[Tensor]:
        """Full batches of validation blocks, in corpus order."""
        return self._loader(self.val_dataset, shuffle=False)

    def _loader(self, dataset: TokenBlocks, shuffle: bool) -> DataLoader[Tensor]:
        # Full batches only (drop_last): a pipeline cuts every batch into its micro-batches.
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            generator=torch.Generator().manual_seed(self.seed) if shuffle else None,
            drop_last=True,
            num_workers=self.num_workers,
        )

    @override
    def test_dataloader(self) -> DataLoader[Tensor]:
        """The held-out blocks, as :meth:`val_dataloader` serves them (the corpus has no third split)."""
        return self.val_dataloader()

    def _load_tokens(self) -> npt.NDArray[np.integer]:
        if self._tokens is not None:
            return self._tokens
        if self.cache is None:
            return tokenize(self.corpus, self.tokenizer)
        key = cache_key(self.corpus.fingerprint(), self.tokenizer.name)
        info = {"corpus": self.corpus.describe(), "tokenizer": self.tokenizer.name}
        return self.cache.load_or_build(key, lambda: tokenize(self.corpus, self.tokenizer), info)


@dataclass(frozen=True)
class BlockSplit:
    """Training and validation blocks of a token stream (block ``i`` starts at ``start + i * seq_len``).

    Attributes:
        train_blocks: Number of training blocks (starting at token 0).
        val_blocks: Number of validation blocks.
        val_start: Token offset of the first validation block.
    """

    train_blocks: int
    val_blocks: int
    val_start: int


def split_blocks(
    num_tokens: int, seq_len: int, val_fraction: float, batch_size: int, what: str = "the corpus"
) -> BlockSplit:
    """Cut ``num_tokens`` into blocks of ``seq_len + 1`` tokens and split them train/validation.

    The validation set is the last ``round(val_fraction * blocks)`` blocks (at least one); both sets
    must hold at least one full batch.

    Raises:
        ValueError: the corpus is empty, shorter than one block, or too short for a full batch of
            each set; the message says which setting to change.
    """
    block = seq_len + 1
    if num_tokens == 0:
        raise ValueError(
            f"{what} is empty (0 tokens); point the corpus at files that contain text (check the paths "
            "and the glob)."
        )
    if num_tokens < block:
        raise ValueError(
            f"seq_len={seq_len} needs blocks of seq_len + 1 = {block} tokens, but {what} has only "
            f"{num_tokens} tokens; lower seq_len below {num_tokens} or add text to the corpus."
        )
    blocks = (num_tokens - 1) // seq_len
    val_blocks = max(1, round(blocks * val_fraction))
    train_blocks = blocks - val_blocks
    for name, count in (("training", train_blocks), ("validation", val_blocks)):
        if count < batch_size:
            raise ValueError(
                f"{what} has {num_tokens} tokens: {blocks} blocks of seq_len + 1 = {block} tokens, of which "
                f"{count} for {name} (val_fraction={val_fraction}), fewer than one batch of batch_size="
                f"{batch_size} (batches are full, drop_last). Lower batch_size or seq_len, "
                f"{'lower' if name == 'training' else 'raise'} val_fraction, or add text to the corpus."
            )
    return BlockSplit(train_blocks=train_blocks, val_blocks=val_blocks, val_start=train_blocks * seq_len)


class TokenBlocks(Dataset[Tensor]):
    """Overlapping windows of a token array: item ``i`` is ``tokens[start + i * seq_len :][: seq_len + 1]``.

    Args:
        tokens: The token stream (1-D integer array, e.g. memory-mapped from the cache).
        seq_len: Input tokens per block (each item has ``seq_len + 1`` tokens).
        start: Token offset of item 0.
        num_blocks: Number of items; ``None`` takes every full block after ``start``.
    """

    def __init__(
        self, tokens: npt.NDArray[np.integer], seq_len: int, start: int = 0, num_blocks: int | None = None
    ):
        available = max(0, (int(tokens.shape[0]) - start - 1) // seq_len)
        count = available if num_blocks is None else num_blocks
        if not 0 <= count <= available:
            raise ValueError(
                f"num_blocks={num_blocks} but only {available} blocks of {seq_len + 1} tokens fit after "
                f"token {start} of {tokens.shape[0]}; lower num_blocks or start."
            )
        self.tokens, self.seq_len, self.start, self.num_blocks = tokens, seq_len, start, count

    def __len__(self) -> int:
        return self.num_blocks

    def __getitem__(self, index: int) -> Tensor:
        if not 0 <= index < self.num_blocks:
            raise IndexError(f"block {index} is out of range for {self.num_blocks} blocks")
        begin = self.start + index * self.seq_len
        return torch.from_numpy(np.array(self.tokens[begin : begin + self.seq_len + 1], dtype=np.int64))


def tokenize(corpus: Corpus, tokenizer: Tokenizer) -> npt.NDArray[np.integer]:
    """All documents of ``corpus`` encoded and concatenated (``eos_id`` after each non-empty one).

    The result uses the smallest unsigned dtype that holds the vocabulary (``uint8`` for bytes).

    Raises:
        ValueError: the tokenizer produced an id outside ``[0, vocab_size)``.
    """
    started = time.perf_counter()
    vocab = tokenizer.vocab_size
    dtype = np.uint8 if vocab <= 2**8 else np.uint16 if vocab <= 2**16 else np.int64
    pieces: list[npt.NDArray[np.integer]] = []
    for text in corpus.documents():
        if not text:
            continue
        ids = np.asarray(tokenizer.encode(text))
        if tokenizer.eos_id is not None:
            ids = np.append(ids, tokenizer.eos_id)
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(
                f"tokenizer {tokenizer.name!r} produced ids in [{ids.min()}, {ids.max()}], outside its "
                f"vocab_size={vocab}; fix the tokenizer's vocab_size, its eos_id or its encode()."
            )
        pieces.append(ids.astype(dtype))  # narrow each document at once: memory stays ~1 byte per token
    tokens: npt.NDArray[np.integer] = np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)
    log.info(
        "tokenised %s: %d tokens in %.2f s", corpus.describe(), tokens.size, time.perf_counter() - started
    )
    return tokens


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}.")
