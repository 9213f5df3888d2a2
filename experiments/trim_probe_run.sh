#!/bin/bash
# The trimmed widths on the GPU: build them, run their GPU tests, time them on seven shapes
# against 128x256 and 128x192 (with and without clusters) and torch.matmul, in turns.
#   MKRT_BENCH_COMMIT=<commit> bash experiments/trim_probe_run.sh    (about 3 min)
export MKRT_JIT_CACHE_DIR=/tmp/mkrt-cache PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "
from mkrt.kernels import gemm as G
print('\n'.join(s.uri[:-6] for s in G.default_specs() if s.b_layout=='nk' and (s.block_n % 64 or (s.block_m==128 and s.block_n in (192,256)))))" | \
  xargs -P 14 -I{} sh -c 'python3 -m mkrt compile --filter {} >/dev/null 2>&1 || echo "compile {} failed"'
echo "compiled at $SECONDS s"
timeout 240 python3 -m pytest -q -m gpu tests/test_gemm.py -k "trimmed or every_tile or bit_identical or split" 2>&1 | tail -5 | tee $OUT/pytest.txt
echo "tests at $SECONDS s"
timeout 240 python3 experiments/gemm_tune.py --shapes 3000x5000x7000 2504x2500x2504 96x28672x8192 3072x12288x3072 1536x1536x1536 4096x14336x4096 5000x3000x2000 \
   --configs 128x256 128x192 --cluster --trim --split-k 1 --tail-split --repeats 7 --out $OUT/probe.jsonl 2>&1 | tee $OUT/probe.txt | grep -v "^given.*best"
echo "done at $SECONDS s"
