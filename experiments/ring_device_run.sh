#!/bin/bash
# One device call for the ring's copy-then-join change (files under $OUT):
#   MKRT_BENCH_COMMIT=<commit> bash experiments/ring_device_run.sh
# 1. GPU tests of ring attention, AllGather+GEMM (they share the gathering role) and
#    mkrt.attention (the engine), and GEMM split-K's workspaces per stream and under capture;
# 2. the ring on 1x2, 1x4, 2x2 at its default split and with 2 communication CTAs, against
#    its baselines, same run;
# 3. if old_<commit>/ holds an earlier checkout (git archive <commit> mkrt experiments/
#    ring_attention.py experiments/attention.py), the same shapes on it, same machine.
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
SHAPES=${SHAPES:-4:3072:16:16:128:0,4:3072:16:16:128:1}
LAYOUTS=${LAYOUTS:-1x2 1x4 2x2}
timeout ${TEST_S:-200} python3 -m pytest -q -m gpu tests/test_ring_attention_gpu.py tests/test_allgather_gemm_gpu.py \
    tests/test_attention.py -p no:cacheprovider 2>&1 | grep -v Warning | tail -12 | tee $OUT/pytest.txt
timeout 90 python3 -m pytest -q -m gpu tests/test_gemm.py -k "split_k_captured or two_streams" -p no:cacheprovider \
    2>&1 | grep -v Warning | tail -4 | tee -a $OUT/pytest.txt
echo "tests done at $SECONDS s"
timeout ${RING_S:-150} python3 experiments/ring_attention.py --layouts $LAYOUTS --shapes $SHAPES \
    --comm-ctas default 2 --out $OUT/ring_attention.jsonl 2>&1 | \
    grep -v Warning | grep -v "return torch" | tee $OUT/ring.txt
echo "ring done at $SECONDS s"
for old in old_*; do
    [ -d "$old/mkrt" ] || continue
    (cd $old && MKRT_BENCH_COMMIT=${old#old_} PYTHONPATH=$PWD timeout ${OLD_S:-110} python3 experiments/ring_attention.py \
        --layouts $LAYOUTS --shapes $SHAPES --out $OUT/ring_attention_$old.jsonl 2>&1 | \
        grep -v Warning | grep -v "return torch" | tee $OUT/ring_$old.txt)
    echo "$old done at $SECONDS s"
done
# 4. mkrt.attention (tiles claimed from a counter since 79501e3) against torch's backends on
#    a few shapes, and the same shapes on the earlier checkout, same machine
ASHAPES=${ASHAPES:-4:4096:16:16:64:1,4:4096:16:16:64:0,4:4096:16:16:128:1,4:4096:16:16:128:0,1:8192:64:8:128:1,2:8192:32:32:64:1}
timeout ${ATT_S:-70} python3 experiments/attention.py --shapes $ASHAPES --out $OUT/attention.jsonl 2>&1 | \
    grep -v Warning | grep -v "return torch" | tee $OUT/attention.txt
for old in old_*; do
    [ -d "$old/mkrt" ] || continue
    (cd $old && MKRT_BENCH_COMMIT=${old#old_} PYTHONPATH=$PWD timeout ${ATT_S:-70} python3 experiments/attention.py \
        --shapes $ASHAPES --out $OUT/attention_$old.jsonl 2>&1 | grep -v Warning | grep -v "return torch" | \
        tee $OUT/attention_$old.txt)
done
echo "attention done at $SECONDS s"
