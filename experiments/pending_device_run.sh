#!/bin/bash
# The next device call (about 7 min, at most 8 files under $OUT), most important first:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# 1. GPU tests of mkrt.attention and the ring (last run at 4b4be63: 79 passed);
# 2. experiments/attention.py and experiments/ring_attention.py now time every call in
#    rotating rounds (interleaved_ms; before 6885d2f mkrt was timed first, which this
#    H100's clock drift favours): the attention suite, then the ring on 1x2, 1x4 and 2x2 at
#    4096 rows per rank, so the README's ratios are re-measured without that bias;
# 3. the planned deal against the cyclic one and claimed tiles, as variants in the same
#    rounds, on two causal shapes;
# 4. experiments/attention_claim_probe.py with claimed_pout (the claimed build counting its
#    CTA out from the producer thread, no CTA barrier): if it closes the claimed build's
#    gap and its outputs stay identical, it is the fix for the ring's claims;
# 5. experiments/gemm_claim_probe.py: does the GEMM engine's ClaimedWork (AllGather+GEMM,
#    gemm_allreduce's role queues) cost the same on the dealt-out tiles?
source experiments/device_prelude.sh log.txt
timeout ${TEST_S:-100} python3 -m pytest -q -m gpu tests/test_attention.py tests/test_ring_attention_gpu.py \
    -p no:cacheprovider 2>&1 | grep -v Warning | tail -4 | tee -a $LOG
echo "tests done at $SECONDS s" | tee -a $LOG
timeout ${SUITE_S:-120} python3 experiments/attention.py --shapes suite --out $OUT/attention.jsonl 2>&1 | \
    grep -v Warning | grep -v "return torch" | tee -a $LOG
echo "suite done at $SECONDS s" | tee -a $LOG
ATT_S=60 attention 4:4096:16:16:128:1,4:4096:16:16:64:1 cyclic,bkv128_s2_pp1_c2_q1
echo "variants done at $SECONDS s" | tee -a $LOG
timeout ${RING_S:-120} python3 experiments/ring_attention.py --layouts 1x2 1x4 2x2 \
    --shapes 4:4096:16:16:128:0,4:4096:16:16:128:1 --out $OUT/ring_attention.jsonl 2>&1 | \
    grep -v Warning | grep -v "return torch" | grep -v "F.scaled_dot" | tee -a $LOG
echo "ring done at $SECONDS s" | tee -a $LOG
timeout 90 python3 experiments/attention_claim_probe.py --turns 3 --out $OUT/attention_claim_probe.jsonl 2>&1 | \
    grep -v Warning | grep -v WARNING | tee -a $LOG
echo "claim probe done at $SECONDS s" | tee -a $LOG
timeout 90 python3 experiments/gemm_claim_probe.py --out $OUT/gemm_claim_probe.jsonl 2>&1 | \
    grep -v Warning | grep -v WARNING | tee -a $LOG
echo "gemm claim probe done at $SECONDS s" | tee -a $LOG
