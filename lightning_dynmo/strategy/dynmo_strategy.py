"""DynMoStrategy: pipeline-parallel training inside Lightning, with live re-placement of layers.

Read in this order: the constructor (what a user configures), ``setup_environment`` (process groups
of the ``data_parallel x pipeline`` grid), ``setup`` (cut the model to this rank's units, then build
optimizers and the pipeline), ``training_step`` / ``backward`` (one torch schedule step per training
step, its gradients handed to Lightning's automatic optimization), ``apply_placement`` (move layers
between ranks at a step boundary) and the collectives over the active ranks.

How a step runs (the schedule step, its gradients, tied parameters, evaluation and predict) is told in
:mod:`lightning_dynmo.strategy.steps`; how ranks, stages and virtual stages map onto each other in
:mod:`lightning_dynmo.pipeline.placement.layout`.

``import lightning_dynmo.strategy.dynmo_strategy`` registers the strategy as ``"dynmo"`` so
``Trainer(strategy="dynmo")`` works.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Mapping
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.distributed import ReduceOp
from torch.distributed.constants import default_pg_timeout
from typing_extensions import override

from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.console_log import show_info_on_rank_zero
from lightning_dynmo.pipeline import (
    DEFAULT_CONTROL_TIMEOUT,
    CommContext,
    MicrobatchCount,
    MigrationReport,
    PipelineLossScaling,
    RankGrid,
    ReleaseEvent,
    TiedParameter,
    UnitMove,
    communication_guard,
    control_timeout_of,
    full_state_from_checkpoint,
    layout_of,
    load_local_state,
    report_interrupt,
    resolve_schedule,
)
from lightning_dynmo.pipeline import (
    grads as pipeline_grads,
)
from lightning_dynmo.pipeline.model.compiled import check_compile_option
from lightning_dynmo.strategy import checkpointing, collectives, connection, replacement, sigterm, steps
from lightning_dynmo.strategy.args import (
    DataParallelSharding,
    StartMethod,
    check_data_parallel_sharding,
    check_sharding_fits,
    check_strategy_args,
)
from lightning_dynmo.strategy.child_watch import WatchedScriptLauncher
from lightning_dynmo.strategy.state import PipelineState, RankState, module_of, trainer_of
from lightning_dynmo.strategy.trainer_checks import check_trainer_setup
from lightning_dynmo.strategy.view import PipelineView

log = logging.getLogger(__name__)


class DynMoStrategy(ParallelStrategy):
    """Pipeline-parallel (optionally x data-parallel) training on ``torch.distributed.pipelining``.

    The LightningModule must follow the model contract of :mod:`lightning_dynmo.pipeline.model.contract`.

    Args:
        pipeline_size: Ranks per pipeline. ``None`` (default) makes every device a stage; otherwise it
            must divide the world size, which runs ``world_size // pipeline_size`` replicas of it.
        schedule: One of torch's schedule names (case-insensitive): ``"GPipe"``, ``"1F1B"``,
            ``"Interleaved1F1B"``, ``"LoopedBFS"``, ``"InterleavedZeroBubble"``, ``"ZBVZeroBubble"``,
            ``"DualPipeV"``. Multi-stage schedules run two virtual stages per rank.
        num_microbatches: Micro-batches per training step; the batch size must be a multiple of it.
            Some schedules need more (1F1B and DualPipeV: at least one per stage).
        placement: The initial split of layers over stages: ``"uniform"`` (equal layer counts),
            ``"parameters"`` (balanced parameter counts), a placement string such as ``"0-2|3-5"``, or
            a :class:`~lightning_dynmo.balancing.Placement`. It must have ``pipeline_size`` stages
            (twice that for multi-stage schedules).
        timeout: Timeout of every process group the strategy uses: a lost peer, or a collective called on
            some ranks only, fails every rank after it, naming the call (see ``pipeline/faults/guard.py``).
        control_timeout: Timeout of DynMo's own agreements (the placement check of ``apply_placement``,
            the callback's decisions, per-step rows and events; never longer than ``timeout``): ranks
            reach them within a step of each other, so a longer wait is a call made on some ranks only.
            Default 100 s; raise it if a training step can take longer. ``None``: ``timeout``.
        start_method: How Lightning starts the processes when it launches them itself: ``"popen"``
            (re-runs the script, default), ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        process_group_backend: ``None`` picks gloo on CPU and NCCL on CUDA.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: Set by the
            Trainer (the cluster environment: Lightning's, torchrun's or SLURM's).
        loss_log_name: Name of the logged pipeline loss (progress bar too); ``None`` disables logging.
        on_release: Called on every rank with a :class:`~lightning_dynmo.pipeline.ReleaseEvent` when
            :meth:`apply_placement` re-packs onto fewer ranks (e.g. to hand released ranks to a job
            manager); callbacks that define ``on_dynmo_ranks_released(trainer, pl_module, event)`` too.
        val_loss_log_name: Name under which the pipelined validation loss is logged (per epoch, on every
            rank and in the progress bar, so ``ModelCheckpoint(monitor=...)`` and ``EarlyStopping`` see
            it everywhere); ``None`` disables logging. See :mod:`lightning_dynmo.pipeline.step.evaluation`.
        test_loss_log_name: The same for ``Trainer.test``.
        save_distributed_checkpoint: ``True`` (default): a directory where each rank writes and reads only
            its units (:mod:`lightning_dynmo.pipeline.checkpoint.sharded`; ``export_full_checkpoint`` makes
            one file of it). ``False``: one file gathered on global rank 0. Both carry checksums and resume
            at any placement or size. Sharded checkpoints refuse (``TypeError``) a custom ``checkpoint_io``
            and ``save_checkpoint(..., storage_options=...)``, which only the file goes through.
        activation_checkpointing: Run each block's forward again in backward instead of keeping its
            activations (``torch.utils.checkpoint``; :mod:`lightning_dynmo.pipeline.step.recompute`).
        compile_blocks: Compile each block's ``forward`` with ``torch.compile``: ``True``, or a dict of its
            keyword arguments. Hooks and parameter names stay outside the compiled code; what recompiles
            when: :mod:`lightning_dynmo.pipeline.model.compiled`. Blocks compiled by the user are refused.
        data_parallel_sharding: ``"replicate"`` (default) keeps a whole stage on every replica; ``"fsdp"``
            shards each stage over its replicas with torch's FSDP2 (see ``docs/guides/sharding.md``).
    """

    strategy_name = "dynmo"

    def __init__(
        self,
        *,
        pipeline_size: int | None = None,
        schedule: str = "1F1B",
        num_microbatches: int = 4,
        placement: str | Placement = "uniform",
        timeout: timedelta | None = default_pg_timeout,
        control_timeout: timedelta | None = DEFAULT_CONTROL_TIMEOUT,
        start_method: StartMethod = "popen",
        process_group_backend: str | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        loss_log_name: str | None = "train_loss",
        on_release: Callable[[ReleaseEvent], Any] | None = None,
        val_loss_log_name: str | None = "val_loss",
        test_loss_log_name: str | None = "test_loss",
        save_distributed_checkpoint: bool = True,
        activation_checkpointing: bool = False,
        compile_blocks: bool | Mapping[str, Any] = False,
        data_parallel_sharding: DataParallelSharding = "replicate",
    ) -> None:
        checkpointing.check_checkpoint_io(checkpoint_io, save_distributed_checkpoint)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._placement_arg, self._eval_log_names = check_strategy_args(
            pipeline_size=pipeline_size,
            num_microbatches=num_microbatches,
            start_method=start_method,
            placement=placement,
            on_release=on_release,
            val_loss_log_name=val_loss_log_name,
            test_loss_log_name=test_loss_log_name,
        )
        self._pipeline_size_arg = pipeline_size
        self._start_method, self._process_group_backend = start_method, process_group_backend
        self._loss_log_name, self._on_release = loss_log_name, on_release
        self._checkpoints = checkpointing.CheckpointParts(save_distributed_checkpoint)
        self.num_nodes = 1
        # The run's state (strategy/state.py), filled in by set_world_ranks / setup_environment / setup.
        self._ranks = RankState(timeout=timeout, control_timeout=control_timeout_of(timeout, control_timeout))
        mode = check_data_parallel_sharding(
            data_parallel_sharding, save_distributed_checkpoint, compile_blocks
        )
        self._pipeline = PipelineState(
            schedule=resolve_schedule(schedule),
            microbatches=MicrobatchCount(num_microbatches),
            recompute=activation_checkpointing,
            compile_options=check_compile_option(compile_blocks),
            data_parallel_sharding=mode,
        )
        self._sync_blocked = False

    # -- the surface callbacks use ------------------------------------------------------------------

    def pipeline_view(self) -> PipelineView:
        """What callbacks read of the pipeline now (take a fresh one after :meth:`apply_placement`)."""
        return PipelineView.of(self, self._ranks, self._pipeline)

    @property
    def placement(self) -> Placement:
        """The current placement (set up in ``setup``)."""
        return self._pipeline.require_placement()

    @property
    def pipeline_size(self) -> int:
        """Ranks per pipeline."""
        return self._ranks.require_grid().pipeline_size

    @property
    def data_parallel_size(self) -> int:
        """Number of pipeline replicas."""
        return self._ranks.require_grid().data_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        """Which replica this rank belongs to."""
        return self._ranks.require_grid().data_parallel_rank(self.global_rank)

    @property
    def stage_index(self) -> int | None:
        """This rank's position in its pipeline (0 .. pipeline_size - 1); ``None`` once released.

        With single-stage schedules it is also the placement stage the rank runs; with multi-stage
        schedules see :attr:`stage_indices`.
        """
        return (
            self._ranks.require_grid().pipeline_rank(self.global_rank)
            if self.global_rank in self._ranks.active_ranks
            else None
        )

    @property
    def stage_indices(self) -> tuple[int, ...]:
        """The placement stages this rank runs (one, or two virtual stages), in increasing order."""
        return self._pipeline.pipe.stage_indices if self._pipeline.pipe is not None else ()

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank runs stage 0 (it feeds the inputs)."""
        return self._pipeline.pipe is not None and self._pipeline.pipe.has_first

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank runs the last stage (it computes the loss)."""
        return self._pipeline.pipe is not None and self._pipeline.pipe.has_last

    @property
    def local_layers(self) -> Mapping[int, nn.Module]:
        """The blocks this rank owns, by global index, in index order."""
        return {int(k): block for k, block in self._module().get_submodule("layers").named_children()}

    @property
    def pipeline_group(self) -> dist.ProcessGroup | None:
        """The process group of this rank's pipeline (ranks in pipeline order)."""
        return self._ranks.pipeline_group

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """The group of ranks holding the same stage in every replica (``None`` without data parallelism)."""
        return self._ranks.data_parallel_group

    @property
    def active_ranks(self) -> tuple[int, ...]:
        """The global ranks taking part in training; collectives of this strategy run over them."""
        return self._ranks.active_ranks

    @property
    def active_group(self) -> dist.ProcessGroup | None:
        """The process group over :attr:`active_ranks` (``None`` once this rank is released)."""
        return self._ranks.active_group

    @property
    def pipeline_stages(self) -> list[Any]:
        """This rank's torch ``PipelineStage`` objects for the current placement (empty when released).

        Profilers wrap their methods to time a step; they are rebuilt by :meth:`apply_placement`.
        """
        return [] if self._pipeline.pipe is None else self._pipeline.pipe.stages

    def pipeline_rank_of(self, global_rank: int) -> int:
        """The position in its pipeline (0 = first stage's rank) of an active ``global_rank``."""
        return self._ranks.require_grid().pipeline_rank(global_rank)

    @property
    def is_released(self) -> bool:
        """Whether this rank was released by a re-pack (it no longer trains; see :meth:`apply_placement`)."""
        return self._ranks.released

    @property
    def save_distributed_checkpoint(self) -> bool:
        """Whether checkpoints are directories each rank writes its units to (else one gathered file)."""
        return self._checkpoints.sharded

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per training step."""
        return self._pipeline.microbatches.current

    @property
    def schedule_name(self) -> str:
        """The canonical name of the pipeline schedule."""
        return self._pipeline.schedule.name

    # -- Lightning plumbing ---------------------------------------------------------------------------

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        """Processes per node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Always true: Lightning then syncs ``sync_dist`` logs and injects samplers."""
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # All stages of one replica must see the same batch: shard by replica, never by global rank.
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    @property
    def process_group_backend(self) -> str | None:
        """The torch.distributed backend in use."""
        return self._process_group_backend

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            return
        if self._start_method == "popen":
            self._launcher = WatchedScriptLauncher(  # names a child rank that was killed (child_watch.py)
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    def set_world_ranks(self) -> None:
        """Set ranks from the cluster environment and check ``pipeline_size`` against the world size."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]  # Lightning's rank_zero_only too
        # Runs when the Trainer is built, so a bad pipeline_size fails before any process starts.
        self._ranks.grid = RankGrid(self.world_size, self._pipeline_size_arg or self.world_size)
        check_sharding_fits(self._pipeline.data_parallel_sharding, self.world_size, self.pipeline_size)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        self._process_group_backend = connection.connect(
            self._ranks,
            self.cluster_environment,
            self._process_group_backend,
            self.root_device,
            self.global_rank,
            self.world_size,
        )

    @property
    def tied_parameters(self) -> tuple[TiedParameter, ...]:
        """Parameters the first-stage and last-stage parts share (e.g. token embedding and head)."""
        return self._pipeline.ties.ties

    def _sync_tied_grads(self) -> None:
        guard = partial(self.guard, "the tied-parameter gradient exchange")
        self._pipeline.ties.sync_grads(self._module(), self._ranks.pipeline_group, guard)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        assert self.model is not None
        show_info_on_rank_zero(self.global_rank)  # before the first placement line
        self.accelerator.setup(trainer)
        module = self._module()
        fitting = trainer.state.fn == TrainerFn.FITTING
        callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector
        check_trainer_setup(module, self.precision_plugin, self._layer_sync, callbacks, fitting)
        # Trainer.validate / test after fit set up the same, already cut module again: keep its stages.
        if module is not self._pipeline.cut_module:
            replacement.place_initially(self, self._ranks, self._pipeline, module, self._placement_arg)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        replacement.shard_local_units(self, self._ranks, self._pipeline)  # before the optimizers see them
        self._route_clipping_through_pipeline()
        sigterm.install(self._ranks, self.guard, self.root_device, trainer, self.launcher)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        groups = self._ranks
        self._pipeline.loss_scaling = PipelineLossScaling(
            self.precision_plugin, lambda: groups.active_group, self.root_device
        )
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            self._pipeline.loss_scaling.agree_on_overflow()
        self.rebuild_pipeline()
        log.info(
            "rank %d: placement %s, schedule %s, stages %s, layers %s",
            self.global_rank,
            self._pipeline.placement,
            self.schedule_name,
            self.stage_indices,
            sorted(self.local_layers),
        )

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # -- placement and units --------------------------------------------------------------------------

    def _local_units(self) -> dict[str, nn.Module]:
        return self._pipeline.local_units(self._module())

    def apply_placement(self, new: Placement | str, num_microbatches: int | None = None) -> MigrationReport:
        """Move layers so that ``new`` becomes the placement; call on all ranks at a step boundary.

        Step boundaries: a callback's ``on_train_batch_start`` / ``on_train_batch_end``, or
        ``on_before_optimizer_step`` (gradients move with their layers). Inside a step (from
        ``on_pipeline_step_end`` up to ``on_after_backward``) it raises: the gradients would be lost.

        Every moved unit travels with its parameters, gradients, buffers, ``requires_grad`` flags,
        plain attributes and optimizer state; the stages and schedule are then rebuilt. Any change of
        the split works (several layers at once, moves between non-neighbouring stages).

        With FEWER stages than now it re-packs: the layers move onto fewer ranks and the others are
        released (they leave ``fit``; see :mod:`lightning_dynmo.strategy.replacement`). More stages than
        now is an error (released ranks do not come back).

        Args:
            new: The target placement (object or string such as ``"0-1|2-5"``), identical on all ranks.
            num_microbatches: With a re-pack, the micro-batch count the smaller pipeline runs from now on
                (:mod:`lightning_dynmo.pipeline.step.microbatches`: it must divide the batch; a batch it does
                not divide runs with the configured count). ``None`` keeps the count.

        Returns:
            This rank's :class:`~lightning_dynmo.pipeline.MigrationReport`.

        Raises:
            ValueError: if ranks passed different placements, or ``new`` does not fit the model or has
                more stages than now.
            RuntimeError: if this rank was released, it is called inside a training step, or a peer was
                lost during the transfer.
        """
        return replacement.apply_placement(
            self,
            self._ranks,
            self._pipeline,
            new,
            num_microbatches,
            migrate=self._migrate,
            on_release=self._on_release,
        )

    def _migrate(self, moves: list[UnitMove], what: str) -> MigrationReport:
        return replacement.migrate(self, self._ranks, self._pipeline, moves, what)

    # -- re-pack and release (phase 2) ----------------------------------------------------------------

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        steps.batch_start(self._ranks, self.guard, self.root_device, self._trainer(), batch, batch_idx)

    def _trainer(self) -> pl.Trainer | None:
        return trainer_of(self)

    def _comm_context(self, control: bool = False) -> CommContext:
        return connection.comm_context(
            self._ranks, self._pipeline, self.global_rank, self._local_units, control
        )

    def guard(self, what: str, control: bool = False) -> AbstractContextManager[None]:
        """Context for a collective named ``what`` on this strategy's ranks: a failure names the peers.

        ``control=True`` for DynMo's own agreements on the control group (its shorter timeout is named).
        """
        return communication_guard(what, self._comm_context(control))

    @override
    def teardown(self) -> None:
        if self._ranks.watch is not None:
            self._ranks.watch.close()
        super().teardown()

    @override
    def on_exception(self, exception: BaseException) -> None:
        # An error outside a guarded step (a callback, the data) is posted too, so the peers can name it.
        call = getattr(getattr(self._trainer(), "state", None), "fn", None)
        report_interrupt(
            exception, f"Trainer.{call.value}" if call else "a Trainer call", self._comm_context()
        )

    # -- placement-independent checkpoints (phase 2) ---------------------------------------------------

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Each rank loads only the units it owns, so the model must be cut first.
        return True

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        return super().checkpoint_io

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: CheckpointIO) -> None:
        # The Trainer sets its plugins here: a custom one must not be ignored by sharded saves.
        checkpointing.check_checkpoint_io(io, self._checkpoints.sharded)
        self._checkpoint_io = io

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state under single-process keys: this rank's units (sharded saves), or the whole
        model gathered over replica 0's pipeline on global rank 0 (``{}`` elsewhere and when released).

        It also takes the optimizer state returned by :meth:`optimizer_state`.
        """
        return self._checkpoints.model_state(
            self._ranks, self.guard, self._local_units, list(self.optimizers), self.global_rank
        )

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """This optimizer's state keyed by parameter name, gathered by :meth:`lightning_module_state_dict`."""
        return self._checkpoints.optimizer_state(optimizer, self.optimizers)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        checkpointing.check_storage_options(storage_options, self._checkpoints.sharded)
        save_file = partial(super().save_checkpoint, storage_options=storage_options)
        layout = partial(layout_of, self)
        self._checkpoints.save(
            self._ranks, self.guard, checkpoint, filepath, save_file, layout, self.is_global_zero
        )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Read a checkpoint after verifying its checksums; from a directory, only this rank's units."""
        path = checkpointing.choose_resume_path(self._ranks, self.guard, self.global_rank, checkpoint_path)
        units, aliases, with_optimizer = (
            self._local_units(),
            self._pipeline.ties.aliases,
            bool(self.optimizers),
        )
        read_file = super().load_checkpoint
        return checkpointing.load(
            self._ranks, self.guard, units, aliases, with_optimizer, path, weights_only, read_file
        )

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load the units this rank owns under its current placement from a DynMo checkpoint."""
        full = full_state_from_checkpoint(checkpoint, with_optimizer=False)
        load_local_state(full, self._local_units(), [])

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load the optimizer state of the parameters this rank owns, by parameter name."""
        full = full_state_from_checkpoint(checkpoint, with_optimizer=True)
        # A single-process checkpoint keeps a tie's optimizer state under its first-stage name only.
        load_local_state(
            full, self._local_units(), list(self.optimizers), aliases=self._pipeline.ties.aliases
        )

    def rebuild_pipeline(self) -> None:
        """New stages and schedule on this rank (all active ranks together, at a step boundary)."""
        replacement.rebuild_pipeline(self, self._ranks, self._pipeline)

    # -- one training step ------------------------------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        return steps.training_step(self, self._ranks, self._pipeline, self._loss_log_name, args, kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        out = super().backward(closure_loss, optimizer, *args, **kwargs)
        self._pipeline.step_in_flight = False
        if not self._sync_blocked:
            self._sync_data_parallel_grads()
            self._sync_tied_grads()
        return out

    def _sync_data_parallel_grads(self) -> None:
        if self._ranks.data_parallel_group is None or self._pipeline.sharding is not None:
            return  # sharded: FSDP reduce-scattered the gradients in the schedule step
        # By name: every replica's stage lists the same parameters in the same order.
        params = [p for _, p in sorted(self._module().named_parameters())]
        pipeline_grads.average_grads(params, self._ranks.data_parallel_group, self.data_parallel_size)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Inside an accumulation window gradients stay local; they are averaged at the window's end."""
        self._sync_blocked = True
        try:
            yield None
        finally:
            self._sync_blocked = False

    def _route_clipping_through_pipeline(self) -> None:
        steps.route_clipping_through_pipeline(self, self._ranks, self._pipeline, self._module())

    # -- evaluation (validate / test / predict) ---------------------------------------------------------

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Tensor:
        """One forward-only pipeline step; logs and returns the batch's mean loss on every rank.

        The model's own ``validation_step`` is not called (it would see a partial model); Lightning's
        ``on_validation_batch_end`` hooks receive the returned loss.
        """
        with self.precision_plugin.val_step_context():
            name = self._eval_log_names["validate"]
            return steps.evaluation_step(self, self._ranks, self._pipeline, name, "validate", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Tensor:
        """Like :meth:`validation_step`, for ``Trainer.test`` (logged as ``test_loss_log_name``)."""
        with self.precision_plugin.test_step_context():
            name = self._eval_log_names["test"]
            return steps.evaluation_step(self, self._ranks, self._pipeline, name, "test", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Tensor:
        """One forward-only pipeline step without a loss; every rank returns the whole batch's output.

        The model's ``pipeline_batch(batch)`` gives the inputs (its target is ignored) and the output is
        what ``pipeline_last`` returns, computed on the last stage and broadcast to the other ranks of
        the pipeline, so ``Trainer.predict`` returns the same predictions on every rank (as a
        single-device run would). The model's own ``predict_step`` is not called.
        """
        return steps.predict_step(self, self._ranks, self._pipeline, args, kwargs)

    # -- collectives over the active ranks ------------------------------------------------------------------

    @override
    def barrier(self, name: str | None = None) -> None:
        collectives.barrier(self._ranks, self.guard, name)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return collectives.broadcast(self._ranks, self.guard, obj, src)

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        return collectives.reduce(self._ranks, self.guard, tensor, group, reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        gather = partial(super().all_gather)
        return collectives.all_gather(self._ranks, self.guard, gather, tensor, group, sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return collectives.reduce_boolean_decision(self._ranks, self.guard, self.root_device, decision, all)

    # -- helpers ------------------------------------------------------------------------------------------

    def _module(self) -> pl.LightningModule:
        return module_of(self)


StrategyRegistry.register(
    "dynmo",
    DynMoStrategy,
    description="DynMo pipeline-parallel strategy (torch.distributed.pipelining)",
    override=True,
)
