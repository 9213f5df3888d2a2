#!/bin/bash
# One short device call (about 1.5 min), rows under $OUT:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# Clusters of two with a CTA-scope release of the partner's stage (was cluster scope, ~1 us
# per k-step at any grid): the GPU tests of clusters, the per-k-step probe, and the tiles
# with and without clusters on the K-misaligned shapes and two aligned ones.
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== gemm cluster tests"
timeout 120 python3 -m pytest -q -m gpu tests/test_gemm.py -k "cluster" -p no:cacheprovider \
    -p timeout --timeout=100 2>&1 | tail -2
echo "== per k-step, 128x256 with and without clusters"
timeout 60 python3 experiments/gemm_probe.py --probes grid --grid-shapes 8192x8192x8192 \
    --grid-configs 128x256 --grids 64 132 --out $OUT/gemm_probe.jsonl 2>&1 | grep -v Warn
echo "== tiles with and without clusters"
timeout 150 python3 experiments/gemm_tune.py --cluster --configs 128x256 128x192 256x128 64x128 --split-k 1 \
    --shapes 3000x5000x7000 4096x4096x4040 8192x8192x8192 2048x2048x2048 24576x8192x1024 \
    --out $OUT/gemm_tune.jsonl 2>&1 | grep -vE "WRONG" | tail -45
echo "done at $SECONDS s"
