#!/bin/bash
# The next device call (at most about 10 min), files under $OUT, most important first:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# 1. GPU tests of what changed since the last H200 run and had not run there: the attention
#    engine and the ring (K/V released apart, bands of key heads, new defaults; run on an
#    H100 only), and the fused GEMM kernels whose unfused paths call mkrt.gemm, which takes
#    stream-K for the last wave by default since 7ab4091;
# 2. the attention suite on the H200 (the machine), against torch's backends, and
#    three consumer warpgroups at head dim 64 (never run yet);
# 3. the ring on 1x2, 1x4, 2x2 on two shapes;
# 4. the GEMM suite on 132, 116 and 100 SMs (the stream-K rule's default, a second run).
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout 240 python3 -m pytest -q -m gpu tests/test_attention.py tests/test_ring_attention_gpu.py \
    tests/test_gemm_allreduce_gpu.py tests/test_allgather_gemm_gpu.py tests/test_gemm_reducescatter_gpu.py -p no:cacheprovider 2>&1 | \
    grep -v Warning | tail -8 | tee $OUT/pytest.txt
echo "tests done at $SECONDS s"
timeout 120 python3 experiments/attention.py --shapes suite --out $OUT/attention.jsonl 2>&1 | \
    grep -v Warning | grep -v "return torch" | tee $OUT/attention.txt
timeout 60 python3 experiments/attention.py --shapes 4:4096:16:16:64:0,4:4096:16:16:64:1,2:8192:32:32:64:1 \
    --variants bkv128_s3_pp1_c3,bkv128_s2_pp1_c3,bkv64_s4_pp1_c3 --out $OUT/attention.jsonl 2>&1 | \
    grep -v Warning | grep -v "return torch" | tee -a $OUT/attention.txt
echo "attention done at $SECONDS s"
timeout 100 python3 experiments/ring_attention.py --layouts 1x2 1x4 2x2 \
    --shapes 4:3072:16:16:128:0,4:3072:16:16:128:1 --out $OUT/ring_attention.jsonl 2>&1 | \
    grep -v Warning | grep -v "return torch" | tee $OUT/ring.txt
echo "ring done at $SECONDS s"
timeout 110 python3 experiments/gemm.py --sms full,116,100 --repeats 7 --out $OUT/gemm.jsonl 2>&1 | \
    grep -E "geomean|scaling|FAILED" | tee $OUT/gemm.txt
echo "gemm suite done at $SECONDS s"
