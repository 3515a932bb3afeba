"""TextDataModule: next-token blocks, a deterministic split and order, a cache that makes reruns cheap."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lightning_dynmo.data import (
    ByteTokenizer,
    StdlibCorpus,
    TextDataModule,
    TextFileCorpus,
    TokenBlocks,
    default_cache_dir,
    split_blocks,
    tokenize,
)
from lightning_dynmo.data.cache import CACHE_ENV, TokenCache

SMALL = StdlibCorpus(max_bytes=120_000)


def _text_module(tmp_path: Path, text: str, **kwargs: Any) -> TextDataModule:
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    return TextDataModule(corpus=TextFileCorpus(paths=path), cache_dir=tmp_path / "cache", **kwargs)


def test_offline_first_run_fills_an_empty_cache_and_the_second_reads_only_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "fresh-cache"
    first = TextDataModule(corpus=SMALL, seq_len=32, cache_dir=cache)
    first.prepare_data()
    first.setup("fit")
    assert len(list(cache.glob("tokens-*.npy"))) == 1 and len(list(cache.glob("tokens-*.json"))) == 1

    def no_reading(self: StdlibCorpus) -> Any:
        raise AssertionError("a cache hit must not read the corpus")

    monkeypatch.setattr(StdlibCorpus, "documents", no_reading)
    second = TextDataModule(corpus=SMALL, seq_len=32, cache_dir=cache)
    second.setup("fit")
    np.testing.assert_array_equal(second.tokens, first.tokens)
    assert isinstance(second.tokens, np.memmap)


def test_cache_key_follows_selection_and_tokenizer(tmp_path: Path) -> None:
    class Renamed(ByteTokenizer):
        name = "bytes-utf8/renamed"

    for corpus, tokenizer in ((SMALL, None), (StdlibCorpus(max_bytes=60_000), None), (SMALL, Renamed())):
        TextDataModule(corpus=corpus, tokenizer=tokenizer, seq_len=16, cache_dir=tmp_path).setup()
    assert len(list(tmp_path.glob("tokens-*.npy"))) == 3
    # Without a cache nothing is written and the tokens are the same.
    uncached = TextDataModule(corpus=SMALL, seq_len=16, use_cache=False)
    cached = TextDataModule(corpus=SMALL, seq_len=16, cache_dir=tmp_path)
    np.testing.assert_array_equal(uncached.tokens, cached.tokens)


def test_an_unreadable_cache_entry_is_rebuilt(tmp_path: Path) -> None:
    dm = TextDataModule(corpus=SMALL, seq_len=16, cache_dir=tmp_path)
    dm.setup()
    entry = next(tmp_path.glob("tokens-*.npy"))
    entry.write_bytes(b"garbage")
    again = TextDataModule(corpus=SMALL, seq_len=16, cache_dir=tmp_path)
    np.testing.assert_array_equal(again.tokens, dm.tokens)


def test_default_cache_dir_is_the_user_cache_not_the_repo(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "lightning_dynmo"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"
    assert TextDataModule(corpus=SMALL).cache is not None
    assert TextDataModule(corpus=SMALL).cache.directory == tmp_path / "mine"  # type: ignore[union-attr]


def test_documents_are_bytes_separated_by_eos(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "1.txt").write_text("ab")
    (tmp_path / "d" / "2.txt").write_text("\u00e9")
    (tmp_path / "d" / "3.txt").write_text("")
    tokens = tokenize(TextFileCorpus(paths=tmp_path / "d"), ByteTokenizer())
    assert tokens.dtype == np.uint8
    assert tokens.tolist() == [97, 98, 0, 0xC3, 0xA9, 0]
    assert ByteTokenizer().decode(tokens[:5].tolist()) == "ab\x00\u00e9"


def test_batches_are_overlapping_next_token_blocks_and_the_split_shares_no_target(tmp_path: Path) -> None:
    dm = TextDataModule(corpus=SMALL, seq_len=16, batch_size=4, shuffle=False, cache_dir=tmp_path)
    tokens = torch.from_numpy(np.array(dm.tokens, dtype=np.int64))
    batch = next(iter(dm.train_dataloader()))
    assert batch.shape == (4, 17) and batch.dtype == torch.int64
    for i in range(4):
        assert torch.equal(batch[i], tokens[i * 16 : i * 16 + 17])
    split = dm.split
    val = dm.val_dataset
    assert len(dm.train_dataset) == split.train_blocks and len(val) == split.val_blocks
    last_train_target = (split.train_blocks - 1) * 16 + 16  # token index of the last training target
    assert split.val_start == last_train_target, "validation targets start right after the training targets"
    assert torch.equal(val[0], tokens[split.val_start : split.val_start + 17])
    assert split.val_blocks == round((split.train_blocks + split.val_blocks) * 0.05)
    shapes = {tuple(b.shape) for loader in (dm.train_dataloader(), dm.val_dataloader()) for b in loader}
    assert shapes == {(4, 17)}, "drop_last: every batch is full"


def test_training_order_is_seeded(tmp_path: Path) -> None:
    def first_batches(**kwargs: Any) -> list[torch.Tensor]:
        dm = TextDataModule(corpus=SMALL, seq_len=16, cache_dir=tmp_path, **kwargs)
        loader = iter(dm.train_dataloader())
        return [next(loader) for _ in range(3)]

    same = first_batches(seed=3)
    assert all(torch.equal(a, b) for a, b in zip(same, first_batches(seed=3), strict=True))
    assert not torch.equal(same[0], first_batches(seed=4)[0])
    ordered = first_batches(shuffle=False)
    assert torch.equal(
        ordered[1][0], TextDataModule(corpus=SMALL, seq_len=16, cache_dir=tmp_path).train_dataset[8]
    )


def test_split_blocks_counts() -> None:
    split = split_blocks(num_tokens=101, seq_len=10, val_fraction=0.2, batch_size=2)
    assert (split.train_blocks, split.val_blocks, split.val_start) == (8, 2, 80)
    tiny = split_blocks(num_tokens=21, seq_len=10, val_fraction=0.01, batch_size=1)
    assert (tiny.train_blocks, tiny.val_blocks) == (1, 1)


def test_bad_inputs_say_what_to_change(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"is empty"):
        _text_module(tmp_path, "").setup()
    with pytest.raises(
        ValueError, match=r"seq_len=64 needs blocks of seq_len \+ 1 = 65 tokens, .* only 12 tokens"
    ):
        _text_module(tmp_path, "hello world", seq_len=64).setup()  # 11 bytes + eos
    with pytest.raises(ValueError, match=r"0 for training .* fewer than one batch of batch_size=1"):
        _text_module(tmp_path, "hello world", seq_len=8, batch_size=1).setup()  # one block, no room for both
    with pytest.raises(
        ValueError, match=r"for validation .* fewer than one batch of batch_size=8.*raise val_fraction"
    ):
        _text_module(tmp_path, "x" * 2000, seq_len=10, batch_size=8, val_fraction=0.01).setup()
    for bad in (0, 1, 1.5, -0.1):
        with pytest.raises(ValueError, match=f"val_fraction={bad} must be a number strictly between 0 and 1"):
            TextDataModule(val_fraction=bad)
    with pytest.raises(ValueError, match=r"seq_len=0 must be an integer >= 1"):
        TextDataModule(seq_len=0)
    with pytest.raises(ValueError, match=r"batch_size=2.5 must be an integer >= 1"):
        TextDataModule(batch_size=2.5)  # type: ignore[arg-type]
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(NotADirectoryError, match=r"is a file, not a directory"):
        TextDataModule(cache_dir=afile)
    with pytest.raises(ValueError, match=r"num_blocks=5 but only 1 blocks"):
        TokenBlocks(np.zeros(12, dtype=np.uint8), seq_len=10, num_blocks=5)


def test_a_tokenizer_out_of_its_vocabulary_is_refused(tmp_path: Path) -> None:
    class Small(ByteTokenizer):
        name, vocab_size = "small", 100

    with pytest.raises(ValueError, match=r"produced ids in \[0, 105\], outside its vocab_size=100"):
        _text_module(tmp_path, "hi", tokenizer=Small()).setup()


def test_store_failure_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = TokenCache(tmp_path / "c")

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(OSError, match=r"cannot create the token cache directory .* use_cache=False"):
        cache.store("k" * 64, np.zeros(3, dtype=np.uint8), {})
