"""Fixtures shared by the dynamism unit tests."""

from collections.abc import Iterator

import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader


@pytest.fixture
def one_thread() -> Iterator[None]:
    # Small matrices on a shared 2-core machine: a second intra-op thread makes each op ~30x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tokens() -> Iterator[DataLoader[Tensor]]:
    """Three batches of 4 rows of 9 tokens (< 256): the tiny GPTs' training data."""
    data = torch.randint(0, 256, (12, 9), generator=torch.Generator().manual_seed(0))
    yield DataLoader(list(data), batch_size=4)
