"""The token cache: a corpus is tokenised once, saved as one ``.npy`` file, and memory-mapped afterwards.

An entry is keyed by a SHA-256 of the corpus fingerprint (see :mod:`.corpus`), the tokenizer's ``name``
and this module's format version, so a different selection, tokenizer or layout never reads a stale
entry. Files are written under a temporary name and renamed into place, so ranks or jobs that build the
same entry at once never read a half-written file; the last writer wins with identical content.

Location: the ``cache_dir`` argument, else ``$LIGHTNING_DYNMO_CACHE``, else ``$XDG_CACHE_HOME/
lightning_dynmo``, else ``~/.cache/lightning_dynmo`` (``%LOCALAPPDATA%\\lightning_dynmo`` on Windows);
never inside the repository.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

log = logging.getLogger(__name__)

__all__ = ["TokenCache", "cache_key", "default_cache_dir"]

CACHE_FORMAT = "lightning_dynmo.tokens/1"
#: Environment variable that overrides the default cache directory.
CACHE_ENV = "LIGHTNING_DYNMO_CACHE"


def default_cache_dir() -> Path:
    """The user cache directory of lightning_dynmo (see the module docstring for the lookup order)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    if sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        return Path(os.environ["LOCALAPPDATA"]) / "lightning_dynmo"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "lightning_dynmo"


def cache_key(corpus_fingerprint: Any, tokenizer_name: str) -> str:
    """Hex SHA-256 of the format version, the corpus fingerprint and the tokenizer name."""
    material = json.dumps(
        {"format": CACHE_FORMAT, "corpus": corpus_fingerprint, "tokenizer": tokenizer_name}, sort_keys=True
    )
    return hashlib.sha256(material.encode("utf-8")).hexdigest()


class TokenCache:
    """A directory of tokenised corpora.

    Args:
        directory: Where entries live; created on first write. ``None`` uses :func:`default_cache_dir`.
    """

    def __init__(self, directory: str | Path | None = None):
        self.directory = Path(directory).expanduser() if directory is not None else default_cache_dir()
        if self.directory.exists() and not self.directory.is_dir():
            raise NotADirectoryError(
                f"cache_dir={str(self.directory)!r} is a file, not a directory; pass a directory for the "
                "token cache (it is created if missing), or use_cache=False to tokenise in memory."
            )

    def path(self, key: str) -> Path:
        """The ``.npy`` file of entry ``key``."""
        return self.directory / f"tokens-{key[:32]}.npy"

    def load(self, key: str) -> npt.NDArray[np.integer] | None:
        """The entry's tokens (memory-mapped, read-only), or ``None`` if it is absent or unreadable."""
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            tokens: npt.NDArray[np.integer] = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as err:  # truncated or foreign file: rebuild rather than fail
            log.warning("token cache entry %s is unreadable (%s); rebuilding it", path, err)
            return None
        return tokens

    def store(self, key: str, tokens: npt.NDArray[np.integer], info: dict[str, Any]) -> Path:
        """Write an entry atomically; ``info`` goes to a JSON file beside it (for people, not for loading)."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise OSError(
                f"cannot create the token cache directory {str(self.directory)!r} ({err.strerror}); pass a "
                f"writable cache_dir, set ${CACHE_ENV}, or use_cache=False to tokenise in memory."
            ) from err
        path = self.path(key)
        tmp = path.with_name(f".{path.stem}-{uuid.uuid4().hex}.tmp.npy")
        np.save(tmp, tokens, allow_pickle=False)
        path.with_suffix(".json").write_text(json.dumps({**info, "key": key}, indent=1, sort_keys=True))
        os.replace(tmp, path)
        return path

    def load_or_build(
        self, key: str, build: Callable[[], npt.NDArray[np.integer]], info: dict[str, Any]
    ) -> npt.NDArray[np.integer]:
        """The cached tokens of ``key``; on a miss, ``build()`` them, store them and return them."""
        tokens = self.load(key)
        if tokens is not None:
            log.info("loaded %d tokens from the cache %s", tokens.shape[0], self.path(key))
            return tokens
        tokens = build()
        log.info("tokenised %d tokens; cached in %s", tokens.shape[0], self.store(key, tokens, info))
        return tokens
