#!/bin/bash
# The next device call (at most 5 min, at most 8 files under $OUT), most important first:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# 1. GPU tests of mkrt.attention (causal tiles now follow a deal planned on the host,
#    attention.deal_tiles; the three-consumer producer keeps 32 registers);
# 2. the planned deal against the cyclic one, in turns, on every causal shape of the suite
#    and two held-out ones (B 2 S 8192 H 32 at D 64 and 128; S 1536 and 3000 are short);
# 3. experiments/attention_claim_probe.py: dealt, claimed and "handed" tiles (the claimed
#    build's code with the fixed deal) in turns: is the claimed build's cost its code or
#    its claims?
# 4. the ring on 2x2 at 4096 rows per rank (last measured at 3072);
# 5. the attention suite at this commit against torch's backends, if time is left.
source experiments/device_prelude.sh log.txt
timeout ${TEST_S:-80} python3 -m pytest -q -m gpu tests/test_attention.py -p no:cacheprovider 2>&1 | \
    grep -v Warning | tail -4 | tee -a $LOG
echo "tests done at $SECONDS s" | tee -a $LOG
ATT_S=110 attention 4:4096:16:16:128:1,1:4096:64:8:128:1,4:4096:16:16:64:1,2:8192:32:32:64:1,2:8192:32:32:128:1,4:1536:16:16:128:1 \
    cyclic,default,cyclic,default
echo "deal vs cyclic done at $SECONDS s" | tee -a $LOG
timeout 60 python3 experiments/attention_claim_probe.py --out $OUT/attention_claim_probe.jsonl 2>&1 | \
    grep -v Warning | tee -a $LOG
echo "claim probe done at $SECONDS s" | tee -a $LOG
timeout ${RING_S:-50} python3 experiments/ring_attention.py --layouts 2x2 \
    --shapes 4:4096:16:16:128:0,4:4096:16:16:128:1 --out $OUT/ring_attention.jsonl 2>&1 | \
    grep -v Warning | grep -v "return torch" | grep -v "F.scaled_dot" | tee -a $LOG
echo "ring done at $SECONDS s" | tee -a $LOG
[ $SECONDS -lt 240 ] && timeout ${SUITE_S:-60} python3 experiments/attention.py --shapes suite --out $OUT/attention_suite.jsonl 2>&1 | \
    grep -v Warning | grep -v "return torch" | tee -a $LOG
echo "suite done at $SECONDS s" | tee -a $LOG
