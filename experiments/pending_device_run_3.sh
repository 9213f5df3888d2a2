#!/bin/bash
# The third device call of the next session (about 9 min), rows under $OUT:
#   MKRT_BENCH_COMMIT=<commit> [END=<s>] bash experiments/pending_device_run_3.sh
# The tensor-parallel pair (issue 14) with fuse="measure" timed beside fuse=None, fused
# and unfused: AllGather+GEMM has never been benchmarked (its fuse=None is a provisional
# rule), GEMM+ReduceScatter's last run was 6 shapes at d792541. Also the AllGather+GEMM
# GPU tests, which now take fuse="measure".
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout 120 python3 -m pytest -q -m gpu tests/test_allgather_gemm_gpu.py -p no:cacheprovider \
    -p timeout --timeout=100 > $OUT/pytest.log 2>&1
echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest.log | tail -8
for op in allgather_gemm gemm_reducescatter; do
  left=$(( ${END:-560} - SECONDS ))
  [ "$op" = allgather_gemm ] && left=$(( left / 2 ))
  echo "== tp_pair $op ($left s)"
  timeout $left python3 experiments/tp_pair.py --ops $op --layouts 1x2 2x2 \
      --out $OUT/tp_pair.jsonl 2>&1 | tail -30
done
echo "done at $SECONDS s"
