#!/bin/bash
# The first device call of the session (about 8 min), rows and logs under $OUT:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# 1. the 30-shape suite with the shipped GEMM rule (89f7f18, fitted at 9509605) on 132, 116
#    and 100 SMs, torch in the same run (issue 12's targets: geomean >= 1.0, no shape below
#    0.90 but M <= 16 at 0.80, scaling within 1.05);
# 2. the K-offset probe with the rule;
# 3. the whole GPU test suite (pytest -m gpu): the GEMM tests now take the rule's tile (some
#    a cluster), the node-arrival signal moved to CTA 0 (ccc5bb0), the cluster grid cut in
#    _PreparedGemm (9132a8a), worlds over the loopback NIC as an EFA SRD endpoint (1bc885d);
#    none of them run on a GPU before.
# Then experiments/pending_sanitizers.sh in a call of its own.
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
DEADLINE=${DEADLINE:-575}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== suite with the shipped rule"
timeout 150 python3 experiments/gemm.py --out $OUT/gemm.jsonl 2>&1 | tee $OUT/gemm.log \
    | grep -E "geomean|FAILED" | tail -20
echo "== K offsets with the shipped rule"
timeout 40 python3 experiments/gemm_probe.py --probes k_offset --k-base 4096x4096x4096 \
    --out $OUT/gemm_probe.jsonl 2>&1 | tee $OUT/gemm_probe.log | grep off
echo "== the whole GPU suite (started at $SECONDS s)"
left=$(( DEADLINE - SECONDS ))
timeout $left python3 -m pytest -q -m gpu tests/ -p no:cacheprovider -p timeout --timeout=120 \
    > $OUT/pytest.log 2>&1
echo "pytest rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest.log | tail -25
echo "done at $SECONDS s"
