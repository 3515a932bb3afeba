"""Which checkpoint to resume from: the one asked for, or, for an incomplete ``last*.ckpt``, the newest
complete checkpoint beside it (with a warning naming the one skipped).

Read in this order: :func:`incompleteness` (why a checkpoint cannot be read whole, cheaply: a directory's
manifest and file sizes, a file's zip directory; no checksum pass), then :func:`resume_path`.

Lightning resolves ``ckpt_path="last"`` to the newest ``last*.ckpt`` of the Trainer's ``ModelCheckpoint``
callbacks before the strategy sees it. DynMo's saves replace a checkpoint atomically
(:mod:`.atomic`), so ``last.ckpt`` is complete unless something else wrote it (an older release's
delete-then-write save, a copy cut short, a file system without atomic renames): then the newest complete
``*.ckpt`` in the same directory is used instead, and a warning names what was skipped and why. Any other
path, named explicitly, is read as given: its loader fails on it, naming it.
"""

from __future__ import annotations

import warnings
import zipfile
from pathlib import Path

from lightning_dynmo.pipeline.checkpoint.atomic import leftovers, repair, set_aside_from
from lightning_dynmo.pipeline.checkpoint.checksums import CheckpointCorruptError, read_manifest

__all__ = ["incompleteness", "is_last_checkpoint", "resume_path"]

_SUFFIX = ".ckpt"


def incompleteness(path: str | Path) -> str | None:
    """Why ``path`` is not a complete checkpoint (``None``: it is), from metadata only.

    A directory needs its manifest (written last, verified by its own CRC-32) and every file it lists at
    its recorded size at least; a file must be a whole zip archive (``torch.save``'s format ends with the
    archive's directory, so a truncated file fails).
    """
    path = Path(path)
    if path.is_dir():
        try:
            manifest = read_manifest(path)
        except CheckpointCorruptError as err:
            return str(err)
        sizes = {name: size for name, (size, _) in manifest.whole_files.items()}
        for item in manifest.items.values():
            sizes[item.file] = max(sizes.get(item.file, 0), item.offset + item.length)
        for name, size in sorted(sizes.items()):
            file = path / name
            if not file.is_file() or file.stat().st_size < size:
                return f"{name} is missing or shorter than the manifest records ({size} bytes)"
        return None
    if path.is_file():
        return None if zipfile.is_zipfile(path) else "not a whole torch checkpoint file (truncated?)"
    return "it does not exist"


def is_last_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is one ``ckpt_path="last"`` resolves to (``last.ckpt``, ``last-v1.ckpt``, ...)."""
    name = Path(path).name
    return name.startswith("last") and name.endswith(_SUFFIX)


def resume_path(path: str | Path) -> Path:
    """The checkpoint to read for ``path``; call on one rank and share the answer (it may repair files).

    - A missing path, or a set-aside name (a save interrupted between its renames; Lightning's ``"last"``
      may pick it): the checkpoint it was set aside from, repaired first (:func:`.atomic.repair`).
    - An incomplete ``last*.ckpt``: the newest complete ``*.ckpt`` in its directory, with a warning.
    - Anything else: ``path``.

    Raises:
        FileNotFoundError: an incomplete ``last*.ckpt`` with no complete checkpoint beside it.
    """
    path = Path(path)
    path = set_aside_from(path) or path
    if not path.exists():
        repair(path)
    if not is_last_checkpoint(path) or (why := incompleteness(path)) is None:
        return path
    staged, aside = leftovers(path)
    skip = {path, *staged, *aside}
    others = [p for p in path.parent.glob(f"*{_SUFFIX}") if p not in skip and incompleteness(p) is None]
    if not others:
        raise FileNotFoundError(
            f"checkpoint {str(path)!r} is incomplete ({why}) and {str(path.parent)!r} holds no complete "
            "checkpoint to resume from instead; resume from another directory or start without ckpt_path."
        )
    newest = max(others, key=lambda p: p.stat().st_mtime)
    warnings.warn(
        f"DynMo: skipping checkpoint {str(path)!r}: it is incomplete ({why}); resuming from {str(newest)!r}, "
        "the newest complete checkpoint beside it.",
        stacklevel=2,
    )
    return newest
