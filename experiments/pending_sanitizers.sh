#!/bin/bash
# The sanitizer runs that never finished, in one device call (about 9 min), rows under $OUT:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_sanitizers.sh
# The multi-node (2x2) cases under initcheck and racecheck, one at a time (three at once
# with 95 s bounds all timed out at e3a9449; racecheck of gemm_allreduce fused 2x2 alone
# finished in 75 s at 6a1950f), with 8 CTAs per rank (the same kernels, less for the
# tools to track) and the cases' own waits raised to 280 s; whatever does not fit in the
# call is named at the end, for the next.
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MKRT_SANITIZE_WAIT_MS=280000 MKRT_SANITIZE_CTAS=8    # 8 CTAs per rank: less to track
DEADLINE=${DEADLINE:-570}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== sanitizers, one at a time"
for job in "initcheck gemm_allreduce_fused_2x2" "racecheck gemm_reducescatter_fused_2x2" \
           "initcheck allgather_gemm_fused_2x2" "racecheck allgather_gemm_fused_2x2" \
           "initcheck allgather_2x2" "initcheck gemm_allreduce_unfused_2x2" \
           "racecheck gemm_allreduce_unfused_2x2"; do
  set -- $job
  left=$(( DEADLINE - SECONDS ))
  [ $left -lt 90 ] && { echo "left for the next call: $job"; continue; }
  bound=$(( left < 300 ? left - 20 : 280 ))
  timeout $(( bound + 15 )) python3 experiments/sanitize.py --tools $1 --cases $2 --parallel 1 \
      --ce-copy-method each --timeout $bound --out $OUT/sanitize.jsonl 2>&1 \
      | grep -E "^$1 "
done
echo "done at $SECONDS s"
