"""Corpora: the stdlib selection is deterministic, files and HF datasets read in order, bad input fails."""

from __future__ import annotations

import importlib.machinery
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from lightning_dynmo.data import HFDatasetCorpus, StdlibCorpus, TextFileCorpus
from lightning_dynmo.data.corpus import STDLIB_EXCLUDED_DIRS


def test_stdlib_selection_is_sorted_within_budget_and_skips_tests() -> None:
    corpus = StdlibCorpus(max_bytes=300_000)
    files = corpus.files()
    root = corpus.library_root
    names = [p.relative_to(root).as_posix() for p in files]
    assert names == sorted(names)
    assert sum(p.stat().st_size for p in files) <= 300_000
    assert not any(STDLIB_EXCLUDED_DIRS & set(p.relative_to(root).parts) for p in files)
    assert files == StdlibCorpus(max_bytes=300_000).files()
    # A larger budget extends the same prefix: the selection is a function of the sorted list and the budget.
    assert StdlibCorpus(max_bytes=600_000).files()[: len(files)] == files
    assert next(corpus.documents()) == files[0].read_text(encoding="utf-8")


def test_stdlib_fingerprint_follows_the_selection() -> None:
    small, large = StdlibCorpus(max_bytes=100_000), StdlibCorpus(max_bytes=200_000)
    assert small.fingerprint() == StdlibCorpus(max_bytes=100_000).fingerprint()
    assert small.fingerprint() != large.fingerprint()


def test_stdlib_corpus_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"size budget must be a positive"):
        StdlibCorpus(max_bytes=0)
    with pytest.raises(FileNotFoundError, match=r"does not exist; pass root="):
        StdlibCorpus(root=str(tmp_path / "nowhere")).files()
    (tmp_path / "notes.txt").write_text("no python here")
    with pytest.raises(ValueError, match=r"has no .py sources"):
        StdlibCorpus(root=str(tmp_path)).files()
    (tmp_path / "big.py").write_text("x = 1\n" * 100)
    with pytest.raises(ValueError, match=r"none that fit in max_bytes=10"):
        StdlibCorpus(root=str(tmp_path), max_bytes=10).files()


def test_text_files_and_directories_in_order(tmp_path: Path) -> None:
    folder = tmp_path / "books"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("bee")
    (folder / "sub" / "a.txt").write_text("ay")
    (folder / "skip.md").write_text("not a txt")
    single = tmp_path / "first.txt"
    single.write_text("one")
    corpus = TextFileCorpus(paths=[single, folder])
    assert list(corpus.documents()) == ["one", "bee", "ay"]
    assert list(TextFileCorpus(paths=str(folder), glob="*.md").documents()) == ["not a txt"]
    before = corpus.fingerprint()
    (folder / "b.txt").write_text("a longer bee")
    assert corpus.fingerprint() != before, "a changed file must change the cache key"


def test_text_file_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"missing.txt' does not exist"):
        TextFileCorpus(paths=tmp_path / "missing.txt")
    with pytest.raises(ValueError, match=r"no path given"):
        TextFileCorpus(paths=[])
    (tmp_path / "a.md").write_text("markdown")
    with pytest.raises(ValueError, match=r"no file matching glob='\*.txt'; change `glob`"):
        TextFileCorpus(paths=tmp_path)
    bad = tmp_path / "latin.txt"
    bad.write_bytes("caf\u00e9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"is not valid utf-8.*pass its `encoding=`"):
        list(TextFileCorpus(paths=bad).documents())
    assert list(TextFileCorpus(paths=bad, encoding="latin-1").documents()) == ["caf\u00e9"]


def test_hf_corpus_without_datasets_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ImportError, match=r"pip install datasets"):
        HFDatasetCorpus(path=tmp_path)


class _FakeDataset:
    """The slice of ``datasets.Dataset`` that HFDatasetCorpus uses."""

    def __init__(self, rows: list[dict[str, Any]]):
        self.rows, self.column_names = rows, list(rows[0])

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: slice) -> dict[str, list[Any]]:
        return {k: [r[k] for r in self.rows[index]] for k in self.column_names}


class _FakeDatasetDict(dict):  # type: ignore[type-arg]
    pass


@pytest.fixture
def fake_datasets(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    saved: dict[str, Any] = {}
    module = types.ModuleType("datasets")
    module.__spec__ = importlib.machinery.ModuleSpec("datasets", None)
    module.DatasetDict = _FakeDatasetDict  # type: ignore[attr-defined]
    module.load_from_disk = lambda path: saved[path]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", module)
    return saved


def test_hf_corpus_reads_rows_of_a_split(fake_datasets: dict[str, Any], tmp_path: Path) -> None:
    rows = [{"text": f"row {i}", "id": i} for i in range(2500)]
    fake_datasets[str(tmp_path)] = _FakeDatasetDict(train=_FakeDataset(rows), test=_FakeDataset(rows[:1]))
    docs = list(HFDatasetCorpus(path=tmp_path).documents())
    assert docs == [f"row {i}" for i in range(2500)]
    assert list(HFDatasetCorpus(path=tmp_path, split="test").documents()) == ["row 0"]
    with pytest.raises(ValueError, match=r"split='valid' is not in .* splits \['test', 'train'\]"):
        list(HFDatasetCorpus(path=tmp_path, split="valid").documents())
    with pytest.raises(ValueError, match=r"text_column='body' is not a column .*\['text', 'id'\]"):
        list(HFDatasetCorpus(path=tmp_path, text_column="body").documents())
    with pytest.raises(FileNotFoundError, match=r"save_to_disk"):
        HFDatasetCorpus(path=tmp_path / "nope")


def test_hf_corpus_with_the_real_package(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")  # optional dependency: runs where it is installed
    datasets.Dataset.from_dict({"text": ["alpha", "beta"]}).save_to_disk(str(tmp_path / "ds"))
    assert list(HFDatasetCorpus(path=tmp_path / "ds").documents()) == ["alpha", "beta"]
