"""The GPT's configuration: :class:`GPTConfig` (shape, blocks, seed), :class:`OptimizerConfig` (AdamW).

Both are frozen, keyword-only dataclasses validated on construction; Hydra instantiates them by
``_target_``. Bad values fail with a message that names the field, the value, the rule and the fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from lightning_dynmo.models.registry import BlockKind, resolve_block

__all__ = ["GPTConfig", "OptimizerConfig", "check_positive_int", "split_block_options"]

Options = TypeVar("Options")


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a :class:`~lightning_dynmo.models.GPT` and the kind of each of its blocks.

    Attributes:
        vocab_size: Token vocabulary size (256 for the byte tokenizer of :mod:`lightning_dynmo.data`).
        seq_len: Longest input sequence (the number of learned position embeddings).
        num_layers: Number of blocks (``layers["0"]`` .. ``layers[str(num_layers - 1)]``).
        d_model: Hidden width; a multiple of ``num_heads``.
        num_heads: Attention heads per block (head width ``d_model // num_heads``).
        d_ff: Hidden width of the MLP; ``None`` means ``4 * d_model`` (GPT-2).
        dropout: Dropout probability on embeddings, attention weights and residual branches
            (0 by default: pipelined and single-process runs then compute the same numbers).
        bias: Linear layers and LayerNorms have biases (GPT-2 style).
        layer_norm_eps: Epsilon of every LayerNorm.
        tie_embeddings: The output head reuses the token embedding's weight (GPT-2). Off by default: with
            a byte vocabulary the head is small, and untied units migrate without coordination.
        blocks: The block kind of every layer: one entry for all layers, or a sequence of
            ``num_layers`` entries. An entry is a registered kind name (``"dense"``) or an options
            instance of a registered kind (see :mod:`lightning_dynmo.models.registry`).
        init_std: Standard deviation of the normal initialisation (GPT-2: 0.02); residual projections
            use ``init_std / sqrt(2 * num_layers)``.
        seed: Base seed of the initial weights; each unit (embedding, block, head) draws from its own
            generator seeded from ``(seed, unit name)``.
    """

    vocab_size: int = 256
    seq_len: int = 128
    num_layers: int = 4
    d_model: int = 128
    num_heads: int = 4
    d_ff: int | None = None
    dropout: float = 0.0
    bias: bool = True
    layer_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    blocks: Any = "dense"
    init_std: float = 0.02
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "num_layers", "d_model", "num_heads"):
            check_positive_int(name, getattr(self, name))
        if self.vocab_size < 2:
            raise ValueError(f"GPTConfig.vocab_size={self.vocab_size} must be >= 2 (256 for byte tokens).")
        if self.d_ff is not None:
            check_positive_int("d_ff", self.d_ff)
        if self.d_model % self.num_heads:
            suggestion = self.num_heads * max(1, self.d_model // self.num_heads)
            raise ValueError(
                f"GPTConfig.d_model={self.d_model} is not divisible by num_heads={self.num_heads}; pick a "
                f"d_model that is a multiple of num_heads (e.g. {suggestion})."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout} must be in [0, 1); 0 disables dropout.")
        if not self.layer_norm_eps > 0 or not self.init_std > 0:
            raise ValueError(
                f"GPTConfig.layer_norm_eps={self.layer_norm_eps} and init_std={self.init_std} must be > 0."
            )
        if not isinstance(self.blocks, str) and isinstance(self.blocks, Sequence):
            object.__setattr__(self, "blocks", tuple(self.blocks))  # frozen and hashable, whatever came in
        self.resolved_blocks()  # unknown kinds or a wrong count fail here, before any module is built

    @property
    def mlp_width(self) -> int:
        """The MLP's hidden width (``d_ff``, or ``4 * d_model`` when unset)."""
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    def resolved_blocks(self) -> tuple[tuple[BlockKind, Any], ...]:
        """The ``(kind, options)`` of every layer, in layer order."""
        entries = self.blocks
        if isinstance(entries, str) or not isinstance(entries, Sequence):
            return tuple(resolve_block(entries, "GPTConfig.blocks") for _ in range(self.num_layers))
        if len(entries) != self.num_layers:
            raise ValueError(
                f"GPTConfig.blocks has {len(entries)} entries but num_layers={self.num_layers}; give one "
                "entry per layer, or a single entry (e.g. blocks='dense') for all layers."
            )
        return tuple(resolve_block(e, f"GPTConfig.blocks[{i}]") for i, e in enumerate(entries))


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW and its learning-rate schedule for :class:`~lightning_dynmo.models.GPT`.

    The learning rate rises linearly over ``warmup_steps`` optimizer steps, then follows a cosine from
    ``lr`` down to ``min_lr_ratio * lr`` over ``decay_steps`` steps and stays there; with
    ``decay_steps=None`` it stays at ``lr`` after the warm-up. Without warm-up and decay there is no
    scheduler.

    Attributes:
        lr: Peak learning rate.
        betas: Adam's ``(beta1, beta2)``.
        eps: Adam's epsilon.
        weight_decay: Decoupled weight decay of the decay group (matrices of Linear layers); biases,
            norms and embeddings are in the second group, without decay.
        warmup_steps: Steps of linear warm-up (0: none).
        decay_steps: Steps of cosine decay after the warm-up (``None``: no decay).
        min_lr_ratio: Final learning rate as a fraction of ``lr``.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 0
    decay_steps: int | None = None
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"OptimizerConfig.lr={self.lr} must be > 0.")
        object.__setattr__(self, "betas", tuple(self.betas))  # a list from YAML becomes the documented tuple
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(
                f"OptimizerConfig.betas={self.betas!r} must be two numbers in [0, 1), e.g. (0.9, 0.95)."
            )
        if not self.eps > 0 or self.weight_decay < 0:
            raise ValueError(
                f"OptimizerConfig.eps={self.eps} must be > 0 and weight_decay={self.weight_decay} >= 0."
            )
        if (
            isinstance(self.warmup_steps, bool)
            or not isinstance(self.warmup_steps, int)
            or self.warmup_steps < 0
        ):
            raise ValueError(f"OptimizerConfig.warmup_steps={self.warmup_steps!r} must be an integer >= 0.")
        if self.decay_steps is not None:
            check_positive_int("decay_steps", self.decay_steps, owner="OptimizerConfig")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"OptimizerConfig.min_lr_ratio={self.min_lr_ratio} must be in [0, 1].")

    @property
    def has_schedule(self) -> bool:
        """Whether the learning rate changes over steps."""
        return self.warmup_steps > 0 or self.decay_steps is not None


# Both travel in checkpoints as the GPT's hyper-parameters; torch.load(weights_only=True), Lightning's
# default for resuming and load_from_checkpoint, unpickles only allow-listed classes.
torch.serialization.add_safe_globals([GPTConfig, OptimizerConfig])


def check_positive_int(name: str, value: Any, owner: str = "GPTConfig") -> None:
    """Raise ``ValueError("<owner>.<name>=<value> must be an integer >= 1.")`` unless it is one (no bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}.{name}={value!r} must be an integer >= 1.")


def split_block_options(
    preset: str, options_type: type[Options], fields: Mapping[str, Any]
) -> tuple[Options, dict[str, Any]]:
    """Split a preset's keywords into its block options and the :class:`GPTConfig` fields it passes on.

    A ready configuration (``moe_gpt_config(num_experts=8, d_model=64)``) takes the fields of its block
    options dataclass and the GPT's own fields side by side, as flat keywords (so Hydra keys stay flat).

    Args:
        preset: The preset's name, for the error.
        options_type: The block options dataclass (e.g. ``MoEOptions``).
        fields: The preset's ``**fields``.

    Returns:
        ``options_type`` built from the keywords it names, and the rest (GPTConfig fields).

    Raises:
        TypeError: a keyword is neither a field of ``options_type`` nor a GPTConfig field other than
            ``blocks`` (the preset sets the blocks).
    """
    own = {f.name for f in dataclasses.fields(options_type)}  # type: ignore[arg-type]
    gpt = {f.name for f in dataclasses.fields(GPTConfig)} - {"blocks"}
    unknown = sorted(set(fields) - own - gpt)
    if unknown:
        raise TypeError(
            f"{preset}() got unknown keyword(s) {unknown}; pass {options_type.__name__} fields "
            f"({', '.join(sorted(own))}) or GPTConfig fields ({', '.join(sorted(gpt))})."
        )
    options = options_type(**{k: v for k, v in fields.items() if k in own})
    return options, {k: v for k, v in fields.items() if k not in own}
