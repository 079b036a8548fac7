#!/usr/bin/env bash
# Issue 15's GPU checks as one prepared run, for the `device` tool's GPU machine (whose image has jax with
# CUDA, flax and optax; nothing is installed here). From the repository root:
#     bash benchmarks/gpu.sh          (device tool: run with timeout_s=480; results also land in $OUT)
# 1. fused Adam on 1,000 x 16x4 against optax.adam (target: at least 3x faster), and on 200 x 256x64 (no slower);
# 2. 8 learning rates as one vmapped step (traced) against a loop of 8 optimizers (issue 25);
# 3. a mixed_bfloat16 training step against float32 on a matmul-heavy MLP (target: at most 0.6x the time).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-$PWD}"
python3 -c "import jax; d = jax.devices(); print(jax.__version__, d); assert d[0].platform == 'gpu', 'no GPU'"
timeout 300 python3 -m benchmarks.optimizers --accelerator-rows 2>&1 | tee "$out/optimizers_gpu.txt"
timeout 120 python3 -m benchmarks.optimizers --sweep 2>&1 | tee "$out/sweep_gpu.txt"
timeout 120 python3 -m benchmarks.mixed_precision 4096 8 4096 2>&1 | tee "$out/mixed_precision_gpu.txt"
