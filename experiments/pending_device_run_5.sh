#!/bin/bash
# One device call (about 8 min), rows and logs under $OUT:
#   MKRT_BENCH_COMMIT=<commit> [DEADLINE=<s>] bash experiments/pending_device_run_5.sh
# 1. AllGather+GEMM and grouped GEMM GPU tests: own tile rows now read the rank's input
#    (the engine's second A map);
# 2. experiments/agg_split.py: the gathering role's split by shape on 1x2;
# 3. experiments/moe.py on 2x2 (MoE across nodes), two models at 1024 tokens per rank;
# 4. agg_split on 2x2 with the time left.
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
DEADLINE=${DEADLINE:-500}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== AllGather+GEMM and grouped GEMM GPU tests"
timeout 110 python3 -m pytest -q -m gpu tests/test_allgather_gemm_gpu.py tests/test_grouped_gemm.py \
    -p no:cacheprovider -p timeout --timeout=60 > $OUT/pytest_agg.log 2>&1
echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest_agg.log | tail -6
echo "== agg_split 1x2"
timeout 150 python3 experiments/agg_split.py --layouts 1x2 --out $OUT/agg_split.jsonl 2>&1 | tail -8
echo "== MoE benchmark, 2x2 (multi-node: first run)"
timeout 100 python3 experiments/moe.py --layouts 2x2 --models qwen3_30b_a3b mixtral_8x7b \
    --tokens 1024 --out $OUT/moe.jsonl 2>&1 | tail -4
left=$(( DEADLINE - SECONDS ))
if [ $left -ge 40 ]; then
  echo "== agg_split 2x2 ($left s)"
  timeout $left python3 experiments/agg_split.py --layouts 2x2 --out $OUT/agg_split.jsonl 2>&1 | tail -8
fi
echo "done at $SECONDS s"
