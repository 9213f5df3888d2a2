#!/bin/bash
# Grouped GEMM in clusters of two (pairs of a group's m-tiles sharing each weight load):
# its GPU tests and its rows against single CTAs; the GEMM suite with 128-byte promotion on
# rows off a sector, on 132, 116 and 100 SMs; at most 8 files under $OUT:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh    (about 7 min)
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "
from mkrt.kernels import gemm as G, grouped_gemm as GG
specs = [s for s in G.default_specs() if s.b_layout == 'nk' and s.block_n % 64 == 0] + GG.default_specs()
print('\n'.join(s.uri[:-6] for s in specs))" | \
    xargs -P 14 -I{} sh -c 'python3 -m mkrt compile --filter {} > /dev/null 2>&1 || echo "compile {} failed"'
echo "compiled at $SECONDS s"
timeout 200 python3 -m pytest -q -m gpu tests/test_grouped_gemm.py 2>&1 | tail -3 | tee $OUT/pytest_grouped.txt
for i in 1 2 3; do timeout 60 python3 -m pytest -q -m gpu tests/test_gemm.py -k two_streams 2>&1 | tail -1; done | tee $OUT/pytest_two_streams.txt
echo "tested at $SECONDS s"
timeout 150 python3 experiments/grouped_gemm.py --iterations 20 --rounds 9 --out $OUT/grouped_gemm.jsonl \
    --clusters-out $OUT/grouped_gemm_cluster.jsonl 2>&1 | grep -v "^  fit" | tee $OUT/grouped.txt
echo "grouped at $SECONDS s"
timeout 240 python3 experiments/gemm.py --sms full,116,100 --out $OUT/gemm.jsonl 2>&1 | grep -E "geomean|scaling|FAILED|3000x5000" | tee $OUT/gemm.txt
echo "done at $SECONDS s"
