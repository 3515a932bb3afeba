"""The child process of one part: ``python -m lightning_dynmo.gpu_check.worker <spec.json> <result.json>``.

Only the process that runs as rank 0 writes the result; an exception is written as the result (with its
traceback) and the process exits non-zero, so the parent records it and goes on.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_dynmo.gpu_check import migration, stalls, training
from lightning_dynmo.gpu_check.plan import Sizes

Kind = Callable[[dict[str, Any], Sizes, str], dict[str, Any] | None]
KINDS: dict[str, Kind] = {
    "train": training.train,
    "costs": training.layer_costs,
    "stalls": stalls.step_stalls,
    "migration": migration.migrate,
    "nccl_probe": migration.nccl_probe,
}


def main(argv: list[str] | None = None) -> int:
    """Run the part ``argv[0]`` describes and write its result to ``argv[1]``; return the exit code."""
    spec_path, result_path = (argv if argv is not None else sys.argv[1:])[:2]
    spec = json.loads(Path(spec_path).read_text())
    if spec["device"] == "cpu":
        torch.set_num_threads(1)  # the dry run shares a few cores between ranks
    try:
        result = KINDS[spec["kind"]](spec["options"], Sizes(**spec["sizes"]), spec["device"])
    except BaseException as err:  # recorded, whatever it is: the check goes on with the next part
        if _is_rank_zero():
            failure = {
                "ok": False,
                "error": f"{type(err).__name__}: {err}",
                "traceback": traceback.format_exc(),
            }
            Path(result_path).write_text(json.dumps(failure))
        return 1
    if result is not None:  # None: a rank other than 0
        Path(result_path).write_text(json.dumps({"ok": True, **result}, indent=1, default=str))
    return 0


def _is_rank_zero() -> bool:
    # Lightning's launcher starts the other ranks with LOCAL_RANK set; the two-process parts with RANK_ENV.
    return os.environ.get("LOCAL_RANK", "0") == "0" and migration.rank() == 0


if __name__ == "__main__":
    sys.exit(main())
