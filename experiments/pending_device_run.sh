#!/bin/bash
# A device call (about 4 min), at most 8 files under $OUT:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# 1. the GEMM GPU tests (split-K on two streams at once among them) and those of the
#    fused kernels whose unfused paths call mkrt.gemm with the rule (the refit allows
#    split-K in 2 parts);
# 2. the 30-shape GEMM suite on the full chip with the refitted rule, in turns.
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
for tile in bm128_bn256 bm128_bn192 bm64_bn128 bm128_bn128 bm64_bn256 bm256_bn128; do echo "gemm_bf16_nk_${tile}"; done | \
    xargs -P 6 -I{} sh -c 'python3 -m mkrt compile --filter {} > /dev/null 2>&1 || echo "compile {} failed"'
timeout 170 python3 -m pytest -q -m gpu tests/test_gemm.py tests/test_gemm_allreduce_gpu.py \
    tests/test_gemm_reducescatter_gpu.py -p no:cacheprovider -p timeout --timeout=100 > $OUT/pytest.log 2>&1
echo "pytest rc=$? at $SECONDS s"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest.log | tail -8
timeout 90 python3 experiments/gemm.py --sms full --out $OUT/gemm.jsonl 2>&1 | grep -E "geomean|FAILED|3000x5000|5000x3000|1536x|16x8192|128x4096"
echo "done at $SECONDS s"
