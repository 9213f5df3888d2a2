#!/bin/bash
# One device call (files under $OUT): does claiming tiles from a counter (79501e3) cost
# mkrt.attention speed where its tiles are even? On an H100 the claimed build ran 573
# TFLOP/s against 613 for 902f997's dealt-out build at B 4, S 4096, H 16, D 128
# (experiments/results/ring_device_run_70d63ad.log), in two separate runs. Here both builds
# run alternately on each shape (q0 = dealt out, q1 = claimed, q0, q1 after the default),
# then the pending checks:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/attention_deal_run.sh
# 1. attention, claimed against dealt out, same run, interleaved; three consumer warpgroups
#    at head dim 64 (never run yet);
# 2. GPU tests of the fused GEMM kernels whose unfused paths call mkrt.gemm (stream-K for the
#    last wave by default since 7ab4091) and the new attention variants;
# 3. the ring at 4096 and 8192 rows per rank (the "communication hidden" range);
# 4. the GEMM suite on 132, 116 and 100 SMs.
source experiments/device_prelude.sh attention.txt
D128_S3=bkv128_s3_pp1_c2_q0,bkv128_s3_pp1_c2_q1,bkv128_s3_pp1_c2_q0,bkv128_s3_pp1_c2_q1
D128_S2=bkv128_s2_pp1_c2_q0,bkv128_s2_pp1_c2_q1,bkv128_s2_pp1_c2_q0,bkv128_s2_pp1_c2_q1
D64=bkv192_s2_pp1_c2_q0,bkv192_s2_pp1_c2_q1,bkv192_s2_pp1_c2_q0,bkv192_s2_pp1_c2_q1,bkv128_s3_pp1_c3,bkv128_s2_pp1_c3
attention 4:4096:16:16:128:0,4:12288:16:16:128:0,2:1000:16:4:128:0 $D128_S3
attention 4:4096:16:16:128:1,4:12288:16:16:128:1,1:8192:64:8:128:1 $D128_S2
attention 4:4096:16:16:64:0,4:4096:16:16:64:1,2:8192:32:32:64:1 $D64
echo "attention done at $SECONDS s"
timeout ${TEST_S:-200} python3 -m pytest -q -m gpu tests/test_gemm_allreduce_gpu.py tests/test_gemm_reducescatter_gpu.py \
    "tests/test_attention.py::test_other_configurations_match_the_reference" -p no:cacheprovider 2>&1 | \
    grep -v Warning | tail -8 | tee $OUT/pytest.txt
echo "tests done at $SECONDS s"
timeout ${RING_S:-120} python3 experiments/ring_attention.py --layouts 1x2 1x4 \
    --shapes 4:4096:16:16:128:0,4:4096:16:16:128:1,1:8192:64:8:128:1 --out $OUT/ring_attention.jsonl 2>&1 | \
    grep -v Warning | grep -v "return torch" | tee $OUT/ring.txt
echo "ring done at $SECONDS s"
timeout ${GEMM_S:-110} python3 experiments/gemm.py --sms full,116,100 --repeats 7 --out $OUT/gemm.jsonl 2>&1 | \
    grep -E "geomean|scaling|FAILED" | tee $OUT/gemm.txt
echo "gemm suite done at $SECONDS s"
