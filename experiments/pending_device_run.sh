#!/bin/bash
# Every GPU test at one commit (the closing check of a session): each default spec of every
# kernel family built in parallel first, then pytest -m gpu over tests/ (about 8 min):
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "
from mkrt.kernels.registry import all_specs
print('\n'.join(s.uri for _, s in all_specs()))" | \
    xargs -P 15 -I{} sh -c 'python3 -m mkrt compile --filter {} > /dev/null 2>&1 || echo "compile {} failed"'
echo "compiled at $SECONDS s"
timeout ${PYTEST_TIMEOUT:-500} python3 -m pytest -q -m gpu tests/ -p no:cacheprovider > $OUT/gpu_pytest.log 2>&1
echo "pytest rc $? at $SECONDS s"
tail -25 $OUT/gpu_pytest.log
