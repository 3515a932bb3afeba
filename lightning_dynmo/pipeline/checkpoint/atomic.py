"""Replace a checkpoint without ever destroying the last good one: write aside, then swap, then clean up.

Read in this order: :func:`staging_path` (where a save writes before it is complete), :func:`swap_in` (the
complete staged checkpoint takes the target's place), :func:`repair` (what an interrupted save left
behind, put right), then the helpers.

At every instant the target path holds either the complete old checkpoint or the complete new one:

- On Linux, :func:`swap_in` exchanges the staged and the target path in one ``renameat2(RENAME_EXCHANGE)``
  system call, then removes the staged path, which now holds the old checkpoint.
- Elsewhere (or on a file system without the exchange) it renames the old checkpoint aside, renames the
  new one in and removes the old one. A crash between the two renames leaves no target, a complete old
  checkpoint aside and a complete new one staged: :func:`repair`, which every save calls first, promotes
  the new one (it is complete: the old one is moved aside only after the new one is).

A staged name starts with a dot and does not end in ``.ckpt``, so Lightning never takes an unfinished
save for a checkpoint. A set-aside name keeps the target's stem and suffix (``last.ckpt`` is set aside as
``last.dynmo-aside-<token>.ckpt``): in the rename-aside window, Lightning's ``ckpt_path="last"`` still
finds the complete old checkpoint.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["leftovers", "repair", "set_aside_from", "staging_path", "swap_in"]

_STAGED = "dynmo-staged"
_ASIDE = "dynmo-aside"
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def staging_path(target: str | Path, token: str) -> Path:
    """The sibling a save of ``target`` writes into before it is complete (``token`` tells saves apart)."""
    target = Path(target)
    return target.parent / f".{target.name}.{_STAGED}-{token}"


def swap_in(staged: Path, target: Path, *, exchange: bool = True) -> None:
    """Put the complete checkpoint ``staged`` (file or directory) at ``target``, replacing what is there.

    Args:
        staged: A complete checkpoint, a sibling of ``target`` (from :func:`staging_path`).
        target: Where it belongs; a checkpoint already there is replaced.
        exchange: Use the atomic exchange where the platform has it (tests turn it off to exercise the
            rename-aside path).
    """
    if not (target.exists() or target.is_symlink()):
        _rename(staged, target)
    elif exchange and _exchange(staged, target):
        _remove(staged)  # it now holds the old checkpoint
    else:
        aside = _aside_path(target, staged.name.rsplit("-", 1)[-1])
        _rename(target, aside)
        _rename(staged, target)
        _remove(aside)
    _sync_directory(target.parent)


def leftovers(target: str | Path) -> tuple[list[Path], list[Path]]:
    """The staged and the set-aside siblings that saves of ``target`` left behind (each sorted by name)."""
    target = Path(target)
    if not target.parent.is_dir():
        return [], []
    staged = sorted(target.parent.glob(f".{_glob_escape(target.name)}.{_STAGED}-*"))
    aside = sorted(target.parent.glob(_glob_escape(_aside_path(target, "TOKEN").name).replace("TOKEN", "*")))
    return staged, aside


def repair(target: str | Path) -> None:
    """Put right what an interrupted save of ``target`` left behind, saying what it did in a log line.

    - ``target`` present: any staged (unfinished) or set-aside (replaced) sibling is removed.
    - ``target`` missing, a checkpoint set aside: the save was interrupted between its two renames; its
      staged checkpoint is complete and takes the target's place (or, if it is gone too, the old one
      returns).
    - ``target`` missing, nothing set aside: a staged sibling is an unfinished first save; removed.
    """
    target = Path(target)
    staged, aside = leftovers(target)
    if not staged and not aside:
        return
    if not (target.exists() or target.is_symlink()) and aside:
        back = staged[-1] if staged else aside[-1]
        _rename(back, target)
        log.warning(
            "checkpoint %s: a save was interrupted while it replaced the checkpoint; restored the %s one",
            target,
            "new (complete)" if staged else "previous",
        )
        staged, aside = leftovers(target)
    for path in [*staged, *aside]:
        log.warning("checkpoint %s: removing %s, left by an interrupted save", target, path.name)
        _remove(path)
    _sync_directory(target.parent)


def set_aside_from(path: str | Path) -> Path | None:
    """What ``path`` was set aside from, if any (``last.dynmo-aside-<token>.ckpt``: ``last.ckpt``)."""
    path = Path(path)
    stem, marker, rest = path.name.partition(f".{_ASIDE}-")
    if not marker or not stem:
        return None
    suffix = Path(rest).suffix
    return path.with_name(stem + suffix)


def _rename(src: Path, dst: Path) -> None:
    """One rename (atomic within a file system); a seam where fault-injection tests stop a save."""
    os.rename(src, dst)


def _aside_path(target: Path, token: str) -> Path:
    stem, suffix = (target.stem, target.suffix) if target.suffix else (target.name, "")
    return target.parent / f"{stem}.{_ASIDE}-{token}{suffix}"


def _exchange(a: Path, b: Path) -> bool:
    """Atomically exchange two paths (Linux ``renameat2``); ``False`` where the platform cannot."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False  # this file system has no exchange: fall back to rename-aside
    raise OSError(err, f"cannot exchange {a} and {b}: {os.strerror(err)}")


def _renameat2() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    return getattr(libc, "renameat2", None)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _sync_directory(directory: Path) -> None:
    """Make the renames in ``directory`` durable (a power loss after the save keeps the new checkpoint)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # a platform without directory descriptors: the renames are still atomic, just not synced
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory; durability is then theirs to give
    finally:
        os.close(fd)


def _glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)
