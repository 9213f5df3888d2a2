#!/bin/bash
# The next device call (about 3 min, at most 8 files under $OUT), most important first:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# 1. GPU tests of the ring: its producer now remembers the sources it has seen whole
#    (no flag load and no fence per block once a source is in);
# 2. the ring on 1x2, 1x4 and 2x2 at 4096 rows per rank, causal or not, with the default
#    stages and with 3 (causal rings ran 2 stages, as mkrt.attention does; the ring's
#    producer has more to do per block, and causal rings reach 0.60-0.83 of the floor
#    against 0.76-0.94 non-causal at 166fff0); then 8192 rows per rank on 1x2.
source experiments/device_prelude.sh log.txt
timeout ${TEST_S:-60} python3 -m pytest -q -m gpu tests/test_ring_attention_gpu.py \
    -p no:cacheprovider 2>&1 | grep -v Warning | tail -3 | tee -a $LOG
echo "tests done at $SECONDS s" | tee -a $LOG
ring() {   # layouts, shapes, stages
    timeout ${RING_S:-130} python3 experiments/ring_attention.py --layouts $1 --shapes $2 \
        --stages $3 --out $OUT/ring_attention.jsonl 2>&1 | \
        grep -v Warning | grep -v "return torch" | grep -v "F.scaled_dot" | tee -a $LOG
}
ring "1x2 1x4 2x2" 4:4096:16:16:128:1,4:4096:16:16:128:0 "default 3"
echo "ring done at $SECONDS s" | tee -a $LOG
RING_S=60 ring 1x2 4:8192:16:16:128:1,4:8192:16:16:128:0 "default 3"
echo "ring 8192 done at $SECONDS s" | tee -a $LOG
