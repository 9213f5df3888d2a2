#!/bin/bash
# One device call (about 7 min), each step bounded, rows under $OUT:
#   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh
# 1. the GEMM gaps: clusters of two at fixed grids (cut grid or slow pipeline?), the cost of
#    K rows off a 128-byte line, torch.matmul's kernel names (experiments/gemm_probe.py);
#    the suite's two worst shapes again (gemm.py);
# 2. host time per call on 1x4 (not measured at 8c681d7);
# 3. why the 2x2 cases never finish under initcheck and racecheck: one run each with the
#    cases' waits at 45 s, so the CommTimeout they end in names the flag and the rank.
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== gemm probes"
timeout 170 python3 experiments/gemm_probe.py --out $OUT/gemm_probe.jsonl 2>&1 | tail -80
echo "== gemm suite's worst two shapes again"
timeout 60 python3 experiments/gemm.py --shapes 24576x8192x1024,3000x5000x7000 --b-layout nk \
    --sms full --out $OUT/gemm.jsonl 2>&1 | tail -4
echo "== host time per call on 1x4"
timeout 60 python3 experiments/runtime.py --layouts 1x4 --ops allgather gemm_allreduce \
    --out $OUT/runtime.jsonl 2>&1 | grep -v "^ "
echo "== where the 2x2 cases stop under initcheck and racecheck (waits 45 s)"
for job in "initcheck allgather_2x2" "racecheck gemm_reducescatter_fused_2x2"; do
  set -- $job
  MKRT_SANITIZE_WAIT_MS=45000 MKRT_SANITIZE_CTAS=8 timeout 130 python3 experiments/sanitize.py \
      --tools $1 --cases $2 --parallel 1 --ce-copy-method each --timeout 110 \
      --out $OUT/sanitize_probe.jsonl 2>&1 | grep -E "^$1 "
done
python3 - <<'PY' 2>/dev/null
import json, os
for line in open(os.environ["OUT"] + "/sanitize_probe.jsonl"):
    row = json.loads(line)
    if row["tool"] != "none":
        print("----", row["tool"], row["case"], "timed_out", row["timed_out"])
        print(row["tail"][-1500:])
PY
echo "done at $SECONDS s"
