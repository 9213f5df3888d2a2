#!/bin/bash
# A device call (about 3 min; ran at 5fc7f29, rows committed), at most 8 files under $OUT:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# 1. grouped GEMM and MoE GPU tests with the tile rule (choose_tile, fitted at 51fa866);
# 2. the expert-GEMM suite and the held-out set again: the rule's default path beside every
#    tile shape, same run;
# 3. initcheck of the unfused GEMM+AllReduce on 1x2 with mkrt's plain-store GEMM, in one
#    process (every writer under the tool: 0 reports expected) and as one process per rank
#    with rank 0 under the tool (reports in the reduce's reads of what rank 1 wrote expected).
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== grouped GEMM and MoE tests"
timeout 200 python3 -m pytest -q -m gpu tests/test_grouped_gemm.py tests/test_moe.py -p no:cacheprovider \
    -p timeout --timeout=90 > $OUT/pytest.log 2>&1
echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest.log | tail -6
echo "== grouped_gemm --sweep-tiles"
timeout 150 python3 experiments/grouped_gemm.py --out $OUT/grouped_gemm.jsonl \
    --sweep-tiles $OUT/grouped_gemm_tiles.jsonl 2>&1 | tail -30
export MKRT_SANITIZE_CTAS=8 MKRT_SANITIZE_WAIT_MS=60000
echo "== initcheck, unfused GEMM+AllReduce 1x2, mkrt's plain-store GEMM: one process"
timeout 100 python3 experiments/sanitize.py --tools initcheck --cases gemm_allreduce_unfused_mkrt_direct_1x2 \
    --parallel 1 --timeout 80 --out $OUT/sanitize.jsonl 2>&1 | grep -E "^(initcheck|none) "
echo "== the same, one process per rank, rank 0 under the tool"
timeout 100 python3 experiments/sanitize.py --tools initcheck --cases gemm_allreduce_unfused_mkrt_direct_1x2 \
    --processes --tool-ranks 0 --timeout 70 --out $OUT/sanitize.jsonl 2>&1 | grep -E "^(initcheck|none) "
echo "done at $SECONDS s"
