#!/bin/bash
# The GEMM sweep with 128-byte L2 promotion on rows off a sector (6147d83) and the trimmed
# widths, then the GEMM GPU tests; at most 8 files under $OUT:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh    (about 5 min)
# Afterwards, on any machine: gemm_tune.py --fit --commit <commit> refits on this sweep
# alone (the older sweeps ran rows off a sector with 256-byte promotion).
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "
from mkrt.kernels import gemm as G
print('\n'.join(s.uri[:-6] for s in G.default_specs() if s.b_layout == 'nk'))" | \
    xargs -P 14 -I{} sh -c 'python3 -m mkrt compile --filter {} > /dev/null 2>&1 || echo "compile {} failed"'
echo "compiled at $SECONDS s"
timeout 300 python3 experiments/gemm_tune.py --configs 128x256 128x192 64x128 --cluster --trim \
    --tail-split 2 3 --out $OUT/gemm_tune.jsonl > $OUT/gemm_tune.log 2>&1
echo "swept at $SECONDS s"
python3 experiments/gemm_tune.py --fit --judge-only --out $OUT/gemm_tune.jsonl 2>&1 | tee $OUT/judge.txt | grep geomean
timeout 200 python3 -m pytest -q -m gpu tests/test_gemm.py 2>&1 | tail -3 | tee $OUT/pytest_gemm.txt
echo "done at $SECONDS s"
