#!/bin/bash
# One device call for the runtime issue: GPU tests, host time per call (after; before
# too when the older checkout is carried in .bench_old), allgather bandwidth, planner rows.
#   TESTS="tests/..." PLANNER_SETS="calibration" bash experiments/runtime_device_run.sh
export MKRT_JIT_CACHE_DIR=/tmp/mkrt-cache-$$ PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
if [ -n "$TESTS" ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu $TESTS -p no:cacheprovider -p timeout --timeout=90 2>&1 | tee $OUT/pytest_gpu.log | grep -E "passed|failed|FAILED|Error" | head -30
fi
# One process per world: a failure in one leaves the others' rows.
for layout in $RUNTIME_LAYOUTS; do
  if [ -d .bench_old/mkrt ]; then
    MKRT_JIT_CACHE_DIR=/tmp/mkrt-cache-old PYTHONPATH=$PWD/.bench_old timeout 100 python3 experiments/runtime.py --layouts $layout --label before --profile $OUT/profile_before_$layout.txt --out $OUT/runtime.jsonl 2>&1 | tee -a $OUT/runtime.log | grep -v "^ "
  fi
  timeout 100 python3 experiments/runtime.py --layouts $layout ${RUNTIME_OPS:+--ops $RUNTIME_OPS} --label after --profile $OUT/profile_after_$layout.txt --out $OUT/runtime.jsonl 2>&1 | tee -a $OUT/runtime.log | grep -v "^ "
done
cat $OUT/profile_before_*.txt > $OUT/profile_before.txt 2>/dev/null; cat $OUT/profile_after_*.txt > $OUT/profile_after.txt 2>/dev/null; rm -f $OUT/profile_*_1x*.txt
if [ -n "$ALLGATHER_BW" ]; then
  timeout 120 python3 experiments/allgather.py --layouts 2x2 2x4 --mib 16 64 256 --iters 10 --out $OUT/allgather.jsonl 2>&1 | tail -8
fi
for set in $PLANNER_SETS; do
  [ "$set" = calibration ] && PLANNER_ARGS="$CALIBRATION_ARGS" || PLANNER_ARGS=""
  for layout in ${PLANNER_LAYOUTS:-1x2 1x4 2x2}; do
    timeout ${PLANNER_TIMEOUT:-150} python3 experiments/planner.py --layouts $layout --sets $set --out $OUT/planner.jsonl $PLANNER_ARGS 2>&1 | tee -a $OUT/planner.log | grep -E "Error|error" | head -3
  done
done
[ -f $OUT/planner.jsonl ] && echo "planner rows: $(grep -c . $OUT/planner.jsonl)"
