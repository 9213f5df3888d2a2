#!/bin/bash
# One device call (about 9 min), each step bounded, rows under $OUT:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# 1. the two-process verbs test, now under its own private MPS daemon, twice;
# 2. (after 3) the GEMM tile sweep (experiments/gemm_tune.py: five tiles and split-K on the FIT and
#    HELD_OUT shapes against torch.matmul), the data the tile rule is fitted on;
# 3. a profile of the stalled-rank 2x2 fault; host time A/B of the launch binding (run with
#    carry [".bench_old"]: git archive 38fac30 mkrt experiments | tar -x -C .bench_old);
# 4. the controller sweep with the launch-time search (roles="search") beside every static
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
echo "== where the stalled-rank 2x2 fault's time goes (0.43 s for 0.3 s waits at 6fdddeb)"
timeout 60 python3 -m cProfile -o $OUT/faults.prof experiments/faults.py --out $OUT/faults.jsonl \
    --only stalled_rank_gemm_allreduce_2x2 queue_full_proxy_stalled 2>&1 | tail -3
echo "== host time A/B: ctypes cuLaunchKernel (38fac30, in .bench_old) and CuPy's binding (now)"
for i in 1 2; do
  MKRT_JIT_CACHE_DIR=/tmp/mkrt-cache-old PYTHONPATH=$PWD/.bench_old timeout 60 python3 .bench_old/experiments/runtime.py \
      --layouts 1x1 1x2 --label ab_38fac30 --out $OUT/runtime_ab.jsonl 2>&1 | grep -v "^ "
  timeout 60 python3 experiments/runtime.py --layouts 1x1 1x2 --label ab_now --out $OUT/runtime_ab.jsonl 2>&1 | grep -v "^ "
done
echo "== GEMM tile sweep"
timeout ${TUNE_TIMEOUT:-270} python3 experiments/gemm_tune.py --out $OUT/gemm_tune.jsonl 2>&1 \
    | tee $OUT/gemm_tune.log | grep -E "best|WRONG|Error" | tail -32
echo "== controller sweep with the search"
left=$(( DEADLINE - SECONDS ))
[ $left -gt 40 ] && timeout $left python3 experiments/controller.py --layouts 1x2 2x2 \
    --sets held_out --limit 6 --step 6 --rounds 3 --out $OUT/controller.jsonl 2>&1 \
    | tee $OUT/controller.log | tail -12
echo "done at $SECONDS s"
