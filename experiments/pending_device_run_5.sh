#!/bin/bash
# One device call (about 8 min), rows and logs under $OUT:
#   MKRT_BENCH_COMMIT=<commit> [DEADLINE=<s>] bash experiments/pending_device_run_5.sh
# 1. AllGather+GEMM GPU tests: own tile rows now read the rank's input (second tensor map);
# 2. MoE GPU tests, one node and several (multi-node MoE);
# 3. experiments/agg_split.py: the gathering role's split by shape on 1x2, then 2x2.
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
DEADLINE=${DEADLINE:-500}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== AllGather+GEMM GPU tests"
timeout 100 python3 -m pytest -q -m gpu tests/test_allgather_gemm_gpu.py -x -p no:cacheprovider \
    -p timeout --timeout=60 > $OUT/pytest_agg.log 2>&1
echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest_agg.log | tail -6
echo "== MoE GPU tests"
timeout 120 python3 -m pytest -q -m gpu tests/test_moe.py -p no:cacheprovider -p timeout \
    --timeout=40 > $OUT/pytest_moe.log 2>&1
echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest_moe.log | tail -12
for layout in 1x2 2x2; do
  left=$(( DEADLINE - SECONDS ))
  [ $left -lt 40 ] && { echo "no time for agg_split $layout"; continue; }
  echo "== agg_split $layout ($left s)"
  timeout $left python3 experiments/agg_split.py --layouts $layout --out $OUT/agg_split.jsonl 2>&1 | tail -8
done
echo "done at $SECONDS s"
