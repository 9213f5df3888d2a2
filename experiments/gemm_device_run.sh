#!/bin/bash
# One device call: GPU tests, SASS check, benchmark(s). Writes under $OUT.
#   bash experiments/gemm_device_run.sh "<bench args>" ["<second bench args>"]
export MKRT_JIT_CACHE_DIR=/tmp/mkrt-cache PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -x -m gpu tests/test_gemm.py -p no:cacheprovider 2>&1 | tee $OUT/pytest.log | tail -15
for c in /tmp/mkrt-cache/gemm_bf16_*/kernel.cubin; do echo "$(basename $(dirname $c)): $(nvdisasm -c $c | grep -c HGMMA) HGMMA, $(nvdisasm -c $c | grep -cE 'LDL|STL') LDL/STL"; done
c=$(ls -d /tmp/mkrt-cache/gemm_bf16_nk*tma* | head -1); [ -n "$c" ] && nvdisasm -c $c/kernel.cubin > $OUT/sass_bf16_nk_tma.txt
for args in "$@"; do
  timeout ${BENCH_TIMEOUT:-200} python3 experiments/gemm.py $args --out $OUT/gemm.jsonl 2>&1 | tee -a $OUT/bench.log
done
