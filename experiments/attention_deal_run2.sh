#!/bin/bash
# Second device call on the claimed-tiles question (files under $OUT, at most 8): attention_deal_run.sh
# found the claimed build 4-9% slower than the dealt-out one on even tiles. Here the claimed
# build keeps its work list in registers (in shared memory before, reloaded after each asm
# memory clobber of the consumers' loop); both builds alternately on each shape:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/attention_deal_run2.sh
# then the ring's band in the rank's share of the L2 against the whole L2, the 2x2
# measured-fusion test (now ordered before its capture) six times, and the
# unordered eager-then-replay loop that it used to run into (experiments/unordered_replay.py).
source experiments/device_prelude.sh attention.txt
D128_S3=bkv128_s3_pp1_c2_q0,bkv128_s3_pp1_c2_q1,bkv128_s3_pp1_c2_q0,bkv128_s3_pp1_c2_q1
D128_S2=bkv128_s2_pp1_c2_q0,bkv128_s2_pp1_c2_q1,bkv128_s2_pp1_c2_q0,bkv128_s2_pp1_c2_q1
D64=bkv128_s3_pp1_c2_q0,bkv128_s3_pp1_c2_q1,bkv128_s3_pp1_c3,bkv128_s3_pp1_c2_q0,bkv128_s3_pp1_c2_q1,bkv128_s3_pp1_c3
attention 4:4096:16:16:128:0,4:12288:16:16:128:0,2:1000:16:4:128:0 $D128_S3
attention 4:4096:16:16:128:1,1:8192:64:8:128:1 $D128_S2
attention 4:4096:16:16:64:0,4:4096:16:16:64:1,2:8192:32:32:64:1,1:3000:8:1:64:1 $D64
echo "attention done at $SECONDS s"
# the ring's band: K/V of the tiles running at once in the rank's share of the L2 (the rule
# since this commit) against each rank budgeting the whole L2 (before), same run
timeout ${RING_S:-110} python3 experiments/ring_attention.py --layouts ${RLAYOUTS:-1x2 1x4} --bands rule whole \
    --shapes 4:4096:16:16:128:0,4:4096:16:16:128:1 --out $OUT/ring_attention.jsonl 2>&1 | \
    grep -v Warning | grep -v "return torch" | grep -v "F.scaled_dot" | tee -a $OUT/attention.txt
echo "ring done at $SECONDS s"
for i in $(seq ${FLAKY:-6}); do
    timeout 60 python3 -m pytest -q -m gpu tests/test_gemm_allreduce_gpu.py -k "measured_fusion_settles and 2x2" \
        -p no:cacheprovider --tb=long 2>&1 | grep -v Warning > /tmp/flaky_$i.txt
    tail -1 /tmp/flaky_$i.txt
    { echo "## run $i"; cat /tmp/flaky_$i.txt; } >> $OUT/flaky.txt
done
echo "flaky loop done at $SECONDS s"
timeout 90 python3 experiments/unordered_replay.py --rounds 20 --out $OUT/unordered_replay.jsonl 2>&1 | \
    grep -v Warning | tee -a $OUT/flaky.txt
echo "unordered replay done at $SECONDS s"
