#!/bin/bash
# The device command of 2026-11-30 (one lent GPU, 15 minutes of device time in all): every part of
# `python -m lightning_dynmo.gpu_check.kernels` in its own process under its own timeout, so that one
# part that hangs or fails costs only itself; the cost curves (issue 42's paper-shape costs) first.
# Then the GPU-marked tests. Writes <part>.json, log.txt and env.txt into $OUT (or ./gpu-out).
# Run as `bash benchmarks/results/gpu/2026-11-30/run.sh [--dry-run]` from the repository root.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
{
    date -u +%FT%TZ
    nvidia-smi -L || echo "no nvidia-smi"
    python3 -c "import torch, lightning; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__)"
} > "$out/env.txt" 2>&1
part() {  # part NAME TIMEOUT_S [extra args]
    local name=$1 limit=$2
    shift 2
    echo "== $name (timeout ${limit}s) $(date -u +%T)" >> "$out/log.txt"
    timeout "$limit" python3 -m lightning_dynmo.gpu_check.kernels --parts "$name" --budget-s "$limit" \
        --out "$out/$name" "$@" >> "$out/log.txt" 2>&1
    echo "$name rc=$? $(date -u +%T)" >> "$out/env.txt"
    [ -f "$out/$name/kernels.json" ] && mv "$out/$name/kernels.json" "$out/$name.json"
    rmdir "$out/$name" 2>/dev/null
}
part cost_curves 170 "$@"
part attention 100 "$@"
part pruning 50 "$@"
part moe 40 "$@"
part stalls 80 "$@"
if [ "${1:-}" != "--dry-run" ]; then
    echo "== pytest -m gpu $(date -u +%T)" >> "$out/log.txt"
    timeout 60 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu \
        tests/unit/pipeline/test_pack.py tests/unit/dynamism/test_pruning_patterns.py \
        tests/unit/dynamism/test_sparse_attention.py tests/unit/dynamism/test_sparse_attention_flex.py \
        >> "$out/log.txt" 2>&1
    echo "pytest rc=$? $(date -u +%T)" >> "$out/env.txt"
fi
