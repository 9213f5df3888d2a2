#!/bin/bash
# The next session's second device call (about 8 min): the sanitizer verdicts still open.
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run_2.sh
# 1. initcheck of the unfused GEMM+AllReduce on 2x2 with mkrt's GEMM (plain stores) in
#    place of cuBLAS's (TMA stores): 0 errors would confirm that the 131,052 reports with
#    cuBLAS are its TMA-stored C, which initcheck does not track;
# 2. racecheck of gemm_reducescatter fused 2x2 (never finished since 51194a8: its ranks
#    stop progressing under the tool, at 60 s and 200 s waits, in one process or four)
#    and gemm_allreduce fused 2x2 (last finished at 6a1950f), one process per rank under
#    MPS with only one rank under the tool at a time (sanitize.py --tool-ranks);
# 3. with the time left: host time per call of MoE and AllGather+GEMM on 2x2 (issue 16:
#    MoE's host time on several nodes never measured).
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MKRT_SANITIZE_WAIT_MS=60000 MKRT_SANITIZE_CTAS=8
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== initcheck, unfused GEMM+AllReduce 2x2 with mkrt's GEMM"
timeout 150 python3 experiments/sanitize.py --tools initcheck --cases gemm_allreduce_unfused_mkrt_gemm_2x2 \
    --parallel 1 --timeout 100 --ce-copy-method each --out $OUT/sanitize.jsonl 2>&1 | grep -E "^(initcheck|none) "
echo "== racecheck, fused 2x2, one rank under the tool at a time"
timeout $(( 480 - SECONDS )) python3 experiments/sanitize.py --tools racecheck \
    --cases gemm_reducescatter_fused_2x2 gemm_allreduce_fused_2x2 --processes --tool-ranks 0 1 2 3 \
    --timeout 75 --ce-copy-method each --out $OUT/sanitize.jsonl 2>&1 | grep -E "^(racecheck|none) "
left=$(( 550 - SECONDS ))
echo "== runtime, 2x2: moe, allgather_gemm ($left s)"
[ $left -gt 30 ] && timeout $left python3 experiments/runtime.py --layouts 2x2 --ops moe allgather_gemm \
    --calls 500 --out $OUT/runtime.jsonl 2>&1 | tail -4
echo "done at $SECONDS s"
