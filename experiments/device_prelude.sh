# Sourced by the device scripts: the environment every GPU run here uses (a JIT cache of
# its own, no NVLink multicast anywhere), the GPU's name first in $OUT/$1, and
# `attention SHAPES VARIANTS`, which times mkrt.attention and the given configurations
# against torch's backends into $OUT/attention.jsonl (log lines appended to $OUT/$1).
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LOG=$OUT/$1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $LOG
attention() {   # shapes, variants
    timeout ${ATT_S:-60} python3 experiments/attention.py --shapes $1 --variants $2 \
        --out $OUT/attention.jsonl 2>&1 | grep -v Warning | grep -v "return torch" | tee -a $LOG
}
