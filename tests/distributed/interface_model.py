"""A model that uses the whole stage interface, and padded batches for it.

``MaskedGPT`` takes left-padded token batches in the Hugging Face convention (``input_ids``,
``attention_mask``); ``pipeline_batch`` turns them into inputs, ``-100``-masked next-token labels and
two side inputs: the attention mask (blocks attend causally to real tokens only) and position ids
(counted from each row's first real token, so left padding does not shift them). Side state crosses
stage boundaries: ``exited`` (bool, early-exit style: an exited token's hidden state is carried
unchanged) and ``score`` (float, on the gradient path: every block adds to it and the head reads it).
Every block adds a router z-loss (an auxiliary loss arising on whatever stage the block runs).

Its own ``training_step`` cuts the batch into the same micro-batches as the pipeline and adds each
micro-batch's auxiliary losses, so it is the exact single-process reference.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_dynmo.pipeline.step.aux_loss import add_aux_loss, collect_aux_losses

IGNORE = -100


class MaskedBlock(nn.Module):
    """Pre-LN block with causal, padding-masked attention, learned positions, a z-loss and early exit."""

    pipeline_inputs = ("attention_mask", "position_ids", "exited", "score")

    def __init__(self, d: int, heads: int, max_pos: int, exit_threshold: float, z_coef: float) -> None:
        super().__init__()
        self.heads = heads
        self.exit_threshold = exit_threshold
        self.z_coef = z_coef
        self.pos = nn.Embedding(max_pos, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.router = nn.Linear(d, 4, bias=False)
        self.score_head = nn.Linear(d, 1)

    def forward(
        self, x: Tensor, attention_mask: Tensor, position_ids: Tensor, exited: Tensor, score: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        h = x + self.pos(position_ids)
        h = h + self._attention(self.ln1(h), attention_mask)
        h = h + self.fc2(F.gelu(self.fc1(self.ln2(h))))
        real = attention_mask.to(h.dtype)
        z = torch.logsumexp(self.router(h), dim=-1).pow(2)
        h = add_aux_loss("router_z", self.z_coef * (z * real).sum() / real.sum(), h)
        out = torch.where(exited.unsqueeze(-1), x, h)
        new_score = score + torch.tanh(self.score_head(h)).squeeze(-1) * (~exited).to(h.dtype)
        new_exited = exited | (h.norm(dim=-1) > self.exit_threshold)
        return out, {"exited": new_exited, "score": new_score}

    def _attention(self, x: Tensor, attention_mask: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        allowed = causal.unsqueeze(0) & attention_mask.bool().unsqueeze(1)  # (b, query, key)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed.unsqueeze(1))
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class MaskedGPT(pl.LightningModule):
    """A tiny GPT that needs every member of the stage interface (see the module docstring)."""

    pipeline_first_parts = ("tok_emb",)
    pipeline_last_parts = ("ln_f", "head", "score_scale")
    pipeline_side_inputs = ("attention_mask", "position_ids")
    pipeline_side_state = ("exited", "score")
    pipeline_aux_losses = ("router_z",)
    pipeline_first_inputs = ("attention_mask",)
    pipeline_last_inputs = ("score",)

    def __init__(
        self,
        *,
        num_layers: int = 4,
        vocab: int = 32,
        d: int = 16,
        heads: int = 2,
        seq_len: int = 8,
        exit_threshold: float = 9.0,
        z_coef: float = 0.01,
        reference_microbatches: int = 4,
        lr: float = 0.005,
        seed: int = 0,
        ignore_mask: bool = False,
        ignore_positions: bool = False,
        aux_grad: bool = True,
    ) -> None:
        super().__init__()
        self.reference_microbatches = reference_microbatches
        self.lr = lr
        # Negative controls for the single-process reference only: drop a side input or the aux gradient.
        self.ignore_mask, self.ignore_positions, self.aux_grad = ignore_mask, ignore_positions, aux_grad
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.tok_emb = nn.Embedding(vocab, d)
            self.layers = nn.ModuleDict(
                {str(i): MaskedBlock(d, heads, seq_len, exit_threshold, z_coef) for i in range(num_layers)}
            )
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab)
            self.score_scale = nn.Linear(1, vocab, bias=False)

    # -- the contract ----------------------------------------------------------------------------

    def pipeline_batch(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        inputs, in_mask = ids[:, :-1], mask[:, :-1]
        labels = torch.where(in_mask.bool(), ids[:, 1:], torch.full_like(inputs, IGNORE))
        position_ids = (in_mask.cumsum(-1) - 1).clamp(min=0)
        return inputs, labels, {"attention_mask": in_mask, "position_ids": position_ids}

    def pipeline_first(self, ids: Tensor, attention_mask: Tensor) -> dict[str, Tensor]:
        hidden = self.tok_emb(ids) * attention_mask.unsqueeze(-1).to(self.tok_emb.weight.dtype)
        exited = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
        score = torch.zeros(ids.shape, dtype=hidden.dtype, device=ids.device)
        return {"hidden": hidden, "exited": exited, "score": score}

    def pipeline_last(self, hidden: Tensor, score: Tensor) -> Tensor:
        logits: Tensor = self.head(self.ln_f(hidden)) + self.score_scale(score.unsqueeze(-1))
        return logits

    def pipeline_loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE)

    # -- the single-process reference -------------------------------------------------------------

    def forward(self, ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        if self.ignore_positions:
            position_ids = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        block_mask = torch.ones_like(attention_mask) if self.ignore_mask else attention_mask
        side = {"attention_mask": block_mask, "position_ids": position_ids}
        state = self.pipeline_first(ids, attention_mask=attention_mask)
        for block in self.layers.values():
            hidden, updates = block(
                state["hidden"], **{n: state.get(n, side.get(n)) for n in block.pipeline_inputs}
            )
            state.update(updates, hidden=hidden)
        return self.pipeline_last(state["hidden"], score=state["score"])

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        inputs, labels, side = self.pipeline_batch(batch)
        n = self.reference_microbatches
        chunks = zip(
            inputs.chunk(n),
            labels.chunk(n),
            side["attention_mask"].chunk(n),
            side["position_ids"].chunk(n),
            strict=True,
        )
        with collect_aux_losses(attach=False) as aux:
            losses = [self.pipeline_loss(self(i, m, p), t) for i, t, m, p in chunks]
        main = torch.stack(losses).mean()
        self.log("train_loss", main.detach())
        self.log("train_aux/router_z", aux.totals()["router_z"] / n)
        return main + aux.total() / n if self.aux_grad else main

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


class PaddedTokens(Dataset[dict[str, Tensor]]):
    """Left-padded random token rows of ``seq_len + 1`` with 0-4 padding tokens each (seeded)."""

    def __init__(self, num_samples: int, seq_len: int = 8, vocab: int = 32, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, vocab, (num_samples, seq_len + 1), generator=gen)
        pads = torch.randint(0, 5, (num_samples,), generator=gen)
        self.mask = (torch.arange(seq_len + 1).unsqueeze(0) >= pads.unsqueeze(1)).long()
        self.ids = self.ids * self.mask  # token 0 is the padding token

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"input_ids": self.ids[index], "attention_mask": self.mask[index]}


def padded_loader(num_samples: int, batch_size: int, seed: int = 0) -> DataLoader[dict[str, Tensor]]:
    return DataLoader(
        PaddedTokens(num_samples, seed=seed), batch_size=batch_size, shuffle=False, drop_last=True
    )


def exit_fraction(model: MaskedGPT, batch: dict[str, Tensor]) -> float:
    """The share of real tokens that exit before the last block (to check the test exercises exits)."""
    inputs, _, side = model.pipeline_batch(batch)
    state = model.pipeline_first(inputs, attention_mask=side["attention_mask"])
    with torch.no_grad():
        for block in model.layers.values():
            hidden, updates = block(
                state["hidden"], **{n: state.get(n, side.get(n)) for n in block.pipeline_inputs}
            )
            state.update(updates, hidden=hidden)
    real = side["attention_mask"].bool()
    return float(state["exited"][real].double().mean().item())
