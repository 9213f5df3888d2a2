#!/bin/bash
# The next device call (at most 4 min, at most 8 files under $OUT), most important first:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# 1. GPU tests of mkrt.attention and the ring: claimed tiles now reach the consumers with
#    Q's barrier (no ring of claims), in both;
# 2. experiments/attention_claim_probe.py: dealt, claimed and handed builds in turns (the
#    claim ring cost handed 15% at ddf93e3, planned_deal_ddf93e3.log);
# 3. the ring on 1x2 and 1x4 at 4096 rows per rank, then the same on an earlier checkout
#    if old_<commit>/ holds one (git archive 6e03df1 mkrt experiments/ring_attention.py
#    experiments/attention.py experiments/device_prelude.sh | tar -x -C old_6e03df1; carry it).
source experiments/device_prelude.sh log.txt
timeout ${TEST_S:-100} python3 -m pytest -q -m gpu tests/test_attention.py tests/test_ring_attention_gpu.py \
    -p no:cacheprovider 2>&1 | grep -v Warning | tail -4 | tee -a $LOG
echo "tests done at $SECONDS s" | tee -a $LOG
timeout 60 python3 experiments/attention_claim_probe.py --out $OUT/attention_claim_probe.jsonl 2>&1 | \
    grep -v Warning | grep -v WARNING | tee -a $LOG
echo "claim probe done at $SECONDS s" | tee -a $LOG
timeout ${RING_S:-60} python3 experiments/ring_attention.py --layouts 1x2 1x4 \
    --shapes 4:4096:16:16:128:0,4:4096:16:16:128:1 --out $OUT/ring_attention.jsonl 2>&1 | \
    grep -v Warning | grep -v "return torch" | grep -v "F.scaled_dot" | tee -a $LOG
echo "ring done at $SECONDS s" | tee -a $LOG
for old in old_*; do
    [ -d "$old/mkrt" ] || continue
    (cd $old && MKRT_BENCH_COMMIT=${old#old_} PYTHONPATH=$PWD timeout ${OLD_S:-50} python3 experiments/ring_attention.py \
        --layouts 1x2 1x4 --shapes 4:4096:16:16:128:0,4:4096:16:16:128:1 2>&1 | \
        grep -v Warning | grep -v "return torch" | grep -v "F.scaled_dot" | tee -a $LOG)
done
echo "old checkout done at $SECONDS s" | tee -a $LOG
