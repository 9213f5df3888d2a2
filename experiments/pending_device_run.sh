#!/bin/bash
# The next device call (about 7 min with the start, at most 8 files under $OUT), most
# important first:   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# Nothing here has run on a GPU yet: no machine could be had in the twentieth session.
# 1. where the ring's time goes (experiments/ring_trace.py) at 4096 rows per rank, causal or
#    not, with each rank's own K/V read from its inputs (new) and from its gathered copy
#    (as until c526389), in the same rounds. At b7b6849 the ring lost a nearly fixed time to
#    the floor: ~0.55 ms on 1x2, ~1-1.4 ms on 1x4, ~4.7 ms on 2x2 (causal and not alike);
#    on 2x2 likely the proxy's inter-node copies (copy kernels on the 4 SMs the ranks leave
#    free), so 2x2 also with 28 CTAs per rank (20 SMs for the copies). The per-source stamps
#    say when each source was first asked for and first seen whole;
# 2. GPU tests of the ring (own K/V in place, direct_own=True, and from the gathered copy,
#    the default; the trace build); if they and the traces bear it out, make direct_own the
#    default;
# 3. fewer copying CTAs now that a rank on one node copies half what it did, and the L2 band
#    as if the rank had the whole L2 (1x2 at 4096);
# 4. the attention engine's GPU tests (its loads take their map from the work list).
source experiments/device_prelude.sh log.txt
trace() {   # layouts, shapes, CTAs per rank
    timeout ${TRACE_S:-100} python3 experiments/ring_trace.py --layouts $1 --shapes $2 --calls 3 --repeats 4 \
        --own direct gathered --ctas $3 --out $OUT/ring_trace.jsonl --raw $OUT/ring_trace_raw.jsonl 2>&1 | \
        grep -v Warning | tee -a $LOG
}
trace "1x2 1x4" 4:4096:16:16:128:1,4:4096:16:16:128:0 default
echo "trace 1x2 1x4 done at $SECONDS s" | tee -a $LOG
trace 2x2 4:4096:16:16:128:1,4:4096:16:16:128:0 "default 28"
echo "trace 2x2 done at $SECONDS s" | tee -a $LOG
timeout ${TEST_S:-90} python3 -m pytest -q -m gpu tests/test_ring_attention_gpu.py \
    -p no:cacheprovider 2>&1 | grep -v Warning | tail -3 | tee -a $LOG
echo "ring tests done at $SECONDS s" | tee -a $LOG
timeout ${SPLIT_S:-100} python3 experiments/ring_attention.py --layouts 1x2 \
    --shapes 4:4096:16:16:128:1,4:4096:16:16:128:0 --comm-ctas default 8 --bands rule whole \
    --own gathered direct \
    --out $OUT/ring_attention.jsonl 2>&1 | grep -v Warning | grep -v "return torch" | \
    grep -v "F.scaled_dot" | tee -a $LOG
echo "split done at $SECONDS s" | tee -a $LOG
timeout ${ATT_TEST_S:-75} python3 -m pytest -q -m gpu tests/test_attention.py \
    -p no:cacheprovider 2>&1 | grep -v Warning | tail -3 | tee -a $LOG
echo "attention tests done at $SECONDS s" | tee -a $LOG
