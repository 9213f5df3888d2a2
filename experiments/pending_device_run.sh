#!/bin/bash
# One short device call (about 1.5 min), rows under $OUT:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# The 30-shape suite with the shipped rule (fitted at 9509605: clusters of two, and a cost
# per row loaded off a 32-byte sector) on 132, 116 and 100 SMs, torch in the same run; the
# K-offset probe with that rule.
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== suite with the shipped rule"
timeout 100 python3 experiments/gemm.py --out $OUT/gemm.jsonl 2>&1 | grep -E "geomean|sms=132" | tail -40
echo "== K offsets with the shipped rule"
timeout 40 python3 experiments/gemm_probe.py --probes k_offset --k-base 4096x4096x4096 \
    --out $OUT/gemm_probe.jsonl 2>&1 | grep off
echo "done at $SECONDS s"
