#!/bin/bash
# The reliability suite's remaining GPU evidence in one device call (about 9 min), each step
# bounded, rows under $OUT:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/reliability_closing_run.sh
# 1. the GPU fuzz samples of ring attention and MoE;
# 2. determinism: ring attention on 2x2 and MoE on 1x4 (MoE runs inside one node), 10,000
#    calls and 2,000 graph replays each;
# 3. the fault matrix again (the kernels moved onto the role board since it last ran);
# 4. host time per call (the prepared launch now goes through CuPy's compiled binding);
# 5. the sanitizers over the cases never run under them (attention, ring attention, grouped
#    GEMM, MoE) and the role-board kernels, until the call's time runs out.
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
DEADLINE=${DEADLINE:-570}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== fuzz"
timeout 150 python3 -m pytest -q -m gpu tests/test_fuzz_gpu.py -k "ring or moe" -p no:cacheprovider \
    -p timeout --timeout=120 2>&1 | tee $OUT/pytest_gpu.log | tail -3
echo "== determinism"
timeout 120 python3 experiments/determinism.py --layout 2x2 --only ring_attention \
    --out $OUT/determinism.jsonl 2>&1 | tail -3
timeout 100 python3 experiments/determinism.py --layout 1x4 --only moe \
    --out $OUT/determinism.jsonl 2>&1 | tail -3
echo "== faults"
timeout 150 python3 experiments/faults.py --out $OUT/faults.jsonl 2>&1 | tail -14
echo "== host time"
timeout 80 python3 experiments/runtime.py --layouts 1x1 1x2 1x4 --out $OUT/runtime.jsonl 2>&1 | grep -v "^ "
echo "== sanitizers"
left=$(( DEADLINE - SECONDS ))
[ $left -gt 60 ] && timeout $left python3 experiments/sanitize.py --tools memcheck synccheck racecheck initcheck \
    --cases attention_d64_causal attention_d128 ring_attention_1x2 ring_attention_2x2 grouped_gemm moe_1x2 \
        gemm_allreduce_fused_1x2 gemm_reducescatter_fused_2x2 \
    --ce-copy-method each --timeout 120 --parallel 4 --out $OUT/sanitize.jsonl 2>&1 \
    | tee $OUT/sanitize.log | grep -E "^(none|memcheck|racecheck|synccheck|initcheck) "
echo "done at $SECONDS s"
