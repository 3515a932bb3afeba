"""Train a tiny Hugging Face model as a 2-process CPU pipeline with DynMoStrategy and DynMoCallback.

    pip install torch==2.13.0 && pip install -e ".[hf]"
    python examples/train_huggingface.py --model mixtral --steps 20

The model is built from a config with random weights (nothing is downloaded): ``llama``, ``gpt2``,
``qwen2``, ``mistral`` or ``mixtral`` (with its router loss). The batches are padded token rows in the
Hugging Face convention, as ``DataCollatorForLanguageModeling`` makes them (``input_ids``,
``attention_mask``, ``labels`` with -100 on padding). ``DynMoCallback`` profiles the layers and
re-partitions them every 5 steps; at the end rank 0 writes the trained weights with ``save_pretrained``
from the checkpoint, whose state dict has the model's own names.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
)

from lightning_dynmo import DynMoCallback, DynMoStrategy
from lightning_dynmo.models.huggingface import HuggingFaceCausalLM

VOCAB, SEQ = 128, 16


def config(kind: str, num_layers: int) -> object:
    """A tiny config of ``kind`` (width 32, 4 heads, 2 key/value heads where the family has them)."""
    if kind == "gpt2":
        return GPT2Config(n_layer=num_layers, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ)
    common = {
        "num_hidden_layers": num_layers,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": SEQ,
    }
    if kind == "mixtral":
        return MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True)
    return {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[kind](**common)


class PaddedText(Dataset[dict[str, torch.Tensor]]):
    """Random token rows, right-padded (token 0) to ``SEQ``: what a language-modelling collator returns."""

    def __init__(self, num_rows: int) -> None:
        gen = torch.Generator().manual_seed(0)
        lengths = torch.randint(SEQ // 2, SEQ + 1, (num_rows,), generator=gen)
        self.mask = (torch.arange(SEQ).unsqueeze(0) < lengths.unsqueeze(1)).long()
        self.ids = torch.randint(1, VOCAB, (num_rows, SEQ), generator=gen) * self.mask

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i].masked_fill(self.mask[i] == 0, -100)
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": labels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama", choices=["llama", "gpt2", "qwen2", "mistral", "mixtral"])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "dynmo-hf-example")
    args = parser.parse_args()

    model = HuggingFaceCausalLM(
        config(args.model, args.layers), seed=0, lr=3e-3
    )  # same weights on every rank
    loader = DataLoader(PaddedText(8 * args.steps), batch_size=8, drop_last=True)
    # One checkpoint file, whose state dict has the model's own names (a sharded directory, the default,
    # keeps the units' names: export_full_checkpoint + model.rename_for_huggingface convert it).
    strategy = DynMoStrategy(num_microbatches=4, save_distributed_checkpoint=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        callbacks=[DynMoCallback(balancer="partition", cost="time", every_n_steps=5)],
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,  # every pipeline rank reads the same batches
    )
    trainer.fit(model, loader)
    checkpoint = args.out / "last.ckpt"
    trainer.save_checkpoint(checkpoint)  # on every rank: the strategy gathers the units on rank 0
    if trainer.is_global_zero:
        print(
            f"final loss {float(trainer.callback_metrics['train_loss']):.4f}, placement {strategy.placement}"
        )
        plain = AutoModelForCausalLM.from_config(model.hf_config)
        plain.load_state_dict(torch.load(checkpoint, weights_only=False)["state_dict"], strict=True)
        plain.save_pretrained(args.out / "pretrained")
        print(f"saved the trained model with save_pretrained to {args.out / 'pretrained'}")


if __name__ == "__main__":
    main()
