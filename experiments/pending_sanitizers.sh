#!/bin/bash
# The sanitizer runs without a finished verdict, one device call, rows under $OUT:
#   MKRT_BENCH_COMMIT=<commit> [JOBS="tool:case ..."] bash experiments/pending_sanitizers.sh
# The multi-node (2x2) cases under initcheck and racecheck, one at a time, with 8 CTAs per
# rank (the same kernels, less for the tools to track) and 60 s waits. At 0837e29 three of
# six finished clean; the other three ended in their bounded waits because one rank's
# kernel or the proxy's copies did not run while another rank's kernel waited under the
# tool (experiments/notes/reliability.md). Each run now keeps the tool's first reports.
# PROCESSES=1 runs each case as one process per rank under mpiexec and a private MPS
# daemon (sanitize.py --processes): the ranks' kernels then run side by side whatever the
# tool does within a process (never run yet; if the tool refuses MPS, the rows say so).
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MKRT_SANITIZE_WAIT_MS=60000 MKRT_SANITIZE_CTAS=8    # 8 CTAs per rank: less to track
DEADLINE=${DEADLINE:-570}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== sanitizers, one at a time"
# JOBS: "tool:case" words; the default is the three without a finished run at 0837e29
JOBS=${JOBS:-"racecheck:gemm_reducescatter_fused_2x2 initcheck:gemm_allreduce_unfused_2x2 racecheck:gemm_allreduce_unfused_2x2"}
for job in $JOBS; do
  set -- ${job/:/ }
  left=$(( DEADLINE - SECONDS ))
  [ $left -lt 90 ] && { echo "left for the next call: $job"; continue; }
  bound=$(( left < 180 ? left - 50 : 130 ))
  # room for the run without the tool first (about 15 s), so a tool run cut at its bound
  # is still written as a row
  timeout $(( bound + 45 )) python3 experiments/sanitize.py --tools $1 --cases $2 --parallel 1 \
      --ce-copy-method each --timeout $bound ${PROCESSES:+--processes} --out $OUT/sanitize.jsonl 2>&1 \
      | grep -E "^$1 "
  # the tool's first reports of the run (what it found, in which kernel)
  tail -1 $OUT/sanitize.jsonl | python3 -c "import json,sys; [print('   ', l) for l in json.loads(sys.stdin.read()).get('first_reports', [])[:8]]"
done
echo "done at $SECONDS s"
