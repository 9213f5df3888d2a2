#!/bin/bash
# The next device call (about 5 min, at most 8 files under $OUT), most important first:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# 1. GPU tests of mkrt.attention and the ring: the consumers' tiles are now broadcast from
#    lane 0 (warp_uniform), so ptxas knows them uniform (the dealt-out build's code shrank
#    from 48000 to 43520 bytes, the claimed one's from 50304 to 44800);
# 2. experiments/attention_claim_probe.py: does that close the claimed build's 4-5% gap to
#    the dealt-out one (at 0cce2ed: claimed 0.92-0.95x, handed_dc 1.00x)? and the suite:
#    does the dealt-out build gain?
# 3. the ring on 1x2, 1x4 and 2x2 at 4096 rows per rank (the ring always claims), each
#    call's warm-up synchronized before the next (at 6fcc451 and 0cce2ed the 2x2 ring
#    timed out in a warm-up that queued every call back to back), then 8192 rows per rank
#    on 1x2.
source experiments/device_prelude.sh log.txt
timeout ${TEST_S:-110} python3 -m pytest -q -m gpu tests/test_attention.py tests/test_ring_attention_gpu.py \
    -p no:cacheprovider 2>&1 | grep -v Warning | tail -4 | tee -a $LOG
echo "tests done at $SECONDS s" | tee -a $LOG
timeout 90 python3 experiments/attention_claim_probe.py --turns 3 --out $OUT/attention_claim_probe.jsonl 2>&1 | \
    grep -v Warning | grep -v WARNING | tee -a $LOG
echo "claim probe done at $SECONDS s" | tee -a $LOG
timeout ${SUITE_S:-100} python3 experiments/attention.py --shapes suite --out $OUT/attention.jsonl 2>&1 | \
    grep -v Warning | grep -v "return torch" | tee -a $LOG
echo "suite done at $SECONDS s" | tee -a $LOG
ring() {   # layouts, shapes
    timeout ${RING_S:-100} python3 experiments/ring_attention.py --layouts $1 --shapes $2 \
        --out $OUT/ring_attention.jsonl 2>&1 | \
        grep -v Warning | grep -v "return torch" | grep -v "F.scaled_dot" | tee -a $LOG
}
ring "1x2 1x4 2x2" 4:4096:16:16:128:0,4:4096:16:16:128:1
echo "ring done at $SECONDS s" | tee -a $LOG
RING_S=60 ring 1x2 4:8192:16:16:128:0,4:8192:16:16:128:1
echo "ring 8192 done at $SECONDS s" | tee -a $LOG
