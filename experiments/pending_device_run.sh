#!/bin/bash
# The next session's first device call (about 9.5 min), at most 8 files under $OUT:
#   MKRT_BENCH_COMMIT=<commit> [DEADLINE=<s>] bash experiments/pending_device_run.sh
# 1. AllGather+GEMM's GPU tests with the refitted split rule (f8a09ce: 40 GB/s per
#    gathering CTA, at most half the CTAs; fitted on agg_split at 54199cd, never run) and
#    blocks taken in arrival order (never run; a new 2x3 case exercises it);
# 2. tp_pair's AllGather+GEMM full set on 1x2 and 2x2: the rule's first judgement on
#    shapes it was not fitted on (against 932f011's rows, same harness);
# 3. both ops on 1x4 (TP 4; issue 14 asks for TP 2, 4 and 8; never run);
# 4. grouped_gemm with torch tensors read through TorchView (no DLPack per call): its GPU
#    tests and the expert-GEMM benchmark (the Qwen3 cases' 0.1-0.2 ms calls looked
#    host-bound: 0.52x and 0.31x of torch at 932f011);
# 5. the planner's 8 misses on 2x2 with a settled fuse="measure" op beside two fixed ones,
#    with the controller (adaptive) and without (static): is the kept path slower in the
#    measuring op, and does the controller's state carry it?
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
DEADLINE=${DEADLINE:-550}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== GPU tests"
timeout 120 python3 -m pytest -q -m gpu tests/test_allgather_gemm_gpu.py tests/test_grouped_gemm.py \
    -p no:cacheprovider -p timeout --timeout=60 > $OUT/pytest.log 2>&1
echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest.log | tail -6
echo "== grouped_gemm"
timeout 60 python3 experiments/grouped_gemm.py --out $OUT/grouped_gemm.jsonl 2>&1 | tail -7
echo "== tp_pair allgather_gemm 1x2 2x2 (150 s)"
timeout 150 python3 experiments/tp_pair.py --ops allgather_gemm --layouts 1x2 2x2 --rounds 3 \
    --out $OUT/tp_pair.jsonl 2>&1 | tail -2
left=$(( (DEADLINE - 130 - SECONDS) ))
echo "== tp_pair both ops, 1x4 ($left s)"
timeout $left python3 experiments/tp_pair.py --ops allgather_gemm gemm_reducescatter --layouts 1x4 \
    --rounds 3 --out $OUT/tp_pair.jsonl --plot $OUT/tp_pair.png 2>&1 | tail -3
MISSES="2x2:2048x4096x2048 2x2:512x4096x1024 2x2:2048x4096x512 2x2:2048x4096x1792 2x2:512x8192x2048 2x2:512x8192x7168 2x2:16384x8192x3696 2x2:788x649x6088"
for roles in adaptive static; do
  left=$(( DEADLINE - SECONDS ))
  [ "$roles" = adaptive ] && left=$(( left / 2 ))
  echo "== instance noise, 2x2 misses, roles=$roles ($left s)"
  timeout $left python3 experiments/instance_noise.py --shapes $MISSES --roles $roles --rounds 3 \
      --out $OUT/instance_noise.jsonl 2>&1 | tail -8
done
echo "done at $SECONDS s"
