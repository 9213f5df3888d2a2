#!/bin/bash
# What the last session left unverified on a GPU, in one device call (about 9 min), each step
# bounded, results under $OUT:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# 1. the controller's multi-node wait signal (changed after the sweep): GPU tests, then the
#    sweep on both shape sets and the role timeline;
# 2. the mpiexec verbs test twice with its diagnostics (it failed 4 of 5 at 9c5fb11 and
#    every time at 8c94938 / 57ba839: CommTimeout, each rank waiting for the other's pass-1 data),
#    then once under MPS (are the two processes' time-sliced kernels the cause?);
# 3. racecheck of the role-board gemm_allreduce alone (three cases in parallel did not finish
#    in 90 s; memcheck, synccheck, 2x2 and the attention cases: a later call);
# 4. AllGather+GEMM's benchmark (never run).
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== tests"
timeout 200 python3 -m pytest -q -m gpu tests/test_controller_gpu.py tests/test_gemm_allreduce_gpu.py \
    tests/test_gemm_reducescatter_gpu.py tests/test_allgather_gemm_gpu.py \
    tests/test_ring_attention_gpu.py -p no:cacheprovider \
    -p timeout --timeout=120 2>&1 \
    | tee $OUT/pytest_gpu.log | tail -5
echo "== controller sweep"
timeout 150 python3 experiments/controller.py --layouts 1x2 1x4 2x2 --sets calibration held_out \
    --limit 10 --step 6 --rounds 3 --out $OUT/controller.jsonl 2>&1 | tee $OUT/controller.log | tail -3
timeout 40 python3 experiments/controller.py --trace --layouts 1x2 2x2 --shape 4096x4096x512 \
    --trace-start 1 --trace-calls 6 --trace-out $OUT/controller_trace.json \
    --plot $OUT/controller_timeline.png 2>&1 | tail -2
# the shapes where the controller lost most at 40eba35 (2x2, small, network-bound): what it saw
for shape in 768x2560x384 512x4096x1024; do
  timeout 30 python3 experiments/controller.py --trace --layouts 2x2 --shape $shape --trace-calls 8 \
      --trace-out $OUT/controller_trace_2x2_$shape.json --plot $OUT/controller_timeline_2x2_$shape.png 2>&1 | tail -1
done
echo "== verbs mpiexec x2"
for i in 1 2; do
  timeout 70 python3 -m pytest -q -m gpu \
      tests/test_verbs_loopback_gpu.py::test_across_processes_through_the_loopback_nic \
      -p no:cacheprovider > $OUT/verbs_mpi_$i.log 2>&1; tail -1 $OUT/verbs_mpi_$i.log
done
echo "== verbs mpiexec under MPS (processes' kernels side by side instead of time-sliced)"
timeout 80 bash experiments/with_mps.sh python3 -m pytest -q -m gpu \
    tests/test_verbs_loopback_gpu.py::test_across_processes_through_the_loopback_nic \
    -p no:cacheprovider > $OUT/verbs_mpi_mps.log 2>&1; tail -1 $OUT/verbs_mpi_mps.log
echo "== sanitizers"
timeout 130 python3 experiments/sanitize.py --tools racecheck \
    --cases gemm_allreduce_fused_1x2 --ce-copy-method each \
    --timeout 120 --parallel 1 --out $OUT/sanitize.jsonl 2>&1 | tee $OUT/sanitize.log \
    | grep -E "^(none|memcheck|racecheck|synccheck) "
echo "== AllGather+GEMM benchmark"
timeout 100 python3 experiments/tp_pair.py --quick --ops allgather_gemm --layouts 1x2 2x2 \
    --rounds 3 --out $OUT/tp_pair.jsonl 2>&1 | tail -16
