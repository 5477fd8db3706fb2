#!/usr/bin/env bash
# The checks that need a GPU, as one short script (a few minutes on one recent GPU):
#   bash bench/gpu_checks.sh OUT_DIR
# 1. the performance ratios on CUDA (batched conditions are a GPU property: on a CPU the forward is
#    compute-bound and five stacked conditions cost five times one);
# 2. MUDDPythia at the 1.4B shapes in bfloat16 with random weights: exact Correct replay, capture vs
#    live, and a streamed cache build (pinned buffers, writer thread) of 64 windows of 1,024 tokens.
set -euo pipefail
out="${1:-gpu-checks}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
python -m fca bench --device cuda --json "$out/bench_cuda.json"
python -m bench.muddpythia_scale --device cuda --dtype bfloat16 --batch 8 --seq-len 1024 --rounds 3 --stream-seqs 64 \
    --json "$out/muddpythia_cuda.json"
