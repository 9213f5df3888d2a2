#!/bin/bash
# The next device call (about 3 min with the start, at most 8 files under $OUT), most important first:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# 1. where the ring's time goes: experiments/ring_trace.py on 1x2 and 2x2 at 4096
#    rows per rank, causal or not (the ring lost about 0.6 ms to the
#    floor at 4096 causal on 1x2 and about 1 ms at 8192: a near-fixed cost somewhere),
#    own K/V read directly and (as until c526389) from the gathered copy, in the same rounds;
# 2. GPU tests of the ring: each rank now reads its own K/V from its inputs (no wait; on
#    one node no copy into its own gathered slot); the trace build's records account for
#    every tile and key block.
source experiments/device_prelude.sh log.txt
trace() {   # layouts, shapes, CTAs per rank
    timeout ${TRACE_S:-60} python3 experiments/ring_trace.py --layouts $1 --shapes $2 --calls 3 --repeats 4 \
        --own direct gathered --ctas $3 --out $OUT/ring_trace.jsonl --raw $OUT/ring_trace_raw.jsonl 2>&1 | \
        grep -v Warning | tee -a $LOG
}
trace 1x2 4:4096:16:16:128:1,4:4096:16:16:128:0 default
echo "trace 1x2 done at $SECONDS s" | tee -a $LOG
# 2x2 lost about 4.7 ms to the floor at 4096 rows per rank, causal or not (b7b6849): a fixed
# cost, likely the proxy's copies between the nodes, GPU copy kernels on the 4 SMs the
# ranks leave free; with 28 CTAs per rank they get 20
trace 2x2 4:4096:16:16:128:1,4:4096:16:16:128:0 "default 28"
echo "trace 2x2 done at $SECONDS s" | tee -a $LOG
timeout ${TEST_S:-60} python3 -m pytest -q -m gpu tests/test_ring_attention_gpu.py \
    -p no:cacheprovider 2>&1 | grep -v Warning | tail -3 | tee -a $LOG
echo "tests done at $SECONDS s" | tee -a $LOG
