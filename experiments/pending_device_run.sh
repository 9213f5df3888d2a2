#!/bin/bash
# What the last session built without running it on a GPU, in one device call (about 8 min):
# the GPU tests of the new and changed code first, then their benchmarks. Results under $OUT.
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
# 1. tests: torch path of attention, ring's new tests, grouped GEMM, MoE, AllGather+GEMM on
#    the moved gathering role, the mpiexec verbs test five times (it failed once)
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu tests/test_attention.py tests/test_ring_attention_gpu.py \
    tests/test_grouped_gemm.py tests/test_moe.py tests/test_allgather_gemm_gpu.py tests/test_fuzz_gpu.py \
    -p no:cacheprovider -p timeout --timeout=120 2>&1 | tee $OUT/pytest_gpu.log | tail -15
for i in 1 2 3 4 5; do
  timeout 90 python3 -m pytest -q -m gpu tests/test_verbs_loopback_gpu.py::test_across_processes_through_the_loopback_nic \
      -p no:cacheprovider 2>&1 | tail -1
done | tee $OUT/verbs_mpi_repeats.log
# 2. benchmarks of the new ops (short forms)
timeout 90 python3 experiments/grouped_gemm.py --out $OUT/grouped_gemm.jsonl 2>&1 | tail -8
timeout 120 python3 experiments/moe.py --layouts 1x4 --tokens 1024 4096 --out $OUT/moe.jsonl 2>&1 | tail -8
timeout 120 python3 experiments/ring_attention.py --layouts 1x4 --shapes 4:6144:16:16:128:0,4:6144:16:16:128:1 \
    --plot $OUT/ring_attention.png --out $OUT/ring_attention.jsonl 2>&1 | grep -v -i warn | tail -4
