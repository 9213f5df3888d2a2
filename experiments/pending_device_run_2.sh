#!/bin/bash
# The second device call of the next session (about 9.5 min), after pending_device_run.sh:
#   MKRT_BENCH_COMMIT=<commit> [END=<s>] bash experiments/pending_device_run_2.sh
# 1. determinism: MoE on 2x2 (10,000 calls and 2,000 graph replays; MoE across nodes has
#    never run that long) and AllGather+GEMM with the new split;
# 2. experiments/instance_noise.py on the planner's 27 held-out misses: how far two op
#    instances of one path differ (are the misses noise?);
# 3. the two 2x2 racecheck runs without a finished verdict, as one process per rank under
#    MPS (sanitize.py --processes; four processes failed at context creation at 7aca30c,
#    now with 8 hardware queues each), then in one process with the time left.
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
END=${END:-560}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== determinism, 2x2: moe and allgather_gemm"
timeout 200 python3 experiments/determinism.py --layout 2x2 --only moe allgather_gemm_fused \
    --out $OUT/determinism.jsonl 2>&1 | tail -8
echo "== instance noise: the planner's 27 held-out misses, the same path in two ops"
timeout 150 python3 experiments/instance_noise.py --from-misses --rounds 3 \
    --out $OUT/instance_noise.jsonl 2>&1 | tail -6
JOBS="racecheck:gemm_reducescatter_fused_2x2 racecheck:gemm_allreduce_unfused_2x2" \
    PROCESSES=1 DEADLINE=$(( END - 120 - SECONDS )) bash experiments/pending_sanitizers.sh
JOBS="racecheck:gemm_reducescatter_fused_2x2" DEADLINE=$(( END - SECONDS )) \
    bash experiments/pending_sanitizers.sh
echo "done at $SECONDS s"
