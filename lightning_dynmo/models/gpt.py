"""GPT: a pre-norm GPT-2 with a pluggable block per layer, following DynMo's pipeline contract.

Read in this order: :class:`GPT` (the LightningModule and its pipeline pieces), :func:`build_unit` (how
each unit is built under its own seed), then the single-process steps and metrics.

Architecture: GPT-2 (``tok_emb + pos_emb`` with learned positions -> ``layers["0"] .. layers[str(L-1)]``
-> ``ln_f`` -> ``head`` -> cross-entropy), pre-norm LayerNorm, GELU MLP, biases. Chosen over Llama style
(RMSNorm, rotary positions, SwiGLU) because it has the fewest moving parts and every piece is in torch:
learned positions are one first-stage embedding (rotary would be recomputed in every block on every
stage), and GPT-2's initialisation is the best-documented baseline. Block kinds come from the registry of
:mod:`lightning_dynmo.models.registry` (``GPTConfig.blocks``), so MoE, early-exit or Mixture-of-Depths
blocks plug in without editing this file.

Pipeline units: the first-stage parts ``tok_emb`` and ``pos_emb``, the blocks ``layers.<i>``, the
last-stage parts ``ln_f`` and ``head``. Each is built by :func:`build_unit` under its own seed, so a rank
that builds only some units gets the weights a single process would.

Stage interface (:mod:`lightning_dynmo.pipeline.model.contract`): the model declares what its blocks need,
collected from the blocks when it is built (:func:`block_interface`):

- side inputs: ``"labels"`` (the next-token targets, for per-layer losses such as early exit), given by
  :meth:`GPT.pipeline_batch` only when a block reads it;
- side state: every entry a block's ``side_state_init`` names (e.g. an exit mask), created by
  :meth:`GPT.pipeline_first` from the embedded hidden state;
- auxiliary losses: every name a block's ``pipeline_aux_losses`` lists (e.g. a MoE balancing loss).

The single-process path (:meth:`GPT.run_blocks`) calls blocks exactly as a pipeline stage does
(:func:`~lightning_dynmo.pipeline.run_block`), and :meth:`GPT.training_step` cuts each batch into
``microbatches`` pieces and adds their auxiliary losses as a pipeline does, so it is the exact reference.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric
from typing_extensions import override

from lightning_dynmo.models import dense as _dense  # noqa: F401  # registers the "dense" kind
from lightning_dynmo.models.config import GPTConfig, OptimizerConfig
from lightning_dynmo.models.init import gpt2_init_, unit_rng
from lightning_dynmo.models.loading import ShardedCheckpointModule
from lightning_dynmo.models.optim import WarmupCosine, build_adamw
from lightning_dynmo.models.reference import reference_training_loss
from lightning_dynmo.pipeline.model.contract import HIDDEN, block_inputs
from lightning_dynmo.pipeline.step.stage import run_block

__all__ = [
    "FIRST_PARTS",
    "GPT",
    "LAST_PARTS",
    "SIDE_INPUTS",
    "BlockInterface",
    "block_interface",
    "build_unit",
    "unit_names",
]

FIRST_PARTS = ("tok_emb", "pos_emb")
LAST_PARTS = ("ln_f", "head")
#: The side inputs a GPT can give its blocks.
SIDE_INPUTS = ("labels",)


class GPT(ShardedCheckpointModule):
    """A GPT following the DynMo model contract (see :mod:`lightning_dynmo.pipeline.model.contract`).

    Trains single-process with its own ``training_step`` (the reference) and pipelined under
    :class:`~lightning_dynmo.DynMoStrategy`. Logs ``train_loss``, ``val_loss`` / ``test_loss`` (per
    epoch) and ``val_ppl`` / ``test_ppl``, the exponential of the token-weighted mean loss, the same way
    in both cases. Its arguments are its hyper-parameters (``hparams``, saved in checkpoints but not sent
    to loggers), so ``GPT.load_from_checkpoint(path)`` rebuilds it from a checkpoint file or a sharded
    checkpoint directory.

    Args:
        config: Shape, block kinds and seed; ``None`` is ``GPTConfig()``.
        optimizer: AdamW settings and LR schedule; ``None`` is ``OptimizerConfig()``.
        microbatches: The single-process ``training_step`` cuts each batch into this many equal pieces
            and averages their losses, as a pipeline with ``num_microbatches`` does. Set it to the
            pipeline's micro-batch count times its data-parallel size for an exact reference when blocks
            route per micro-batch (MoE capacity, auxiliary losses); 1 for plain training.
    """

    pipeline_first_parts = FIRST_PARTS
    pipeline_last_parts = LAST_PARTS

    def __init__(
        self,
        config: GPTConfig | None = None,
        optimizer: OptimizerConfig | None = None,
        *,
        microbatches: int = 1,
    ):
        super().__init__()
        if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
            raise ValueError(f"GPT(microbatches={microbatches!r}) must be an integer >= 1.")
        # Every __init__ argument up the subclass chain (Lightning collects a subclass's own too), so
        # load_from_checkpoint rebuilds the same shape; the configs are allow-listed for weights_only loads.
        # Not sent to loggers: Lightning's hparams.yaml writer refuses frozen dataclasses (ValueError).
        self.save_hyperparameters(logger=False)
        self.config = config if config is not None else GPTConfig()
        self.optimizer_config = optimizer if optimizer is not None else OptimizerConfig()
        self.microbatches = microbatches
        cfg = self.config
        self.tok_emb = build_unit(cfg, "tok_emb")
        self.pos_emb = build_unit(cfg, "pos_emb")
        self.layers = nn.ModuleDict({str(i): build_unit(cfg, f"layers.{i}") for i in range(cfg.num_layers)})
        self.ln_f = build_unit(cfg, "ln_f")
        self.head = build_unit(cfg, "head")
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        interface = block_interface(self.layers.values())
        self.pipeline_side_inputs = interface.side_inputs
        self.pipeline_side_state = tuple(interface.side_state_init)
        self.pipeline_aux_losses = interface.aux_losses
        self._side_state_init = interface.side_state_init  # from the block classes: known on every rank
        # Token-weighted mean losses for perplexity. Every rank holds the same values (the strategy's loss
        # is already global), so nothing is synced: a re-pack's released ranks would never join a sync.
        # Built on the CPU even inside a meta-device declaration (local construction materialises pipeline
        # units only, and a meta metric state could never be moved); Lightning moves them with the model.
        with torch.device("cpu"):
            self.eval_loss_means = nn.ModuleDict(
                {p: MeanMetric(sync_on_compute=False) for p in ("val", "test")}
            )

    # -- the pipeline contract ------------------------------------------------------------------

    def pipeline_batch(self, batch: Tensor) -> Any:
        """Token rows of length ``seq_len + 1`` -> (inputs, next-token targets[, side inputs])."""
        inputs, target = batch[:, :-1], batch[:, 1:]
        if not self.pipeline_side_inputs:
            return inputs, target
        return inputs, target, {"labels": target}

    def pipeline_first(self, idx: Tensor) -> Any:
        """Token plus learned position embeddings (then embedding dropout), and the blocks' side state."""
        length = idx.shape[1]
        if length > self.config.seq_len:
            raise ValueError(
                f"the input has {length} tokens per sequence but GPTConfig.seq_len={self.config.seq_len} "
                "(the number of position embeddings); build the model with seq_len >= the data's seq_len."
            )
        positions = torch.arange(length, device=idx.device)
        hidden = F.dropout(self.tok_emb(idx) + self.pos_emb(positions), self.config.dropout, self.training)
        if not self._side_state_init:
            return hidden
        return {HIDDEN: hidden, **{name: init(hidden) for name, init in self._side_state_init.items()}}

    def pipeline_last(self, hidden: Tensor) -> Tensor:
        """Final LayerNorm and the vocabulary head: logits ``[batch, seq, vocab_size]``."""
        logits: Tensor = self.head(self.ln_f(hidden))
        return logits

    def pipeline_loss(self, logits: Tensor, target: Tensor) -> Tensor:
        """Mean next-token cross-entropy."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    def run_blocks(self, first: Any, side_inputs: Mapping[str, Tensor] | None = None) -> Tensor:
        """The blocks in global index order, called as a pipeline stage calls them; the last hidden state.

        Args:
            first: What :meth:`pipeline_first` returned (the hidden state, or it and the side state).
            side_inputs: The side inputs the blocks read (``{"labels": target}`` when one reads labels).
        """
        state: dict[str, Tensor] = dict(first) if isinstance(first, Mapping) else {HIDDEN: first}
        for key, block in self.layers.items():
            state = run_block(
                block,
                state,
                side_inputs or {},
                reads=block_inputs(block),
                side_state=self.pipeline_side_state,
                who=f"layers.{key}",
                model_name=type(self).__name__,
            )
        return state[HIDDEN]

    @override
    def forward(self, idx: Tensor, labels: Tensor | None = None) -> Tensor:
        """Logits of the tokens ``idx`` (``[batch, seq]`` with ``seq <= seq_len``).

        ``labels`` (the next-token targets) is needed only when a block reads it (e.g. early-exit losses).
        """
        side = {"labels": labels} if labels is not None else {}
        return self.pipeline_last(self.run_blocks(self.pipeline_first(idx), side))

    @override
    def setup(self, stage: str) -> None:
        """Check that a datamodule's vocabulary and sequence length fit this model, before any step runs."""
        datamodule = getattr(self.trainer, "datamodule", None)
        vocab, seq_len = getattr(datamodule, "vocab_size", None), getattr(datamodule, "seq_len", None)
        if isinstance(vocab, int) and vocab > self.config.vocab_size:
            raise ValueError(
                f"the datamodule's tokenizer has vocab_size={vocab} but GPTConfig.vocab_size="
                f"{self.config.vocab_size}; build the model with GPTConfig(vocab_size={vocab}) or more."
            )
        if isinstance(seq_len, int) and seq_len > self.config.seq_len:
            raise ValueError(
                f"the datamodule serves seq_len={seq_len} tokens but GPTConfig.seq_len="
                f"{self.config.seq_len}; build the model with GPTConfig(seq_len={seq_len}) or more, or lower "
                "the datamodule's seq_len."
            )

    # -- single-process steps (DynMoStrategy replaces them with pipelined steps) ----------------

    @override
    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        # As a pipeline: the mean of the micro-batches' losses, each micro-batch's auxiliary losses added.
        n = self.microbatches
        return reference_training_loss(
            self,
            batch.shape[0],
            n,
            lambda: [self._loss(piece) for piece in batch.chunk(n)],
            owner="GPT",
            model_name="GPT",
        )

    @override
    def validation_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        # Same name and value as DynMoStrategy's pipelined validation: the batch's mean loss.
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, batch_size=batch.shape[0])
        return loss

    @override
    def test_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("test_loss", loss, prog_bar=True, batch_size=batch.shape[0])
        return loss

    def _loss(self, batch: Tensor) -> Tensor:
        inputs, target = batch[:, :-1], batch[:, 1:]
        labels = target if self.pipeline_side_inputs else None
        return self.pipeline_loss(self(inputs, labels), target)

    # -- perplexity: fed from the batch-end hooks, which see the batch loss in both modes ------

    @override
    def on_validation_batch_end(
        self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._update_eval_loss("val", outputs, batch)

    @override
    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._update_eval_loss("test", outputs, batch)

    @override
    def on_validation_epoch_end(self) -> None:
        self._log_perplexity("val")

    @override
    def on_test_epoch_end(self) -> None:
        self._log_perplexity("test")

    def _update_eval_loss(self, phase: str, loss: Any, batch: Tensor) -> None:
        if isinstance(loss, Tensor):  # every row has seq_len targets: rows weigh like tokens
            self._eval_mean(phase).update(loss.detach().float(), weight=batch.shape[0])

    def _log_perplexity(self, phase: str) -> None:
        mean = self._eval_mean(phase)
        if mean.update_called:
            self.log(f"{phase}_ppl", mean.compute().exp(), prog_bar=True, sync_dist=True)
        mean.reset()

    def _eval_mean(self, phase: str) -> MeanMetric:
        return cast(MeanMetric, self.eval_loss_means[phase])

    # -- optimizer ----------------------------------------------------------------------------

    @override
    def optimizer_step(
        self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None
    ) -> None:
        """The optimizer step, then each local block's ``after_optimizer_step`` (e.g. MoE expert bias).

        A block with state that follows optimizer steps (not forwards) defines
        ``after_optimizer_step(*, group, step)``; it is called in layer order on the rank holding the
        block, with the strategy's data-parallel group (``None`` without data parallelism) and the
        global step. A method called from here rather than a hook on the block, since hooks do not migrate.
        """
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        group = _data_parallel_group(self.trainer.strategy)
        for block in self.layers.values():
            after_step = getattr(block, "after_optimizer_step", None)
            if callable(after_step):
                after_step(group=group, step=self.trainer.global_step)

    @override
    def configure_optimizers(self) -> Any:
        """AdamW with a decay and a no-decay group (both always, in that order) over the local units."""
        tied_head = ("head.weight",) if self.config.tie_embeddings else ()
        optimizer = build_adamw(self, self.optimizer_config, no_decay=tied_head)
        if not self.optimizer_config.has_schedule:
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(self.optimizer_config))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _data_parallel_group(strategy: Any) -> dist.ProcessGroup | None:
    """The group of replicas of this rank's blocks: DynMoStrategy's, every rank under DDP, else ``None``."""
    if hasattr(strategy, "data_parallel_group"):
        group: dist.ProcessGroup | None = strategy.data_parallel_group
        return group
    if dist.is_available() and dist.is_initialized() and getattr(strategy, "world_size", 1) > 1:
        return dist.group.WORLD
    return None


def unit_names(config: GPTConfig) -> tuple[str, ...]:
    """Every unit's global name, in pipeline order: first parts, ``layers.<i>``, last parts."""
    return (*FIRST_PARTS, *(f"layers.{i}" for i in range(config.num_layers)), *LAST_PARTS)


def build_unit(config: GPTConfig, name: str) -> nn.Module:
    """Build and initialise one unit under its own seed (its weights depend on ``(config.seed, name)`` only).

    Raises:
        ValueError: ``name`` is not a unit of ``config`` (see :func:`unit_names`).
        TypeError: a block factory returned something other than an ``nn.Module``.
    """
    if name not in unit_names(config):
        raise ValueError(
            f"build_unit: {name!r} is not a unit of this GPT; units are {FIRST_PARTS}, 'layers.0' .. "
            f"'layers.{config.num_layers - 1}' and {LAST_PARTS}."
        )
    with unit_rng(config.seed, name):
        module = _construct(config, name)
        gpt2_init_(module, config.num_layers, config.init_std)
        init_weights = getattr(module, "init_weights", None)
        if callable(init_weights):
            init_weights(config)
    if name == "head" and config.tie_embeddings:
        with torch.no_grad():  # the head is the embedding: same values wherever it is built
            cast(nn.Linear, module).weight.copy_(cast(nn.Embedding, build_unit(config, "tok_emb")).weight)
    return module


def _construct(config: GPTConfig, name: str) -> nn.Module:
    d = config.d_model
    if name == "tok_emb":
        return nn.Embedding(config.vocab_size, d)
    if name == "pos_emb":
        return nn.Embedding(config.seq_len, d)
    if name == "ln_f":
        return nn.LayerNorm(d, eps=config.layer_norm_eps, bias=config.bias)
    if name == "head":
        return nn.Linear(d, config.vocab_size, bias=False)
    index = int(name.removeprefix("layers."))
    kind, options = config.resolved_blocks()[index]
    block = kind.factory(config, index, options)
    if not isinstance(block, nn.Module):
        raise TypeError(
            f"the factory of block kind {kind.name!r} returned {type(block).__name__} for layer {index}; it "
            "must return an nn.Module (see lightning_dynmo.models.registry)."
        )
    return block


@dataclass(frozen=True)
class BlockInterface:
    """What a GPT's blocks need from the stage interface (see :func:`block_interface`).

    Attributes:
        side_inputs: The side inputs some block reads (a subset of :data:`SIDE_INPUTS`).
        side_state_init: Per side-state entry some block reads, how to make its initial value from the
            embedded hidden state ``[batch, seq, d_model]``.
        aux_losses: The auxiliary losses the blocks may add.
    """

    side_inputs: tuple[str, ...]
    side_state_init: dict[str, Callable[[Tensor], Tensor]]
    aux_losses: tuple[str, ...]


def block_interface(blocks: Iterable[nn.Module]) -> BlockInterface:
    """Collect the blocks' stage-interface declarations.

    A block declares, as class or instance attributes: ``pipeline_inputs`` (what it reads, the
    contract's), ``side_state_init`` (a mapping from each side-state entry it introduces to a function
    of the embedded hidden state giving its initial value) and ``pipeline_aux_losses`` (the names of the
    auxiliary losses it adds).

    Raises:
        TypeError: a block reads a name that is neither a GPT side input nor a declared side-state entry.
    """
    side_inputs: list[str] = []
    inits: dict[str, Callable[[Tensor], Tensor]] = {}
    aux: list[str] = []
    blocks = list(blocks)
    for block in blocks:
        inits.update({k: v for k, v in dict(getattr(block, "side_state_init", {})).items() if k not in inits})
        aux += [n for n in getattr(block, "pipeline_aux_losses", ()) if n not in aux]
    for block in blocks:
        for name in block_inputs(block):
            if name in SIDE_INPUTS:
                side_inputs += [name] if name not in side_inputs else []
            elif name not in inits:
                raise TypeError(
                    f"the GPT block {type(block).__name__} reads {name!r}, which is neither a GPT side input "
                    f"{SIDE_INPUTS} nor a side-state entry some block initialises (side_state_init); give "
                    "the block a side_state_init for it."
                )
    return BlockInterface(tuple(side_inputs), inits, tuple(aux))
