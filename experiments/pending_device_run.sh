#!/bin/bash
# Two device calls, at most 8 files under $OUT each:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh tests    (about 7 min)
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh bench    (about 3 min)
# tests: every GPU test (tests/ -m gpu).
# bench: the grouped GEMM suite with choose_epilogue's stores, in turns; the GEMM tile
#        sweep with torch.matmul as gemm.py calls it, and the committed rule judged on it;
#        the 30-shape GEMM suite on the full chip, in turns.
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
if [ "$1" = tests ]; then
    timeout 560 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider -p timeout --timeout=120 \
        > $OUT/pytest.log 2>&1
    echo "pytest rc=$? at $SECONDS s"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest.log | tail -12
else
    for tile in bm128_bn256 bm128_bn192 bm64_bn128 bm128_bn128 bm64_bn256; do echo "gemm_bf16_nk_${tile}"; done | \
        xargs -P 5 -I{} sh -c 'python3 -m mkrt compile --filter {} > /dev/null 2>&1 || echo "compile {} failed"'
    timeout 120 python3 experiments/grouped_gemm.py --out $OUT/grouped_gemm.jsonl 2>&1 | tail -8
    timeout 150 python3 experiments/gemm_tune.py --configs 128x256 128x192 64x128 --cluster \
        --tail-split 2 3 --out $OUT/gemm_tune.jsonl > $OUT/gemm_tune.log 2>&1
    echo "sweep rc=$? at $SECONDS s"
    python3 experiments/gemm_tune.py --fit --judge-only --out $OUT/gemm_tune.jsonl 2>&1 | tee $OUT/judge.txt | grep geomean
    timeout 150 python3 experiments/gemm.py --sms full --out $OUT/gemm.jsonl 2>&1 | grep -E "geomean|FAILED|3000x5000|5000x3000|1536x"
fi
echo "done at $SECONDS s"
