#!/bin/bash
# mkrt.gemm as a programmatic dependent launch: the GEMM, GEMM+AllReduce and
# GEMM+ReduceScatter GPU tests, the small-shape probe (prepared launch programmatic and
# plain, eager and in graphs), the GEMM suite on 132, 116 and 100 SMs; at most 8 files:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh    (about 5 min)
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "
from mkrt.kernels import gemm as G
print('\n'.join(s.uri[:-6] for s in G.default_specs() if s.b_layout == 'nk' and s.block_n % 64 == 0))" | \
    xargs -P 14 -I{} sh -c 'python3 -m mkrt compile --filter {} > /dev/null 2>&1 || echo "compile {} failed"'
echo "compiled at $SECONDS s"
timeout 280 python3 -m pytest -q -m gpu tests/test_gemm.py tests/test_gemm_allreduce_gpu.py \
    tests/test_gemm_reducescatter_gpu.py 2>&1 | tail -4 | tee $OUT/pytest.txt
echo "tested at $SECONDS s"
timeout 120 python3 experiments/gemm_probe.py --probes small --iterations 20 --repeats 9 \
    --out $OUT/small.jsonl 2>&1 | grep -v Warning | tee $OUT/small.txt
timeout 200 python3 experiments/gemm.py --sms full,116,100 --out $OUT/gemm.jsonl 2>&1 | \
    grep -E "geomean|scaling|FAILED|1536x1536|3000x5000" | tee $OUT/gemm.txt
echo "done at $SECONDS s"
