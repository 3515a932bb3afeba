"""Random-but-learnable token data with fixed-length batches (pipelines cache activation shapes)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset


class RandomTokenDataset(Dataset[Tensor]):
    """``num_samples`` token sequences of length ``seq_len + 1`` (inputs plus the shifted target).

    Each sequence is an arithmetic progression modulo ``vocab_size`` with a random start and stride,
    so a model can learn it and losses go down. Generated once from ``seed``: the same arguments
    give the same data in every process.
    """

    def __init__(self, num_samples: int = 64, seq_len: int = 16, vocab_size: int = 64, seed: int = 0):
        if num_samples < 1 or seq_len < 1 or vocab_size < 2:
            raise ValueError(
                f"num_samples={num_samples}, seq_len={seq_len}, vocab_size={vocab_size}: need num_samples "
                ">= 1, seq_len >= 1 and vocab_size >= 2."
            )
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab_size, (num_samples, 1), generator=gen)
        stride = torch.randint(1, vocab_size, (num_samples, 1), generator=gen)
        self.tokens = (start + stride * torch.arange(seq_len + 1)) % vocab_size

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, index: int) -> Tensor:
        return self.tokens[index]


class RandomTokenDataModule(pl.LightningDataModule):
    """Serves :class:`RandomTokenDataset` in order, by default in fixed-size batches (``drop_last``).

    Args:
        batch_size: Sequences per batch (per data-parallel replica).
        num_samples: Dataset size.
        seq_len: Tokens per input sequence.
        vocab_size: Token vocabulary size.
        seed: Data seed.
        drop_last: Drop a last partial batch (pipelines prefer one batch shape).
    """

    def __init__(
        self,
        batch_size: int = 8,
        num_samples: int = 64,
        seq_len: int = 16,
        vocab_size: int = 64,
        seed: int = 0,
        drop_last: bool = True,
    ):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1.")
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.dataset = RandomTokenDataset(num_samples, seq_len, vocab_size, seed)

    def train_dataloader(self) -> DataLoader[Tensor]:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False, drop_last=self.drop_last)
