#!/bin/bash
# The second device command of 2026-11-30, on what was left of the session's device time: the kernel
# check's cost curves again (a second sample; the head now also timed alone and with its vocabulary
# padded to a multiple of 128), then `python -m benchmarks.gpu_overhead` at the 135M shape, 2 rounds
# (never run on a GPU before). Writes cost_curves-2.json, gpu_overhead.md, log-2.txt and env-2.txt.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
{
    date -u +%FT%TZ
    nvidia-smi -L || echo "no nvidia-smi"
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} > "$out/env-2.txt" 2>&1
echo "== cost_curves $(date -u +%T)" >> "$out/log-2.txt"
timeout 90 python3 -m lightning_dynmo.gpu_check.kernels --parts cost_curves --budget-s 90 --out "$out/k" \
    >> "$out/log-2.txt" 2>&1
echo "cost_curves rc=$? $(date -u +%T)" >> "$out/env-2.txt"
[ -f "$out/k/kernels.json" ] && mv "$out/k/kernels.json" "$out/cost_curves-2.json"
rmdir "$out/k" 2>/dev/null
echo "== gpu_overhead $(date -u +%T)" >> "$out/log-2.txt"
timeout "${OVERHEAD_S:-480}" python3 -m benchmarks.gpu_overhead --shapes 135M --rounds 2 --job-timeout 150 \
    --out "$out/gpu_overhead.md" --force >> "$out/log-2.txt" 2>&1
echo "gpu_overhead rc=$? $(date -u +%T)" >> "$out/env-2.txt"
