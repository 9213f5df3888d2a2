#!/bin/bash
# The first device call of the next session (about 9.5 min), rows and logs under $OUT:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# 1. fuse="measure" on the GPU (written 03788a0, never run): its GPU test, with the
#    gemm_allreduce and controller tests it shares helpers with;
# 2. the planner's held-out set with fuse="measure" timed beside fuse=None, fused and
#    unfused (experiments/planner.py; rows per shape, so a cut run keeps what it did):
#    1x2, then 1x4. The target: the pick never more than 3% slower than the
#    faster path, on every held-out shape of 1x2, 1x4 and 2x2.
# Then experiments/pending_device_run_2.sh: 2x2 and the sanitizer runs.
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
DEADLINE=${DEADLINE:-570}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== GPU tests"
timeout 150 python3 -m pytest -q -m gpu tests/test_gemm_allreduce_gpu.py tests/test_controller_gpu.py \
    -p no:cacheprovider -p timeout --timeout=100 > $OUT/pytest.log 2>&1
echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest.log | tail -10
for layout in 1x2 1x4; do
  left=$(( DEADLINE - SECONDS ))
  [ $left -lt 60 ] && { echo "left for the next call: $layout"; continue; }
  [ "$layout" = "1x2" ] && budget=$(( left / 2 )) || budget=$left
  echo "== planner, held-out, $layout ($budget s)"
  timeout $budget python3 experiments/planner.py --layouts $layout --sets held_out --rounds 3 \
      --out $OUT/planner.jsonl 2>&1 | tee -a $OUT/planner.log | grep -cE "best/auto"
done
echo "done at $SECONDS s"
