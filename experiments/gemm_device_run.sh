#!/bin/bash
# One device call: GPU tests, SASS check, benchmark(s). Writes under $OUT.
#   bash experiments/gemm_device_run.sh "<bench args>" ["<second bench args>"]
export MKRT_JIT_CACHE_DIR=/tmp/mkrt-cache PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -x -m gpu tests/test_gemm.py -p no:cacheprovider 2>&1 | tee $OUT/pytest.log | tail -15
# NVRTC's cubin does not open in nvdisasm here: rebuild the rendered source with nvcc for SASS.
for c in /tmp/mkrt-cache/gemm_bf16_nk*/; do nvcc -std=c++17 -gencode arch=compute_90a,code=sm_90a -cubin -o /tmp/k.cubin $c/kernel.cu 2>/dev/null && echo "$(basename $c): $(cuobjdump -sass /tmp/k.cubin | grep -c HGMMA) HGMMA, $(cuobjdump -sass /tmp/k.cubin | grep -cE 'LDL|STL') LDL/STL" && cuobjdump -sass /tmp/k.cubin > $OUT/sass_$(basename $c | cut -c1-40).txt; done
for args in "$@"; do
  timeout ${BENCH_TIMEOUT:-200} python3 experiments/gemm.py $args --out $OUT/gemm.jsonl 2>&1 | tee -a $OUT/bench.log
done
