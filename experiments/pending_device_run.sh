#!/bin/bash
# The next device call (about 7 min, at most 8 files under $OUT), most important first:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# 1. GPU tests of what changed without a GPU since 5ddff8c: mkrt.attention's defaults (tiles
#    dealt out at head dim 128, three consumer warpgroups at 64, 24/240 registers above
#    128-key blocks), the ring's L2 bands, AllGather+GEMM (shares the tile queue), and the
#    measured-fusion test ordered before its capture, three times;
# 2. experiments/unordered_replay.py: eager call + replay, ordered and not;
# 3. the claimed build (work list in registers) against the dealt-out one in turns;
# 4. the ring's bands: the rank's share of the L2 against the whole L2, 1x2 and 1x4, and
#    the same shapes on an earlier checkout (carry old_7547cc9: before the key-block cursor);
# 5. the attention suite at the new defaults against torch's backends.
source experiments/device_prelude.sh log.txt
timeout ${TEST_S:-150} python3 -m pytest -q -m gpu tests/test_attention.py tests/test_ring_attention_gpu.py \
    tests/test_allgather_gemm_gpu.py -p no:cacheprovider 2>&1 | grep -v Warning | tail -6 | tee -a $LOG
for i in 1 2 3; do
    timeout 50 python3 -m pytest -q -m gpu tests/test_gemm_allreduce_gpu.py -k "measured_fusion_settles" \
        -p no:cacheprovider --tb=short 2>&1 | grep -v Warning | tail -3 | tee -a $LOG
done
echo "tests done at $SECONDS s" | tee -a $LOG
timeout 60 python3 experiments/unordered_replay.py --rounds 20 --out $OUT/unordered_replay.jsonl 2>&1 | \
    grep -v Warning | tee -a $LOG
attention 4:4096:16:16:128:0,4:12288:16:16:128:0,4:4096:16:16:128:1 \
    bkv128_s3_pp1_c2_q0,bkv128_s3_pp1_c2_q1,bkv128_s3_pp1_c2_q0,bkv128_s3_pp1_c2_q1
echo "claimed vs dealt out done at $SECONDS s" | tee -a $LOG
timeout ${RING_S:-120} python3 experiments/ring_attention.py --layouts 1x2 1x4 --bands rule whole \
    --shapes 4:4096:16:16:128:0,4:4096:16:16:128:1 --out $OUT/ring_attention.jsonl 2>&1 | \
    grep -v Warning | grep -v "return torch" | grep -v "F.scaled_dot" | tee -a $LOG
echo "ring done at $SECONDS s" | tee -a $LOG
# the same ring shapes on an earlier checkout, if old_<commit>/ holds one (git archive <commit>
# mkrt experiments/ring_attention.py experiments/attention.py | tar -x -C old_<commit>;
# 7547cc9 is the last before the consumers' key-block cursor)
for old in old_*; do
    [ -d "$old/mkrt" ] || continue
    (cd $old && MKRT_BENCH_COMMIT=${old#old_} PYTHONPATH=$PWD timeout ${OLD_S:-60} python3 experiments/ring_attention.py \
        --layouts 1x2 1x4 --shapes 4:4096:16:16:128:0,4:4096:16:16:128:1 2>&1 | \
        grep -v Warning | grep -v "return torch" | grep -v "F.scaled_dot" | tee -a $LOG)
done
timeout ${ATT_S:-90} python3 experiments/attention.py --shapes suite --out $OUT/attention.jsonl 2>&1 | \
    grep -v Warning | grep -v "return torch" | tee -a $LOG
echo "suite done at $SECONDS s" | tee -a $LOG
