"""Hash-sparse attention on FlexAttention: its CPU forward equals the gather kernel and the dense reference
in float64, the kernel choice and its errors, and why the ``mask_mod`` must be passed."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from lightning_dynmo.dynamism import sparse_attention_flex
from lightning_dynmo.dynamism.sparse_attention import (
    SparseAttentionBlock,
    SparseAttentionOptions,
    block_sparse_attention,
    bucket_masked_attention,
    hash_buckets,
    plan_tiles,
    random_rotations,
)
from lightning_dynmo.dynamism.sparse_attention_flex import (
    flex_bucket_attention,
    plan_block_mask,
    resolve_attention_kernel,
)
from lightning_dynmo.models import GPTConfig

CONFIG = GPTConfig(vocab_size=32, seq_len=16, num_layers=2, d_model=16, num_heads=2, d_ff=24)
TOL = 1e-12
pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")


def _qkv(batch: int = 2, heads: int = 3, seq: int = 32, dim: int = 8, seed: int = 0) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, seq, dim, dtype=torch.float64, generator=generator) for _ in range(3)]


@pytest.mark.parametrize(("num_buckets", "block_size"), [(1, 8), (2, 4), (4, 8), (8, 4), (8, 32)])
def test_flex_forward_equals_the_gather_kernel_and_the_dense_reference(
    num_buckets: int, block_size: int
) -> None:
    q, k, v = _qkv()
    rotations = random_rotations(7, 3, 8, num_buckets)
    q_bucket, k_bucket = hash_buckets(q, rotations), hash_buckets(k, rotations)
    plan = plan_tiles(q_bucket, k_bucket, block_size)
    with torch.no_grad():
        flex = flex_bucket_attention(q, k, v, plan)
    torch.testing.assert_close(flex, block_sparse_attention(q, k, v, plan), rtol=0, atol=TOL)
    torch.testing.assert_close(flex, bucket_masked_attention(q, k, v, q_bucket, k_bucket), rtol=0, atol=TOL)
    # The block lists are the plan's active tiles, in every query tile.
    mask = plan_block_mask(plan)
    assert torch.equal(mask.kv_num_blocks, plan.active.sum(-1).to(torch.int32))
    # Negative control: another bucket assignment gives another attention.
    other = random_rotations(8, 3, 8, num_buckets)
    if num_buckets > 1:
        moved = bucket_masked_attention(q, k, v, hash_buckets(q, other), hash_buckets(k, other))
        assert (moved - flex).abs().max().item() > 1e-3


def test_the_block_lists_alone_do_not_mask_on_a_cpu_so_the_mask_mod_is_passed() -> None:
    q, k, v = _qkv()
    rotations = random_rotations(7, 3, 8, 4)
    q_bucket, k_bucket = hash_buckets(q, rotations), hash_buckets(k, rotations)
    plan = plan_tiles(q_bucket, k_bucket, 8)
    full = plan_block_mask(plan)
    lists_only = BlockMask.from_kv_blocks(
        full.kv_num_blocks, full.kv_indices, BLOCK_SIZE=8, seq_lengths=(32, 32)
    )
    d = q.shape[-1]

    def sort(x: Tensor, order: Tensor) -> Tensor:
        return x.gather(2, order.unsqueeze(-1).expand(-1, -1, -1, d))

    with torch.no_grad():
        unmasked = flex_attention(
            sort(q, plan.q_order), sort(k, plan.k_order), sort(v, plan.k_order), block_mask=lists_only
        )
    reference = sort(bucket_masked_attention(q, k, v, q_bucket, k_bucket), plan.q_order)
    assert (unmasked - reference).abs().max().item() > 1e-3


def _block(**options: Any) -> SparseAttentionBlock:
    torch.manual_seed(0)
    return SparseAttentionBlock(
        CONFIG, SparseAttentionOptions(num_buckets=4, block_size=4, **options), 1
    ).double()


def _hidden(seed: int = 1) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(3, CONFIG.seq_len, CONFIG.d_model, dtype=torch.float64, generator=generator)


def test_a_flex_block_computes_what_a_gather_block_computes_in_evaluation() -> None:
    flex, gather = _block(kernel="flex").eval(), _block(kernel="gather").eval()
    gather.load_state_dict(flex.state_dict())
    x = _hidden()
    with torch.no_grad():
        out = flex(x)
    torch.testing.assert_close(out, gather(x), rtol=0, atol=TOL)
    assert (flex.active_blocks, flex.causal_blocks) == (gather.active_blocks, gather.causal_blocks)
    assert flex.active_blocks < flex.causal_blocks, "the test needs inactive tiles"


def test_auto_trains_on_the_gather_kernel_on_a_cpu_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    sparse_attention_flex._logged.clear()
    auto, gather = _block(), _block(kernel="gather")
    gather.load_state_dict(auto.state_dict())
    x = _hidden().requires_grad_(True)
    with caplog.at_level(logging.INFO, logger=sparse_attention_flex.__name__):
        auto(x).sum().backward()
        auto(x)
    said = [r.getMessage() for r in caplog.records if "kernel='auto'" in r.getMessage()]
    assert said == [
        "sparse attention kernel='auto' on cpu runs 'gather': FlexAttention has no CPU backward; "
        "the gather kernel is exact against it."
    ]
    gather.hash_forwards.zero_()
    auto.hash_forwards.zero_()
    torch.testing.assert_close(auto(x), gather(x), rtol=0, atol=0)


def test_auto_picks_flex_on_cuda_unless_dropout_or_small_tiles_forbid_it() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_attention_kernel("auto", cuda, block_size=128, needs_grad=True, dropout_p=0.0) == "flex"
    assert resolve_attention_kernel("auto", cuda, block_size=128, needs_grad=True, dropout_p=0.1) == "gather"
    assert resolve_attention_kernel("auto", cuda, block_size=8, needs_grad=True, dropout_p=0.0) == "gather"
    assert resolve_attention_kernel("auto", cpu, block_size=128, needs_grad=False, dropout_p=0.0) == "gather"
    assert resolve_attention_kernel("flex", cpu, block_size=4, needs_grad=False, dropout_p=0.0) == "flex"
    assert (
        resolve_attention_kernel("gather", cuda, block_size=128, needs_grad=True, dropout_p=0.0) == "gather"
    )


def test_flex_refuses_what_it_cannot_run() -> None:
    block = _block(kernel="flex").train()
    with pytest.raises(
        RuntimeError, match=r"kernel='flex' cannot train on cpu: torch's FlexAttention has no backward"
    ):
        block(_hidden())
    with pytest.raises(
        RuntimeError, match=r"kernel='flex' with attention dropout 0.1: FlexAttention has no dropout"
    ):
        resolve_attention_kernel("flex", torch.device("cuda"), block_size=64, needs_grad=True, dropout_p=0.1)
    with pytest.raises(RuntimeError, match=r"kernel='flex' with block_size=8 on CUDA: .* multiple of 16"):
        resolve_attention_kernel("flex", torch.device("cuda"), block_size=8, needs_grad=False, dropout_p=0.0)
    with pytest.raises(
        ValueError, match=r"SparseAttentionOptions.kernel='triton' is not one of \('auto', 'flex', 'gather'\)"
    ):
        SparseAttentionOptions(kernel="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_flex_trains_like_the_gather_kernel_on_cuda() -> None:
    q, k, v = (x.float().cuda().requires_grad_(True) for x in _qkv(seq=64, dim=16))
    rotations = random_rotations(7, 3, 16, 4)
    plan = plan_tiles(hash_buckets(q, rotations), hash_buckets(k, rotations), 16)
    weight = torch.randn(2, 3, 64, 16, device="cuda")
    grads = []
    for attend in (flex_bucket_attention, block_sparse_attention):
        out = attend(q, k, v, plan)
        grads.append((out, *torch.autograd.grad((out * weight).sum(), [q, k, v])))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
