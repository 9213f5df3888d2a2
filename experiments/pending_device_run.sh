#!/bin/bash
# One device call (about 7 min), each step bounded, rows under $OUT:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# 1. the fault matrix after its two timing fixes (the timeout hint's queue read, the
#    full-ring fault's setup outside its timed call);
# 2. mkrt.gemm with the fitted tile rule on the 30-shape suite, full chip, 116 and 100 SMs,
#    against torch.matmul in the same run (issue: GEMM on any shape);
# 3. racecheck of the role-board kernels on 2x2, alone and with a longer bound (they never
#    finished in 90-120 s beside other sanitizer runs).
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
DEADLINE=${DEADLINE:-540}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== faults"
timeout 120 python3 experiments/faults.py --out $OUT/faults.jsonl 2>&1 | tail -12
echo "== gemm suite"
timeout 200 python3 experiments/gemm.py --sms full,116,100 --iterations 10 --repeats 5 \
    --out $OUT/gemm.jsonl 2>&1 | tee $OUT/gemm.log | grep -vE "^(#|case)" | tail -40
echo "== racecheck, role board, 2x2"
left=$(( DEADLINE - SECONDS ))
[ $left -gt 60 ] && timeout $left python3 experiments/sanitize.py --tools racecheck \
    --cases gemm_allreduce_fused_2x2 gemm_reducescatter_fused_2x2 --ce-copy-method each \
    --timeout $(( left - 30 )) --parallel 2 --out $OUT/sanitize.jsonl 2>&1 \
    | tee $OUT/sanitize.log | grep -E "^(none|racecheck) "
echo "done at $SECONDS s"
