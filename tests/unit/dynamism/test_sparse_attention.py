"""The hash-sparse attention block in float64: one bucket is dense causal attention, the tiled computation
equals the dense bucket-masked reference (forward and gradients), tiles on a hand-worked example, the
seeded rotations and their forward count, the work signal, and bad options."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_dynmo.dynamism.sparse_attention import (
    SparseAttentionBlock,
    SparseAttentionOptions,
    block_sparse_attention,
    bucket_masked_attention,
    hash_buckets,
    plan_tiles,
    random_rotations,
    rotation_seed,
    sparse_attention_gpt_config,
)
from lightning_dynmo.models import GPT, DenseBlock, GPTConfig
from lightning_dynmo.pipeline.model.contract import check_model_contract
from lightning_dynmo.pipeline.step.stage import StageModule
from tests.quiet_trainer import quiet_trainer

CONFIG = GPTConfig(vocab_size=32, seq_len=16, num_layers=2, d_model=16, num_heads=2, d_ff=24)
TOL = 1e-12


def _qkv(batch: int = 2, heads: int = 3, seq: int = 32, dim: int = 8, seed: int = 0) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(batch, heads, seq, dim, dtype=torch.float64, generator=generator).requires_grad_(True)
        for _ in range(3)
    ]


def _grads(out: Tensor, inputs: list[Tensor], weight: Tensor) -> tuple[Tensor, ...]:
    return torch.autograd.grad((out * weight).sum(), inputs)


def _block(seed: int = 0, layer_index: int = 0, **options: Any) -> SparseAttentionBlock:
    torch.manual_seed(seed)
    return SparseAttentionBlock(CONFIG, SparseAttentionOptions(**options), layer_index).double()


def _hidden(batch: int = 3, seed: int = 1) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, CONFIG.seq_len, CONFIG.d_model, dtype=torch.float64, generator=generator)


# -- one bucket is dense causal attention ---------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_one_bucket_equals_dense_causal_attention_forward_and_backward(block_size: int) -> None:
    q, k, v = inputs = _qkv()
    buckets = hash_buckets(q, None)
    plan = plan_tiles(buckets, hash_buckets(k, None), block_size)
    assert plan.active_blocks() == plan.causal_blocks()  # the causal tiles, no more
    out = block_sparse_attention(q, k, v, plan)
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, dense, rtol=0, atol=TOL)
    weight = torch.randn_like(out)
    for mine, theirs in zip(_grads(out, inputs, weight), _grads(dense, inputs, weight), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=TOL)


def test_one_bucket_block_equals_the_dense_block_and_more_buckets_do_not() -> None:
    sparse = _block(num_buckets=1, block_size=4)
    dense = DenseBlock(CONFIG).double()
    for name in ("ln_1", "attn", "ln_2", "mlp"):  # same parameter names
        getattr(dense, name).load_state_dict(getattr(sparse, name).state_dict())
    x = _hidden().requires_grad_(True)
    out_sparse, out_dense = sparse(x), dense(x)
    torch.testing.assert_close(out_sparse, out_dense, rtol=0, atol=TOL)
    (g_sparse,) = torch.autograd.grad(out_sparse.square().sum(), x)
    (g_dense,) = torch.autograd.grad(out_dense.square().sum(), x)
    torch.testing.assert_close(g_sparse, g_dense, rtol=0, atol=TOL)
    # Negative control: the same weights with 4 buckets attend to fewer keys.
    hashed = _block(num_buckets=4, block_size=4)
    hashed.load_state_dict(sparse.state_dict())
    assert (hashed(x) - out_dense).abs().max().item() > 1e-4


# -- the tiled computation equals the dense bucket-masked reference -------------------------------------


@pytest.mark.parametrize(("num_buckets", "block_size"), [(2, 4), (4, 8), (8, 4), (16, 2), (8, 32)])
def test_block_sparse_equals_the_dense_masked_reference_forward_and_backward(
    num_buckets: int, block_size: int
) -> None:
    q, k, v = inputs = _qkv()
    rotations = random_rotations(7, 3, 8, num_buckets)
    q_bucket, k_bucket = hash_buckets(q, rotations), hash_buckets(k, rotations)
    plan = plan_tiles(q_bucket, k_bucket, block_size)
    out = block_sparse_attention(q, k, v, plan)
    reference = bucket_masked_attention(q, k, v, q_bucket, k_bucket)
    torch.testing.assert_close(out, reference, rtol=0, atol=TOL)
    weight = torch.randn_like(out)
    for mine, theirs in zip(_grads(out, inputs, weight), _grads(reference, inputs, weight), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=TOL)
    assert plan.active_blocks() < plan.causal_blocks() or block_size == 32
    # Negative control: the reference with another bucket assignment (the next forward's rotations).
    other = random_rotations(8, 3, 8, num_buckets)
    moved = bucket_masked_attention(q, k, v, hash_buckets(q, other), hash_buckets(k, other))
    assert (moved - out).abs().max().item() > 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_keep_float32_statistics_and_return_their_dtype(dtype: torch.dtype) -> None:
    # On an H200 under CUDA bf16 autocast the scores came back bf16 and exp float32, and the bf16
    # accumulator refused the float32 sums (2026-11-27). The statistics are now float32 whatever comes in.
    q, k, v = _qkv(seq=64)
    rotations = random_rotations(7, 3, 8, 4)
    q_bucket, k_bucket = hash_buckets(q, rotations), hash_buckets(k, rotations)
    plan = plan_tiles(q_bucket, k_bucket, 8)
    reference = bucket_masked_attention(q, k, v, q_bucket, k_bucket)
    out = block_sparse_attention(q.to(dtype), k.to(dtype), v.to(dtype), plan)
    assert out.dtype == dtype
    error = (out.double() - reference).abs().max().item()
    assert error < 0.03, error  # the inputs' own rounding, not an accumulation in half precision
    # Negative control: the tolerance tells attention over other buckets apart.
    other = random_rotations(8, 3, 8, 4)
    moved = bucket_masked_attention(q, k, v, hash_buckets(q, other), hash_buckets(k, other))
    assert (out.double() - moved).abs().max().item() > 0.1


def test_a_query_without_visible_keys_outputs_zero_with_finite_gradients() -> None:
    q, k, v = inputs = _qkv(batch=1, heads=1, seq=8)
    q_bucket = torch.zeros(1, 1, 8, dtype=torch.long)
    k_bucket = torch.tensor([[[1, 0, 1, 1, 1, 1, 1, 1]]])  # only key 1 shares the queries' bucket
    plan = plan_tiles(q_bucket, k_bucket, 2)
    out = block_sparse_attention(q, k, v, plan)
    assert out[0, 0, 0].abs().max().item() == 0  # query 0 comes before key 1
    torch.testing.assert_close(out[0, 0, 1:], v[0, 0, 1].expand(7, -1), rtol=0, atol=TOL)
    grads = _grads(out, inputs, torch.ones_like(out))
    assert all(torch.isfinite(g).all() for g in grads)
    # Nothing shared: no tile is active, the output is zero, the gradients too.
    none = plan_tiles(q_bucket, torch.ones_like(k_bucket), 2)
    assert none.active_blocks() == 0
    out = block_sparse_attention(q, k, v, none)
    assert out.abs().max().item() == 0
    assert all(g.abs().max().item() == 0 for g in _grads(out, inputs, torch.ones_like(out)))


def test_tiles_on_a_hand_worked_example() -> None:
    # Buckets alternate 0, 1: sorted, bucket 0 holds positions 0 2 4 6 and bucket 1 holds 1 3 5 7.
    # Tiles of 2: Q0 = K0 = {0, 2}, Q1 = K1 = {4, 6} (bucket 0), Q2 = K2 = {1, 3}, Q3 = K3 = {5, 7}.
    # Active: same bucket range and first key <= last query: (0,0) (1,0) (1,1) (2,2) (3,2) (3,3).
    buckets = torch.tensor([[[0, 1, 0, 1, 0, 1, 0, 1]]])
    plan = plan_tiles(buckets, buckets, 2)
    assert plan.q_order.tolist() == [[[0, 2, 4, 6, 1, 3, 5, 7]]]
    assert plan.active[0, 0].nonzero().tolist() == [[0, 0], [1, 0], [1, 1], [2, 2], [3, 2], [3, 3]]
    assert (plan.active_blocks(), plan.causal_blocks()) == (6, 10)


@pytest.mark.parametrize("seed", range(4))
def test_every_visible_pair_lies_in_an_active_tile(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    q_bucket = torch.randint(0, 4, (2, 2, 24), generator=generator)
    k_bucket = torch.randint(0, 4, (2, 2, 24), generator=generator)
    plan = plan_tiles(q_bucket, k_bucket, 3)
    q_rank, k_rank = plan.q_order.argsort(-1), plan.k_order.argsort(-1)  # sorted slot of each position
    visible = (q_bucket.unsqueeze(-1) == k_bucket.unsqueeze(-2)) & torch.ones(24, 24).tril().bool()
    b, h, t, s = visible.nonzero(as_tuple=True)
    assert plan.active[b, h, q_rank[b, h, t] // 3, k_rank[b, h, s] // 3].all()


# -- seeded rotations and the forward count -------------------------------------------------------------


def test_rotation_seeds_are_stable_and_depend_on_every_part() -> None:
    seed = rotation_seed(0, 0, 3, 10)
    assert seed == rotation_seed(0, 0, 3, 10) and 0 <= seed < 2**63
    others = {rotation_seed(1, 0, 3, 10), rotation_seed(0, 1, 3, 10), rotation_seed(0, 0, 4, 10)}
    assert len({seed, *others}) == 4
    assert rotation_seed(0, 0, 3, 11) != seed
    rotations = random_rotations(seed, 2, 8, 6)
    assert rotations is not None and rotations.shape == (2, 8, 3)
    torch.testing.assert_close(rotations.norm(dim=1), torch.ones(2, 3, dtype=torch.float64))
    assert torch.equal(rotations, random_rotations(seed, 2, 8, 6))
    assert random_rotations(seed, 2, 8, 1) is None


def test_training_forwards_advance_the_count_and_draw_new_buckets() -> None:
    block = _block(num_buckets=4, block_size=4).train()
    x = _hidden()
    first = block(x)
    assert int(block.hash_forwards) == 1
    second = block(x)  # same input, next rotations
    assert int(block.hash_forwards) == 2 and (first - second).abs().max().item() > 1e-6
    # A fresh block at count 1 repeats the second forward exactly: the count is all that varies.
    again = _block(num_buckets=4, block_size=4).train()
    again.hash_forwards.fill_(1)
    assert torch.equal(again(x), second)
    # Other layer, other rotations.
    other_layer = _block(num_buckets=4, block_size=4, layer_index=1).train()
    other_layer.load_state_dict(block.state_dict())
    other_layer.hash_forwards.fill_(1)
    assert (other_layer(x) - second).abs().max().item() > 1e-6


def test_eval_forwards_and_shape_inference_do_not_advance_the_count() -> None:
    model = GPT(sparse_attention_gpt_config(num_layers=2, d_model=16, num_heads=2, seq_len=8, block_size=4))
    model = model.double()
    block = model.layers["0"]
    assert isinstance(block, SparseAttentionBlock)
    inputs = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        first = model.eval()(inputs)
        assert torch.equal(model(inputs), first)  # evaluation is repeatable
    model.train()
    with torch.no_grad():
        model(inputs)
    assert int(block.hash_forwards) == 0 and block.active_blocks > 0 and block.step_active_blocks == 0
    spec = check_model_contract(model)
    stage = StageModule(model, spec, range(2), first=True, last=True)
    with stage.shape_inference():
        stage(inputs)
    assert int(block.hash_forwards) == 0
    stage(inputs)
    assert int(block.hash_forwards) == 1 and block.step_active_blocks == block.active_blocks


def test_the_count_is_state_that_travels_and_resumes() -> None:
    block = _block(num_buckets=4, block_size=4).train()
    x = _hidden()
    block(x)
    assert "hash_forwards" in block.state_dict()
    moved = pickle.loads(pickle.dumps(block))  # what a migration sends
    resumed = _block(num_buckets=4, block_size=4).train()
    resumed.load_state_dict(block.state_dict())  # what a checkpoint restores
    expected = block(x)
    assert torch.equal(moved(x), expected) and torch.equal(resumed(x), expected)
    # Negative control: a block that lost its count redraws the first forward's rotations.
    assert (_block(num_buckets=4, block_size=4).train()(x) - expected).abs().max().item() > 1e-6


# -- the work signal -------------------------------------------------------------------------------------


def test_the_active_fraction_is_the_last_steps_active_over_causal_tiles() -> None:
    block = _block(num_buckets=8, block_size=2).train()
    assert block.active_fraction == 1.0
    active = []
    for seed in (1, 2):
        block(_hidden(seed=seed))
        active.append(block.active_blocks)
    assert block.causal_blocks == 3 * 2 * 8 * 9 // 2  # batch x heads x n (n + 1) / 2 with n = 8 tiles
    assert block.step_active_blocks == sum(active)
    block.after_optimizer_step(step=0)
    assert block.active_fraction == pytest.approx(sum(active) / (2 * block.causal_blocks))
    assert 0 < block.active_fraction < 1
    assert block.step_active_blocks == block.step_causal_blocks == 0
    block.after_optimizer_step()  # a step without forwards keeps the last signal
    assert block.active_fraction == pytest.approx(sum(active) / (2 * block.causal_blocks))
    dense = _block(num_buckets=1, block_size=2).train()
    dense(_hidden())
    dense.after_optimizer_step()
    assert dense.active_fraction == 1.0


def test_the_gpt_counts_forwards_and_closes_steps(tokens: DataLoader[Tensor]) -> None:
    config = sparse_attention_gpt_config(
        num_layers=2, d_model=16, num_heads=2, seq_len=8, num_buckets=4, block_size=2
    )
    model = GPT(config, microbatches=2)
    assert [block.layer_index for block in model.layers.values()] == [0, 1]
    trainer = quiet_trainer(
        max_steps=3,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, tokens)
    for block in model.layers.values():
        assert int(block.hash_forwards) == 3 * 2
        assert 0 < block.active_fraction < 1 and block.step_active_blocks == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_draws_the_cpu_rotations_and_matches_the_cpu() -> None:
    block = _block(num_buckets=4, block_size=4).train()
    x = _hidden()
    cpu = block(x)
    block.hash_forwards.zero_()
    cuda = block.cuda()(x.cuda())
    torch.testing.assert_close(cuda.cpu(), cpu, rtol=0, atol=1e-10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_autocast_runs_forward_and_backward_close_to_float32() -> None:
    block = _block(num_buckets=4, block_size=4).float().cuda().train()
    x = _hidden().float().cuda().requires_grad_(True)
    exact = block(x)
    block.hash_forwards.zero_()  # the same rotations again
    with torch.autocast("cuda", dtype=torch.bfloat16):
        mixed = block(x)
    mixed.float().square().sum().backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())
    # The median: a bf16 projection may move a near-tie row to another bucket, which changes that row.
    assert (mixed.float() - exact).abs().median().item() < 0.02


# -- bad input -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"num_buckets": 0}, r"SparseAttentionOptions.num_buckets=0 must be an integer >= 1"),
        ({"num_buckets": 3}, r"SparseAttentionOptions.num_buckets=3 must be 1 or even.*use 4"),
        ({"num_buckets": 2.0}, r"SparseAttentionOptions.num_buckets=2.0 must be an integer >= 1"),
        ({"block_size": 0}, r"SparseAttentionOptions.block_size=0 must be an integer >= 1"),
        ({"block_size": True}, r"SparseAttentionOptions.block_size=True must be an integer >= 1"),
        ({"hash_seed": -1}, r"SparseAttentionOptions.hash_seed=-1 must be an integer >= 0"),
    ],
)
def test_bad_options_are_refused(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SparseAttentionOptions(**options)


def test_a_block_size_that_does_not_divide_the_sequence_is_refused() -> None:
    with pytest.raises(ValueError, match=r"block_size=48 does not divide seq_len=128: .* \(e\.g\. 16\)"):
        sparse_attention_gpt_config(seq_len=128, block_size=48)
    config = GPTConfig(seq_len=12, blocks=SparseAttentionOptions(block_size=8))
    with pytest.raises(ValueError, match=r"block_size=8 does not divide GPTConfig.seq_len=12"):
        GPT(config)
    block = _block(block_size=4)
    with pytest.raises(ValueError, match=r"block_size=4 does not divide the input's sequence length=6"):
        block(torch.zeros(1, 6, CONFIG.d_model, dtype=torch.float64))
