#!/bin/bash
# One device call: every GPU test, the proxy benchmark, then (optional) gemm_allreduce
# cases on emulated worlds. Writes under $OUT.
#   MKRT_BENCH_COMMIT=<short hash> bash experiments/proxy_device_run.sh ["<gemm_allreduce args>"]
export MKRT_JIT_CACHE_DIR=/tmp/mkrt-cache PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export MKRT_BENCH_COMMIT=${MKRT_BENCH_COMMIT:-unknown}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,pci.bus_id --format=csv,noheader
(lscpu | grep -E "Model name|Socket|NUMA|^CPU\(s\)"; nvidia-smi topo -m) > $OUT/host_topology.txt 2>&1
cat $OUT/host_topology.txt
python3 -m mkrt compile --all > $OUT/compile.log 2>&1; tail -2 $OUT/compile.log
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -m gpu tests -p no:cacheprovider --timeout 100 2>&1 \
  | tee $OUT/pytest.log | tail -15
timeout ${BENCH_TIMEOUT:-300} python3 experiments/proxy.py --out $OUT/proxy.jsonl $PROXY_ARGS 2>&1 | tee $OUT/proxy.log
for args in "$@"; do
  timeout ${GAR_TIMEOUT:-240} python3 experiments/gemm_allreduce.py $args --out $OUT/gemm_allreduce.jsonl \
    2>&1 | tee -a $OUT/gemm_allreduce.log
done
