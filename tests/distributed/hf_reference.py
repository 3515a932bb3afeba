"""Tiny Hugging Face models, padded batches, and the reference: the plain model trained by its own forward.

``HFReference`` trains a ``transformers`` model in one process with the model's own ``forward`` and the
library's causal-LM loss formula (labels padded with -100 and shifted, mean over non-ignored tokens),
computed here in the logits' dtype: the library's own ``ForCausalLMLoss`` casts logits to float32, which
would cap a float64 comparison at float32 rounding (``test_huggingface.py`` checks that the two agree to
float32 precision). For MoE models it adds the per-layer Switch load-balancing loss, written here
independently from the adapter's, over each of ``microbatches`` row chunks (as a pipeline sees them).

Its optimizer is AdamW with the weight-decay groups of HF's ``Trainer.get_decay_parameter_names`` (the
library's own rule) and an optional LR scheduler stepped every optimizer step.

Its switches are the negative controls of the equivalence tests: drop the attention mask, drop the
causal mask too, count positions 0..seq-1 (the model's default), drop the router loss, use the
library's cross-layer router loss, or decay every parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, WIDTH = 64, 8, 16
PAD = 0


def tiny_config(kind: str, *, num_layers: int = 4, **overrides: Any) -> Any:
    """A tiny config of ``kind`` (gpt2, llama, qwen2, mistral, mixtral) with dropout 0."""
    if kind == "gpt2":
        base: dict[str, Any] = {
            "n_layer": num_layers, "n_embd": WIDTH, "n_head": 2, "vocab_size": VOCAB, "n_positions": 16,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 1, "eos_token_id": 1,
        }  # fmt: skip
        return transformers.GPT2Config(**{**base, **overrides})
    common: dict[str, Any] = {
        "num_hidden_layers": num_layers, "hidden_size": WIDTH, "intermediate_size": 32,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": VOCAB,
        "max_position_embeddings": 16,
        "bos_token_id": 1, "eos_token_id": 1, "pad_token_id": None,
    }  # fmt: skip
    classes = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
        "mixtral": transformers.MixtralConfig,
    }
    if kind == "mistral":
        common["sliding_window"] = 3
    if kind == "mixtral":
        common |= {"num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": True}
        common["router_aux_loss_coef"] = 0.5
    return classes[kind](**{**common, **overrides})


def tiny_model(kind: str, *, attn: str = "eager", seed: int = 0, **overrides: Any) -> Any:
    """The tiny model in float64, randomly initialised under ``seed`` (the same on every rank)."""
    extra = {"experts_implementation": "eager"} if kind == "mixtral" else {}  # grouped_mm has no float64
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_config(kind, **overrides), attn_implementation=attn, **extra
    )
    return model.double()


class PaddedBatches(Dataset[dict[str, Tensor]]):
    """Rows of ``SEQ`` tokens with 0-3 padding: "right", "left", alternating ("both") or "none"."""

    def __init__(self, num_samples: int, padding: str = "both", seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, VOCAB, (num_samples, SEQ), generator=gen)
        pads = torch.randint(0, 4, (num_samples,), generator=gen)
        col = torch.arange(SEQ).unsqueeze(0)
        right = col < SEQ - pads.unsqueeze(1)
        left = col >= pads.unsqueeze(1)
        if padding == "none":
            keep = torch.ones_like(right)
        elif padding == "right":
            keep = right
        elif padding == "left":
            keep = left
        else:
            keep = torch.where((torch.arange(num_samples) % 2 == 0).unsqueeze(1), left, right)
        self.mask = keep.long()
        self.ids = ids * self.mask

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"input_ids": self.ids[index], "attention_mask": self.mask[index]}


def causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """The library's causal-LM loss formula (pad labels with -100, shift, token mean), in logits' dtype."""
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=-100)


def per_layer_router_loss(
    router_logits: tuple[Tensor, ...], mask: Tensor, *, top_k: int, coef: float, microbatches: int
) -> Tensor:
    """Mean over row chunks of ``coef / L * sum_l E * sum_e f_le P_le`` (real tokens only)."""
    num_layers, rows = len(router_logits), mask.shape[0]
    chunk_losses = []
    for rows_mb in torch.arange(rows).chunk(microbatches):
        total = torch.zeros((), dtype=router_logits[0].dtype)
        real = mask[rows_mb].reshape(-1).bool()
        for layer_logits in router_logits:
            logits = layer_logits.reshape(rows, -1, layer_logits.shape[-1])[rows_mb].reshape(
                -1, layer_logits.shape[-1]
            )
            probs = logits.softmax(-1)[real]
            experts = probs.shape[-1]
            chosen = probs.topk(top_k, dim=-1).indices
            f = torch.stack([(chosen == e).any(-1).double().mean() for e in range(experts)])
            total = total + experts * (f.to(probs.dtype) * probs.mean(0)).sum()
        chunk_losses.append(coef / num_layers * total)
    return torch.stack(chunk_losses).mean()


class HFReference(pl.LightningModule):
    """The plain Hugging Face model trained in one process by its own forward (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        *,
        lr: float = 0.01,
        microbatches: int = 1,
        use_mask: bool = True,
        causal: bool = True,
        positions: str = "from_mask",
        router: str = "per_layer",
        weight_decay: float = 0.0,
        decay: str = "trainer",
        lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    ) -> None:
        super().__init__()
        self.hf = model
        self.lr, self.microbatches = lr, microbatches
        self.weight_decay, self.decay, self.lr_scheduler = weight_decay, decay, lr_scheduler
        self.use_mask, self.causal, self.positions, self.router = use_mask, causal, positions, router
        self.moe = getattr(model.config, "output_router_logits", False)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        kwargs: dict[str, Any] = {"input_ids": ids}
        if self.use_mask:
            kwargs["attention_mask"] = mask
        if not self.causal:  # a prepared 4-D mask is used as it is: every token sees every token
            kwargs["attention_mask"] = torch.zeros(
                ids.shape[0], 1, ids.shape[1], ids.shape[1], dtype=torch.float64
            )
        if self.positions == "from_mask":  # as Hugging Face generation makes them
            kwargs["position_ids"] = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        if self.moe:
            kwargs["output_router_logits"] = True
        out = self.hf(**kwargs)
        loss = causal_lm_loss(out.logits, ids.masked_fill(mask == 0, -100))
        self.log("train_loss", loss.detach())
        if self.moe:
            config = self.hf.config
            if self.router == "per_layer":
                aux = per_layer_router_loss(
                    out.router_logits, mask, top_k=config.num_experts_per_tok,
                    coef=config.router_aux_loss_coef, microbatches=self.microbatches,
                )  # fmt: skip
            elif self.router == "huggingface":
                aux = config.router_aux_loss_coef * out.aux_loss
            else:
                aux = torch.zeros((), dtype=loss.dtype)
            self.log("train_aux/router_load_balance", aux.detach())
            loss = loss + aux
        return loss

    def configure_optimizers(self) -> Any:
        # HF Trainer's own rule (its names list a tied tensor under each name; it decays as one).
        decays = set(transformers.Trainer.get_decay_parameter_names(None, self.hf))
        if self.decay == "all":  # negative control
            decays = {n for n, _ in self.hf.named_parameters()}
        params = list(self.hf.named_parameters())
        groups = [
            {"params": [p for n, p in params if n in decays], "weight_decay": self.weight_decay},
            {"params": [p for n, p in params if n not in decays], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.lr)
        if self.lr_scheduler is None:
            return optimizer
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": self.lr_scheduler(optimizer), "interval": "step"},
        }
