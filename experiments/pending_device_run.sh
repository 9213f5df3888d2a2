#!/bin/bash
# What is left unverified on a GPU, in one device call (about 9 min), each step bounded,
# rows under $OUT:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# 1. GPU tests of code never run: the MoE tests and fuzz samples (problems now from
#    mkrt.kernels.moe.random_problem; the dispatch + combine sample is new), gemm_allreduce
#    with 192- and 128-wide compute tiles (block_n), mkrt.gemm's 256x128 tiles and its
#    clusters of two CTAs sharing B by TMA multicast (cluster="m2");
# 2. those GEMM variants timed beside the one-CTA tiles on the 3000x5000x7000 gap (0.58x
#    torch), that shape with M, N and K rounded to multiples of 128 (misaligned rows or the
#    shape?) and four others, torch.matmul in the same run; split-K (now writing only the
#    rows inside the matrix) on three small-M shapes; host time per call of allgather,
#    gemm_allreduce, ring attention and MoE (the last two never measured);
# The sanitizer runs that never finished are the other call: experiments/pending_sanitizers.sh.
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== MoE tests and GPU fuzz (one shared problem maker now; dispatch + combine alone: new)"
timeout 150 python3 -m pytest -q -m gpu tests/test_moe.py tests/test_fuzz_gpu.py -k "moe or dispatch" \
    -p no:cacheprovider 2>&1 | tail -2
echo "== gemm_allreduce with 128 x 192 and 128 x 128 compute tiles (block_n, new)"
timeout 120 python3 -m pytest -q -m gpu tests/test_gemm_allreduce_gpu.py -k narrower \
    -p no:cacheprovider -p timeout --timeout=100 2>&1 | tail -2
echo "== gemm: clusters of two sharing B and 256x128 tiles (first GPU runs)"
timeout 200 python3 -m pytest -q -m gpu tests/test_gemm.py -k "cluster or every_tile or split_k" -p no:cacheprovider \
    -p timeout --timeout=180 2>&1 | tail -3
echo "== host time per call: the two target ops, and ring attention and MoE (never measured)"
timeout 90 python3 experiments/runtime.py --layouts 1x1 1x2 --ops allgather gemm_allreduce ring_attention moe \
    --out $OUT/runtime.jsonl 2>&1 | grep -v "^ "
echo "== split-K writing and reading only the rows inside the matrix, on small-M shapes"
timeout 60 python3 experiments/gemm_tune.py --configs 64x128 128x256 --split-k 2 4 \
    --shapes 16x8192x8192 64x14336x4096 128x4096x4096 --out $OUT/gemm_tune.jsonl 2>&1 | grep best
echo "== gemm: misaligned rows or the shape? and do pairs sharing B close the gap?"
timeout 170 python3 experiments/gemm_tune.py --cluster --configs 128x256 128x192 64x128 256x128 --split-k 1 \
    --shapes 3000x5000x7000 3000x5000x7168 3072x5120x7000 3072x5120x7168 24576x8192x1024 \
        8192x8192x8192 2048x2048x2048 16x8192x8192 \
    --out $OUT/gemm_tune.jsonl 2>&1 | grep -vE "WRONG" | tail -40
echo "done at $SECONDS s"
