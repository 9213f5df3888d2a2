#!/bin/bash
# attention_deal_run2.sh cut to about 150 s, for a session with little device time left:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/attention_deal_run3.sh
# the claimed build (work list in registers) against the dealt-out one in turns at head dim
# 128, the new default at head dim 64 against the old one, the ring's L2 bands at 1x2, the
# fixed measured-fusion test twice and the unordered replay loop.
source experiments/device_prelude.sh attention.txt
attention 4:4096:16:16:128:0,4:12288:16:16:128:0 bkv128_s3_pp1_c2_q0,bkv128_s3_pp1_c2_q1,bkv128_s3_pp1_c2_q0,bkv128_s3_pp1_c2_q1
attention 4:4096:16:16:64:0,4:4096:16:16:64:1 bkv192_s2_pp1_c2_q0,bkv128_s3_pp1_c2_q1
echo "attention done at $SECONDS s"
timeout 60 python3 experiments/ring_attention.py --layouts 1x2 --bands rule whole --iterations 3 --repeats 3 \
    --shapes 4:4096:16:16:128:0 --out $OUT/ring_attention.jsonl 2>&1 | \
    grep -v Warning | grep -v "return torch" | grep -v "F.scaled_dot" | tee -a $LOG
echo "ring done at $SECONDS s"
for i in 1 2; do
    timeout 50 python3 -m pytest -q -m gpu tests/test_gemm_allreduce_gpu.py -k "measured_fusion_settles and 2x2" \
        -p no:cacheprovider --tb=short 2>&1 | grep -v Warning | tail -3 | tee -a $OUT/flaky.txt
done
timeout 60 python3 experiments/unordered_replay.py --rounds 20 --out $OUT/unordered_replay.jsonl 2>&1 | \
    grep -v Warning | tee -a $OUT/flaky.txt
echo "all done at $SECONDS s"
