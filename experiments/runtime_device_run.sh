#!/bin/bash
# One device call for the runtime issue: GPU tests of the changed launch path, host time
# per call before (the checkout in .bench_old, carried) and after, the planner's table.
#   bash experiments/runtime_device_run.sh [planner args...]
export MKRT_JIT_CACHE_DIR=/tmp/mkrt-cache-$$ PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
git_commit=${MKRT_BENCH_COMMIT:-unknown}
PYTHONPATH=$PWD timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu ${TESTS:-tests} -p no:cacheprovider 2>&1 | tee $OUT/pytest_gpu.log | grep -E "passed|failed|FAILED|Error" | head -40
# One process per world: a failure in one leaves the others' rows.
for layout in ${RUNTIME_LAYOUTS:-1x1 1x2 1x4}; do
  if [ -d .bench_old/mkrt ]; then
    MKRT_JIT_CACHE_DIR=/tmp/mkrt-cache-old PYTHONPATH=$PWD/.bench_old timeout 100 python3 experiments/runtime.py --layouts $layout --label before --profile $OUT/profile_before_$layout.txt --out $OUT/runtime.jsonl 2>&1 | tee -a $OUT/runtime.log | grep -v "^ "
  fi
  PYTHONPATH=$PWD timeout 100 python3 experiments/runtime.py --layouts $layout --label after --profile $OUT/profile_after_$layout.txt --out $OUT/runtime.jsonl 2>&1 | tee -a $OUT/runtime.log | grep -v "^ "
done
cat $OUT/profile_before_*.txt > $OUT/profile_before.txt 2>/dev/null; cat $OUT/profile_after_*.txt > $OUT/profile_after.txt; rm -f $OUT/profile_*_1x*.txt
if [ "$#" -gt 0 ]; then
  PYTHONPATH=$PWD timeout ${PLANNER_TIMEOUT:-300} python3 experiments/planner.py --out $OUT/planner.jsonl "$@" 2>&1 | tee $OUT/planner.log | tail -5
fi
