"""HuggingFaceCausalLM: a ``transformers`` causal LM under DynMo's pipeline contract, with its own modules.

Read in this order: :class:`HuggingFaceCausalLM` (construction: the model's embedding, decoder layers,
final norm and head become the pipeline units), its contract methods (:meth:`~HuggingFaceCausalLM.
pipeline_batch`, :meth:`~HuggingFaceCausalLM.pipeline_loss`), the single-process steps, then the
checkpoint names. Where each family keeps its pieces: :mod:`lightning_dynmo.models.hf_architecture`; how
a decoder layer becomes a block: :mod:`lightning_dynmo.models.hf_blocks`. Needs the ``hf`` extra
(``pip install -e ".[hf]"``).

Batches follow the Hugging Face convention: a dict with ``input_ids`` ``[batch, seq]`` and optionally
``attention_mask`` (1 = real token; default all ones), ``labels`` (``-100`` = ignored; default
``input_ids`` with padding set to ``-100``, as ``DataCollatorForLanguageModeling(mlm=False)`` makes them)
and ``position_ids``. Any other key is refused rather than silently ignored.

- Labels are shifted inside, as the model's own loss does: position ``t`` predicts ``labels[t + 1]``
  and the last position predicts nothing (the inputs are not cut, so ``labels = input_ids`` is right).
- Position ids, when the batch has none, come from the attention mask as Hugging Face generation makes
  them (``cumsum(mask) - 1``, padding at 1), so left padding does not shift a row's positions. (The
  model's own ``forward`` without ``position_ids`` counts ``0..seq-1`` whatever the padding; with right
  padding the two agree on every real token.)
- Masks: each block builds its layer's causal (or sliding-window) mask with the library's own mask
  functions from the 2-D attention mask and the position ids, for the configured attention
  implementation (``"eager"``, ``"sdpa"``, ...).
- Rotary embeddings: the model's rotary module (no parameters, only non-persistent buffers) stays on
  every rank, outside the units; :meth:`~HuggingFaceCausalLM.pipeline_batch` computes ``cos``/``sin``
  once per step from the position ids, and they reach every block as side inputs. No parameter is
  duplicated.

Loss normalisation. The model's loss is the mean over the batch's non-ignored tokens. A pipeline
averages its micro-batches' losses, and the mean of per-micro-batch means differs from it when the
micro-batches hold different numbers of tokens (padding). So :meth:`~HuggingFaceCausalLM.pipeline_batch`
packs the whole batch's token count ``N`` and row count ``B`` into the target, and each micro-batch of
``b`` rows returns its summed token loss times ``B / (N * b)``: the mean over the ``B / b`` micro-batches
is exactly the batch's token mean, at any micro-batch count. It is computed in the logits' dtype, at
least float32 (the library always casts logits to float32 for its loss, also in float64 runs). With
data parallelism each replica's loss is its own batch's token mean and replicas are averaged (like DDP).

Mixtral's router loss, when ``config.output_router_logits`` is set (as for training with the library),
is added per layer through :func:`~lightning_dynmo.pipeline.add_aux_loss` (see
:mod:`~lightning_dynmo.models.hf_blocks` for how it relates to the library's cross-layer formula) and
logged as ``train_aux/router_load_balance``.

Checkpoint files keep the model's own state-dict names (``model.layers.0.self_attn.q_proj.weight``,
``transformer.h.0.attn.c_attn.weight``, ``lm_head.weight``): the adapter renames the keys in
``on_save_checkpoint`` and back in ``on_load_checkpoint``
(:func:`~lightning_dynmo.pipeline.rename_checkpoint_keys`), so ``checkpoint["state_dict"]`` loads
strictly into the plain model, which ``save_pretrained`` then writes. A sharded checkpoint (a directory,
DynMoStrategy's default) keeps the units' names, because each rank reads its own units' items back by
those names before any model hook runs; :func:`~lightning_dynmo.pipeline.export_full_checkpoint`
makes one file of it and :meth:`~HuggingFaceCausalLM.rename_for_huggingface` gives that file the model's
names.

Dropout is the model's own modules' (configure it in the config; training and evaluation modes are
Lightning's); the generation config is kept untouched and handed to :meth:`~HuggingFaceCausalLM.
to_huggingface`. The adapter shares the given model's modules: under DynMoStrategy the memory of the
units another rank owns is freed only if the caller holds no reference to the model (build the adapter
from a config, or ``del`` the model).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

try:
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "lightning_dynmo.models.huggingface needs the `transformers` package: pip install -e '.[hf]'"
    ) from error

from lightning_dynmo.models.hf_architecture import (
    ARCHITECTURES,
    FIRST_ROLES,
    LAST_ROLES,
    HFArchitecture,
    NameMap,
    find_pieces,
)
from lightning_dynmo.models.hf_blocks import (
    BLOCK_CHILD,
    ROTARY_INPUTS,
    ROUTER_LOSS,
    SIDE_INPUTS,
    HuggingFaceBlock,
    attention_kind,
)
from lightning_dynmo.models.hf_optim import (
    OptimizerFactory,
    SchedulerFactory,
    build_optimization,
    trainer_decay_groups,
)
from lightning_dynmo.models.hf_pretrained import (
    PretrainedWeights,
    SafetensorsFiles,
    meta_model,
    real_rotary,
    tied_names,
)
from lightning_dynmo.models.loading import ShardedCheckpointModule
from lightning_dynmo.models.reference import reference_training_loss
from lightning_dynmo.pipeline.checkpoint.renaming import rename_checkpoint_keys
from lightning_dynmo.pipeline.model.contract import HIDDEN, block_inputs
from lightning_dynmo.pipeline.step.stage import run_block

__all__ = ["BATCH_KEYS", "IGNORE_INDEX", "HuggingFaceCausalLM", "hf_position_ids"]

IGNORE_INDEX = -100
#: The batch keys the adapter reads.
BATCH_KEYS = ("input_ids", "attention_mask", "labels", "position_ids")

# A custom recipe is a hyper-parameter: allow-listed for torch.load(weights_only=True), Lightning's default.
torch.serialization.add_safe_globals([HFArchitecture])


class HuggingFaceCausalLM(ShardedCheckpointModule):
    """A Hugging Face causal LM (GPT-2, Llama, Qwen2, Mistral, Mixtral) following DynMo's model contract.

    Units: the first-stage parts ``embedding`` (and GPT-2's ``position_embedding`` and
    ``embedding_dropout``), the blocks ``layers.<i>`` (each wrapping the model's decoder layer ``i``),
    and the last-stage parts ``final_norm`` and ``head``, all the model's own module objects. Trains
    single-process with its own ``training_step`` and pipelined under
    :class:`~lightning_dynmo.DynMoStrategy`; logs ``train_loss`` (and ``train_aux/router_load_balance``),
    ``val_loss``, ``test_loss``.

    Hyper-parameters (``hparams``): the arguments, with ``model`` as its config's ``to_dict()`` (a model
    is not a hyper-parameter, and a plain dict loads under ``torch.load(weights_only=True)``) and, for a
    model, its attention implementation; so ``HuggingFaceCausalLM.load_from_checkpoint(path)`` rebuilds
    the model from its config and loads the checkpoint's weights (a file, or a sharded directory).

    Args:
        model: A ``transformers`` causal-LM model, or its config (then the model is built from it with
            random weights under ``seed``; nothing is downloaded), or a config's ``to_dict()`` (as
            ``hparams["model"]`` holds it). Build the same weights on every rank.
        attn_implementation: With a config: the attention implementation (``"eager"``, ``"sdpa"``, ...);
            ``None`` takes the library's default. With a model, set it when building the model.
        seed: The seed of the random initialisation when ``model`` is a config.
        architecture: Where the model keeps its pieces; ``None`` uses the recipe of its model type
            (:data:`~lightning_dynmo.models.hf_architecture.ARCHITECTURES`).
        lr: AdamW's learning rate (the default optimizer's).
        weight_decay: The weight decay of the decaying group: every parameter but biases and norm
            weights, HF Trainer's rule (:mod:`lightning_dynmo.models.hf_optim`).
        optimizer: Builds the optimizer from the parameter groups ``[decay, no decay]`` (each with its
            ``weight_decay``), e.g. ``functools.partial(torch.optim.SGD, lr=0.1)``; it must keep the
            groups as given. ``None``: ``torch.optim.AdamW(groups, lr=lr)``.
        lr_scheduler: Builds the LR scheduler from the optimizer, stepped every optimizer step (or
            returns Lightning's ``lr_scheduler`` dict), e.g. ``lambda opt:
            transformers.get_cosine_schedule_with_warmup(opt, 100, 10_000)``. ``None``: none.
        microbatches: The single-process ``training_step`` cuts each batch into this many equal pieces
            (each normalised as in a pipeline), so that per-micro-batch router statistics match a pipeline
            with that many micro-batches times its data-parallel size; 1 for plain training.

    Raises:
        TypeError: ``model`` is neither a model nor a config, or the architecture is not supported (the
            message names the missing pieces).
        ValueError: a bad argument (the message names it).
    """

    # The parts (the model's own modules; ``None`` on ranks that do not own them under DynMoStrategy).
    embedding: Any
    position_embedding: Any
    embedding_dropout: Any
    final_norm: Any
    head: Any

    def __init__(
        self,
        model: PreTrainedModel | PretrainedConfig | Mapping[str, Any],
        *,
        attn_implementation: str | None = None,
        seed: int = 0,
        architecture: HFArchitecture | None = None,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        microbatches: int = 1,
        optimizer: OptimizerFactory | None = None,
        lr_scheduler: SchedulerFactory | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
            raise ValueError(f"HuggingFaceCausalLM(microbatches={microbatches!r}) must be an integer >= 1.")
        hf = _build(model, attn_implementation, seed)
        # Loggers get them too, unless a recipe (a frozen dataclass, which Lightning's hparams.yaml refuses).
        # Factories are code, not hyper-parameters: load_from_checkpoint takes them again as arguments.
        self.save_hyperparameters(ignore=["model", "optimizer", "lr_scheduler"], logger=architecture is None)
        self.save_hyperparameters(_config_hparams(model, hf), logger=architecture is None)
        pieces = find_pieces(hf, architecture)
        recipe = architecture if architecture is not None else ARCHITECTURES[hf.config.model_type]
        self.lr, self.weight_decay, self.microbatches = lr, weight_decay, microbatches
        self._optimizer, self._lr_scheduler = optimizer, lr_scheduler
        self.hf_config: Any = hf.config
        self._hf_class: type[Any] = type(hf)
        self._generation_config = copy.deepcopy(getattr(hf, "generation_config", None))
        self._names = NameMap(recipe, BLOCK_CHILD)
        self._pretrained: PretrainedWeights | None = None  # set by from_pretrained
        for role, module in pieces.parts.items():
            setattr(self, role, module)
        self.pipeline_first_parts = tuple(r for r in FIRST_ROLES if r in pieces.parts)
        self.pipeline_last_parts = tuple(r for r in LAST_ROLES if r in pieces.parts)
        # Not a unit: no parameters, no persistent buffers; every rank keeps its own (see pipeline_batch).
        self.rotary = pieces.rotary
        router_weight = _router_loss_weight(hf.config, recipe, len(pieces.layers))
        self.layers = nn.ModuleDict(
            {
                str(i): HuggingFaceBlock(
                    layer,
                    config=hf.config,
                    kind=attention_kind(hf.config, i),
                    rotary=pieces.rotary is not None,
                    router=recipe.router if router_weight else None,
                    router_loss_weight=router_weight,
                    top_k=int(getattr(hf.config, "num_experts_per_tok", 1)),
                )
                for i, layer in enumerate(pieces.layers)
            }
        )
        self.pipeline_side_inputs = SIDE_INPUTS + (ROTARY_INPUTS if pieces.rotary is not None else ())
        self.pipeline_first_inputs = ("position_ids",) if "position_embedding" in pieces.parts else ()
        self.pipeline_aux_losses = (ROUTER_LOSS,) if router_weight else ()

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        *,
        dtype: torch.dtype | None = None,
        attn_implementation: str | None = None,
        architecture: HFArchitecture | None = None,
        **kwargs: Any,
    ) -> Self:
        """The adapter of a pretrained model, built on the meta device: each rank reads only its units.

        Nothing is allocated or read here. Under :class:`~lightning_dynmo.DynMoStrategy` each rank
        materialises the units it owns once the strategy has cut the model, and
        :meth:`pipeline_init_unit` fills them from the directory's safetensors files (see
        :mod:`lightning_dynmo.models.hf_pretrained`); the weights equal
        ``AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)``'s. Without the strategy (one
        process), load every unit with :func:`lightning_dynmo.pipeline.materialize_model` first.

        Args:
            directory: A local ``save_pretrained`` directory (``config.json`` and ``model.safetensors``,
                or ``model.safetensors.index.json`` and its shards; for a Hub model, download those
                files with ``huggingface_hub.snapshot_download``).
            dtype: The parameters' dtype; ``None`` takes the one the config records (else float32).
            attn_implementation: The attention implementation (``"eager"``, ``"sdpa"``, ...).
            architecture: As in the constructor.
            **kwargs: The constructor's other arguments (``lr``, ``microbatches``, ...).

        Raises:
            FileNotFoundError: the directory has no safetensors weights (the message says how to get them).
        """
        path = Path(directory)
        files = SafetensorsFiles(path)  # fails early, before the model is built
        hf = meta_model(path, dtype=dtype, attn_implementation=attn_implementation)
        recipe = architecture if architecture is not None else ARCHITECTURES.get(hf.config.model_type)
        if recipe is not None and recipe.rotary is not None:
            real_rotary(hf, recipe.rotary)
        adapter = cls(hf, architecture=architecture, **kwargs)
        adapter._pretrained = PretrainedWeights(
            files, adapter.huggingface_name, tied_names(hf), str(getattr(hf, "base_model_prefix", ""))
        )
        return adapter

    def pipeline_init_unit(self, name: str, unit: nn.Module) -> None:
        """Fill a unit materialised from the meta device with its pretrained weights (see
        :meth:`from_pretrained`); called by :mod:`lightning_dynmo.pipeline.model.construction`.

        Raises:
            TypeError: the adapter was built around a meta-device model that no directory backs.
            KeyError: the checkpoint lacks one of the unit's tensors (the message names it and the file).
        """
        if self._pretrained is None:
            raise TypeError(
                f"HuggingFaceCausalLM holds unit {name!r} on the meta device but has no weights to load into "
                "it; build it with HuggingFaceCausalLM.from_pretrained(directory), or pass a model with real "
                "weights (or its config)."
            )
        self._pretrained.load_unit(name, unit)

    # -- the pipeline contract ------------------------------------------------------------------

    def pipeline_batch(self, batch: Mapping[str, Tensor]) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """A Hugging Face batch -> ``(input_ids, packed target, side inputs)`` (see the module docstring).

        The target is ``[batch, seq + 2]``: the shifted labels, then the batch's count of non-ignored
        labels and its row count in every row (what :meth:`pipeline_loss` normalises by).

        Raises:
            TypeError: the batch is not a dict with an integer ``input_ids`` tensor ``[batch, seq]``.
            ValueError: an unknown key, or a tensor whose shape differs from ``input_ids``.
        """
        ids, mask, labels, positions = _batch_fields(batch)
        shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
        counts = torch.stack([(shifted != IGNORE_INDEX).sum(), torch.tensor(ids.shape[0], device=ids.device)])
        target = torch.cat([shifted, counts.to(shifted.dtype).expand(ids.shape[0], 2)], dim=1)
        side = {"attention_mask": mask, "position_ids": positions}
        if self.rotary is not None:
            # The model computes cos/sin in float32 and casts them to the hidden state's dtype; blocks cast.
            probe = torch.empty(0, dtype=torch.float32, device=positions.device)
            side["rotary_cos"], side["rotary_sin"] = self.rotary(probe, positions)
        return ids, target, side

    def pipeline_first(self, input_ids: Tensor, position_ids: Tensor | None = None) -> Tensor:
        """Token embedding (plus learned positions and embedding dropout where the model has them)."""
        hidden: Tensor = self.embedding(input_ids)
        if getattr(self, "position_embedding", None) is not None:
            hidden = hidden + self.position_embedding(position_ids)
        if getattr(self, "embedding_dropout", None) is not None:
            hidden = self.embedding_dropout(hidden)
        return hidden

    def pipeline_last(self, hidden: Tensor) -> Tensor:
        """Final norm and the vocabulary head: logits ``[batch, seq, vocab]``."""
        logits: Tensor = self.head(self.final_norm(hidden))
        return logits

    def pipeline_loss(self, logits: Tensor, target: Tensor) -> Tensor:
        """This micro-batch's share of the batch's token-mean cross-entropy (see the module docstring)."""
        labels, tokens, rows = target[:, :-2], target[0, -2], target[0, -1]
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()
        total = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            labels.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        return total * (rows.to(total.dtype) / (tokens.clamp(min=1).to(total.dtype) * labels.shape[0]))

    # -- single process ---------------------------------------------------------------------------

    @override
    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        """Logits ``[batch, seq, vocab]``, computed as the pipeline computes them."""
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        inputs, _, side = self.pipeline_batch({k: v for k, v in batch.items() if v is not None})
        return self._logits(inputs, side)

    @override
    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        inputs, target, side = self.pipeline_batch(batch)
        n = self.microbatches
        return reference_training_loss(
            self,
            inputs.shape[0],
            n,
            lambda: [
                self.pipeline_loss(self._logits(i, s), t) for i, t, s in _chunks(inputs, target, side, n)
            ],
            owner="HuggingFaceCausalLM",
            model_name=type(self).__name__,
        )

    @override
    def validation_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        # Same name and value as DynMoStrategy's pipelined validation: the batch's token-mean loss.
        return self._eval_loss("val_loss", batch)

    @override
    def test_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        return self._eval_loss("test_loss", batch)

    @override
    def configure_optimizers(self) -> Any:
        """The optimizer over the local parameters in HF Trainer's weight-decay groups, and its scheduler."""
        groups = trainer_decay_groups(self, self.huggingface_name, self.weight_decay)
        return build_optimization(
            groups, lr=self.lr, optimizer=self._optimizer, lr_scheduler=self._lr_scheduler
        )

    def _eval_loss(self, log_name: str, batch: Mapping[str, Tensor]) -> Tensor:
        inputs, target, side = self.pipeline_batch(batch)
        loss = self.pipeline_loss(self._logits(inputs, side), target)
        self.log(log_name, loss, prog_bar=True, batch_size=inputs.shape[0])
        return loss

    def _logits(self, inputs: Tensor, side: Mapping[str, Tensor]) -> Tensor:
        hidden = self.pipeline_first(inputs, **{n: side[n] for n in self.pipeline_first_inputs})
        state = {HIDDEN: hidden}
        for key, block in self.layers.items():
            state = run_block(
                block,
                state,
                side,
                reads=block_inputs(block),
                side_state=(),
                who=f"layers.{key}",
                model_name=type(self).__name__,
            )
        return self.pipeline_last(state[HIDDEN])

    # -- the model's own names ----------------------------------------------------------------------

    def huggingface_name(self, key: str) -> str:
        """The model's own state-dict name of the adapter's key (``layers.0.layer.mlp.up_proj.weight`` ->
        ``model.layers.0.mlp.up_proj.weight``).

        Raises:
            KeyError: ``key`` belongs to no unit.
        """
        return self._names.to_huggingface(key)

    def huggingface_state_dict(self) -> dict[str, Any]:
        """This module's ``state_dict()`` under the model's own names (the units present on this rank)."""
        return {self.huggingface_name(k): v for k, v in self.state_dict().items()}

    def to_huggingface(self) -> Any:
        """A new model of the original class holding these weights (and the original generation config).

        Raises:
            RuntimeError: this rank does not hold every unit (under DynMoStrategy: save a checkpoint,
                whose ``state_dict`` loads into the plain model).
        """
        model = self._hf_class(self.hf_config)
        expected = set(model.state_dict())
        state = self.huggingface_state_dict()
        if set(state) != expected:
            raise RuntimeError(
                f"to_huggingface needs every unit, but this module lacks {len(expected - set(state))} of the "
                "model's tensors (under DynMoStrategy each rank holds only its own). Save a checkpoint "
                "instead: its state_dict loads into the plain model with load_state_dict(strict=True)."
            )
        model.to(dtype=self.embedding.weight.dtype)
        model.load_state_dict(state, strict=True)
        if self._generation_config is not None:
            model.generation_config = copy.deepcopy(self._generation_config)
        return model

    def rename_for_huggingface(self, checkpoint: dict[str, Any]) -> None:
        """Give a loaded checkpoint's model and optimizer state the model's own names, in place.

        For a file exported from a sharded checkpoint (one-file checkpoints already have them); then
        ``checkpoint["state_dict"]`` loads into the plain model with ``load_state_dict(strict=True)``.
        Keys that belong to no unit are kept.
        """
        rename_checkpoint_keys(checkpoint, self._saved_name)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # A sharded save (a directory) is read back unit by unit under the units' names: keep them there.
        strategy = getattr(self._trainer, "strategy", None)
        if not getattr(strategy, "save_distributed_checkpoint", False):
            self.rename_for_huggingface(checkpoint)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Files with the model's names get the units' names back; units' names are kept (sharded saves).
        rename_checkpoint_keys(checkpoint, self._loaded_name)

    def _saved_name(self, key: str) -> str:
        try:
            return self._names.to_huggingface(key)
        except KeyError:
            return key  # not a unit's (a subclass's own state): saved as it is

    def _loaded_name(self, key: str) -> str:
        ours = self._names.from_huggingface(key)
        return ours if ours is not None else key


def hf_position_ids(attention_mask: Tensor) -> Tensor:
    """Position ids from a 2-D attention mask as Hugging Face generation makes them (padding at 1)."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


def _config_hparams(model: Any, hf: Any) -> dict[str, Any]:
    """``model`` as a hyper-parameter: the config as a plain dict, and a given model's attention kind."""
    hparams: dict[str, Any] = {"model": hf.config.to_dict()}
    if isinstance(model, PreTrainedModel):
        hparams["attn_implementation"] = hf.config._attn_implementation
    return hparams


def _build(model: Any, attn_implementation: str | None, seed: int) -> Any:
    if isinstance(model, Mapping):
        model = _config_from_dict(model)
    if isinstance(model, PretrainedConfig):
        kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return AutoModelForCausalLM.from_config(model, **kwargs)  # type: ignore[no-untyped-call]
    if isinstance(model, PreTrainedModel):
        if attn_implementation is not None:
            raise ValueError(
                f"HuggingFaceCausalLM got a model and attn_implementation={attn_implementation!r}; set the "
                "attention implementation when building the model (from_config/from_pretrained(..., "
                "attn_implementation=...)), or pass its config instead of the model."
            )
        return model
    raise TypeError(
        "HuggingFaceCausalLM takes a transformers causal-LM model, its config or the config's to_dict(), "
        f"got {type(model).__name__}; e.g. HuggingFaceCausalLM(LlamaConfig(...)) or "
        "HuggingFaceCausalLM(AutoModelForCausalLM.from_config(config))."
    )


def _config_from_dict(values: Mapping[str, Any]) -> Any:
    model_type = values.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"HuggingFaceCausalLM got a config dict with model_type={model_type!r}, which transformers does "
            "not know; pass a config's to_dict() (it names its model_type, e.g. 'llama'), or the config."
        )
    return CONFIG_MAPPING[model_type].from_dict(dict(values))


def _router_loss_weight(config: Any, recipe: HFArchitecture, num_layers: int) -> float:
    # The model adds its router loss only when output_router_logits is set; so does the adapter.
    if recipe.router is None or not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0)) / num_layers


def _batch_fields(batch: Any) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if not isinstance(batch, Mapping) or not isinstance(batch.get("input_ids"), Tensor):
        got = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise TypeError(
            f"HuggingFaceCausalLM takes batches in the Hugging Face convention, a dict with an `input_ids` "
            f"tensor [batch, seq] (and optionally {list(BATCH_KEYS[1:])}); got {got}."
        )
    unknown = sorted(k for k in batch if k not in BATCH_KEYS)
    if unknown:
        raise ValueError(
            f"the batch has keys {unknown} that HuggingFaceCausalLM does not use (it reads "
            f"{list(BATCH_KEYS)}); "
            "drop them from the batch (e.g. in the collator) rather than have them silently ignored."
        )
    ids = batch["input_ids"]
    if ids.dim() != 2 or ids.dtype.is_floating_point:
        raise TypeError(
            f"batch['input_ids'] must be integer token ids [batch, seq], got {ids.dtype} {tuple(ids.shape)}."
        )
    for key in BATCH_KEYS[1:]:
        value = batch.get(key)
        if value is not None and (not isinstance(value, Tensor) or value.shape != ids.shape):
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(
                f"batch[{key!r}] has shape {shape} but input_ids has {tuple(ids.shape)}; every field is "
                "[batch, seq]."
            )
    mask = batch.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask.long()
    labels = batch.get("labels")
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX) if labels is None else labels.long()
    positions = batch.get("position_ids")
    positions = hf_position_ids(mask) if positions is None else positions.long()
    return ids, mask, labels, positions


def _chunks(
    inputs: Tensor, target: Tensor, side: Mapping[str, Tensor], n: int
) -> Iterator[tuple[Tensor, Tensor, dict[str, Tensor]]]:
    sides: MutableMapping[str, tuple[Tensor, ...]] = {k: v.chunk(n) for k, v in side.items()}
    for k, (i, t) in enumerate(zip(inputs.chunk(n), target.chunk(n), strict=True)):
        yield i, t, {name: pieces[k] for name, pieces in sides.items()}
