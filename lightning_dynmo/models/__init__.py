"""Models that follow DynMo's pipeline contract: the GPT and its pluggable blocks.

:class:`GPT` (a LightningModule) is configured by :class:`GPTConfig` (shape, per-layer block kinds, seed)
and :class:`OptimizerConfig` (AdamW, LR schedule). Block kinds live in a registry that other modules
extend with :func:`register_block`; ``"dense"`` (:class:`DenseBlock`) is built in.

:mod:`lightning_dynmo.models.huggingface` (``HuggingFaceCausalLM``, the ``hf`` extra) pipelines a
``transformers`` causal LM with its own modules; it is not imported here, so ``transformers`` stays optional.

Modules:

- :mod:`.gpt`: :class:`GPT`, a pre-norm GPT-2 with a pluggable block per layer, under the pipeline contract.
- :mod:`.config`: :class:`GPTConfig` (shape, blocks, seed) and :class:`OptimizerConfig` (AdamW, LR schedule).
- :mod:`.registry`: the block registry, which kinds of block a GPT can use (:func:`register_block`).
- :mod:`.dense`: the dense GPT-2 block (kind ``"dense"``) and the pieces block variants reuse.
- :mod:`.init`: initial weights, seeded per unit (GPT-2's initialisation).
- :mod:`.loading`: ``load_from_checkpoint`` from a sharded checkpoint directory as well as from a file.
- :mod:`.optim`: AdamW with two weight-decay groups, the same on every rank, and its warm-up/cosine schedule.
- :mod:`.reference`: the single-process training step, computed as a pipeline computes it.
- :mod:`.huggingface`: ``HuggingFaceCausalLM``, a ``transformers`` causal LM under the pipeline contract.
- :mod:`.hf_architecture`: where a Hugging Face causal LM keeps the pieces DynMo pipelines, and their names.
- :mod:`.hf_blocks`: a Hugging Face decoder layer as a pipeline block (causal mask, rotary, router loss).
- :mod:`.hf_optim`: the adapter's optimizer: HF Trainer's weight-decay groups, optimizer/scheduler factories.
- :mod:`.hf_pretrained`: per-stage pretrained loading: each rank reads only its units' safetensors tensors.
"""

from lightning_dynmo.models.config import GPTConfig, OptimizerConfig
from lightning_dynmo.models.dense import MLP, CausalSelfAttention, DenseBlock
from lightning_dynmo.models.gpt import GPT, build_unit, unit_names
from lightning_dynmo.models.init import gpt2_init_, unit_rng, unit_seed
from lightning_dynmo.models.optim import build_adamw, weight_decay_groups
from lightning_dynmo.models.registry import (
    BlockKind,
    block_kinds,
    register_block,
    resolve_block,
    unregister_block,
)

__all__ = [
    "GPT",
    "MLP",
    "BlockKind",
    "CausalSelfAttention",
    "DenseBlock",
    "GPTConfig",
    "OptimizerConfig",
    "block_kinds",
    "build_adamw",
    "build_unit",
    "gpt2_init_",
    "register_block",
    "resolve_block",
    "unit_names",
    "unit_rng",
    "unit_seed",
    "unregister_block",
    "weight_decay_groups",
]
