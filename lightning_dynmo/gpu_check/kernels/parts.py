"""The kernel check's measurements, one function per part; each returns a JSON-ready dict.

Read in this order: :func:`attention` (sparse attention on FlexAttention and on the gather kernel against
dense SDPA), :func:`pruning` (pruned blocks on their kernels against a dense block), :func:`stalls` (20
training steps of MoD and early exit, token buckets on and off), :func:`moe` (grouped GEMM against padded
experts), then :func:`cost_curves` (each case's block cost as a function of its statistic, the head with
its loss, the embedding).

Every block runs forward + backward on one micro-batch of the :class:`~.timing.Shape`, its parameters in
the shape's dtype (bf16 on a GPU: no autocast, so the sparse kernels see the dtype they run).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dynmo.dynamism.early_exit import EarlyExitBlock, EarlyExitOptions, early_exit_config
from lightning_dynmo.dynamism.mod import MoDBlock, MoDOptions, mod_config
from lightning_dynmo.dynamism.moe import MoEBlock, MoEOptions
from lightning_dynmo.dynamism.pruning import GlobalMagnitudePruner, PruningConfig, PruningScope
from lightning_dynmo.dynamism.pruning_schedule import PruningSchedule
from lightning_dynmo.dynamism.sparse_attention import (
    SparseAttentionBlock,
    SparseAttentionOptions,
    block_sparse_attention,
    bucket_masked_attention,
    hash_buckets,
    plan_tiles,
    random_rotations,
)
from lightning_dynmo.dynamism.sparse_attention_flex import flex_bucket_attention, resolve_attention_kernel
from lightning_dynmo.dynamism.tokens import token_counts
from lightning_dynmo.events import EventBus
from lightning_dynmo.gpu_check.kernels.timing import Shape, Timer
from lightning_dynmo.gpu_check.stalls import ALLOCATOR_COUNTERS
from lightning_dynmo.models import GPT, DenseBlock, GPTConfig

__all__ = ["attention", "cost_curves", "moe", "pruning", "stalls"]

#: The most active tiles the sparse-attention figures are taken at (the issue's bound).
MAX_ACTIVE_FRACTION = 0.30
#: Steps of the stall part, and the first ones left out of its max / median (warm-up).
STALL_STEPS, STALL_WARMUP = 20, 3
#: bf16 attention against the float32 reference: the largest error accepted.
BF16_ATTENTION_TOLERANCE = 2e-2
#: The head's padded vocabulary is the next multiple of this (Megatron-LM's default divisor).
VOCAB_MULTIPLE = 128


def padded_vocab(shape: Shape) -> int:
    """``shape``'s vocabulary rounded up to a multiple of :data:`VOCAB_MULTIPLE`."""
    return -(-shape.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def block_config(shape: Shape, num_layers: int = 1) -> GPTConfig:
    """A GPT config of ``shape`` (no dropout: FlexAttention has none)."""
    return GPTConfig(
        vocab_size=shape.vocab_size,
        seq_len=shape.seq_len,
        num_layers=num_layers,
        d_model=shape.d_model,
        num_heads=shape.num_heads,
        dropout=0.0,
    )


def fwd_bwd(block: nn.Module, shape: Shape, device: str, *extra: Tensor) -> Callable[[], None]:
    """One forward + backward of ``block`` on a fixed random micro-batch (``extra``: side inputs)."""
    gen = torch.Generator(device=device).manual_seed(0)
    size = (shape.micro_batch, shape.seq_len, shape.d_model)
    x = torch.randn(size, generator=gen, device=device, dtype=shape.torch_dtype, requires_grad=True)
    grad = torch.randn(size, generator=gen, device=device, dtype=shape.torch_dtype)

    def run() -> None:
        out = block(x, *extra)
        (out[0] if isinstance(out, tuple) else out).backward(grad)

    return run


def viable(variants: dict[str, Callable[[], None]]) -> tuple[dict[str, Callable[[], None]], dict[str, str]]:
    """The variants that run once without an error, and the others' errors (recorded, not hidden)."""
    ok, errors = {}, {}
    for name, run in variants.items():
        try:
            run()
        except Exception as error:  # a kernel this device or torch lacks: recorded in the report
            errors[name] = f"{type(error).__name__}: {error}"[:500]
        else:
            ok[name] = run
    return ok, errors


def points(values: tuple[Any, ...], device: str) -> tuple[Any, ...]:
    """All of a curve's ``values`` on a GPU; the first and last in the CPU dry run (it only checks the
    parts run)."""
    return values if device == "cuda" else (values[0], values[-1])


def _on(module: nn.Module, shape: Shape, device: str) -> nn.Module:
    return module.to(device=device, dtype=shape.torch_dtype)


# -- sparse attention ---------------------------------------------------------------------------------


def attention(shape: Shape, timer: Timer, device: str) -> dict[str, Any]:
    """Sparse attention (at most 30% active tiles) against dense SDPA, alone and in a whole block."""
    b, h, t = shape.micro_batch, shape.num_heads, shape.seq_len
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(b, h, t, shape.d_model // h, generator=gen, device=device, dtype=shape.torch_dtype)
        for _ in range(3)
    )
    num_buckets, rotations, fraction = _sparse_enough(q, k, shape.tile)
    errors = _attention_errors(q, k, v, rotations, shape.tile, device)
    for x in (q, k, v):
        x.requires_grad_(True)
    grad = torch.randn_like(q)
    variants: dict[str, Callable[[], None]] = {
        "dense_sdpa": lambda: _backward(F.scaled_dot_product_attention(q, k, v, is_causal=True), grad)
    }
    for kernel in ("gather", "flex") if device == "cuda" else ("gather",):
        variants[kernel] = _sparse_run(kernel, q, k, v, rotations, shape.tile, grad)
    ran, failed = viable(variants)
    attention_ms = timer.compare(ran)
    blocks_ms, block_errors = _attention_blocks(shape, timer, device, num_buckets)
    dense = attention_ms["dense_sdpa"]["median_ms"]
    sparse = min(attention_ms[name]["median_ms"] for name in ran if name != "dense_sdpa")
    block_ratio = None
    if {"dense_block", "sparse_block"} <= blocks_ms.keys():
        block_ratio = blocks_ms["sparse_block"]["median_ms"] / blocks_ms["dense_block"]["median_ms"]
    kernel = resolve_attention_kernel(
        "auto", torch.device(device), block_size=shape.tile, needs_grad=True, dropout_p=0
    )
    return {
        # Compiled FlexAttention must not recompile per plan (a rebuilt BlockMask keeps its shapes).
        "dynamo_stats": {str(k): v for k, v in torch._dynamo.utils.counters["stats"].items()},
        "num_buckets": num_buckets,
        "active_fraction": fraction,
        "auto_kernel": kernel,
        "errors_vs_float32_reference": errors,
        "attention": attention_ms,
        "blocks": blocks_ms,
        "failed": {**failed, **block_errors},
        "attention_ratio": sparse / dense,
        "block_ratio": block_ratio,
        "must_show": {
            "attention_ratio_at_most_0.5": sparse / dense <= 0.5,
            "block_cheaper": _lt(block_ratio, 1.0),
        },
    }


def _sparse_enough(q: Tensor, k: Tensor, tile: int) -> tuple[int, Tensor | None, float]:
    """The fewest buckets whose plan keeps at most 30% of the causal tiles active (and its rotations)."""
    heads, head_dim = q.shape[1], q.shape[-1]
    for num_buckets in (4, 8, 16, 32, 64):
        rotations = random_rotations(0, heads, head_dim, num_buckets)
        plan = plan_tiles(hash_buckets(q, rotations), hash_buckets(k, rotations), tile)
        fraction = plan.active_blocks() / plan.causal_blocks()
        if fraction <= MAX_ACTIVE_FRACTION:
            break
    return num_buckets, rotations, fraction


def _sparse_run(
    kernel: str, q: Tensor, k: Tensor, v: Tensor, rotations: Tensor | None, tile: int, grad: Tensor
) -> Callable[[], None]:
    def run() -> None:  # the plan is part of the cost: a block hashes and plans at every forward
        plan = plan_tiles(hash_buckets(q, rotations), hash_buckets(k, rotations), tile)
        attend = flex_bucket_attention if kernel == "flex" else block_sparse_attention
        _backward(attend(q, k, v, plan), grad)

    return run


def _attention_errors(
    q: Tensor, k: Tensor, v: Tensor, rotations: Tensor | None, tile: int, device: str
) -> dict[str, Any]:
    """Each kernel's largest error against the dense bucket-masked reference in float32."""
    q_bucket, k_bucket = hash_buckets(q, rotations), hash_buckets(k, rotations)
    plan = plan_tiles(q_bucket, k_bucket, tile)
    with torch.no_grad():
        reference = bucket_masked_attention(q.float(), k.float(), v.float(), q_bucket, k_bucket)
        out = {"gather": block_sparse_attention(q, k, v, plan)}
        if device == "cuda":
            out["flex"] = flex_bucket_attention(q, k, v, plan)
    errors: dict[str, Any] = {name: float((o.float() - reference).abs().max()) for name, o in out.items()}
    errors["tolerance"] = BF16_ATTENTION_TOLERANCE if q.dtype == torch.bfloat16 else 1e-4
    errors["within"] = all(e <= errors["tolerance"] for n, e in errors.items() if n in out)
    return errors


def _attention_blocks(
    shape: Shape, timer: Timer, device: str, num_buckets: int
) -> tuple[dict[str, Any], dict[str, str]]:
    config = block_config(shape)
    options = SparseAttentionOptions(num_buckets=num_buckets, block_size=shape.tile, kernel="auto")
    torch.manual_seed(0)
    dense = _on(DenseBlock(config), shape, device)
    sparse = _on(SparseAttentionBlock(config, options, 0), shape, device)
    ran, failed = viable(
        {"dense_block": fwd_bwd(dense, shape, device), "sparse_block": fwd_bwd(sparse, shape, device)}
    )
    return timer.compare(ran), failed


# -- pruning --------------------------------------------------------------------------------------------

#: (pattern, kernel, sparsities) the pruning part measures.
PRUNING_KERNELS = (
    ("2:4", "semi_structured", (0.5,)),
    ("block", "bsr", (0.5, 0.75, 0.9)),
    ("unstructured", "csr", (0.9,)),
)


def pruning(shape: Shape, timer: Timer, device: str) -> dict[str, Any]:
    """A pruned block on each sparse kernel and sparsity against the dense block."""
    config = block_config(shape)
    torch.manual_seed(0)
    dense = _on(DenseBlock(config), shape, device)
    variants = {"dense": fwd_bwd(dense, shape, device)}
    setup_errors = {}
    for pattern, kernel, sparsities in PRUNING_KERNELS:
        for sparsity in points(sparsities, device) if len(sparsities) > 1 else sparsities:
            name = f"{kernel}@{sparsity}"
            try:
                variants[name] = fwd_bwd(
                    _pruned(dense, shape, device, pattern, kernel, sparsity), shape, device
                )
            except Exception as error:  # e.g. no semi-structured kernel on this device: recorded
                setup_errors[name] = f"{type(error).__name__}: {error}"[:500]
    ran, failed = viable(variants)
    timed = timer.compare(ran)
    ratios = {n: timed[n]["median_ms"] / timed["dense"]["median_ms"] for n in timed if n != "dense"}
    best = min(ratios.values(), default=None)
    return {
        "timed": timed,
        "ratio_to_dense": ratios,
        "failed": {**setup_errors, **failed},
        "must_show": {"some_pruned_block_at_most_0.75": _lt(best, 0.75 + 1e-12)},
    }


def _pruned(
    dense: nn.Module, shape: Shape, device: str, pattern: str, kernel: str, sparsity: float
) -> nn.Module:
    block = _on(DenseBlock(block_config(shape)), shape, device)
    block.load_state_dict(dense.state_dict())
    layers = {0: block}
    GlobalMagnitudePruner.prepare(layers)
    schedule = PruningSchedule(final_sparsity=sparsity)
    config = PruningConfig(pattern=pattern, kernel=kernel, block_size=shape.block, schedule=schedule)
    GlobalMagnitudePruner(config, event_bus=EventBus()).prune_to(
        sparsity, PruningScope(layers, 1, device=torch.device(device))
    )
    return block


# -- MoD and early-exit stalls --------------------------------------------------------------------------


def stalls(shape: Shape, timer: Timer, device: str) -> dict[str, Any]:
    """20 training steps of a MoD GPT and of an early-exit GPT, token buckets on (64) and off."""
    result: dict[str, Any] = {}
    for case in ("mod", "early_exit"):
        for bucket in (64, None):
            result[f"{case}/bucket={bucket}"] = _stall_run(case, bucket, shape, device)
    result["must_show"] = {
        f"{name}: max_after_warmup_at_most_2x_median": run["max_over_median"] <= 2.0
        for name, run in result.items()
        if name.endswith("=64")
    }
    return result


def _stall_model(case: str, bucket: int | None, shape: Shape) -> GPT:
    fields: dict[str, Any] = {
        "num_layers": shape.num_layers,
        "d_model": shape.d_model,
        "num_heads": shape.num_heads,
        "seq_len": shape.seq_len,
        "vocab_size": shape.vocab_size,
        "token_bucket": bucket,
    }
    if case == "mod":
        return GPT(mod_config(capacity=0.125, routing="predictor", **fields))
    # An untrained head's top-1 minus top-2 probability is ~1e-5 over 50,257 tokens: this threshold lets a
    # varying share leave, so the counts move from step to step (they are recorded).
    threshold = 2e-5 if shape.vocab_size > 10_000 else 0.02
    return GPT(
        early_exit_config(first_exit_layer=1, threshold=threshold, position_temperature=None, **fields)
    )


def _stall_run(case: str, bucket: int | None, shape: Shape, device: str) -> dict[str, Any]:
    """Train ``STALL_STEPS`` steps; per step its wall time, allocator work, token counts and MLP rows."""
    torch.manual_seed(0)
    model = _on(_stall_model(case, bucket, shape), shape, device)
    assert isinstance(model, GPT)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    mlp_rows: dict[int, list[int]] = {}  # the rows each routed block's MLP multiplied: its kernel shape
    handles = []
    for index in token_counts(model):
        seen = mlp_rows.setdefault(index, [])
        mlp = model.layers[str(index)].mlp
        assert isinstance(mlp, nn.Module)
        handles.append(
            mlp.register_forward_pre_hook(lambda m, args, seen=seen: seen.append(args[0].shape[0]))
        )
    try:
        steps = STALL_STEPS if device == "cuda" else STALL_WARMUP + 2
        rows = [_stall_step(model, optimizer, shape, device, mlp_rows) | {"step": n} for n in range(steps)]
    finally:
        for handle in handles:
            handle.remove()
    steady = sorted(float(r["wall_ms"]) for r in rows[STALL_WARMUP:])
    median = steady[len(steady) // 2]
    return {"steps": rows, "median_ms": median, "max_ms": steady[-1], "max_over_median": steady[-1] / median}


def _stall_step(
    model: GPT, optimizer: torch.optim.Optimizer, shape: Shape, device: str, mlp_rows: dict[int, list[int]]
) -> dict[str, Any]:
    cuda = device == "cuda"
    for seen in mlp_rows.values():
        seen.clear()
    before = torch.cuda.memory_stats() if cuda else {}
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = torch.randint(0, shape.vocab_size, (shape.micro_batch, shape.seq_len + 1), device=device)
    idx, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    logits = model(idx, labels)
    _backward(F.cross_entropy(logits.float().reshape(-1, shape.vocab_size), labels.reshape(-1)))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    after = torch.cuda.memory_stats() if cuda else {}
    return {
        "wall_ms": round(1e3 * (time.perf_counter() - start), 3),
        "processed_tokens": {i: c.last_processed for i, c in token_counts(model).items()},
        "mlp_rows": {i: list(seen) for i, seen in mlp_rows.items()},
        "allocator": {key: after.get(key, 0) - before.get(key, 0) for key in ALLOCATOR_COUNTERS},
    }


# -- MoE ------------------------------------------------------------------------------------------------


def moe(shape: Shape, timer: Timer, device: str) -> dict[str, Any]:
    """Padded against grouped-GEMM experts (8 experts, top 2), near-uniform and skewed routing."""
    result: dict[str, Any] = {}
    for skew in (1.0, 20.0) if device == "cuda" else (20.0,):
        blocks = _moe_pair(shape, device, skew)
        ran, failed = viable({kernel: fwd_bwd(block, shape, device) for kernel, block in blocks.items()})
        timed = timer.compare(ran)
        result[f"router_scale={skew}"] = {
            "timed": timed,
            "failed": failed,
            "work_ratio": blocks["padded"].rows_computed / (shape.micro_batch * shape.seq_len * 2),
        }
    return result


def _moe_pair(shape: Shape, device: str, skew: float) -> dict[str, MoEBlock]:
    config = block_config(shape)
    blocks = {}
    for kernel in ("padded", "grouped"):
        torch.manual_seed(0)
        block = MoEBlock(config, MoEOptions(num_experts=8, top_k=2, expert_kernel=kernel))
        block.init_weights(config)
        with torch.no_grad():
            block.router.weight.mul_(skew)
        blocks[kernel] = block.to(device=device, dtype=shape.torch_dtype)
    return blocks


# -- cost curves ----------------------------------------------------------------------------------------


def cost_curves(shape: Shape, timer: Timer, device: str) -> dict[str, Any]:
    """Each case's block forward + backward against its statistic, and the head + loss and embedding."""
    curves = {
        "dense_and_freezing": _freezing_curve(shape, timer, device),
        "sparse_attention": _sparse_attention_curve(shape, timer, device),
        "mod": _mod_curve(shape, timer, device),
        "early_exit": _early_exit_curve(shape, timer, device),
        "early_exit_padded_vocab": _early_exit_curve(shape, timer, device, padded_vocab(shape)),
        "head_loss_and_embedding": _head_and_embedding(shape, timer, device),
    }
    return curves


def _curve(
    timer: Timer, points: dict[str, tuple[float, Callable[[], None]]], statistic: str
) -> dict[str, Any]:
    ran, failed = viable({name: run for name, (_, run) in points.items()})
    timed = timer.compare(ran)
    return {
        "statistic": statistic,
        "points": [
            {"name": name, statistic: points[name][0], **timed[name]} for name in points if name in timed
        ],
        "failed": failed,
    }


def _freezing_curve(shape: Shape, timer: Timer, device: str) -> dict[str, Any]:
    torch.manual_seed(0)
    trainable = _on(DenseBlock(block_config(shape)), shape, device)
    frozen = _on(DenseBlock(block_config(shape)), shape, device).requires_grad_(False)
    points = {
        "trainable": (1.0, fwd_bwd(trainable, shape, device)),
        "frozen": (0.0, fwd_bwd(frozen, shape, device)),
    }
    return _curve(timer, points, "trainable_fraction")


def _sparse_attention_curve(shape: Shape, timer: Timer, device: str) -> dict[str, Any]:
    curve = {}
    for num_buckets in points((1, 2, 4, 8, 16, 32), device):
        options = SparseAttentionOptions(num_buckets=num_buckets, block_size=shape.tile, kernel="auto")
        torch.manual_seed(0)
        block = _on(SparseAttentionBlock(block_config(shape), options, 0), shape, device)
        run = fwd_bwd(block, shape, device)
        run()  # the plan of this input: its active fraction is the statistic
        assert isinstance(block, SparseAttentionBlock)
        curve[f"buckets={num_buckets}"] = (block.active_blocks / block.causal_blocks, run)
    return _curve(timer, curve, "active_fraction")


def _mod_curve(shape: Shape, timer: Timer, device: str) -> dict[str, Any]:
    curve = {}
    for capacity in points((0.0625, 0.125, 0.25, 0.5, 1.0), device):
        torch.manual_seed(0)
        block = _on(MoDBlock(block_config(shape), 0, MoDOptions(capacity=capacity)), shape, device)
        tokens = MoDOptions(capacity=capacity).capacity_tokens(shape.seq_len)
        curve[f"capacity={capacity}"] = (tokens / shape.seq_len, fwd_bwd(block, shape, device))
    return _curve(timer, curve, "processed_fraction")


def _early_exit_curve(
    shape: Shape, timer: Timer, device: str, vocab_size: int | None = None
) -> dict[str, Any]:
    """The early-exit block against its active tokens; ``vocab_size``: its exit head that wide (padded as
    the last head is in :func:`_head_and_embedding`; the labels stay in the real vocabulary)."""
    config = block_config(shape, num_layers=2)
    if vocab_size is not None:
        config = dataclasses.replace(config, vocab_size=vocab_size)
    gen = torch.Generator(device=device).manual_seed(1)
    labels = torch.randint(
        0, shape.vocab_size, (shape.micro_batch, shape.seq_len), generator=gen, device=device
    )
    curve = {}
    for active in points((1.0, 0.75, 0.5, 0.25, 0.1), device):
        torch.manual_seed(0)
        block = _on(EarlyExitBlock(config, 0, EarlyExitOptions(threshold=2.0)), shape, device)
        exited = torch.rand(labels.shape, generator=gen, device=device) >= active
        curve[f"active={active}"] = (
            float((~exited).float().mean()),
            fwd_bwd(block, shape, device, labels, exited),
        )
    return {**_curve(timer, curve, "active_fraction"), "vocab_size": config.vocab_size}


def _head_and_embedding(shape: Shape, timer: Timer, device: str) -> dict[str, Any]:
    """The head + loss and the embedding; beside them the head's matrix product alone, and both again with
    the vocabulary padded to a multiple of :data:`VOCAB_MULTIPLE` (Megatron-LM's and nanoGPT's habit: an
    odd width such as GPT-2's 50,257 keeps the GEMM off its aligned tensor-core paths)."""
    torch.manual_seed(0)
    padded = padded_vocab(shape)
    head = _on(nn.Linear(shape.d_model, shape.vocab_size, bias=False), shape, device)
    head_padded = _on(nn.Linear(shape.d_model, padded, bias=False), shape, device)
    tokens = nn.Embedding(shape.vocab_size, shape.d_model)
    positions = nn.Embedding(shape.seq_len, shape.d_model)
    embed = nn.ModuleList([_on(tokens, shape, device), _on(positions, shape, device)])
    gen = torch.Generator(device=device).manual_seed(2)
    size = (shape.micro_batch, shape.seq_len)
    ids = torch.randint(0, shape.vocab_size, size, generator=gen, device=device)
    hidden = torch.randn(
        *size, shape.d_model, generator=gen, device=device, dtype=shape.torch_dtype, requires_grad=True
    )
    grad = torch.randn(*size, shape.d_model, generator=gen, device=device, dtype=shape.torch_dtype)
    place = torch.arange(shape.seq_len, device=device)

    def head_loss(linear: nn.Module) -> Callable[[], None]:
        def run() -> None:
            logits = linear(hidden).float()
            _backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1)))

        return run

    def head_matmul(linear: nn.Module) -> Callable[[], None]:
        def run() -> None:
            out = linear(hidden)
            _backward(out, torch.ones_like(out))

        return run

    def embedding() -> None:
        (embed[0](ids) + embed[1](place)).backward(grad)

    variants = {
        "head_and_loss": head_loss(head),
        "embedding": embedding,
        "head_matmul": head_matmul(head),
        "head_and_loss_padded_vocab": head_loss(head_padded),
        "head_matmul_padded_vocab": head_matmul(head_padded),
    }
    ran, failed = viable(variants)
    return {"padded_vocab_size": padded, "timed": timer.compare(ran), "failed": failed}


def _backward(out: Tensor, grad: Tensor | None = None) -> None:
    torch.autograd.backward(out, grad)


def _lt(value: float | None, bound: float) -> bool | None:
    return None if value is None else value < bound
