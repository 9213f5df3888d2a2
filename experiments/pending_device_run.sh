#!/bin/bash
# The first device call of the next session (about 9.5 min), rows and logs under $OUT:
#   MKRT_BENCH_COMMIT=<commit> [DEADLINE=<s>] bash experiments/pending_device_run.sh
# 1. GPU tests never run: MoE's muted rank (1x2, 2x2); AllGather+GEMM and ring attention
#    with blocks spread chunk by chunk (6b5c50d: the gathering role both share; AllGather+
#    GEMM's tiles wait per chunk); the MoE and fuse-measure files again (fuse=None now
#    measures; gather_split is the default split). If AllGather+GEMM or ring attention
#    fail here, 6b5c50d is the first suspect;
# 2. experiments/tp_pair.py, both ops, full shape set on 1x2 and 2x2: AllGather+GEMM with
#    the split rule and own-rows map has run on the quick set only (3a53e20), and the rule
#    was fitted on agg_split's 10 shapes: the full set is its first judgement on others;
# 3. experiments/moe.py on 2x2 and 1x4 side by side, three models, 1024 and 4096 tokens.
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
DEADLINE=${DEADLINE:-560}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== GPU tests"
timeout 200 python3 -m pytest -q -m gpu tests/test_moe.py tests/test_allgather_gemm_gpu.py \
    tests/test_ring_attention_gpu.py tests/test_fusion_measure.py -p no:cacheprovider -p timeout \
    --timeout=60 > $OUT/pytest.log 2>&1
echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest.log | tail -10
timeout 100 python3 -m pytest -q -m gpu tests/test_fuzz_gpu.py -k moe -p no:cacheprovider -p timeout \
    --timeout=80 > $OUT/pytest_fuzz_moe.log 2>&1        # random routing, now on 2x1, 2x2, 3x1 too
echo "pytest (MoE fuzz) rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest_fuzz_moe.log | tail -4
for op in allgather_gemm gemm_reducescatter; do
  left=$(( DEADLINE - 120 - SECONDS ))
  [ "$op" = allgather_gemm ] && left=$(( left * 6 / 10 ))
  [ $left -lt 40 ] && { echo "no time for tp_pair $op"; continue; }
  echo "== tp_pair $op ($left s)"
  timeout $left python3 experiments/tp_pair.py --ops $op --layouts 1x2 2x2 --rounds 3 \
      --out $OUT/tp_pair.jsonl --plot $OUT/tp_pair.png 2>&1 | tail -4
done
left=$(( DEADLINE - SECONDS ))
echo "== moe ($left s)"
timeout $left python3 experiments/moe.py --layouts 2x2 1x4 --tokens 1024 4096 --plot $OUT/moe.png \
    --out $OUT/moe.jsonl 2>&1 | tail -14
echo "done at $SECONDS s"
