#!/bin/bash
# A device call (about 7 min), at most 8 files under $OUT:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# 1. grouped GEMM: GPU tests with the 128-column tiles; every tile shape on the expert-GEMM
#    suite (the fit set of a tile rule) and on held-out shapes (grouped_gemm.py --sweep-tiles);
# 2. initcheck of the unfused GEMM+AllReduce on 2x2 with mkrt's GEMM storing C by plain
#    stores, one rank under the tool: the TMA explanation of initcheck's reports predicts
#    none (ac8a8da: with mkrt's TMA stores, the same reports as with cuBLAS's);
# 3. racecheck of gemm_reducescatter fused 2x2 on rank 2 (ceaa97b: ranks 0 and 3 clean;
#    ac8a8da: rank 1 clean, rank 2's reduce role waited 100 s for flag 11).
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== grouped GEMM tests"
timeout 100 python3 -m pytest -q -m gpu tests/test_grouped_gemm.py -p no:cacheprovider -p timeout \
    --timeout=60 > $OUT/pytest.log 2>&1
echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest.log | tail -6
echo "== grouped_gemm --sweep-tiles"
timeout 170 python3 experiments/grouped_gemm.py --out $OUT/grouped_gemm.jsonl \
    --sweep-tiles $OUT/grouped_gemm_tiles.jsonl 2>&1 | tail -30
export MKRT_SANITIZE_CTAS=8
echo "== initcheck, unfused GEMM+AllReduce 2x2, mkrt's GEMM by plain stores, rank 0"
MKRT_SANITIZE_WAIT_MS=60000 timeout 130 python3 experiments/sanitize.py --tools initcheck \
    --cases gemm_allreduce_unfused_mkrt_direct_2x2 \
    --processes --tool-ranks 0 --timeout 90 --ce-copy-method each --out $OUT/sanitize.jsonl 2>&1 \
    | grep -E "^(initcheck|none) "
left=$(( 480 - SECONDS ))
echo "== racecheck, gemm_reducescatter fused 2x2, rank 2 ($left s)"
MKRT_SANITIZE_WAIT_MS=100000 timeout $left python3 experiments/sanitize.py --tools racecheck \
    --cases gemm_reducescatter_fused_2x2 --processes --tool-ranks 2 --timeout $(( left - 25 )) \
    --ce-copy-method each --out $OUT/sanitize.jsonl 2>&1 | grep -E "^(racecheck|none) |CommTimeout" | cut -c1-600
echo "done at $SECONDS s"
