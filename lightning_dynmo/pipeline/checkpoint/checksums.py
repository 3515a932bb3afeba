"""Checkpoint integrity: every DynMo checkpoint carries CRC-32 checksums that are verified on load.

Read in this order: :class:`CheckpointCorruptError` (what a damaged checkpoint raises),
:func:`load_torch_file` (a single ``torch.save`` file, verified then loaded), :class:`ItemChecksum`,
:func:`write_manifest` and :func:`read_manifest` (the checksum manifest of a sharded checkpoint
directory), :func:`verify_item` (one item of it), then the helpers.

Single file. ``torch.save`` writes a zip archive whose records (the pickled structure ``<name>/data.pkl``
and one record ``<name>/data/<key>`` per tensor storage) each carry a CRC-32, but ``torch.load`` does not
check them: overwritten tensor bytes load silently. :func:`load_torch_file` reads the file once, checks
every record's CRC-32 with Python's ``zipfile`` and only then unpickles it. A mismatch names the file,
the record and the checkpoint entries whose tensors live in it (e.g.
``optimizer_states[0]['state']['layers.3.fc1.weight']['exp_avg']``, found by reading the pickled structure
without rebuilding any object). A truncated file has lost its zip directory (which sits at the end); the
record the file ends in is found by walking the records' local headers from the start.

Sharded directory. ``dynmo_checksums.json`` lists every stored item (data file, byte offset, length,
CRC-32 of the stored bytes, key) and the size and CRC-32 of each small file the loaders read whole
(``.metadata``, ``meta.pt``); the manifest carries a CRC-32 of its own content. Writers checksum the
bytes they wrote; a loading rank checks the manifest and the small files, then each item it reads, as it
reads it (:func:`verify_item`), so verification costs no extra read and covers exactly the rank's share.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import zipfile
import zlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "MANIFEST_FILENAME",
    "MANIFEST_FORMAT",
    "CheckpointCorruptError",
    "ItemChecksum",
    "crc32_of_file",
    "crc32_of_stream",
    "crc32_records",
    "load_torch_file",
    "read_manifest",
    "verify_item",
    "verify_torch_bytes",
    "write_manifest",
]

MANIFEST_FILENAME = "dynmo_checksums.json"
MANIFEST_FORMAT = "lightning_dynmo.checksums/1"
_FIX = (
    "The file changed after it was written (a disk, copy or transfer error); resume from another checkpoint."
)


class CheckpointCorruptError(RuntimeError):
    """A checkpoint file failed its checksum or is truncated; the message names the file and the entry."""


def load_torch_file(path: str | os.PathLike[str], *, weights_only: bool | None = None) -> Any:
    """``torch.load`` of a checkpoint file on CPU, after checking the CRC-32 of every zip record.

    The file is read once; verification and unpickling work on the same bytes.

    Raises:
        CheckpointCorruptError: naming the file and the damaged record (and its checkpoint entries), or
            the record a truncated file ends in.
    """
    import torch  # torch only here: the rest of the module is plain Python

    data = Path(path).read_bytes()
    verify_torch_bytes(data, str(path))
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)


@contextmanager
def crc32_records() -> Iterator[None]:
    """Make ``torch.save`` compute its records' CRC-32 (torch's default, which a user may have turned off)."""
    from torch.serialization import get_crc32_options, set_crc32_options  # torch only here, as above

    before = get_crc32_options()
    set_crc32_options(True)
    try:
        yield
    finally:
        set_crc32_options(before)


def verify_torch_bytes(data: bytes, name: str) -> None:
    """Check every record of a ``torch.save`` zip archive against its stored CRC-32.

    Raises:
        CheckpointCorruptError: see :func:`load_torch_file`.
    """
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as err:
        raise CheckpointCorruptError(_truncation_message(data, name, err)) from err
    with archive:
        for info in archive.infolist():
            try:
                with archive.open(info) as record:
                    while record.read(1 << 20):
                        pass
            except (zipfile.BadZipFile, zlib.error, EOFError) as err:
                entries = _entries_of_record(archive, info.filename)
                where = f" (holds {', '.join(entries)})" if entries else ""
                raise CheckpointCorruptError(
                    f"checkpoint file {name!r} is damaged: its record {info.filename!r}{where} fails its "
                    f"CRC-32 check ({err}). {_FIX}"
                ) from err


# ----------------------------------------------------------------------------------------------------
# The manifest of a sharded checkpoint
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ItemChecksum:
    """One stored item of a sharded checkpoint.

    Attributes:
        file: Data file name, relative to the checkpoint directory.
        offset: First byte of the item in ``file``.
        length: Number of stored bytes.
        crc32: CRC-32 of those bytes.
        key: The item's key (e.g. ``"state_dict.layers.3.fc1.weight"``).
    """

    file: str
    offset: int
    length: int
    crc32: int
    key: str


def write_manifest(directory: Path, items: Sequence[ItemChecksum], whole_files: Sequence[str]) -> None:
    """Write the checksum manifest of ``directory`` (atomically, as the checkpoint's last file).

    Args:
        directory: The checkpoint directory.
        items: Every stored item, from every writer.
        whole_files: Small files that loaders read whole (their size and CRC-32 are recorded now).
    """
    body = {
        "format": MANIFEST_FORMAT,
        "files": {
            f: {"size": (directory / f).stat().st_size, "crc32": crc32_of_file(directory / f)}
            for f in whole_files
        },
        "items": sorted([i.file, i.offset, i.length, i.crc32, i.key] for i in items),
    }
    text = json.dumps({**body, "crc32": _crc_of_json(body)}, indent=0)
    tmp = directory / f".{MANIFEST_FILENAME}.tmp"
    tmp.write_text(text)
    os.replace(tmp, directory / MANIFEST_FILENAME)


@dataclass(frozen=True)
class Manifest:
    """A verified manifest: items by (file, offset), and the recorded whole files."""

    directory: Path
    items: Mapping[tuple[str, int], ItemChecksum]
    whole_files: Mapping[str, tuple[int, int]]

    def check_whole_file(self, name: str, data: bytes) -> None:
        """Compare a small file read whole with its recorded size and CRC-32.

        Raises:
            CheckpointCorruptError: naming the file.
        """
        size, crc = self.whole_files[name]
        path = self.directory / name
        if len(data) != size:
            raise CheckpointCorruptError(
                f"checkpoint file {str(path)!r} has {len(data)} bytes but was written with {size}: it is "
                f"truncated or was replaced. {_FIX}"
            )
        if zlib.crc32(data) != crc:
            raise CheckpointCorruptError(
                f"checkpoint file {str(path)!r} fails its CRC-32 check (stored {crc:#010x}, computed "
                f"{zlib.crc32(data):#010x}). {_FIX}"
            )


def read_manifest(directory: Path) -> Manifest:
    """Read and verify ``directory``'s checksum manifest.

    Raises:
        CheckpointCorruptError: if the manifest is missing (the save did not finish), unreadable or
            fails its own CRC-32.
    """
    path = directory / MANIFEST_FILENAME
    if not path.is_file():
        raise CheckpointCorruptError(
            f"checkpoint directory {str(directory)!r} has no {MANIFEST_FILENAME}: the save did not finish "
            "(it is written last) or the file was removed. Resume from another checkpoint."
        )
    try:
        raw = json.loads(path.read_text())
        body = {k: v for k, v in raw.items() if k != "crc32"}
        ok = raw.get("format") == MANIFEST_FORMAT and raw.get("crc32") == _crc_of_json(body)
    except (ValueError, AttributeError, UnicodeDecodeError) as err:
        raise CheckpointCorruptError(
            f"checkpoint manifest {str(path)!r} is unreadable ({err}). {_FIX}"
        ) from err
    if not ok:
        raise CheckpointCorruptError(
            f"checkpoint manifest {str(path)!r} fails its own CRC-32 check or has an unknown format. {_FIX}"
        )
    items = {(f, o): ItemChecksum(f, o, n, c, k) for f, o, n, c, k in body["items"]}
    whole = {name: (entry["size"], entry["crc32"]) for name, entry in body["files"].items()}
    return Manifest(directory=directory, items=items, whole_files=whole)


def verify_item(manifest: Manifest, file: str, offset: int, data: bytes, expected_length: int) -> None:
    """Check the bytes just read for the item stored at ``offset`` in ``file``.

    Raises:
        CheckpointCorruptError: naming the file and the item's key when the file ended early, the item is
            not in the manifest, or its CRC-32 differs.
    """
    path = str(manifest.directory / file)
    item = manifest.items.get((file, offset))
    if item is None or item.length != expected_length:
        raise CheckpointCorruptError(
            f"checkpoint file {path!r}: DCP's metadata points at bytes [{offset}, "
            f"{offset + expected_length}) which the checksum manifest does not list; .metadata and the "
            f"manifest disagree. {_FIX}"
        )
    if len(data) != item.length:
        raise CheckpointCorruptError(
            f"checkpoint file {path!r} is truncated: entry {item.key!r} needs bytes [{offset}, "
            f"{offset + item.length}) but the file ends at byte {offset + len(data)}. {_FIX}"
        )
    if zlib.crc32(data) != item.crc32:
        raise CheckpointCorruptError(
            f"checkpoint file {path!r} is damaged: entry {item.key!r} (bytes [{offset}, "
            f"{offset + item.length})) fails its CRC-32 check (stored {item.crc32:#010x}, computed "
            f"{zlib.crc32(data):#010x}). {_FIX}"
        )


def crc32_of_file(path: Path) -> int:
    """CRC-32 of a whole file, streamed."""
    with open(path, "rb") as f:
        return crc32_of_stream(f, 0, None)


def crc32_of_stream(f: Any, offset: int, length: int | None) -> int:
    """CRC-32 of ``length`` bytes of the open binary file ``f`` from ``offset`` (to its end when ``None``)."""
    crc = 0
    f.seek(offset)
    left = length
    while left is None or left > 0:
        chunk = f.read(1 << 20 if left is None else min(left, 1 << 20))
        if not chunk:
            break
        crc = zlib.crc32(chunk, crc)
        if left is not None:
            left -= len(chunk)
    return crc


def _crc_of_json(body: Mapping[str, Any]) -> int:
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


# ----------------------------------------------------------------------------------------------------
# Naming damaged records of a torch.save archive
# ----------------------------------------------------------------------------------------------------

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_SIGNATURE = 0x04034B50


def _truncation_message(data: bytes, name: str, err: Exception) -> str:
    records = list(_local_records(data))
    if not records:
        return f"checkpoint file {name!r} ({len(data)} bytes) is not a torch checkpoint: {err}. {_FIX}"
    last_name, data_start = records[-1]
    return (
        f"checkpoint file {name!r} is truncated: it has {len(data)} bytes and lost its zip directory (kept "
        f"at the end); the file ends inside or after its record {last_name!r} (data from byte {data_start}). "
        f"{_FIX}"
    )


def _local_records(data: bytes) -> Iterator[tuple[str, int]]:
    """(record name, data offset) of each zip local header found from the start of ``data``.

    torch writes sizes after each record's data, so headers are found by their signature; a hit inside
    tensor bytes is rejected unless its name shares the first record's archive prefix.
    """
    prefix: str | None = None
    pos = data.find(b"PK\x03\x04")
    while pos >= 0 and pos + _LOCAL_HEADER.size <= len(data):
        fields = _LOCAL_HEADER.unpack_from(data, pos)
        name_len, extra_len = fields[9], fields[10]
        start = pos + _LOCAL_HEADER.size
        try:
            record = data[start : start + name_len].decode()
        except UnicodeDecodeError:
            record = ""
        plausible = fields[0] == _LOCAL_SIGNATURE and 0 < name_len < 512 and start + name_len <= len(data)
        if plausible and (prefix is None or record.startswith(prefix)):
            prefix = prefix or record.split("/", 1)[0] + "/"
            yield record, start + name_len + extra_len
        pos = data.find(b"PK\x03\x04", pos + 4)


def _entries_of_record(archive: zipfile.ZipFile, record: str) -> list[str]:
    """Checkpoint entries (as subscript paths) whose tensors are stored in ``record``."""
    _, _, tail = record.partition("/data/")
    pickles = [n for n in archive.namelist() if n.endswith("/data.pkl")]
    if not tail or not pickles:
        return []
    try:
        root = _OpaqueUnpickler(io.BytesIO(archive.read(pickles[0]))).load()
    except Exception:  # a damaged structure record: nothing more to name than the record itself
        return []
    return [
        path.removeprefix("['").replace("']", "", 1) if path.startswith("['") else path or "<root>"
        for path, key in _storage_refs(root, "")
        if key == tail
    ]


@dataclass(frozen=True)
class _StorageRef:
    key: str


class _Opaque:
    """Stands for any object of the pickle; keeps what built it so storage references can be found.

    ``args`` are the constructor's arguments (a tensor's storage among them: walked without extending
    the path); ``items`` what pickle set on the object afterwards (state, items, appended values).
    """

    args: list[Any]
    items: list[Any]

    def __new__(cls, *args: Any, **kwargs: Any) -> _Opaque:
        self = super().__new__(cls)
        self.args = [*args, *kwargs.values()]
        self.items = []
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Opaque:
        return _Opaque(self, *args, **kwargs)

    def __setstate__(self, state: Any) -> None:
        self.items.append(state)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.items.append({key: value})

    def append(self, value: Any) -> None:
        self.items.append(value)

    def extend(self, values: Any) -> None:
        self.items.extend(values)


_SAFE_BUILTINS = {"dict", "list", "tuple", "set", "frozenset", "bytearray", "complex", "slice", "range"}


class _OpaqueUnpickler(pickle.Unpickler):
    """Reads torch's pickled structure without importing or calling anything (every class is opaque)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _SAFE_BUILTINS:
            return super().find_class(module, name)
        if module == "collections" and name == "OrderedDict":
            return super().find_class(module, name)
        return _Opaque

    def persistent_load(self, pid: Any) -> Any:
        return _StorageRef(str(pid[2])) if isinstance(pid, tuple) and len(pid) > 2 else _Opaque()


def _storage_refs(obj: Any, path: str) -> Iterator[tuple[str, str]]:
    if isinstance(obj, _StorageRef):
        yield path, obj.key
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _storage_refs(value, f"{path}[{key!r}]")
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            yield from _storage_refs(value, f"{path}[{i}]")
    elif isinstance(obj, _Opaque):
        for arg in obj.args:  # a tensor rebuilt from a storage keeps the path of the tensor
            yield from _storage_refs(arg, path)
        for item in obj.items:
            yield from _storage_refs(item, path)
