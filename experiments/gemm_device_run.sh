#!/bin/bash
# One device call: GPU tests, SASS check, benchmark. Writes under $OUT.
export MKRT_JIT_CACHE_DIR=/tmp/mkrt-cache PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -x -m gpu tests/test_gemm.py -p no:cacheprovider 2>&1 | tee $OUT/pytest.log | tail -25
for c in /tmp/mkrt-cache/gemm_*/kernel.cubin; do echo "$c: $(cuobjdump -sass $c | grep -cE 'HGMMA') HGMMA, $(cuobjdump -sass $c | grep -cE 'LDL|STL') LDL/STL"; done
c=$(ls /tmp/mkrt-cache/gemm_bf16_nk*/kernel.cubin | head -1); [ -n "$c" ] && cuobjdump -sass $c > $OUT/sass_bf16_nk.txt
timeout ${BENCH_TIMEOUT:-300} python3 experiments/gemm.py "$@" --out $OUT/gemm.jsonl 2>&1 | tee $OUT/bench.log
