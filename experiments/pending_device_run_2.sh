#!/bin/bash
# The second device call of the next session (about 9.5 min), after pending_device_run.sh:
#   MKRT_BENCH_COMMIT=<commit> [START_1X4=<n>] [END=<s>] bash experiments/pending_device_run_2.sh
# 1. the planner's held-out set on 2x2 (fuse="measure" beside fuse=None, fused, unfused),
#    and the rest of 1x4 if the first call did not finish it (START_1X4: shapes done);
# 2. the three 2x2 sanitizer runs without a verdict (experiments/pending_sanitizers.sh),
#    first as one process per rank under MPS (PROCESSES=1).
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== MoE GPU tests (across nodes: first run)"
timeout 150 python3 -m pytest -q -m gpu tests/test_moe.py -p no:cacheprovider -p timeout --timeout=60 \
    > $OUT/pytest_moe.log 2>&1
echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest_moe.log | tail -12
if [ -n "$START_1X4" ]; then
  echo "== planner, held-out, 1x4 from shape $START_1X4"
  timeout 120 python3 experiments/planner.py --layouts 1x4 --sets held_out --rounds 3 \
      --start $START_1X4 --out $OUT/planner.jsonl 2>&1 | tee -a $OUT/planner.log | grep -cE "best/auto"
fi
echo "== planner, held-out, 2x2"
END=${END:-570}
timeout $(( END * 300 / 570 - SECONDS )) python3 experiments/planner.py --layouts 2x2 --sets held_out --rounds 3 \
    --out $OUT/planner.jsonl 2>&1 | tee -a $OUT/planner.log | grep -cE "best/auto"
# one process per rank under MPS (new), then in one process as before if time is left
PROCESSES=1 DEADLINE=$(( END * 440 / 570 - SECONDS )) bash experiments/pending_sanitizers.sh
DEADLINE=$(( END - SECONDS )) bash experiments/pending_sanitizers.sh
echo "done at $SECONDS s"
