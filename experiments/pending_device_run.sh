#!/bin/bash
# One device call (about 9 min), each step bounded, rows under $OUT:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# 1. the two-process verbs test, now under its own private MPS daemon, twice;
# 2. the GEMM tile sweep (experiments/gemm_tune.py: five tiles and split-K on the FIT and
#    HELD_OUT shapes against torch.matmul), the data the tile rule is fitted on;
# 3. the controller sweep with the launch-time search (roles="search") beside every static
#    split, the default rule and the adaptive controller.
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
DEADLINE=${DEADLINE:-575}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== verbs mpiexec (private MPS)"
for i in 1 2; do
  timeout 60 python3 -m pytest -q -m gpu \
      tests/test_verbs_loopback_gpu.py::test_across_processes_through_the_loopback_nic \
      -p no:cacheprovider > $OUT/verbs_mpi_$i.log 2>&1; tail -1 $OUT/verbs_mpi_$i.log
done
echo "== GEMM tile sweep"
timeout ${TUNE_TIMEOUT:-290} python3 experiments/gemm_tune.py --out $OUT/gemm_tune.jsonl 2>&1 \
    | tee $OUT/gemm_tune.log | grep -E "best|WRONG|Error" | tail -32
echo "== controller sweep with the search"
left=$(( DEADLINE - SECONDS ))
[ $left -gt 40 ] && timeout $left python3 experiments/controller.py --layouts 1x2 1x4 2x2 \
    --sets calibration held_out --limit 10 --step 6 --rounds 3 --out $OUT/controller.jsonl 2>&1 \
    | tee $OUT/controller.log | tail -12
echo "done at $SECONDS s"
