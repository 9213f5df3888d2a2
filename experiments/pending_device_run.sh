#!/bin/bash
# A device call (about 4 min), at most 8 files under $OUT:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# 1. the bf16 [N, K] GEMM kernels compiled in parallel;
# 2. gemm_probe odd_rows: tiles x clusters x epilogues x raster groups on shapes whose rows
#    start off a 32-byte sector, in turns with torch.matmul;
# 3. the grouped GEMM suite and its tile sweep, now timed in turns;
# 4. the GEMM tile sweep again with torch.matmul as gemm.py calls it (no out=), and the
#    committed rule judged on it.
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
for tile in bm128_bn256 bm128_bn192 bm128_bn128 bm64_bn256 bm64_bn128 bm256_bn128; do echo "gemm_bf16_nk_${tile}"; done | \
    xargs -P 6 -I{} sh -c 'python3 -m mkrt compile --filter {} > /dev/null 2>&1 || echo "compile {} failed"'
echo "compiled at $SECONDS s"
echo "== odd rows"
timeout 120 python3 experiments/gemm_probe.py --probes odd_rows --out $OUT/gemm_odd_rows.jsonl 2>&1 | \
    awk '{n[$1]++} n[$1] <= 6' 
echo "== grouped GEMM, in turns"
timeout 180 python3 experiments/grouped_gemm.py --out $OUT/grouped_gemm.jsonl \
    --sweep-tiles $OUT/grouped_gemm_tiles.jsonl 2>&1 | grep -v "^  " 
python3 experiments/grouped_tiles_fit.py --rows $OUT/grouped_gemm_tiles.jsonl 2>&1 | tail -6
echo "== GEMM tile sweep (torch without out=)"
timeout 150 python3 experiments/gemm_tune.py --configs 128x256 128x192 64x128 --cluster \
    --tail-split 2 3 --out $OUT/gemm_tune.jsonl > $OUT/gemm_tune.log 2>&1
echo "sweep rc=$? at $SECONDS s"
python3 experiments/gemm_tune.py --fit --judge-only --out $OUT/gemm_tune.jsonl 2>&1 | tee $OUT/judge.txt | tail -18
echo "done at $SECONDS s"
