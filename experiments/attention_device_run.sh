#!/bin/bash
# One device call for the attention engine (files under $OUT):
#   bash experiments/attention_device_run.sh
# 1. GPU tests of mkrt.attention and the ring kernel (they share the engine);
# 2. the engine's configurations on the main shapes against torch's backends, same run;
# 3. the ring (1x4 emulated) on two shapes against its baselines;
# 4. if experiments/old_engine/ holds an earlier engine, the same shapes on it (same machine);
# 5. Nsight Compute on one call of the engine and of cuDNN (where the time goes).
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
SHAPES=${SHAPES:-4:4096:16:16:128:0,4:4096:16:16:128:1,4:12288:16:16:128:0,4:12288:16:16:128:1,1:8192:64:8:128:1}
VARIANTS=${VARIANTS:-bkv64_s4_pp1,bkv128_s2_pp1,bkv128_s3_pp1,bkv176_s2_pp1,bkv192_s2_pp1,bkv128_s2_pp0}
timeout 200 python3 -m pytest -q -m gpu tests/test_attention.py tests/test_ring_attention_gpu.py \
    -p no:cacheprovider 2>&1 | grep -v Warning | tail -8 | tee $OUT/pytest.txt
echo "tests done at $SECONDS s"
timeout 200 python3 experiments/attention.py --shapes $SHAPES --variants $VARIANTS \
    --out $OUT/attention.jsonl 2>&1 | grep -v Warning | tee $OUT/attention.txt
timeout 60 python3 experiments/attention.py --shapes 4:4096:16:16:64:0,4:4096:16:16:64:1 \
    --variants ${VARIANTS64:-bkv128_s3_pp1,bkv176_s3_pp1,bkv192_s2_pp1,bkv192_s3_pp1,bkv192_s3_pp0} \
    --out $OUT/attention.jsonl 2>&1 | grep -v Warning | tee -a $OUT/attention.txt
echo "timed at $SECONDS s"
if [ "${RING:-1}" = 1 ]; then
    timeout 120 python3 experiments/ring_attention.py --layouts 1x4 --shapes 4:3072:16:16:128:0,4:3072:16:16:128:1 \
        --out $OUT/ring_attention.jsonl 2>&1 | grep -v Warning | tee $OUT/ring.txt
    echo "ring timed at $SECONDS s"
fi
if [ -f experiments/old_engine/attention_tile.py ]; then
    old=/tmp/old-engine; rm -rf $old; mkdir -p $old; cp -r mkrt experiments $old/
    cp experiments/old_engine/attention_tile.py $old/mkrt/kernels/device/attention_tile.py
    cp experiments/old_engine/attention.py $old/mkrt/kernels/attention.py
    mkdir -p $OUT/old
    (cd $old && PYTHONPATH=$old MKRT_JIT_CACHE_DIR=/tmp/mkrt-cache-old timeout 90 python3 experiments/attention.py \
        --shapes 4:4096:16:16:128:0,4:4096:16:16:128:1 --variants bkv128_s2_pp1 \
        --out $OUT/old/attention.jsonl 2>&1 | grep -v Warning | tee $OUT/old/attention.txt)
    echo "old engine timed at $SECONDS s"
fi
if [ "${NCU:-1}" = 1 ] && command -v ncu > /dev/null; then
    cat > /tmp/one_call.py <<'PY'
import torch, mkrt
from torch.nn.attention import SDPBackend, sdpa_kernel
q, k, v = (torch.randn(4, 4096, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for _ in range(2):
    mkrt.attention(q, k, v)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)))
torch.cuda.synchronize()
PY
    timeout 120 ncu --clock-control none --kernel-name regex:"attention_forward|sdpa|fprop|fmha|flash" \
        --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \
        --section SchedulerStats --section LaunchStats --section Occupancy \
        python3 /tmp/one_call.py > $OUT/ncu.txt 2>&1
    echo "ncu done at $SECONDS s (rc $?)"
fi
