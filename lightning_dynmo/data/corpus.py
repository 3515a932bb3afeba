"""Where the text comes from: the embedded standard-library corpus, plain text files, local HF datasets.

Read in this order: :class:`Corpus` (the protocol the data module uses), :class:`StdlibCorpus` (the
default, needs no download), :class:`TextFileCorpus`, :class:`HFDatasetCorpus`.

A corpus yields *documents* (strings) in a fixed order and a *fingerprint*: a small JSON-able value that
changes whenever the documents would change. The fingerprint is computed from file metadata (path, size,
modification time), never from the content, so a cache hit costs a few ``stat`` calls instead of reading
the corpus; copying a file (new mtime) only costs one rebuild.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = ["Corpus", "HFDatasetCorpus", "StdlibCorpus", "TextFileCorpus"]

#: Directories of the standard library left out of :class:`StdlibCorpus`: installed third-party code,
#: caches, and the test suites (which hold deliberately malformed and non-UTF-8 files).
STDLIB_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)
_NO_DATASETS = (
    "HFDatasetCorpus needs the optional `datasets` package, which is not installed (it is not a dependency "
    "of lightning_dynmo): run `pip install datasets`, or use TextFileCorpus with plain text files."
)


@runtime_checkable
class Corpus(Protocol):
    """A deterministic source of documents for :class:`~lightning_dynmo.data.TextDataModule`."""

    def fingerprint(self) -> dict[str, Any]:
        """A JSON-able value that identifies the documents (part of the token-cache key)."""
        ...

    def documents(self) -> Iterator[str]:
        """The documents, always in the same order."""
        ...

    def describe(self) -> str:
        """One line for logs and error messages."""
        ...


@dataclass(frozen=True, kw_only=True)
class StdlibCorpus:
    """The ``.py`` sources (code and docstrings) of the running Python's standard library.

    Files are taken in sorted order of their path relative to the library root, skipping
    :data:`STDLIB_EXCLUDED_DIRS`, until the next file would exceed ``max_bytes``. The selection is
    deterministic for one interpreter; another Python version ships other sources, so its corpus (and
    cache key) differs.

    Attributes:
        max_bytes: Size budget of the selection in bytes (default 4 MiB, about 4M byte tokens; the
            library of CPython 3.11 has about 12 MB of such sources).
        root: The library directory; ``None`` uses ``sysconfig.get_paths()["stdlib"]``.
    """

    max_bytes: int = 4 * 2**20
    root: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_bytes, int) or self.max_bytes < 1:
            raise ValueError(
                f"StdlibCorpus(max_bytes={self.max_bytes!r}): the size budget must be a positive number of "
                "bytes, e.g. max_bytes=4 * 2**20."
            )

    @property
    def library_root(self) -> Path:
        """The directory whose sources are read."""
        return Path(self.root if self.root is not None else sysconfig.get_paths()["stdlib"])

    def files(self) -> list[Path]:
        """The selected files, in corpus order."""
        root = self.library_root
        if not root.is_dir():
            raise FileNotFoundError(
                f"StdlibCorpus: the standard library directory {str(root)!r} does not exist; pass "
                "root=<a directory of .py files>, or use TextFileCorpus(paths=...) instead."
            )
        candidates = sorted(_walk_sources(root), key=lambda p: p.relative_to(root).as_posix())
        selected, total = [], 0
        for path in candidates:
            total += path.stat().st_size
            if total > self.max_bytes:
                break
            selected.append(path)
        if not selected:
            what = (
                "has no .py sources" if not candidates else f"has none that fit in max_bytes={self.max_bytes}"
            )
            raise ValueError(
                f"StdlibCorpus: {str(root)!r} {what} (a stripped Python install ships only byte code). Raise "
                "max_bytes, or use TextFileCorpus(paths=...) with your own text."
            )
        return selected

    def fingerprint(self) -> dict[str, Any]:
        """Interpreter version, library root, budget and every selected file's size and mtime."""
        root = self.library_root
        return {
            "kind": "stdlib",
            "python": sys.version,
            "root": str(root),
            "max_bytes": self.max_bytes,
            "files": _stat_list(self.files(), root),
        }

    def documents(self) -> Iterator[str]:
        """One document per selected file."""
        for path in self.files():
            yield _read_text(path, "utf-8", "StdlibCorpus")

    def describe(self) -> str:
        """E.g. ``"stdlib sources of Python 3.11.7 (<= 4194304 bytes)"``."""
        return f"stdlib sources of Python {sys.version.split()[0]} (<= {self.max_bytes} bytes)"


@dataclass(frozen=True, kw_only=True)
class TextFileCorpus:
    """Plain text files: each file is one document.

    Attributes:
        paths: One path or several; a directory contributes every file under it (recursively) whose
            name matches ``glob``. Files are read in the given order, each directory's files sorted.
        glob: File-name pattern for directories (e.g. ``"*.md"``, or ``"*"`` for every file).
        encoding: Text encoding of the files.
    """

    paths: str | Path | Sequence[str | Path]
    glob: str = "*.txt"
    encoding: str = "utf-8"

    def __post_init__(self) -> None:
        self.files()  # bad paths fail when the corpus is built, not in the middle of setup

    def _path_list(self) -> list[Path]:
        items = [self.paths] if isinstance(self.paths, (str, Path)) else list(self.paths)
        if not items:
            raise ValueError(
                "TextFileCorpus(paths=[]): no path given; pass a text file, a directory of text files, or a "
                "list of them."
            )
        return [Path(p).expanduser() for p in items]

    def files(self) -> list[Path]:
        """Every file of the corpus, in corpus order."""
        files: list[Path] = []
        for path in self._path_list():
            if path.is_file():
                files.append(path)
            elif path.is_dir():
                found = sorted(p for p in path.rglob(self.glob) if p.is_file())
                if not found:
                    raise ValueError(
                        f"TextFileCorpus: directory {str(path)!r} has no file matching glob={self.glob!r}; "
                        "change `glob` (e.g. glob='*' for every file) or point `paths` at the text files."
                    )
                files.extend(found)
            else:
                raise FileNotFoundError(
                    f"TextFileCorpus: path {str(path)!r} does not exist (resolved from the working directory "
                    f"{str(Path.cwd())!r}); fix `paths` or use an absolute path."
                )
        return files

    def fingerprint(self) -> dict[str, Any]:
        """Every file's absolute path, size and mtime, plus the encoding."""
        return {"kind": "text_files", "encoding": self.encoding, "files": _stat_list(self.files(), None)}

    def documents(self) -> Iterator[str]:
        """One document per file."""
        for path in self.files():
            yield _read_text(path, self.encoding, "TextFileCorpus")

    def describe(self) -> str:
        """E.g. ``"3 text file(s) under ['data/']"``."""
        return f"{len(self.files())} text file(s) from {[str(p) for p in self._path_list()]}"


@dataclass(frozen=True, kw_only=True)
class HFDatasetCorpus:
    """A Hugging Face dataset saved on local disk (``Dataset.save_to_disk``): one document per row.

    Needs the optional ``datasets`` package (not a dependency of lightning_dynmo); nothing is
    downloaded.

    Attributes:
        path: The directory written by ``save_to_disk`` (a ``Dataset`` or a ``DatasetDict``).
        split: Which split of a ``DatasetDict`` to read (ignored for a plain ``Dataset``).
        text_column: The column holding the text.
    """

    path: str | Path
    split: str = "train"
    text_column: str = "text"

    def __post_init__(self) -> None:
        if importlib.util.find_spec("datasets") is None:
            raise ImportError(_NO_DATASETS)
        if not Path(self.path).expanduser().is_dir():
            raise FileNotFoundError(
                f"HFDatasetCorpus: path {str(self.path)!r} is not a directory; pass the directory written by "
                "`dataset.save_to_disk(path)`."
            )

    def _load(self) -> Any:
        try:
            datasets: Any = importlib.import_module("datasets")
        except ImportError as err:
            raise ImportError(_NO_DATASETS) from err
        loaded = datasets.load_from_disk(str(Path(self.path).expanduser()))
        if isinstance(loaded, datasets.DatasetDict):
            if self.split not in loaded:
                raise ValueError(
                    f"HFDatasetCorpus: split={self.split!r} is not in {str(self.path)!r}, which has the "
                    f"splits {sorted(loaded)}; pick one of them."
                )
            loaded = loaded[self.split]
        if self.text_column not in loaded.column_names:
            raise ValueError(
                f"HFDatasetCorpus: text_column={self.text_column!r} is not a column of {str(self.path)!r} "
                f"(columns: {loaded.column_names}); pass the column that holds the text."
            )
        return loaded

    def fingerprint(self) -> dict[str, Any]:
        """Split, column, and every file of the saved dataset (size and mtime)."""
        root = Path(self.path).expanduser().resolve()
        files = sorted(p for p in root.rglob("*") if p.is_file())
        return {
            "kind": "hf_dataset",
            "split": self.split,
            "text_column": self.text_column,
            "root": str(root),
            "files": _stat_list(files, root),
        }

    def documents(self) -> Iterator[str]:
        """One document per row, in row order (read in chunks of 1000 rows)."""
        dataset = self._load()
        for start in range(0, len(dataset), 1000):
            yield from dataset[start : start + 1000][self.text_column]

    def describe(self) -> str:
        """E.g. ``"HF dataset /data/wiki (split 'train', column 'text')"``."""
        return f"HF dataset {str(self.path)!r} (split {self.split!r}, column {self.text_column!r})"


def _walk_sources(root: Path) -> Iterator[Path]:
    """``*.py`` files under ``root``, never descending into an excluded directory."""
    for folder, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in STDLIB_EXCLUDED_DIRS]
        for name in names:
            path = Path(folder) / name
            if name.endswith(".py") and path.is_file():
                yield path


def _stat_list(files: list[Path], root: Path | None) -> list[tuple[str, int, int]]:
    rows = []
    for path in files:
        stat = path.stat()
        name = path.relative_to(root).as_posix() if root is not None else str(path.resolve())
        rows.append((name, stat.st_size, stat.st_mtime_ns))
    return rows


def _read_text(path: Path, encoding: str, who: str) -> str:
    try:
        return path.read_text(encoding=encoding)
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{who}: {str(path)!r} is not valid {encoding} ({err.reason} at byte {err.start}); convert the "
            "file, pass its `encoding=`, or leave it out of the corpus."
        ) from err
