"""Per case, a block's measured forward and backward seconds as a function of its statistic (issue 20).

Real compute on this machine's CPU, one torch thread, at SmolLM2-135M's shape (random init: times do not
depend on trained values). Per case, a block is timed (medians of repeats after warm-up) at several values
of its statistic; the points become the case's :class:`~lightning_dynmo.balancing.trace.CostCurve` (a
measured table, piecewise linear) and a least-squares line through them gives the fit's error. The parts
(embedding; final norm + head + cross-entropy) are timed too. The dated result file
``benchmarks/results/cost_curves-<date>.json`` (+ ``.md``) is what :mod:`benchmarks._lib.trace_cases` loads.

``python -m benchmarks.trained.cost_curves [--quick] [--out FOLDER] [--force]``; ``--quick`` is a tiny
shape with 2 repeats (a smoke run for the tests, not figures).
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from benchmarks._lib.trained.moe import upcycle
from benchmarks._lib.trained.traces import hardware
from lightning_dynmo.dynamism.moe import MoEOptions
from lightning_dynmo.dynamism.sparse_attention import TilePlan, block_sparse_attention

__all__ = ["QUICK", "SMOLLM2", "CurveShape", "fit_error", "main", "measure"]

RESULTS = Path(__file__).resolve().parents[1] / "results"
Point = tuple[float, float, float]  # (statistic, fwd_s, bwd_s)


@dataclass(frozen=True)
class CurveShape:
    """The model's sizes and the workload each case is timed on.

    Attributes:
        hidden: Width; ``intermediate`` the MLP's; ``heads``/``kv_heads`` attention heads (GQA).
        vocab: Vocabulary of the tied head.
        batch: Rows per micro-batch; ``seq`` their length (``T = batch * seq`` tokens, as in the traces).
        attn_seq: Sparse attention's sequence (one row); ``tile``: its tile size.
        experts: MoE experts (top-2).
        repeats: Timed repeats per point (the median is kept); ``warmup``: untimed ones before.
    """

    hidden: int = 576
    intermediate: int = 1536
    heads: int = 9
    kv_heads: int = 3
    vocab: int = 49152
    batch: int = 2
    seq: int = 128
    attn_seq: int = 1024
    tile: int = 64
    experts: int = 8
    repeats: int = 7
    warmup: int = 2

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch."""
        return self.batch * self.seq


SMOLLM2 = CurveShape()
QUICK = CurveShape(64, 192, 4, 2, 256, 2, 16, 128, 8, 4, repeats=2, warmup=1)
TOKEN_SHARES = (0.03, 0.1, 0.25, 0.5, 0.75, 1.0)
DENSITIES = (0.1, 0.2, 0.3, 0.5, 0.7, 1.0)  # sparsity 90% .. 50%, then dense
TILE_SHARES = (0.1, 0.25, 0.5, 0.75, 1.0)
LOAD_RATIOS = (1.0, 1.5, 2.0, 3.0, 4.0)


# -- timing ----------------------------------------------------------------------------------------------


def _median_s(fn: Callable[[], Any], shape: CurveShape) -> float:
    for _ in range(shape.warmup):
        fn()
    times = []
    for _ in range(shape.repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_fwd_bwd(
    forward: Callable[[], Tensor], shape: CurveShape, backward: bool = True
) -> tuple[float, float]:
    """Median seconds of ``forward()`` and of the backward of its sum (backward 0 if not ``backward``)."""
    with torch.no_grad() if not backward else torch.enable_grad():
        fwd = _median_s(forward, shape)
    if not backward:
        return fwd, 0.0
    bwd_times = []
    for i in range(shape.warmup + shape.repeats):
        loss = forward().float().sum()
        start = time.perf_counter()
        loss.backward()  # type: ignore[no-untyped-call]
        if i >= shape.warmup:
            bwd_times.append(time.perf_counter() - start)
    return fwd, statistics.median(bwd_times)


def fit_error(points: Sequence[Point]) -> dict[str, float]:
    """Least-squares lines (forward, backward) through ``points``; their largest error relative to a point."""
    xs = [p[0] for p in points]
    result: dict[str, float] = {}
    worst = 0.0
    for j, name in ((1, "fwd"), (2, "bwd")):
        ys = [p[j] for p in points]
        if len(xs) < 2 or not any(ys):
            continue
        slope, intercept = statistics.linear_regression(xs, ys)
        result[f"{name}_slope_s"], result[f"{name}_intercept_s"] = slope, intercept
        worst = max(
            worst, *(abs(slope * x + intercept - y) / y for x, y in zip(xs, ys, strict=True) if y > 0)
        )
    result["max_relative_error"] = worst
    return result


# -- the model -------------------------------------------------------------------------------------------


class _Llama:
    """A one-block Llama of ``shape`` (random init) and a way to run its block on ``n`` tokens."""

    def __init__(self, shape: CurveShape) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=shape.vocab,
            hidden_size=shape.hidden,
            intermediate_size=shape.intermediate,
            num_hidden_layers=1,
            num_attention_heads=shape.heads,
            num_key_value_heads=shape.kv_heads,
            head_dim=shape.hidden // shape.heads,
            max_position_embeddings=max(4096, shape.attn_seq),
            tie_word_embeddings=True,
        )
        torch.manual_seed(0)
        self.model: Any = LlamaForCausalLM(config)
        self.block: Any = self.model.model.layers[0]
        self.shape = shape

    def block_input(self, rows: int, seq: int, grad: bool = True) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Random hidden states ``[rows, seq, d]`` and their rotary embeddings."""
        hidden = torch.randn(rows, seq, self.shape.hidden, requires_grad=grad)
        positions = torch.arange(seq).unsqueeze(0).expand(rows, -1)
        with torch.no_grad():
            rotary = self.model.model.rotary_emb(hidden, positions)
        return hidden, rotary

    def run_block(self, hidden: Tensor, rotary: tuple[Tensor, Tensor]) -> Tensor:
        """The block's output (causal attention, no mask tensor)."""
        out: Tensor = self.block(hidden, position_embeddings=rotary)
        return out[0] if isinstance(out, tuple) else out

    def time_block(self, rows: int, seq: int, backward: bool = True) -> tuple[float, float]:
        """A block's forward and backward seconds on ``rows x seq`` tokens."""
        hidden, rotary = self.block_input(rows, seq)
        return time_fwd_bwd(lambda: self.run_block(hidden, rotary), self.shape, backward)


# -- the cases -------------------------------------------------------------------------------------------


def tokens_case(llama: _Llama, shares: Sequence[float] = TOKEN_SHARES) -> dict[str, Any]:
    """MoD routed blocks and early exit: the block on ``round(share x T)`` tokens of one row."""
    tokens = llama.shape.tokens
    points = [(s, *llama.time_block(1, max(1, round(s * tokens)))) for s in shares]
    return {
        "statistic": f"share of the micro-batch's {tokens} tokens processed",
        "points": points,
        "dense_block_s": llama.time_block(1, tokens),
    }


def _linears(block: Any) -> list[nn.Linear]:
    attn, mlp = block.self_attn, block.mlp
    return [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]


def _pruned(weight: Tensor, density: float, block: int) -> Tensor:
    """``weight`` with whole ``block x block`` tiles of the smallest magnitude zeroed (BSR can skip them)."""
    rows, cols = weight.shape[0] // block, weight.shape[1] // block
    tiles = weight.detach().abs().reshape(rows, block, cols, block).sum((1, 3))
    keep = max(1, round(density * tiles.numel()))
    mask = torch.zeros(tiles.numel(), dtype=torch.bool)
    mask[tiles.flatten().topk(keep).indices] = True
    full = mask.view(rows, cols).repeat_interleave(block, 0).repeat_interleave(block, 1)
    return weight.detach() * full


KERNELS = ("dense", "masked-dense", "csr", "bsr")
#: The kernels that run unstructured sparsity (what magnitude pruning leaves): the pruning curve's choices.
UNSTRUCTURED = ("dense", "csr")


def _kernel_time(kind: str, weight: Tensor, x: Tensor, shape: CurveShape, block: int) -> tuple[float, float]:
    """One linear's forward (``x W^T``) and backward seconds under kernel ``kind``.

    Backward: the input gradient ``g W`` and the weight gradient ``g^T x``; a sparse kernel's weight
    gradient is needed at the kept entries only, the same multiply-adds as its input gradient, so its
    input-gradient time is counted twice.
    """
    grad = torch.randn(x.shape[0], weight.shape[0])
    if kind in ("dense", "masked-dense"):
        mask = weight != 0

        def effective() -> Tensor:
            return weight if kind == "dense" else weight * mask

        def dense_backward() -> None:
            w = effective()
            grad @ w
            (grad.t() @ x) * (mask if kind == "masked-dense" else 1.0)

        with torch.no_grad():
            return _median_s(lambda: F.linear(x, effective()), shape), _median_s(dense_backward, shape)
    if kind == "csr":
        fwd_w, bwd_w = weight.to_sparse_csr(), weight.t().contiguous().to_sparse_csr()
    else:
        fwd_w = weight.to_sparse_bsr((block, block))
        bwd_w = weight.t().contiguous().to_sparse_bsr((block, block))
    xt, gt = x.t().contiguous(), grad.t().contiguous()
    with torch.no_grad():
        return _median_s(lambda: torch.mm(fwd_w, xt), shape), 2 * _median_s(
            lambda: torch.mm(bwd_w, gt), shape
        )


def semi_structured_support() -> str:
    """Whether torch's semi-structured (2:4) sparsity runs here; the reason in words when not."""
    try:
        from torch.sparse import to_sparse_semi_structured

        weight = torch.zeros(64, 64)
        weight[:, ::2] = 1.0
        to_sparse_semi_structured(weight)
        return "supported"
    except Exception as err:  # any failure means "not on this machine"; its text is reported
        return f"not supported on this CPU build: {type(err).__name__}: {str(err).splitlines()[0][:160]}"


def pruning_case(llama: _Llama, densities: Sequence[float] = DENSITIES) -> dict[str, Any]:
    """Pruning: the block's seven linears as dense, masked-dense, CSR and BSR at each density.

    The block's cost at a density is the dense block's minus its dense linears' plus the fastest kernel
    that runs *unstructured* sparsity (the traces' global magnitude pruning): CSR where it beats dense,
    else dense (a framework would keep a matrix dense where sparse is slower). Every point is measured.
    The dense kernel does the same work at every density, so its time is the median of its timings over
    the densities: one stalled timing (seen: 2.10 ms among 0.20-0.22 ms under a loaded machine) would
    otherwise make that density's point negative. Masked-dense and BSR (by tiles, a structure
    unstructured pruning does not have) are timed and reported beside it, not used.
    """
    shape = llama.shape
    block = 16 if shape.hidden % 16 == 0 and shape.intermediate % 16 == 0 else 8
    linears = _linears(llama.block)
    inputs = [torch.randn(shape.tokens, lin.in_features) for lin in linears]
    dense_block = llama.time_block(shape.batch, shape.seq)
    kernels: dict[str, dict[str, tuple[float, float]]] = {}
    winners: dict[str, str] = {}
    for density in densities:
        row: dict[str, tuple[float, float]] = {}
        for kind in KERNELS:
            times = [
                _kernel_time(
                    kind, _pruned(lin.weight, density, block if kind == "bsr" else 1), x, shape, block
                )
                for lin, x in zip(linears, inputs, strict=True)
            ]
            row[kind] = (sum(t[0] for t in times), sum(t[1] for t in times))
        kernels[f"{density:.2f}"] = row
    dense_runs = [row["dense"] for row in kernels.values()]
    dense = (statistics.median(t[0] for t in dense_runs), statistics.median(t[1] for t in dense_runs))
    points: list[Point] = []
    for density, row in zip(densities, kernels.values(), strict=True):
        best = min(UNSTRUCTURED, key=lambda k: sum(dense if k == "dense" else row[k]))
        cost = dense if best == "dense" else row[best]
        winners[f"{density:.2f}"] = best
        points.append((density, dense_block[0] - dense[0] + cost[0], dense_block[1] - dense[1] + cost[1]))
    sparse = [d for d, w in winners.items() if w != "dense"]
    label = "measured: the fastest kernel for unstructured sparsity per density (CSR at densities " + (
        f"{', '.join(sparse)}, dense elsewhere)" if sparse else "none: dense everywhere)"
    )
    return {
        "statistic": "density of the block's linear weights (magnitude-pruned; for BSR by "
        f"{block}x{block} tiles, a structure the traces' unstructured pruning does not have)",
        "points": points,
        "label": label,
        "dense_block_s": dense_block,
        "kernels_s": kernels,
        "winners": winners,
        "semi_structured_2_4": semi_structured_support(),
    }


def _causal_plan(rows: int, heads: int, tiles: int, tile: int, share: float, seed: int = 0) -> TilePlan:
    """A tile plan (one bucket, positions in order) keeping the diagonal and a random ``share`` of the
    causal tile pairs: only the count of active tiles matters for time."""
    causal = torch.ones(tiles, tiles, dtype=torch.bool).tril()
    below = causal.tril(-1).nonzero()
    keep = max(0, round(share * int(causal.sum())) - tiles)
    generator = torch.Generator().manual_seed(seed)
    active = torch.eye(tiles, dtype=torch.bool)
    chosen = below[torch.randperm(len(below), generator=generator)[:keep]]
    active[chosen[:, 0], chosen[:, 1]] = True
    order = torch.arange(tiles * tile).expand(rows, heads, -1)
    zeros = torch.zeros(rows, heads, tiles, tile, dtype=torch.long)
    return TilePlan(order, order, zeros, zeros, active.expand(rows, heads, -1, -1))


def sparse_attention_case(llama: _Llama, shares: Sequence[float] = TILE_SHARES) -> dict[str, Any]:
    """Sparse attention: the library's :func:`block_sparse_attention` on a share of the causal tiles.

    The block's cost is the dense block's (at ``attn_seq``, one row) minus its dense causal attention
    core (``scaled_dot_product_attention``) plus the faster of the sparse core and the dense one.
    """
    shape = llama.shape
    seq, heads, head_dim = shape.attn_seq, shape.heads, shape.hidden // shape.heads
    tiles = seq // shape.tile

    def qkv() -> list[Tensor]:
        return [torch.randn(1, heads, seq, head_dim, requires_grad=True) for _ in range(3)]

    q, k, v = qkv()
    dense_core = time_fwd_bwd(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), shape)
    dense_block = llama.time_block(1, seq)
    cores: dict[str, tuple[float, float]] = {"dense (sdpa, causal)": dense_core}
    points: list[Point] = []
    for share in shares:
        plan = _causal_plan(1, heads, tiles, shape.tile, share)
        core = time_fwd_bwd(functools.partial(block_sparse_attention, q, k, v, plan), shape)
        cores[f"sparse {share:.2f}"] = core
        best = min(core, dense_core, key=sum)
        points.append(
            (share, dense_block[0] - dense_core[0] + best[0], dense_block[1] - dense_core[1] + best[1])
        )
    beaten = [s for s in shares if sum(cores[f"sparse {s:.2f}"]) < sum(dense_core)]
    return {
        "statistic": f"active / causal tile pairs (seq {seq}, {shape.tile}-token tiles, {tiles} per row)",
        "points": points,
        "label": "measured: library block_sparse_attention, or dense sdpa where faster; the sparse kernel "
        f"beats dense at shares {beaten or 'none'}",
        "dense_block_s": dense_block,
        "cores_s": cores,
    }


def moe_case(llama: _Llama, ratios: Sequence[float] = LOAD_RATIOS) -> dict[str, Any]:
    """MoE: an upcycled MLP (top-2 of ``experts``) whose busiest expert holds ``ratio`` x the mean load.

    An expert-parallel layer waits for its busiest expert, so its MLP costs ``E`` times one expert on
    ``ratio x T k / E`` tokens (at ratio 1: all experts balanced, the MoE MLP's real time); the block adds
    its attention part (the dense block minus the dense MLP) and the router.
    """
    shape = llama.shape
    options = MoEOptions(num_experts=shape.experts, top_k=2, capacity_factor=None)
    mlp = llama.block.mlp
    x = torch.randn(shape.tokens, shape.hidden, requires_grad=True)
    dense_mlp = time_fwd_bwd(lambda: mlp(x), shape)
    dense_block = llama.time_block(shape.batch, shape.seq)
    holder = nn.Module()
    holder.model = nn.Module()
    holder.model.layers = nn.ModuleList([nn.Module()])  # upcycle reads model.model.layers[i].mlp
    holder.model.layers[0].mlp = mlp
    moe = upcycle(holder, options)[0]
    router = time_fwd_bwd(lambda: moe.router(x), shape)
    mean = shape.tokens * options.top_k / options.num_experts
    points: list[Point] = []
    for ratio in ratios:
        rows = torch.randn(max(1, round(ratio * mean)), shape.hidden, requires_grad=True)
        expert = time_fwd_bwd(functools.partial(moe.expert, 0, rows), shape)
        e = options.num_experts
        points.append(
            (
                ratio,
                dense_block[0] - dense_mlp[0] + router[0] + e * expert[0],
                dense_block[1] - dense_mlp[1] + router[1] + e * expert[1],
            )
        )
    return {
        "statistic": f"busiest expert's load / mean load (top-2 of {shape.experts}, {shape.tokens} tokens)",
        "points": points,
        "label": "measured: attention part + router + E x the busiest expert (expert-parallel wait)",
        "dense_block_s": dense_block,
        "dense_mlp_s": dense_mlp,
    }


def freezing_case(llama: _Llama) -> dict[str, Any]:
    """Freezing: a trainable block, a frozen one (forward only) and a frozen one behind a trainable block
    (forward + input gradient). The curve is front-to-back freezing's (AutoFreeze): frozen = forward only."""
    shape = llama.shape
    trainable = llama.time_block(shape.batch, shape.seq)
    frozen_fwd = llama.time_block(shape.batch, shape.seq, backward=False)
    for p in llama.block.parameters():
        p.requires_grad_(False)
    try:
        input_grad = llama.time_block(shape.batch, shape.seq)
    finally:
        for p in llama.block.parameters():
            p.requires_grad_(True)
    return {
        "statistic": "block needs a backward (1 trainable / 0 frozen)",
        "points": [(0.0, frozen_fwd[0], 0.0), (1.0, *trainable)],
        "label": "measured: frozen prefix = forward only",
        "dense_block_s": trainable,
        "frozen_behind_trainable_s": input_grad,
    }


def parts(llama: _Llama) -> dict[str, tuple[float, float]]:
    """The embedding (lookup) and the final norm + tied head + cross-entropy, on one micro-batch."""
    shape = llama.shape
    ids = torch.randint(shape.vocab, (shape.batch, shape.seq))
    embed = llama.model.model.embed_tokens
    hidden = torch.randn(shape.batch, shape.seq, shape.hidden, requires_grad=True)

    def head() -> Tensor:
        logits = llama.model.lm_head(llama.model.model.norm(hidden))
        return F.cross_entropy(logits.view(-1, shape.vocab), ids.view(-1))

    return {
        "dense_block": llama.time_block(shape.batch, shape.seq),
        "embedding": time_fwd_bwd(lambda: embed(ids), shape),
        "head_and_loss": time_fwd_bwd(head, shape),
    }


# -- the command -----------------------------------------------------------------------------------------


def measure(shape: CurveShape) -> dict[str, Any]:
    """Every case's points, label, fit error and dense block (its unit), the parts, on one torch thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llama = _Llama(shape)
        tokens = tokens_case(llama)
        cases = {
            "mod": {**tokens, "label": "measured: the block on the routed tokens"},
            "early_exit": {**tokens, "label": "measured: the block on the tokens still active"},
            "pruning": pruning_case(llama),
            "sparse_attention": sparse_attention_case(llama),
            "moe": moe_case(llama),
            "freezing": freezing_case(llama),
        }
        measured_parts = parts(llama)
        for case in cases.values():
            case["fit"] = fit_error(case["points"])
        return {"cases": cases, "parts": measured_parts, "hardware": hardware()}
    finally:
        torch.set_num_threads(threads)


def markdown(result: dict[str, Any]) -> str:
    """The result as tables: per case its points and fit error, then the parts."""
    lines = [f"# Cost curves ({result['date']})", "", f"`{result['command']}`", "", result["hardware"], ""]
    lines += [
        "| case | statistic | fwd ms | bwd ms | linear fit max error | label |",
        "|---|---|---|---|---|---|",
    ]
    for name, case in result["cases"].items():
        for x, fwd, bwd in case["points"]:
            err = case["fit"].get("max_relative_error", 0.0)
            lines.append(
                f"| {name} | {x:g} | {fwd * 1e3:.3f} | {bwd * 1e3:.3f} | {err:.1%} | {case['label']} |"
            )
    lines += ["", "| part | fwd ms | bwd ms |", "|---|---|---|"]
    lines += [f"| {k} | {f * 1e3:.3f} | {b * 1e3:.3f} |" for k, (f, b) in result["parts"].items()]
    pruning = result["cases"]["pruning"]
    kinds = list(next(iter(pruning["kernels_s"].values())))
    lines += [
        "",
        "Pruning: the seven linears' forward + backward ms per kernel and density (the curve uses the "
        "fastest of dense and CSR: unstructured sparsity; BSR needs tiles pruned whole).",
        "",
        "| density | " + " | ".join(kinds) + " | curve uses |",
        "|---" * (len(kinds) + 2) + "|",
    ]
    for density, row in pruning["kernels_s"].items():
        cells = " | ".join(f"{1e3 * sum(row[k]):.2f}" for k in kinds)
        lines.append(f"| {density} | {cells} | {pruning['winners'][density]} |")
    lines += ["", f"2:4: {pruning['semi_structured_2_4']}."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> Path:
    """Measure, print the table, write ``cost_curves-<date>.json`` and ``.md``; returns the JSON's path."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trained.cost_curves", description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="tiny shape, 2 repeats: a smoke run, not figures"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the result files")
    parser.add_argument("--force", action="store_true", help="overwrite an existing dated file")
    args = parser.parse_args(args_list)
    shape = QUICK if args.quick else SMOLLM2
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    path: Path = args.out / f"cost_curves-{date}.json"
    if path.exists() and not args.force:
        raise SystemExit(f"{path} exists; pass --force to overwrite it or --out to write elsewhere.")
    result = {
        "date": date,
        "command": " ".join(["python -m benchmarks.trained.cost_curves", *args_list]),
        "shape": asdict(shape),
        "quick": args.quick,
        **measure(shape),
    }
    text = markdown(result)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    path.with_suffix(".md").write_text(text)
    return path


if __name__ == "__main__":
    main()
