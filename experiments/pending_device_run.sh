#!/bin/bash
# Prepared for the next session (not run yet), at most 8 files under $OUT:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh    (about 4 min)
# 1. the 30-shape GEMM suite with the pooled refit on 132, 116 and 100 SMs, in turns (the
#    refit has run on the full chip only, ec3ed95; scaling pairs not yet measured with it);
# 2. a fourth tile sweep to pool with 89b664c, a45be3f and a32711b (gemm_tune --fit
#    --commit ... judges a refit on the pooled held-out rows);
# 3. the grouped GEMM suite and held-out set with choose_epilogue, 12 rounds of 20 calls.
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
for tile in bm128_bn256 bm128_bn192 bm64_bn128 bm128_bn128 bm64_bn256 bm256_bn128; do echo "gemm_bf16_nk_${tile}"; done | \
    xargs -P 6 -I{} sh -c 'python3 -m mkrt compile --filter {} > /dev/null 2>&1 || echo "compile {} failed"'
timeout 200 python3 experiments/gemm.py --sms full,116,100 --out $OUT/gemm.jsonl 2>&1 | grep -E "geomean|scaling|FAILED"
timeout 150 python3 experiments/gemm_tune.py --configs 128x256 128x192 64x128 --cluster \
    --tail-split 2 3 --out $OUT/gemm_tune.jsonl > $OUT/gemm_tune.log 2>&1
python3 experiments/gemm_tune.py --fit --judge-only --out $OUT/gemm_tune.jsonl 2>&1 | tee $OUT/judge.txt | grep geomean
timeout 120 python3 experiments/grouped_gemm.py --iterations 20 --rounds 12 --out $OUT/grouped_gemm.jsonl \
    --sweep-tiles $OUT/grouped_gemm_tiles.jsonl 2>&1 | grep -v "^  "
echo "done at $SECONDS s"
