#!/bin/bash
# Prepared for the next session (not run yet), at most 8 files under $OUT (about 6 min):
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# 1. grouped GEMM and MoE GPU tests at this commit (their last host-side edit, 3d866ac, ran
#    CPU tests only);
# 2. the GEMM suite on 132, 116 and 100 SMs twice, to tell the scaling pair that misses
#    1.05 (3000x5000x7000 at 308fa51, 7168^3 at 356c5e6) from run-to-run spread.
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "
from mkrt.kernels import gemm as G, grouped_gemm as GG
specs = [s for s in G.default_specs() if s.b_layout == 'nk' and s.dtype == 'bf16' and s.block_n % 64 == 0]
print('\n'.join(s.uri[:-6] for s in specs + GG.default_specs()))" | \
    xargs -P 15 -I{} sh -c 'python3 -m mkrt compile --filter {} > /dev/null 2>&1 || echo "compile {} failed"'
echo "compiled at $SECONDS s"
timeout 200 python3 -m pytest -q -m gpu tests/test_grouped_gemm.py tests/test_moe.py -p no:cacheprovider 2>&1 | \
    grep -v Warning | tail -4 | tee $OUT/pytest.txt
for run in 1 2; do
    timeout 120 python3 experiments/gemm.py --sms full,116,100 --repeats 9 --out $OUT/gemm.jsonl 2>&1 | \
        grep -E "geomean|scaling.*(1\.0[5-9]|1\.[1-9])|FAILED" | tee -a $OUT/gemm.txt
done
echo "done at $SECONDS s"
