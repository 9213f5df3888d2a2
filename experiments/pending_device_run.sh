#!/bin/bash
# One device call (about 6 min), rows under $OUT:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# Clusters of two with a CTA-scope release of the partner's stage (was cluster scope, ~1 us
# per k-step at any grid):
# 1. the GPU tests of clusters;
# 2. the sweep of the three tiles that won shapes (128x256 on 19 of 30, 64x128 on 6, 128x192
#    on 3 at b218b7c), each with and without clusters, FIT and HELD_OUT, torch in the same run;
# 3. the rule refitted on the FIT rows of this run (its judgement on HELD_OUT printed), the
#    fit file copied to $OUT;
# 4. the suite on 116 and 100 SMs with that fit (scaling), as far as the call's time goes.
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== gemm cluster tests"
timeout 100 python3 -m pytest -q -m gpu tests/test_gemm.py -k "cluster" -p no:cacheprovider \
    -p timeout --timeout=90 2>&1 | tail -2
echo "== sweep: three tiles, with and without clusters"
timeout 200 python3 experiments/gemm_tune.py --cluster --configs 128x256 128x192 64x128 --split-k 1 \
    --out $OUT/gemm_tune.jsonl 2>&1 | grep -E "best|WRONG"
echo "== the rule refitted on this run's FIT rows"
python3 experiments/gemm_tune.py --fit --commit "$MKRT_BENCH_COMMIT" --out $OUT/gemm_tune.jsonl 2>&1 | tail -40
cp mkrt/kernels/gemm_rule_fit.json $OUT/
echo "== suite on 116 and 100 SMs with the refitted rule"
timeout $(( 370 - SECONDS > 20 ? 370 - SECONDS : 20 )) python3 experiments/gemm.py --sms 116,100 \
    --out $OUT/gemm.jsonl 2>&1 | tail -70
echo "done at $SECONDS s"
