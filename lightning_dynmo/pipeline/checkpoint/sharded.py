"""Sharded checkpoints: each rank writes and reads only its own units, with ``torch.distributed.checkpoint``.

Read in this order: the directory layout and keys (below), :func:`save_sharded` (collective save),
:func:`load_sharded_part` (collective load of one rank's share, at any placement or size),
:func:`export_full_checkpoint` (one file for single-device use; :func:`read_full_checkpoint` the same in
memory), then the DCP reader/writer and helpers.

A checkpoint is a directory (Lightning's convention for sharded checkpoints, as in its
``ModelParallelStrategy``)::

    <dir>/.metadata              DCP's index: every key, its shape and dtype, and where it is stored
    <dir>/__<r>_0.distcp         the items group rank r wrote
    <dir>/meta.pt                the rest of the Lightning checkpoint (loops, callbacks, LR schedulers,
                                 the DynMo layout record), written by the first active rank
    <dir>/dynmo_checksums.json   CRC-32 of every item and of the small files, written last: a directory
                                 without it is a save that did not finish (see :mod:`.checksums`)

Keys, one DCP item each, under the single-process names (so any placement can find its share)::

    state_dict.<key>                               a model state_dict entry (a tensor, or extra state)
    optimizer_states.<k>.param_groups              optimizer k's param_group hyper-parameters
    optimizer_states.<k>.param_group_of.<unit>     {parameter name: param_group index} of a unit
    optimizer_states.<k>.state.<parameter>.<name>  one per-parameter state value (exp_avg, step, ...)

Data-parallel replicas hold the same keys with the same values; DCP writes each key once (its
de-duplication spreads the keys over the replicas). Units sharded with FSDP2
(``DynMoStrategy(data_parallel_sharding="fsdp")``) write their parameters and optimizer state as DTensors:
each replica writes the rows of its own shard of the same key. A loading rank reads the manifest,
``.metadata`` and ``meta.pt`` whole (they grow with the number of keys, not with the model's bytes) and
then exactly the items of the units it owns (of a sharded unit, the rows of its own shards, whatever shard
count wrote them), verifying each as it reads it.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import shutil
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from lightning_dynmo.pipeline.checkpoint.atomic import repair, staging_path, swap_in
from lightning_dynmo.pipeline.checkpoint.checksums import (
    MANIFEST_FILENAME,
    CheckpointCorruptError,
    ItemChecksum,
    Manifest,
    crc32_of_stream,
    crc32_records,
    read_manifest,
    verify_item,
    verify_torch_bytes,
    write_manifest,
)
from lightning_dynmo.pipeline.checkpoint.state import OptimizerFullState
from lightning_dynmo.pipeline.model.units import unit_of_key

log = logging.getLogger(__name__)

__all__ = [
    "META_FILENAME",
    "CheckpointSaveError",
    "export_full_checkpoint",
    "is_sharded_checkpoint",
    "load_sharded_part",
    "read_full_checkpoint",
    "save_sharded",
]

#: Lightning's name for the non-tensor part of a sharded checkpoint.
META_FILENAME = "meta.pt"
_DCP_METADATA = ".metadata"
_MODEL = "state_dict."
_OPTIM = "optimizer_states."


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a checkpoint directory (it has DCP's ``.metadata`` or the checksum manifest)."""
    p = Path(path)
    return p.is_dir() and ((p / _DCP_METADATA).is_file() or (p / MANIFEST_FILENAME).is_file())


def save_sharded(
    path: str | Path,
    checkpoint: dict[str, Any],
    *,
    group: dist.ProcessGroup | None,
    coordinator: int,
) -> None:
    """Collective over ``group``: write this rank's model and optimizer state into the directory ``path``.

    ``checkpoint`` is a Lightning checkpoint whose ``"state_dict"`` holds this rank's part of the model
    state (single-process keys) and whose ``"optimizer_states"`` (if any) hold this rank's
    :class:`~.state.OptimizerFullState` per optimizer; they are removed from it.
    The rest is written by ``coordinator`` as ``meta.pt``.

    Args:
        path: The checkpoint directory (``coordinator``'s value counts); an existing checkpoint there (a
            directory or a gathered file) is replaced only once the new one is complete: a crash at any
            point leaves the old or the new checkpoint whole (:mod:`.atomic`).
        checkpoint: See above.
        group: The ranks that save (every active rank); ``None`` is the default group.
        coordinator: GLOBAL rank that writes ``meta.pt`` and the manifest (a member of ``group``).

    Raises:
        FileExistsError: if ``path`` is a non-empty directory that is not a checkpoint.
        CheckpointSaveError: on every rank, if any rank failed to write (a full disk, a read-only
            directory), naming each failing rank and its cause; the previous checkpoint is intact.
    """
    # Every rank writes into the same fresh sibling, named by the coordinator; the manifest is written
    # last, and only then does the complete checkpoint take the place of the old one (see .atomic). Each
    # step that may fail on some ranks only ends in an agreement, so a failure stops every rank at once.
    box: list[Any] = [str(path), uuid.uuid4().hex]
    dist.broadcast_object_list(box, src=coordinator, group=group)
    path, is_coordinator = Path(box[0]), dist.get_rank() == coordinator
    staged = staging_path(path, box[1])
    _check_target(path)  # on every rank (one file system), so a bad path fails all ranks, none waits
    save = _SaveSteps(path, group)
    save.agree("preparing the directory", lambda: _prepare(path, staged) if is_coordinator else None)
    try:
        items = _flat_items(checkpoint.pop("state_dict", {}), checkpoint.pop("optimizer_states", []))
        writer = _RecordingWriter(staged)
        planner = DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
        try:
            dcp_save(items, storage_writer=writer, planner=planner, process_group=group)
        except CheckpointException as err:
            raise CheckpointSaveError(save.describe("writing the items", _dcp_failures(err))) from err
        written = save.agree("reading the items back", lambda: _checksum_written(staged, writer.results))
        all_items = [item for part in written for item in part]
        save.agree(
            "writing meta.pt and the manifest",
            lambda: _finish(staged, path, checkpoint, all_items) if is_coordinator else None,
        )
    except BaseException:
        if is_coordinator:
            shutil.rmtree(staged, ignore_errors=True)  # the previous checkpoint at ``path`` is untouched
        raise


class CheckpointSaveError(RuntimeError):
    """A save failed (a full disk, a read-only target, ...); raised on every saving rank alike.

    The checkpoint that was at the path before the save is untouched, and training stops (the error
    propagates out of ``Trainer.fit`` on every rank) rather than going on without the checkpoint asked for.
    """


class _SaveSteps:
    """The steps of one save that end in an agreement: every rank learns every rank's failure."""

    def __init__(self, path: Path, group: dist.ProcessGroup | None) -> None:
        self.path, self.group = path, group

    def agree(self, what: str, step: Callable[[], Any]) -> list[Any]:
        """Run ``step`` on this rank, then all ranks exchange results; any failure raises on all of them."""
        try:
            result, error = step(), None
        except Exception as err:  # reported to every rank below, so none waits for this one
            result, error = None, f"{type(err).__name__}: {err}"
        outcomes: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(outcomes, (dist.get_rank(), error, result), group=self.group)
        failures = {rank: error for rank, error, _ in outcomes if error is not None}
        if failures:
            raise CheckpointSaveError(self.describe(what, failures))
        return [result for _, _, result in outcomes]

    def describe(self, what: str, failures: Mapping[int, str]) -> str:
        causes = "; ".join(f"rank {rank}: {error}" for rank, error in sorted(failures.items()))
        return (
            f"saving the checkpoint {str(self.path)!r} failed while {what} ({causes}). The previous "
            f"checkpoint at that path, if any, is intact. Free space or make {str(self.path.parent)!r} "
            "writable (or choose another ModelCheckpoint(dirpath=...)), then resume from the last checkpoint."
        )


def _prepare(path: Path, staged: Path) -> None:
    repair(path)
    staged.mkdir(parents=True)


def _finish(staged: Path, path: Path, checkpoint: dict[str, Any], items: list[ItemChecksum]) -> None:
    """On the coordinator: ``meta.pt``, the manifest (last), then the complete checkpoint takes its place."""
    with crc32_records():
        torch.save(checkpoint, staged / META_FILENAME)
    write_manifest(staged, items, whole_files=[_DCP_METADATA, META_FILENAME])
    swap_in(staged, path)


def _dcp_failures(err: CheckpointException) -> dict[int, str]:
    failures = {}
    for rank, failure in err.failures.items():
        exc = failure[0] if isinstance(failure, tuple) else failure
        failures[int(rank)] = f"{type(exc).__name__}: {exc}"
    return failures


def load_sharded_part(
    path: Path,
    local_units: Mapping[str, nn.Module],
    *,
    with_optimizers: bool,
    aliases: Mapping[str, str] | None = None,
    group: dist.ProcessGroup | None,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Collective over ``group``: read the checkpoint's non-tensor part and the share of ``local_units``.

    Returns a Lightning checkpoint in the gathered format restricted to this rank's units: ``meta.pt``'s
    content plus ``"state_dict"`` (the units' entries) and, with ``with_optimizers`` and if the checkpoint
    has optimizer state, ``"optimizer_states"`` (param_groups, and the units' param_group indices and
    per-parameter state), ready for :func:`~lightning_dynmo.pipeline.load_local_state`.

    Args:
        path: The checkpoint directory.
        local_units: The units this rank owns, by global name.
        with_optimizers: Read optimizer state (resuming training) or not (weights only).
        aliases: For a parameter without saved state, another name to read its state under (a tied
            parameter that a single process saved under its first name).
        group: The loading ranks; ``None`` is the default group.
        weights_only: Passed to ``torch.load`` for ``meta.pt``.

    Raises:
        CheckpointCorruptError: naming the file and entry, if anything this rank reads is damaged or the
            save did not finish (every rank raises it, since every rank takes part).
    """

    def choose(metadata: Metadata) -> dict[str, Any]:
        return _wanted_keys(metadata, local_units, with_optimizers, aliases or {})

    return _read(Path(path), choose, group=group, alone=False, weights_only=weights_only)


def export_full_checkpoint(path: str | Path, out: str | Path) -> Path:
    """Write a sharded checkpoint as one gathered Lightning checkpoint file (single process, no group).

    The file is what ``DynMoStrategy(save_distributed_checkpoint=False)`` writes: ``ckpt["state_dict"]``
    has exactly the single-process model's keys (plain ``model.load_state_dict`` works on one device) and
    ``ckpt["optimizer_states"]`` is keyed by parameter name, so ``DynMoStrategy`` resumes from it too.

    Args:
        path: The sharded checkpoint directory.
        out: The file to write.

    Returns:
        ``out`` as a ``Path``.

    Raises:
        ValueError: if ``path`` is not a sharded checkpoint directory.
        CheckpointCorruptError: if any part of it is damaged.
    """
    checkpoint = read_full_checkpoint(path, who="export_full_checkpoint")
    dst = Path(out)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with crc32_records():
        torch.save(checkpoint, dst)
    return dst


def read_full_checkpoint(
    path: str | Path, *, who: str = "read_full_checkpoint", weights_only: bool | None = False
) -> dict[str, Any]:
    """A sharded checkpoint as one gathered Lightning checkpoint in memory (single process, no group).

    What :func:`export_full_checkpoint` writes to its file (see there), verified item by item.

    Args:
        path: The sharded checkpoint directory.
        who: The caller named in the error (the public function the user called).
        weights_only: Passed to ``torch.load`` for ``meta.pt``.

    Raises:
        ValueError: if ``path`` is not a sharded checkpoint directory.
        CheckpointCorruptError: if any part of it is damaged.
    """
    src = Path(path)
    if not is_sharded_checkpoint(src):
        raise ValueError(
            f"{who}: {str(src)!r} is not a sharded checkpoint directory (no .metadata or "
            f"{MANIFEST_FILENAME}); pass the directory DynMoStrategy saved (e.g. epoch=0-step=4.ckpt/)."
        )
    return _read(src, _every_key, group=None, alone=True, weights_only=weights_only)


def _read(
    path: Path,
    choose: Callable[[Metadata], dict[str, Any]],
    *,
    group: dist.ProcessGroup | None,
    alone: bool,
    weights_only: bool | None = False,
) -> dict[str, Any]:
    """Verify the index files, then read the items ``choose`` picks: collective over ``group``, or in
    this process ``alone`` (no collective, even inside a distributed job)."""
    manifest = read_manifest(path)
    metadata = _unpickle_metadata(_read_whole(manifest, _DCP_METADATA))
    meta = _read_meta(manifest, weights_only)
    wanted = choose(metadata)
    reader = _VerifyingReader(path, manifest, metadata)
    planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        try:
            dcp_load(wanted, storage_reader=reader, planner=planner, process_group=group, no_dist=alone)
        except CheckpointException as err:
            _raise_corruption(err)
            raise
    log.debug("read %d bytes of checkpoint items from %s", reader.bytes_read, path)
    return {**meta, **_unflatten(wanted, _model_keys(metadata))}


# ----------------------------------------------------------------------------------------------------
# Keys
# ----------------------------------------------------------------------------------------------------


def _flat_items(model: Mapping[str, Any], optimizers: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    items = {f"{_MODEL}{key}": value for key, value in model.items()}
    for k, opt in enumerate(optimizers):
        prefix = f"{_OPTIM}{k}."
        items[f"{prefix}param_groups"] = list(opt["param_groups"])
        by_unit: dict[str, dict[str, int]] = {}
        for fqn, index in opt["param_group_of"].items():
            by_unit.setdefault(unit_of_key(fqn), {})[fqn] = index
        for unit, group_of in by_unit.items():
            items[f"{prefix}param_group_of.{unit}"] = group_of
        for fqn, state in opt["state"].items():
            for name, value in state.items():
                items[f"{prefix}state.{fqn}.{name}"] = value
    return items


def _wanted_keys(
    metadata: Metadata,
    local_units: Mapping[str, nn.Module],
    with_optimizers: bool,
    aliases: Mapping[str, str],
) -> dict[str, Any]:
    """Placeholders for the keys this rank reads: its units' entries and its parameters' optimizer state."""
    saved = metadata.state_dict_metadata
    units = set(local_units)
    # A unit sharded with FSDP2 reads the rows of its own shards only, into DTensors laid out like its own.
    sharded = {
        f"{unit}.{key}": value
        for unit, module in local_units.items()
        for key, value in module.state_dict().items()
        if isinstance(value, DTensor)
    }
    wanted = {
        key: _placeholder(md, sharded.get(key[len(_MODEL) :]))
        for key, md in saved.items()
        if key.startswith(_MODEL) and unit_of_key(key[len(_MODEL) :]) in units
    }
    if not with_optimizers:
        return wanted
    params = {
        f"{unit}.{name}" for unit, module in local_units.items() for name, _ in module.named_parameters()
    }
    candidates = params | set(aliases.values())
    with_state = {_split_state_key(k, candidates) for k in saved if k.startswith(_OPTIM) and ".state." in k}
    # A parameter without saved state of its own reads its alias's (same value, saved under that name).
    names = {aliases[p] if p in aliases and p not in with_state else p for p in params}
    units |= {unit_of_key(n) for n in names}
    for key, md in saved.items():
        if not key.startswith(_OPTIM):
            continue
        _, _, rest = key[len(_OPTIM) :].partition(".")
        kind, _, tail = rest.partition(".")
        take = (
            kind == "param_groups"
            or (kind == "param_group_of" and tail in units)
            or (kind == "state" and _split_state_key(key, names) in names)
        )
        if take:
            owner = _split_state_key(key, names) if kind == "state" else None
            wanted[key] = _placeholder(md, sharded.get(owner) if owner is not None else None)
    return wanted


def _split_state_key(key: str, names: set[str]) -> str | None:
    """The parameter name in ``optimizer_states.<k>.state.<parameter>.<name>``, if it is one of ``names``."""
    _, _, rest = key.partition(".state.")
    dot = rest.rfind(".")
    while dot > 0:
        if rest[:dot] in names:
            return rest[:dot]
        dot = rest.rfind(".", 0, dot)
    return None


def _model_keys(metadata: Metadata) -> set[str]:
    """The saved model state_dict keys (every parameter name is one)."""
    return {key[len(_MODEL) :] for key in metadata.state_dict_metadata if key.startswith(_MODEL)}


def _unflatten(items: Mapping[str, Any], model_keys: set[str]) -> dict[str, Any]:
    """Flat keys back to the gathered checkpoint format (``state_dict`` and ``optimizer_states``)."""
    model = {key[len(_MODEL) :]: value for key, value in items.items() if key.startswith(_MODEL)}
    out: dict[str, Any] = {"state_dict": model}
    optimizers: dict[int, OptimizerFullState] = {}
    for key, value in items.items():
        if not key.startswith(_OPTIM):
            continue
        index, _, rest = key[len(_OPTIM) :].partition(".")
        opt = optimizers.setdefault(
            int(index), OptimizerFullState(param_groups=[], param_group_of={}, state={})
        )
        kind = rest.partition(".")[0]
        if kind == "param_groups":
            opt["param_groups"] = value
        elif kind == "param_group_of":
            opt["param_group_of"].update(value)
        else:
            fqn = _split_state_key(key, model_keys)
            assert fqn is not None, f"optimizer state {key!r} names no saved parameter"
            opt["state"].setdefault(fqn, {})[key[len(f"{_OPTIM}{index}.state.{fqn}.") :]] = value
    if optimizers:
        out["optimizer_states"] = [optimizers[k] for k in sorted(optimizers)]
    return out


def _every_key(metadata: Metadata) -> dict[str, Any]:
    return {key: _placeholder(md) for key, md in metadata.state_dict_metadata.items()}


def _placeholder(md: Any, like: DTensor | None = None) -> Any:
    """Where DCP reads an item: a tensor of its size, or a shard laid out like ``like`` (a sharded
    parameter or its optimizer state of the same size)."""
    if not isinstance(md, TensorStorageMetadata):
        return None
    if like is not None and tuple(md.size) == tuple(like.shape):
        return torch.zeros_like(like, dtype=md.properties.dtype)
    return torch.empty(md.size, dtype=md.properties.dtype)


# ----------------------------------------------------------------------------------------------------
# DCP storage: record what was written, verify what is read
# ----------------------------------------------------------------------------------------------------


class _RecordingWriter(FileSystemWriter):
    """DCP's file writer that keeps this rank's write results (file, offset and length of each item)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, single_file_per_rank=True, thread_count=1)
        self.results: list[Any] = []

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        self.results = list(future.wait())
        return future


class _VerifyingReader(FileSystemReader):
    """DCP's file reader that checks every item's bytes against the manifest before DCP decodes them.

    Items are read with ``os.pread`` (no read-ahead: a rank reads its items' bytes and no others), and
    the index DCP asks for is the one already read and verified.
    """

    def __init__(self, path: Path, manifest: Manifest, metadata: Metadata) -> None:
        super().__init__(path)
        self.manifest = manifest
        self.metadata = metadata
        self.bytes_read = 0

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.metadata.storage_meta is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata

    def _slice_file(self, file: Any, sinfo: Any) -> io.BytesIO:
        data = os.pread(file.fileno(), sinfo.length, sinfo.offset)
        self.bytes_read += len(data)
        verify_item(self.manifest, sinfo.relative_path, sinfo.offset, data, sinfo.length)
        return io.BytesIO(data)


def _checksum_written(path: Path, results: Sequence[Any]) -> list[ItemChecksum]:
    """CRC-32 of each item this rank wrote, read back file by file in offset order."""
    out = []
    by_file: dict[str, list[Any]] = {}
    for result in results:
        by_file.setdefault(result.storage_data.relative_path, []).append(result)
    for name, entries in by_file.items():
        with open(path / name, "rb") as f:
            for r in sorted(entries, key=lambda r: r.storage_data.offset):
                offset, length = r.storage_data.offset, r.storage_data.length
                out.append(
                    ItemChecksum(name, offset, length, crc32_of_stream(f, offset, length), r.index.fqn)
                )
    return out


def _read_whole(manifest: Manifest, name: str) -> bytes:
    path = manifest.directory / name
    if not path.is_file():
        raise CheckpointCorruptError(
            f"checkpoint directory {str(manifest.directory)!r} lacks {name}, which its manifest lists; the "
            "directory is incomplete. Resume from another checkpoint."
        )
    data = path.read_bytes()
    manifest.check_whole_file(name, data)
    return data


def _read_meta(manifest: Manifest, weights_only: bool | None) -> dict[str, Any]:
    data = _read_whole(manifest, META_FILENAME)
    verify_torch_bytes(data, str(manifest.directory / META_FILENAME))
    meta = torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)
    assert isinstance(meta, dict)
    return meta


def _unpickle_metadata(data: bytes) -> Metadata:
    metadata = pickle.loads(data)
    assert isinstance(metadata, Metadata)
    return metadata


def _raise_corruption(err: CheckpointException) -> None:
    """Re-raise the first corruption error a rank met inside DCP (DCP wraps every rank's failure)."""
    for failure in err.failures.values():
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, CheckpointCorruptError):
            raise CheckpointCorruptError(str(exc)) from err


def _check_target(path: Path) -> None:
    if path.is_dir() and any(path.iterdir()) and not is_sharded_checkpoint(path):
        raise FileExistsError(
            f"cannot save a sharded checkpoint to {str(path)!r}: it is a non-empty directory that is not "
            "a checkpoint. Choose another path (ModelCheckpoint(dirpath=...)) or empty it."
        )
