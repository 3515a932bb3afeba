"""A gathered (one-file) checkpoint: damage and truncation fail with the file and the entry named.

The negative controls show what happens without the check: torch loads 64 overwritten bytes silently
(different optimizer values, no error) and reports a truncated file only as a zip-reader failure.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_dynmo.pipeline.checkpoint.checksums import (
    CheckpointCorruptError,
    crc32_records,
    load_torch_file,
)
from lightning_dynmo.pipeline.checkpoint.contents import read_checkpoint


def _checkpoint() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.fc.weight": torch.randn(64, 32, generator=g, dtype=torch.float64) for i in range(3)}
    state = {
        f"layers.{i}.fc.weight": {"step": torch.tensor(4.0), "exp_avg": torch.randn(64, 32, generator=g)}
        for i in range(3)
    }
    optimizer = {"param_groups": [{"lr": 0.01}], "param_group_of": dict.fromkeys(state, 0), "state": state}
    return {"epoch": 1, "state_dict": model, "optimizer_states": [optimizer]}


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "epoch1.ckpt"
    with crc32_records():
        torch.save(_checkpoint(), path)
    return path


def _overwrite(path: Path, at: int, n: int = 64) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(b"\xff" * n)


def test_an_intact_file_loads_as_saved(saved: Path) -> None:
    loaded = load_torch_file(saved, weights_only=True)
    expected = _checkpoint()
    assert loaded["epoch"] == 1
    for key, value in expected["state_dict"].items():
        assert torch.equal(loaded["state_dict"][key], value)


def test_overwritten_bytes_name_the_file_record_and_entry(saved: Path) -> None:
    _overwrite(saved, saved.stat().st_size * 3 // 4)  # inside the optimizer state's tensors
    with pytest.raises(
        CheckpointCorruptError,
        match=r"epoch1\.ckpt' is damaged: its record 'epoch1/data/\d+' \(holds "
        r"optimizer_states\[0\]\['state'\]\['layers\.\d\.fc\.weight'\]\['exp_avg'\]\) fails its CRC-32 check",
    ):
        load_torch_file(saved, weights_only=True)
    # Negative control: torch alone loads it without a word, with changed optimizer values.
    silently = torch.load(saved, weights_only=True)
    changed = [
        fqn
        for fqn, state in _checkpoint()["optimizer_states"][0]["state"].items()
        if not torch.equal(silently["optimizer_states"][0]["state"][fqn]["exp_avg"], state["exp_avg"])
    ]
    assert changed


def test_damage_to_the_pickled_structure_is_named(saved: Path) -> None:
    _overwrite(saved, 100, n=4)
    with pytest.raises(CheckpointCorruptError, match=r"record 'epoch1/data\.pkl' fails its CRC-32 check"):
        load_torch_file(saved, weights_only=True)


def test_a_truncated_file_names_the_record_it_ends_in(saved: Path) -> None:
    os.truncate(saved, saved.stat().st_size // 2)
    with pytest.raises(
        CheckpointCorruptError,
        match=r"epoch1\.ckpt' is truncated: it has \d+ bytes .* ends inside or after its record "
        r"'epoch1/data/\d+'",
    ):
        load_torch_file(saved, weights_only=True)
    # Negative control: torch's own error (a zip-reader failure) names no entry.
    with pytest.raises((RuntimeError, OSError)) as info:
        torch.load(saved, weights_only=True)
    assert "data/" not in str(info.value)


def test_a_file_that_is_not_a_checkpoint_is_named(tmp_path: Path) -> None:
    path = tmp_path / "notes.ckpt"
    path.write_bytes(b"not a zip archive at all")
    with pytest.raises(CheckpointCorruptError, match=r"notes\.ckpt' \(24 bytes\) is not a torch checkpoint"):
        load_torch_file(path)


def test_saves_compute_record_checksums_even_if_the_user_turned_them_off(tmp_path: Path) -> None:
    from torch.serialization import get_crc32_options, set_crc32_options

    set_crc32_options(False)
    try:
        with crc32_records():
            torch.save(_checkpoint(), tmp_path / "a.ckpt")
        assert get_crc32_options() is False  # restored
    finally:
        set_crc32_options(True)
    assert load_torch_file(tmp_path / "a.ckpt", weights_only=True)["epoch"] == 1


def test_read_checkpoint_leaves_remote_paths_to_lightning() -> None:
    assert read_checkpoint("s3://bucket/x.ckpt", {}, False, {}, None, None) is None
