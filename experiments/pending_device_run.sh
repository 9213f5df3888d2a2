#!/bin/bash
# A device call (about 9.5 min), rows and logs under $OUT:
#   MKRT_BENCH_COMMIT=<commit> [DEADLINE=<s>] bash experiments/pending_device_run.sh
# For two kernel changes never run on a GPU:
# * AllGather+GEMM: communication CTAs join the compute role after their copies (tiles
#   claimed from a per-launch counter). GPU tests, fuzzing, determinism on 2x2, the tp_pair
#   full set on 1x2/2x2 (against 378b14f: 0.56-0.97x of unfused on projection shapes) and
#   agg_split's static splits (the split rule was fitted before the change);
# * grouped_gemm: grouped raster inside each group. GPU tests, fuzzing, the expert-GEMM
#   benchmark (against 9c5fb11: 0.49-1.40x of torch) and moe.py on 2x2 and 1x4.
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
DEADLINE=${DEADLINE:-560}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== GPU tests"
timeout 170 python3 -m pytest -q -m gpu tests/test_allgather_gemm_gpu.py tests/test_grouped_gemm.py \
    tests/test_moe.py tests/test_ring_attention_gpu.py -p no:cacheprovider -p timeout \
    --timeout=60 > $OUT/pytest.log 2>&1
echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest.log | tail -10
timeout 90 python3 -m pytest -q -m gpu tests/test_fuzz_gpu.py -k "allgather_gemm or grouped or moe_random" \
    -p no:cacheprovider -p timeout --timeout=80 > $OUT/pytest_fuzz.log 2>&1
echo "pytest (fuzz) rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest_fuzz.log | tail -4
echo "== grouped_gemm"
timeout 60 python3 experiments/grouped_gemm.py --out $OUT/grouped_gemm.jsonl 2>&1 | tail -9
echo "== determinism, 2x2"
timeout 60 python3 experiments/determinism.py --layout 2x2 --only allgather_gemm_fused moe \
    --out $OUT/determinism.jsonl 2>&1 | grep -v WARNING | tail -5
left=$(( (DEADLINE - SECONDS) / 3 ))
echo "== tp_pair allgather_gemm ($left s)"
timeout $left python3 experiments/tp_pair.py --ops allgather_gemm --layouts 1x2 2x2 --rounds 3 \
    --out $OUT/tp_pair.jsonl --plot $OUT/tp_pair.png 2>&1 | tail -3
left=$(( (DEADLINE - SECONDS) / 2 ))
echo "== moe ($left s)"
timeout $left python3 experiments/moe.py --layouts 2x2 1x4 --tokens 1024 4096 --plot $OUT/moe.png \
    --out $OUT/moe.jsonl 2>&1 | tail -13
left=$(( DEADLINE - SECONDS ))
echo "== agg_split ($left s)"
timeout $left python3 experiments/agg_split.py --layouts 1x2 2x2 --rounds 3 --out $OUT/agg_split.jsonl 2>&1 | tail -3
echo "done at $SECONDS s"
