#!/bin/bash
# The prepared command for the next lent GPU (issue 42; 15 minutes of device time in all, its start
# included): the kernel check's cost curves at the paper's shape, now with early exit's exit heads also
# padded to a multiple of 128 as the last head is (the `early_exit_padded_vocab` curve, which
# `--padded-vocab-head` then takes), then the GPU-marked tests. Each under its own timeout. Writes
# cost_curves.json, log.txt and env.txt into $OUT (or ./gpu-out); commit them under
# benchmarks/results/gpu/<date>/ with a README, as the earlier dates are.
# Run as `bash benchmarks/gpu_session.sh [--dry-run]` from the repository root (about 3 minutes on an
# H200; the dry run, tiny on CPU, under a minute).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
{
    date -u +%FT%TZ
    nvidia-smi -L || echo "no nvidia-smi"
    python3 -c "import torch, lightning; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__)"
} > "$out/env.txt" 2>&1
echo "== cost_curves (timeout 150s) $(date -u +%T)" >> "$out/log.txt"
timeout 150 python3 -m lightning_dynmo.gpu_check.kernels --parts cost_curves --budget-s 150 --out "$out/k" "$@" \
    >> "$out/log.txt" 2>&1
echo "cost_curves rc=$? $(date -u +%T)" >> "$out/env.txt"
[ -f "$out/k/kernels.json" ] && mv "$out/k/kernels.json" "$out/cost_curves.json"
rmdir "$out/k" 2>/dev/null
if [ "${1:-}" != "--dry-run" ]; then
    echo "== pytest -m gpu $(date -u +%T)" >> "$out/log.txt"
    timeout 60 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu \
        tests/unit/pipeline/test_pack.py tests/unit/dynamism/test_pruning_patterns.py \
        tests/unit/dynamism/test_sparse_attention.py tests/unit/dynamism/test_sparse_attention_flex.py \
        >> "$out/log.txt" 2>&1
    echo "pytest rc=$? $(date -u +%T)" >> "$out/env.txt"
fi
