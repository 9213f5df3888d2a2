#!/bin/bash
# Planner rows, one process per (world, set) so one failure costs one table.
#   bash experiments/planner_device_run.sh "1x4 2x2" "calibration held_out" [planner args]
export MKRT_JIT_CACHE_DIR=/tmp/mkrt-cache-$$ PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
layouts=$1; sets=$2; shift 2
for set in $sets; do
  for layout in $layouts; do
    timeout ${PLANNER_TIMEOUT:-200} python3 experiments/planner.py --layouts $layout --sets $set --out $OUT/planner.jsonl "$@" 2>&1 | tee -a $OUT/planner.log | grep -E "Error|error" | head -3
  done
done
grep -c . $OUT/planner.jsonl
