#!/bin/bash
# A device call (about 5 min), at most 8 files under $OUT:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# 1. the bf16 [N, K] GEMM kernels compiled in parallel (16 cores);
# 2. the tile sweep on the 30 shapes (FIT and HELD_OUT), every configuration of a shape and
#    torch.matmul timed in turns (interleaved rounds): the fit's three tiles with and
#    without clusters, each also with the last wave's tiles split in 2 and 3 parts;
# 3. the committed rule judged on those rows, then a refit on their FIT rows judged on
#    their HELD_OUT rows (the refit's file comes back; the suite below uses the committed);
# 4. the 30-shape suite with the committed rule on 132, 116 and 100 SMs, timed in turns.
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== compile"
for tile in bm128_bn256 bm128_bn192 bm128_bn128 bm64_bn256 bm64_bn128 bm256_bn128; do echo "gemm_bf16_nk_${tile}"; done | \
    xargs -P 6 -I{} sh -c 'python3 -m mkrt compile --filter {} > /dev/null 2>&1 || echo "compile {} failed"'
echo "compiled at $SECONDS s"
echo "== tile sweep, interleaved"
timeout 240 python3 experiments/gemm_tune.py --configs 128x256 128x192 64x128 --cluster \
    --tail-split 2 3 --out $OUT/gemm_tune.jsonl > $OUT/gemm_tune.log 2>&1
echo "sweep rc=$? at $SECONDS s"; grep " best " $OUT/gemm_tune.log
echo "== the committed rule judged on these rows"
python3 experiments/gemm_tune.py --fit --judge-only --out $OUT/gemm_tune.jsonl 2>&1 | tee $OUT/judge.txt | grep -E "geomean|committed"
echo "== refit"
python3 experiments/gemm_tune.py --fit --out $OUT/gemm_tune.jsonl 2>&1 | tee $OUT/fit.txt | tail -36
cp mkrt/kernels/gemm_rule_fit.json $OUT/gemm_rule_fit.json && git checkout mkrt/kernels/gemm_rule_fit.json
echo "== suite, committed rule"
timeout 200 python3 experiments/gemm.py --sms full,116,100 --out $OUT/gemm.jsonl 2>&1 | grep -E "geomean|scaling|FAILED|3000x5000|5000x3000" 
echo "done at $SECONDS s"
