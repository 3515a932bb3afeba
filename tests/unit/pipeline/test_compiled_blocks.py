"""Blocks compiled by DynMo (``compile_blocks``): the forward only, hooks outside, plain names, migration.

The compiler backend is ``"eager"`` (torch's own: Dynamo captures the block's forward as a graph and runs
it without code generation), so these tests check what DynMo does around the compiled region (which
forward runs, where hooks fire, what travels) in seconds on 2 cores; inductor's code generation is
exercised by ``benchmarks/action_cost.py --compile``. A backend that changes the graph's output is the
negative control: it proves the compiled forward is the one that runs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_dynmo.models import GPT, GPTConfig
from lightning_dynmo.pipeline.migration.pack import pack_unit, unpack_unit
from lightning_dynmo.pipeline.model.compiled import check_compile_option, compile_blocks, is_compiled_block
from lightning_dynmo.profiling.clock import StepClock
from lightning_dynmo.profiling.layer_timer import LayerTimer, module_has_hooks


def _blocks() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=32, num_layers=2, d_model=16, num_heads=2, seq_len=8)
    model = GPT(config).double()
    return dict(model.layers.items())


def _fwd_bwd(block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.clone().requires_grad_(True)
    out = block(x)
    out.square().sum().backward()
    grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    return out.detach(), grads


def _perturbing(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    def run(*args: Any) -> Any:
        out = gm(*args)
        return [o * (1 + 1e-6) if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in out]

    return run


def test_a_compiled_block_computes_what_the_eager_one_does_and_keeps_its_names() -> None:
    torch._dynamo.reset()
    eager, compiled = _blocks(), _blocks()
    names = {k: [n for n, _ in b.state_dict().items()] for k, b in compiled.items()}
    assert compile_blocks(compiled, {"backend": "eager"}) == ["0", "1"]
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    for key in eager:
        out_e, grads_e = _fwd_bwd(eager[key], x)
        out_c, grads_c = _fwd_bwd(compiled[key], x)
        torch.testing.assert_close(out_c, out_e, rtol=0, atol=1e-12)
        for a, b in zip(grads_c, grads_e, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        assert list(compiled[key].state_dict()) == names[key]  # no "_orig_mod."
        assert is_compiled_block(compiled[key])
    # Negative control: a backend that changes the graph's output shows the compiled forward runs.
    torch._dynamo.reset()
    perturbed = _blocks()
    compile_blocks(perturbed, {"backend": _perturbing})
    out_p, _ = _fwd_bwd(perturbed["0"], x)
    out_e, _ = _fwd_bwd(eager["0"], x)
    assert (out_p - out_e).abs().max() > 1e-9


def test_compiling_again_leaves_compiled_blocks_alone() -> None:
    blocks = _blocks()
    compile_blocks(blocks, {"backend": "eager"})
    forwards = {k: b.forward for k, b in blocks.items()}
    assert compile_blocks(blocks, {"backend": "eager"}) == []
    assert all(blocks[k].forward is forwards[k] for k in blocks)


def test_the_profiler_times_a_compiled_block_from_outside() -> None:
    torch._dynamo.reset()
    blocks = _blocks()
    compile_blocks(blocks, {"backend": "eager"})
    timer = LayerTimer({0: blocks["0"], 1: blocks["1"]}, StepClock("cpu"))
    timer.attach()
    timer.begin_step()
    x = torch.randn(2, 8, 16, dtype=torch.float64, requires_grad=True)
    for _ in range(3):
        blocks["1"](blocks["0"](x)).sum().backward()
    times = timer.end_step()
    timer.detach()
    for t in times.values():
        assert t.num_calls == 3 and t.fwd_time_s > 0 and t.bwd_time_s > 0
    assert not any(module_has_hooks(b) for b in blocks.values())


def test_a_compiled_block_travels_without_its_compiled_code_and_compiles_on_arrival() -> None:
    torch._dynamo.reset()
    blocks = _blocks()
    compile_blocks(blocks, {"backend": "eager"})
    packed = pack_unit("layers.0", blocks["0"])
    arrived, _ = unpack_unit(packed.structure, packed.payloads)
    assert not is_compiled_block(arrived) and "forward" not in vars(arrived)
    assert is_compiled_block(blocks["0"])  # the sender's block is left as it was
    for (n, a), (m, b) in zip(arrived.state_dict().items(), blocks["0"].state_dict().items(), strict=True):
        assert n == m and torch.equal(a, b)
    assert compile_blocks({"0": arrived}, {"backend": "eager"}) == ["0"]
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    torch.testing.assert_close(_fwd_bwd(arrived, x)[0], _fwd_bwd(blocks["0"], x)[0], rtol=0, atol=0)


def test_compile_option_values() -> None:
    assert check_compile_option(False) is None and check_compile_option(None) is None
    assert check_compile_option(True) == {}
    assert check_compile_option({"mode": "max-autotune-no-cudagraphs"}) == {
        "mode": "max-autotune-no-cudagraphs"
    }
    with pytest.raises(TypeError, match=r"compile_blocks='yes' must be a bool or a dict of torch.compile"):
        check_compile_option("yes")
    with pytest.raises(TypeError, match=r"compile_blocks\['fullgraph'\]=1 must be a bool"):
        check_compile_option({"fullgraph": 1})


def test_what_compiles_again_another_block_of_the_class_and_an_arrival_reuse_the_code() -> None:
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()  # counts the graphs torch's compiler builds
    blocks = _blocks()
    compile_blocks(blocks, {"backend": counter})
    x = torch.randn(2, 8, 16, dtype=torch.float64, requires_grad=True)
    blocks["0"](x).sum().backward()
    assert counter.frame_count == 1
    blocks["1"](x).sum().backward()  # another block of the same class, the same shapes: no new graph
    packed = pack_unit("layers.1", blocks["1"])
    arrived, _ = unpack_unit(packed.structure, packed.payloads)
    compile_blocks({"1": arrived}, {"backend": counter})
    arrived(x).sum().backward()  # compiled on arrival: torch's cache serves it, no new graph
    assert counter.frame_count == 1
    with torch.no_grad():
        blocks["0"](x)  # without gradients (evaluation): one more graph
    blocks["0"](torch.randn(4, 8, 16, dtype=torch.float64))  # a new input shape: one more
    assert counter.frame_count == 3
