#!/bin/bash
# A device call (about 8 min), at most 8 files under $OUT:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# 1. every GEMM kernel the tests and the sweep use, compiled in parallel (16 cores);
# 2. the GEMM GPU tests (split-K of every tile and of the last wave's tiles, with and
#    without clusters: against float32, bit-identical over 20 calls) and the rule's tests;
# 3. the tile sweep on the 30 shapes (FIT and HELD_OUT), the three tiles of the fit with
#    and without clusters, each also with the last wave's tiles split in 2, 3 and 4 parts;
# 4. the rule refitted on the FIT rows and judged on HELD_OUT (printed; the fit file back).
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== compile"
for dtype in bf16 f16; do for layout in nk kn; do for tile in bm128_bn256 bm128_bn192 bm128_bn128 bm64_bn256 bm64_bn128 bm256_bn128; do
    echo "gemm_${dtype}_${layout}_${tile}"; done; done; done | \
    xargs -P 16 -I{} sh -c 'python3 -m mkrt compile --filter {} > /dev/null 2>&1 || echo "compile {} failed"'
echo "compiled at $SECONDS s"
echo "== GEMM GPU tests"
timeout 240 python3 -m pytest -q -m gpu tests/test_gemm.py tests/test_gemm_rule.py -p no:cacheprovider \
    -p timeout --timeout=120 > $OUT/pytest.log 2>&1
echo "pytest rc=$? at $SECONDS s"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest.log | tail -8
echo "== tile sweep with the tail split"
timeout 330 python3 experiments/gemm_tune.py --configs 128x256 128x192 64x128 --cluster \
    --tail-split 2 3 4 --out $OUT/gemm_tune.jsonl > $OUT/gemm_tune.log 2>&1
echo "sweep rc=$? at $SECONDS s"; grep -c '"us"' $OUT/gemm_tune.jsonl; grep " best " $OUT/gemm_tune.log
echo "== fit and judge"
python3 experiments/gemm_tune.py --fit --out $OUT/gemm_tune.jsonl 2>&1 | tee $OUT/fit.txt | tail -45
cp mkrt/kernels/gemm_rule_fit.json $OUT/gemm_rule_fit.json
echo "done at $SECONDS s"
