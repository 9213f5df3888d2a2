#!/bin/bash
# The sanitizer runs that never finished, in one device call (about 9 min), rows under $OUT:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_sanitizers.sh
# The multi-node (2x2) cases under initcheck and racecheck, one at a time, with 8 CTAs per
# rank (the same kernels, less for the tools to track). At 8c681d7 two of them ran past
# 265 s with 280 s waits; at a0cde01, with 45 s waits, racecheck of gemm_reducescatter
# ended in a wait for the node-arrival signal that the other node's *last* CTA posted
# (experiments/notes/reliability.md). That signal now comes from CTA 0 (ccc5bb0): waits
# of 60 s show quickly whether the cases finish now; whatever does not fit in the call is
# named at the end, for the next.
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MKRT_SANITIZE_WAIT_MS=60000 MKRT_SANITIZE_CTAS=8    # 8 CTAs per rank: less to track
DEADLINE=${DEADLINE:-570}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== sanitizers, one at a time"
for job in "initcheck gemm_allreduce_fused_2x2" "racecheck gemm_reducescatter_fused_2x2" \
           "initcheck allgather_gemm_fused_2x2" "racecheck allgather_gemm_fused_2x2" \
           "initcheck gemm_allreduce_unfused_2x2" \
           "racecheck gemm_allreduce_unfused_2x2"; do
  set -- $job
  left=$(( DEADLINE - SECONDS ))
  [ $left -lt 90 ] && { echo "left for the next call: $job"; continue; }
  bound=$(( left < 180 ? left - 50 : 130 ))
  # room for the run without the tool first (about 15 s), so a tool run cut at its bound
  # is still written as a row
  timeout $(( bound + 45 )) python3 experiments/sanitize.py --tools $1 --cases $2 --parallel 1 \
      --ce-copy-method each --timeout $bound --out $OUT/sanitize.jsonl 2>&1 \
      | grep -E "^$1 "
done
echo "done at $SECONDS s"
