#!/bin/bash
# Every example on a GPU machine, then the demo; one log per run, each starting with the
# commit, the command, the GPU and the date (what experiments/results/examples_*.log hold).
#   MKRT_BENCH_COMMIT=<commit> OUT=<folder> bash experiments/examples/run_on_gpu.sh
# The tree may be a copy without .git: MKRT_BENCH_COMMIT names the commit then.
# Files written to $OUT: 4 logs, walkthrough_split.{csv,png}, sweep.{csv,png}.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache}
OUT=${OUT:-/tmp/mkrt-examples}
mkdir -p "$OUT"
commit=${MKRT_BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)
status=0

run() {   # run LOG_NAME COMMAND...
    local name=$1 rc
    shift
    {
        echo "# commit: $commit${TREE_NOTE:+ ($TREE_NOTE)}"
        echo "# command: $*"
        echo "# gpu: ${gpu:-none}; date: $(date -u +%F); run by experiments/examples/run_on_gpu.sh"
    } > "$OUT/$name.log"
    timeout "${EXAMPLE_TIMEOUT:-120}" "$@" >> "$OUT/$name.log" 2>&1
    rc=$?
    echo "# exit status: $rc" >> "$OUT/$name.log"
    echo "== $name (exit $rc)"
    tail -n 30 "$OUT/$name.log"
    [ $rc -eq 0 ] || status=1
}

run examples_walkthrough python3 experiments/examples/walkthrough.py --out "$OUT"
run examples_tp_mlp python3 experiments/examples/tp_mlp.py --launch 2
run examples_sweep python3 experiments/examples/sweep.py --out "$OUT"
run demo_gpu python3 -m mkrt demo
exit $status
