#!/bin/bash
# Stream-K (the tiles after the full waves shared out by k-blocks): its GPU tests beside
# split-K's, and the probe against the same tile without it and the rule's pick, on reduced
# grids and shapes of a wave or less (about 3 min); at most 8 files under $OUT:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "
from mkrt.kernels import gemm as G
print('\n'.join(s.uri[:-6] for s in G.default_specs()
                if s.split == 'streamk' or (s.dtype == 'bf16' and s.b_layout == 'nk' and s.block_n % 64 == 0)))" | \
    xargs -P 15 -I{} sh -c 'python3 -m mkrt compile --filter {} > /dev/null 2>&1 || echo "compile {} failed"'
echo "compiled at $SECONDS s"
timeout 120 python3 -m pytest -q -m gpu tests/test_gemm.py -k "stream_k or split_k" -p no:cacheprovider 2>&1 | \
    grep -v Warning | tail -4 | tee $OUT/pytest.txt
echo "tested at $SECONDS s"
timeout 150 python3 experiments/gemm_probe.py --probes streamk --iterations 10 --repeats 7 \
    --out $OUT/streamk.jsonl 2>&1 | grep -v Warning | tee $OUT/streamk.txt
echo "done at $SECONDS s"
