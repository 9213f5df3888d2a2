#!/bin/bash
# The second call of the next session (about 8 min), after pending_device_run.sh:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run_2.sh   (run with carry [".bench_old"])
# 1. memcheck and synccheck of the role-board kernels (1x2, 2x2; racecheck is in the first);
# 2. the planner's fused/unfused pick with the controller on (its fit predates it), on the
#    calibration and held-out sets, 1x2 and 2x2: the rows a refit needs (experiments/planner.py --fit);
# 3. attention's default configuration judged on shapes it was not chosen on (held out:
#    other lengths, GQA, f16) against the other candidates, same run;
# 4. the controller on a finer grid (every 2 CTAs) for three shapes, as the issue asks;
# 5. gemm_allreduce before the role board (9c5fb11) and now, A/B.
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== sanitizers"
timeout 130 python3 experiments/sanitize.py --tools memcheck synccheck \
    --cases gemm_allreduce_fused_1x2 gemm_allreduce_fused_2x2 gemm_reducescatter_fused_2x2 \
    --ce-copy-method each --timeout 60 --parallel 2 --out $OUT/sanitize.jsonl 2>&1 \
    | tee $OUT/sanitize.log | grep -E "^(none|memcheck|racecheck|synccheck) "
echo "== planner"
timeout 150 python3 experiments/planner.py --layouts 1x2 2x2 --sets calibration held_out \
    --limit 12 --rounds 3 --out $OUT/planner.jsonl 2>&1 | tail -6
echo "== attention, held-out shapes"
timeout 120 python3 experiments/attention.py --repeats 3 --iterations 5 \
    --shapes 2:2048:32:8:128:1,2:8192:32:8:128:0,8:1024:16:16:128:1,1:16384:8:8:128:1,4:2048:16:16:64:1 \
    --variants bkv128_s2_pp0,bkv64_s4_pp0,bkv128_s3_pp1 --out $OUT/attention.jsonl 2>&1 | tail -10
echo "== controller, every 2 CTAs"
timeout 90 python3 experiments/controller.py --layouts 1x2 2x2 --sets held_out --limit 3 --step 2 \
    --rounds 3 --out $OUT/controller.jsonl 2>&1 | tail -6
echo "== A/B: gemm_allreduce before the role board (9c5fb11, static strided roles) and now"
# needs the run's carry: [".bench_old"] (git archive 9c5fb11 mkrt experiments | tar -x -C .bench_old)
if [ -d .bench_old/mkrt ]; then
  MKRT_JIT_CACHE_DIR=/tmp/mkrt-cache-old PYTHONPATH=$PWD/.bench_old timeout 90 python3 .bench_old/experiments/gemm_allreduce.py \
      --layouts 1x2 2x2 --cases llm --iters 20 --out $OUT/gemm_allreduce_before.jsonl 2>&1 | tail -8
  timeout 90 python3 experiments/gemm_allreduce.py --layouts 1x2 2x2 --cases llm --iters 20 \
      --out $OUT/gemm_allreduce_now.jsonl 2>&1 | tail -8
fi
