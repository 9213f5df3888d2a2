#!/bin/bash
# One device call for the runtime issue: GPU tests of the changed launch path, host time
# per call before (the checkout in .bench_old, carried) and after, the planner's table.
#   bash experiments/runtime_device_run.sh [planner args...]
export MKRT_JIT_CACHE_DIR=/tmp/mkrt-cache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
git_commit=${MKRT_BENCH_COMMIT:-unknown}
PYTHONPATH=$PWD timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu ${TESTS:-tests} -p no:cacheprovider 2>&1 | tee $OUT/pytest_gpu.log | tail -25
if [ -d .bench_old/mkrt ]; then
  PYTHONPATH=$PWD/.bench_old timeout 200 python3 experiments/runtime.py --label before --profile $OUT/profile_before.txt --out $OUT/runtime.jsonl 2>&1 | tee $OUT/runtime.log
fi
PYTHONPATH=$PWD timeout 200 python3 experiments/runtime.py --label after --profile $OUT/profile_after.txt --out $OUT/runtime.jsonl 2>&1 | tee -a $OUT/runtime.log
if [ "$#" -gt 0 ]; then
  PYTHONPATH=$PWD timeout ${PLANNER_TIMEOUT:-300} python3 experiments/planner.py --out $OUT/planner.jsonl "$@" 2>&1 | tee $OUT/planner.log | tail -5
fi
