"""``python -m lightning_dynmo.train`` (``dynmo-train``): compose ``conf/``, start ranks, fit, test, report.

Read in this order: :func:`main` (the Hydra entry point), :func:`run` (start the ranks, or train when
this process is a rank), :func:`fit` (instantiate every node of the config and call ``Trainer.fit``,
resuming from ``ckpt_path``, then ``Trainer.test`` with ``run_test=true``).

The configuration is ``conf/train.yaml`` (the repository's top-level ``conf/``, shipped inside the wheel)
and its groups (``model``, ``dynamism``, ``balancer``, ``strategy``, ``callbacks``, ``trainer``, ``data``,
``logger``, ``experiment``); each node names a public constructor by ``_target_`` and is validated against a
schema generated from that constructor (:mod:`lightning_dynmo.app.schema`). Examples::

    python -m lightning_dynmo.train                                      # the quick start
    python -m lightning_dynmo.train dynamism=pruning balancer=diffusion_time trainer.max_steps=200
    python -m lightning_dynmo.train ckpt_path=outputs/<date>/<time>/checkpoints/last.ckpt run_test=true
    python -m lightning_dynmo.train hydra.run.dir=outputs/myrun ckpt_path=last  # start, or resume that run
    python -m lightning_dynmo.train -m dynamism=early_exit,pruning balancer=partition_time,diffusion_time
    torchrun --standalone --nproc-per-node 2 -m lightning_dynmo.train   # ranks started by torchrun

Every run writes to its own directory (``outputs/<date>/<time>``, multirun jobs under
``multirun/<date>/<time>/<job>``; both ignored by git): Hydra's ``.hydra/`` (the composed config),
``train_rank<r>.log``, ``csv/`` and ``tensorboard/`` logs, ``checkpoints/`` and ``summary.json``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.utilities.model_helpers import is_overridden
from omegaconf import DictConfig, OmegaConf

import lightning_dynmo.dynamism  # noqa: F401  # registers the dynamic block kinds
from lightning_dynmo.app import quiet
from lightning_dynmo.app.help import user_config_groups
from lightning_dynmo.app.launch import (
    CHILD_ENV,
    check_multi_node,
    external_launcher,
    local_processes,
    rank_of_this_process,
    run_id,
    start_local_ranks,
)
from lightning_dynmo.app.report import RunReport, format_summary
from lightning_dynmo.app.schema import register_schemas

__all__ = ["CONF_DIR", "conf_dir", "fit", "main", "run"]

log = logging.getLogger(__name__)


def conf_dir(package: Path) -> Path:
    """Where the application's Hydra configuration is: the wheel's copy, or the clone's top-level ``conf/``.

    The repository keeps one copy, ``conf/`` beside the package; the build backend ships it inside the wheel
    as ``lightning_dynmo/conf`` (see setup.py). A clone (``python -m lightning_dynmo.train`` from its root,
    or an editable install) reads the top-level folder.

    Args:
        package: The folder of the ``lightning_dynmo`` package that is running.

    Raises:
        FileNotFoundError: Neither place holds ``train.yaml``.
    """
    for candidate in (package / "conf", package.parent / "conf"):
        if (candidate / "train.yaml").is_file():
            return candidate
    raise FileNotFoundError(
        f"the application's configuration (train.yaml) is neither in {package / 'conf'} (an installed wheel) "
        f"nor in {package.parent / 'conf'} (a clone); reinstall lightning-dynmo, or run from a full clone"
    )


#: The Hydra configuration of the application (top-level ``conf/``, shipped in the wheel as
#: ``lightning_dynmo/conf/``).
CONF_DIR = conf_dir(Path(__file__).resolve().parent)

register_schemas()
if not OmegaConf.has_resolver("dynmo_run_id"):
    OmegaConf.register_new_resolver("dynmo_run_id", run_id)
    OmegaConf.register_new_resolver("dynmo_rank", lambda: str(rank_of_this_process()))
if not OmegaConf.has_resolver("dynmo_config_groups"):
    OmegaConf.register_new_resolver("dynmo_config_groups", user_config_groups)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def main(cfg: DictConfig) -> dict[str, Any] | None:
    """The Hydra entry point (one call per job of a multirun)."""
    return run(cfg)


def run(cfg: DictConfig) -> dict[str, Any] | None:
    """Train the job ``cfg`` describes; returns the run summary on the process that reports it.

    In the process Hydra started, with several ranks to run on this node and no launcher around
    (torchrun, ``srun``), start the ranks (:func:`~lightning_dynmo.app.launch.start_local_ranks`), then
    print the summary rank 0 wrote. Otherwise this process is a rank (or the only one): train.
    """
    quiet.configure(rank_of_this_process())
    check_multi_node(cfg.trainer.get("num_nodes", 1))
    nproc = local_processes(cfg.trainer)
    if nproc > 1 and external_launcher() is None:
        run_dir = str(cfg.run_dir)
        start_local_ranks(nproc, list(HydraConfig.get().overrides.task), run_dir=run_dir)
        summary_path = Path(run_dir) / "summary.json"
        if not summary_path.exists():
            return None
        summary: dict[str, Any] = json.loads(summary_path.read_text())
        print(format_summary(summary), flush=True)
        return summary
    return fit(cfg)


def fit(cfg: DictConfig) -> dict[str, Any] | None:
    """Instantiate the config's nodes, fit, and return rank 0's summary (``None`` on other ranks)."""
    if cfg.trainer.get("accelerator") == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = instantiate(cfg.data, _convert_="all")
    model = instantiate(cfg.model, _convert_="all")
    strategy = instantiate(cfg.strategy, _convert_="all")
    callbacks = [instantiate(node, _convert_="all") for node in _nodes(cfg.callbacks)]
    for callback in callbacks:
        if isinstance(callback, RunReport):
            callback.run_info.update(_choices(cfg))
            # The process that launched this rank prints the table once every rank has finished.
            callback.print_summary = callback.print_summary and os.environ.get(CHILD_ENV) != "1"
    loggers = [instantiate(node, _convert_="all") for node in _nodes(cfg.logger)]
    trainer = instantiate(
        cfg.trainer, strategy=strategy, callbacks=callbacks, logger=loggers or False, _convert_="all"
    )
    if cfg.get("run_test"):
        _check_test_split(datamodule)
    trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    if cfg.get("run_test"):
        trainer.test(model, datamodule=datamodule)
    report = next((c for c in callbacks if isinstance(c, RunReport)), None)
    return report.summary if report is not None else None


def _check_test_split(datamodule: Any) -> None:
    """Before fitting: ``run_test=true`` needs a datamodule with a test split."""
    if not is_overridden("test_dataloader", datamodule, pl.LightningDataModule):
        raise ValueError(
            f"run_test=true, but the datamodule {type(datamodule).__name__} has no test split (no "
            "test_dataloader); set run_test=false, or use a datamodule with one (e.g. data=stdlib)."
        )


def _nodes(group: Any) -> list[Any]:
    """The non-null nodes of a named group (``callbacks``, ``logger``), in config order."""
    if group is None:
        return []
    return [node for node in group.values() if node is not None]


def _choices(cfg: DictConfig) -> dict[str, Any]:
    """The group options this run was composed from (for the summary)."""
    choices: dict[str, Any] = {}
    if HydraConfig.initialized():
        picked = HydraConfig.get().runtime.choices
        choices = {g: picked.get(g) for g in ("dynamism", "balancer", "model", "trainer", "experiment")}
    choices["schedule"] = cfg.strategy.get("schedule")
    choices["run_dir"] = str(cfg.run_dir)
    return {k: v for k, v in choices.items() if v is not None}


if __name__ == "__main__":
    main()
