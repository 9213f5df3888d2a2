#!/bin/bash
# A device call (about 3 min), at most 8 files under $OUT:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# 1. grouped GEMM kernels (both epilogues) compiled in parallel;
# 2. grouped GEMM and MoE GPU tests (TMA stores of the tiles inside one group);
# 3. the grouped GEMM suite in turns: the default (direct stores) and TMA stores beside
#    torch._grouped_mm and the cuBLAS loop.
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
for f in grouped_gemm_bf16_nk_bm128_bn256 grouped_gemm_bf16_nk_bm64_bn256 grouped_gemm_bf16_nk_bm128_bn128 \
         grouped_gemm_bf16_nk_bm64_bn128 grouped_gemm_f16; do echo $f; done | \
    xargs -P 5 -I{} sh -c 'python3 -m mkrt compile --filter {} > /dev/null 2>&1 || echo "compile {} failed"'
echo "compiled at $SECONDS s"
timeout 240 python3 -m pytest -q -m gpu tests/test_grouped_gemm.py tests/test_moe.py -p no:cacheprovider \
    -p timeout --timeout=120 > $OUT/pytest.log 2>&1
echo "pytest rc=$? at $SECONDS s"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest.log | tail -8
timeout 200 python3 experiments/grouped_gemm.py --out $OUT/grouped_gemm.jsonl 2>&1 | tail -12
echo "done at $SECONDS s"
