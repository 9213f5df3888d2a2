#!/bin/bash
# The next device call (about 5 min), rows under $OUT:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# The GEMM rule shipped at 89f7f18 (fitted at 9509605: clusters of two, a cost per row
# loaded off a 32-byte sector) has not run through mkrt.gemm's default path on a GPU:
# 1. every GEMM GPU test with it (the tests take the rule's tile, now sometimes a cluster);
# 2. the 30-shape suite with it on 132, 116 and 100 SMs, torch in the same run (the issue's
#    targets: geomean >= 1.0, no shape below 0.90 but M <= 16 at 0.80, scaling within 1.05);
# 3. the K-offset probe with it;
# 4. worlds over the loopback NIC as an EFA SRD endpoint (sender-written flags, 1bc885d):
#    gemm_allreduce and allgather against the `ce` path, bit for bit (never run).
# Then the whole GPU test suite (pytest -m gpu) in a call of its own, and
# experiments/pending_sanitizers.sh.
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== GEMM GPU tests with the shipped rule"
timeout 200 python3 -m pytest -q -m gpu tests/test_gemm.py tests/test_gemm_rule.py -p no:cacheprovider \
    -p timeout --timeout=180 2>&1 | tail -3
echo "== suite with the shipped rule"
timeout 150 python3 experiments/gemm.py --out $OUT/gemm.jsonl 2>&1 | grep -E "geomean|sms=132|FAILED" | tail -40
echo "== K offsets with the shipped rule"
timeout 40 python3 experiments/gemm_probe.py --probes k_offset --k-base 4096x4096x4096 \
    --out $OUT/gemm_probe.jsonl 2>&1 | grep off
echo "== worlds over the stand-in as an EFA endpoint"
timeout 150 python3 -m pytest -q -m gpu tests/test_verbs_loopback_gpu.py -k "loopback_efa" \
    -p no:cacheprovider -p timeout --timeout=120 2>&1 | tail -3
echo "done at $SECONDS s"
