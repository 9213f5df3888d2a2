#!/bin/bash
# The next device call (at most about 10 min), files under $OUT, most important first:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# 1. GPU tests of the fused GEMM kernels whose unfused paths call mkrt.gemm, which takes
#    stream-K for the last wave by default since 7ab4091 (the ring, AllGather+GEMM and the
#    attention engine: experiments/ring_device_run.sh);
# 2. the attention suite on the H200 (the machine), against torch's backends, the
#    same on an earlier checkout in old_<commit>/ if there is one, and three consumer
#    warpgroups at head dim 64 (never run yet);
# 3. the GEMM suite on 132, 116 and 100 SMs (the stream-K rule's default, a second run).
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout 200 python3 -m pytest -q -m gpu tests/test_gemm_allreduce_gpu.py tests/test_gemm_reducescatter_gpu.py -p no:cacheprovider 2>&1 | \
    grep -v Warning | tail -8 | tee $OUT/pytest.txt
echo "tests done at $SECONDS s"
timeout 120 python3 experiments/attention.py --shapes suite --out $OUT/attention.jsonl 2>&1 | \
    grep -v Warning | grep -v "return torch" | tee $OUT/attention.txt
for old in old_*; do     # an earlier checkout (git archive <commit> mkrt experiments/attention.py ...)
    [ -d "$old/mkrt" ] || continue
    (cd $old && MKRT_BENCH_COMMIT=${old#old_} PYTHONPATH=$PWD timeout 120 python3 experiments/attention.py \
        --shapes suite --out $OUT/attention_$old.jsonl 2>&1 | grep -v Warning | grep -v "return torch" | \
        tee $OUT/attention_$old.txt)
done
timeout 60 python3 experiments/attention.py --shapes 4:4096:16:16:64:0,4:4096:16:16:64:1,2:8192:32:32:64:1 \
    --variants bkv128_s3_pp1_c3,bkv128_s2_pp1_c3,bkv64_s4_pp1_c3 --out $OUT/attention.jsonl 2>&1 | \
    grep -v Warning | grep -v "return torch" | tee -a $OUT/attention.txt
echo "attention done at $SECONDS s"
timeout 110 python3 experiments/gemm.py --sms full,116,100 --repeats 7 --out $OUT/gemm.jsonl 2>&1 | \
    grep -E "geomean|scaling|FAILED" | tee $OUT/gemm.txt
echo "gemm suite done at $SECONDS s"
