"""Sharded checkpoints below Lightning: save at one split, load at another, each rank reading its share.

Two ranks train the toy model (every kind of per-layer state: masks, frozen parameters, extra state,
AdamW state in two param_groups) at split A, and save with ``save_sharded``; two fresh ranks with other
initial values load at split B. What they load must equal, bitwise, what was saved. Each loading rank
must read its own items and nothing else (bytes counted by the kernel, ``/proc/self/io``), and a damaged
or truncated file must fail on every rank with an error naming the file and the entry.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from lightning_dynmo.pipeline.checkpoint.checksums import MANIFEST_FILENAME
from lightning_dynmo.pipeline.checkpoint.contents import full_state_from_checkpoint
from lightning_dynmo.pipeline.checkpoint.sharded import (
    export_full_checkpoint,
    load_sharded_part,
    save_sharded,
)
from lightning_dynmo.pipeline.checkpoint.state import load_local_state, local_full_state
from lightning_dynmo.pipeline.model.units import unit_of_key
from tests.distributed import toy_model as tm
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed

NUM_LAYERS, STEPS = 4, 2
STAGES_A = [["embed", "layers.0", "layers.1"], ["layers.2", "layers.3", "head"]]
STAGES_B = [["embed", "layers.0", "layers.1", "layers.2", "layers.3"], ["head"]]


def bytes_read_by_this_process() -> int:
    """Bytes this process passed through read(2) and similar calls (the kernel's count, all threads)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar line")


def _save(rank: int, world_size: int, path: Path) -> dict[str, Any]:
    torch.set_default_dtype(torch.float64)
    units = tm.local_units(STAGES_A, rank, NUM_LAYERS, seed=0)
    optimizer = tm.make_optimizer(units)
    schedule = tm.make_schedule(units, stage_index=rank, num_stages=world_size)
    for batch in tm.batches(STEPS):
        tm.pipeline_step(schedule, optimizer, batch)
    part = local_full_state(units, [optimizer], copy=False)
    checkpoint = {"state_dict": part["model"], "optimizer_states": part["optimizer"], "epoch": 7}
    save_sharded(path, checkpoint, group=None, coordinator=0)
    return _saved_part(tm.snapshot(units, [optimizer]))


def _saved_part(snapshot: dict[str, Any]) -> dict[str, Any]:
    """A snapshot without gradients (a checkpoint is taken between steps and holds none)."""
    return {k: v for k, v in snapshot.items() if not k.startswith("grad:")}


def _load(rank: int, world_size: int, path: Path, stages: Sequence[Sequence[str]]) -> dict[str, Any]:
    torch.set_default_dtype(torch.float64)
    # Other values than the saved ones: the load must overwrite everything.
    units = tm.local_units(stages, rank, NUM_LAYERS, seed=123)
    optimizer = tm.make_optimizer(units)
    before = bytes_read_by_this_process()
    part = load_sharded_part(path, units, with_optimizers=True, group=None)
    read = bytes_read_by_this_process() - before
    load_local_state(full_state_from_checkpoint(part, with_optimizer=True), units, [optimizer])
    return {
        "snapshot": _saved_part(tm.snapshot(units, [optimizer])),
        "read": read,
        "units": sorted(units),
        "epoch": part["epoch"],
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A checkpoint directory saved by two ranks at split A, and what they held (merged snapshots)."""
    tmp = tmp_path_factory.mktemp("sharded")
    path = tmp / "step2.ckpt"
    snapshots = run_distributed(_save, 2, tmp, timeout_s=60, args=(path,))
    return path, {k: v for snap in snapshots for k, v in snap.items()}


def _manifest_items(path: Path) -> list[list[Any]]:
    return list(json.loads((path / MANIFEST_FILENAME).read_text())["items"])


def _share(path: Path, units: Sequence[str]) -> int:
    """Bytes of the stored items a rank owning ``units`` needs (its units' entries and optimizer state)."""
    mine = set(units)
    total = 0
    for _file, _offset, length, _crc, key in _manifest_items(path):
        if key.startswith("state_dict."):
            unit = unit_of_key(key.removeprefix("state_dict."))
        elif ".param_group_of." in key:
            unit = key.rpartition(".param_group_of.")[2]
        elif ".state." in key:
            unit = unit_of_key(key.partition(".state.")[2])
        else:
            unit = next(iter(mine))  # param_groups: every rank reads them
        total += length if unit in mine else 0
    return total


def test_a_sharded_save_loads_bitwise_at_another_split_reading_only_each_ranks_share(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    path, expected = saved
    loaded = run_distributed(_load, 2, tmp_path, timeout_s=60, args=(path, STAGES_B))
    tm.assert_same({k: v for res in loaded for k, v in res["snapshot"].items()}, expected)
    assert all(res["epoch"] == 7 for res in loaded)  # meta.pt: the rest of the checkpoint
    # Each rank reads its items and the three small files every rank reads whole, nothing else (the few
    # extra bytes are collective messages).
    small = sum((path / f).stat().st_size for f in (".metadata", "meta.pt", MANIFEST_FILENAME))
    for res in loaded:
        share = _share(path, res["units"])
        assert share + small <= res["read"] <= share + small + 16 * 1024, (res["units"], share, res["read"])
    # The measure separates the ranks: the head alone is a small part of the checkpoint.
    head, rest = sorted(loaded, key=lambda res: res["read"])
    assert head["units"] == ["head"] and head["read"] < rest["read"] / 3


def test_export_gives_the_gathered_single_file(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path, expected = saved
    out = export_full_checkpoint(path, tmp_path / "full.ckpt")
    ckpt = torch.load(out, weights_only=False)
    assert ckpt["epoch"] == 7
    model = tm.build_model(NUM_LAYERS, seed=5).double()
    model.load_state_dict(ckpt["state_dict"])  # the plain single-process model loads it
    for name, value in model.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(
                value,
                expected[f"param:{name}"] if f"param:{name}" in expected else expected[f"buffer:{name}"],
            )
    (opt,) = ckpt["optimizer_states"]
    assert set(opt["state"]) == {n for n, p in model.named_parameters() if p.requires_grad}


def test_export_refuses_a_path_that_is_not_a_checkpoint_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"is not a sharded checkpoint directory"):
        export_full_checkpoint(tmp_path, tmp_path / "out.ckpt")


def _damaged_copy(saved_path: Path, tmp_path: Path, damage: str) -> tuple[Path, str]:
    """A copy of the checkpoint with ``damage`` applied; returns it and the key of the damaged item."""
    path = tmp_path / "copy.ckpt"
    shutil.copytree(saved_path, path)
    items = [i for i in _manifest_items(path) if i[4] == "state_dict.layers.3.fc1.weight"]
    file, offset, length, _, key = items[0]
    target = path / file
    if damage == "overwrite":
        with open(target, "r+b") as f:
            f.seek(offset + length // 2)
            f.write(b"\xff" * 64)
    elif damage == "truncate":
        os.truncate(target, offset + length // 2)
    return path, f"{file}' is damaged: entry '{key}'" if damage == "overwrite" else f"{file}' is truncated"


@pytest.mark.parametrize("damage", ["overwrite", "truncate"])
def test_a_damaged_item_fails_on_every_rank_naming_the_file_and_entry(
    damage: str, saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    # layers.3 is read by rank 0 only (split B); DCP gathers the failure, so rank 1 reports it too.
    path, message = _damaged_copy(saved[0], tmp_path, damage)
    with pytest.raises(
        AssertionError, match=rf"(?s)2 of 2 rank\(s\) failed.*CheckpointCorruptError.*{message}"
    ):
        run_distributed(_load, 2, tmp_path, timeout_s=60, args=(path, STAGES_B))
    if damage == "overwrite":
        # Negative control: torch's own reader, without the checksums, loads the damaged value silently.
        key = "state_dict.layers.3.fc1.weight"
        value = {key: torch.empty_like(saved[1]["param:layers.3.fc1.weight"])}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp_load(value, storage_reader=FileSystemReader(path), no_dist=True)
        assert not torch.equal(value[key], saved[1]["param:layers.3.fc1.weight"])


@pytest.mark.parametrize(
    ("victim", "message"),
    [
        (".metadata", r"\.metadata' fails its CRC-32 check"),
        (MANIFEST_FILENAME, r"fails its own CRC-32 check|is unreadable"),
        ("meta.pt", r"meta\.pt' fails its CRC-32 check"),
    ],
)
def test_a_damaged_index_file_is_named(
    victim: str, message: str, saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    path = tmp_path / "copy.ckpt"
    shutil.copytree(saved[0], path)
    data = bytearray((path / victim).read_bytes())
    data[len(data) // 2] ^= 0x01
    (path / victim).write_bytes(bytes(data))
    with pytest.raises(Exception, match=message):
        export_full_checkpoint(path, tmp_path / "out.ckpt")


def test_an_unfinished_save_is_refused(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path = tmp_path / "copy.ckpt"
    shutil.copytree(saved[0], path)
    (path / MANIFEST_FILENAME).unlink()
    with pytest.raises(Exception, match=r"has no dynmo_checksums\.json: the save did not finish"):
        export_full_checkpoint(path, tmp_path / "out.ckpt")


def _save_into(rank: int, world_size: int, path: Path) -> None:
    save_sharded(path, {"state_dict": {"layers.0.w": torch.zeros(2)}}, group=None, coordinator=0)


def test_saving_into_a_directory_that_is_not_a_checkpoint_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(AssertionError, match=r"FileExistsError: cannot save a sharded checkpoint to .*mine"):
        run_distributed(_save_into, 1, tmp_path, timeout_s=30, args=(target,))
    assert (target / "notes.txt").read_text() == "keep me"
