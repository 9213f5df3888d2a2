#!/bin/bash
# One device call (at most about 10 min), files under $OUT:
#   MKRT_BENCH_COMMIT=<commit> [SUITE_RUNS=0..2] [GROUPED=0] [PROBE=0] bash experiments/pending_device_run.sh
# In order of what matters most, so a timeout cuts the least:
# 1. GPU tests of mkrt.gemm's defaults, split-K and stream-K (their parts are added up by
#    device/partial_sums.py; the rule takes stream-K for the last wave, gemm_rule.stream_k_pays);
# 2. the GEMM suite on 132, 116 and 100 SMs SUITE_RUNS times: the scaling pairs, run to run;
# 3. the grouped GEMM's stream-K against whole tiles on the expert-GEMM suite and held-out
#    set (grouped_gemm_stream_k.jsonl, outputs checked and repeated bit for bit), then its
#    GPU tests;
# 4. stream-K against the same tile without it, in turns, on suite cases where the rule
#    takes it (gemm_streamk_probe.jsonl).
export MKRT_JIT_CACHE_DIR=${MKRT_JIT_CACHE_DIR:-/tmp/mkrt-cache-$$} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export MKRT_GEMM_STREAM_K_RULE=1     # the default since 6888eda's suite run
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "
from mkrt.kernels import gemm as G, grouped_gemm as GG
specs = [s for s in G.default_specs() if s.dtype == 'bf16' and s.block_n % 64 == 0
         and (s.b_layout == 'nk' or s.split == 'streamk')]
specs += [s for s in GG.default_specs() if s.dtype == 'bf16' and not s.cluster]
print('\n'.join(s.uri for s in specs))" | \
    xargs -P 15 -I{} sh -c 'python3 -m mkrt compile --filter {} > /dev/null 2>&1 || echo "compile {} failed"' | \
    tee $OUT/compile.txt
echo "compiled at $SECONDS s"
timeout 150 python3 -m pytest -q -m gpu \
    "tests/test_gemm.py::test_gemm_matches_float32_reference" "tests/test_gemm.py::test_gemm_with_fewer_ctas" \
    "tests/test_gemm.py::test_split_k_matches_the_reference_and_repeats_bit_for_bit" \
    "tests/test_gemm.py::test_split_k_on_two_streams_at_once_keeps_the_parts_apart" \
    "tests/test_gemm.py::test_stream_k_matches_the_reference_and_repeats_bit_for_bit" \
    "tests/test_gemm.py::test_the_rules_stream_k_runs_by_default_and_gives_way_to_explicit_options" \
    -p no:cacheprovider 2>&1 | grep -v Warning | tail -6 | tee $OUT/pytest.txt
echo "tests done at $SECONDS s"
for run in $(seq 1 ${SUITE_RUNS:-1}); do
    timeout 110 python3 experiments/gemm.py --sms full,116,100 --repeats 7 --out $OUT/gemm.jsonl 2>&1 | \
        grep -E "geomean|scaling|FAILED" | tee -a $OUT/gemm.txt
    echo "suite $run done at $SECONDS s" | tee -a $OUT/gemm.txt
done
if [ "${GROUPED:-1}" = 1 ]; then
    timeout 120 python3 experiments/grouped_gemm.py --stream-k-out $OUT/grouped_gemm_stream_k.jsonl \
        --only-stream-k --iterations 10 --rounds 5 2>&1 | grep -v Warning | tee $OUT/grouped_stream_k.txt
    echo "grouped stream-K done at $SECONDS s"
    timeout 90 python3 -m pytest -q -m gpu tests/test_grouped_gemm.py -k "stream_k or matches_the_reference" \
        -p no:cacheprovider 2>&1 | grep -v Warning | tail -6 | tee $OUT/grouped_pytest.txt
    echo "grouped tests done at $SECONDS s"
fi
if [ "${PROBE:-1}" = 1 ]; then
    timeout 60 python3 experiments/gemm_probe.py --probes streamk --repeats 7 --out $OUT/gemm_streamk_probe.jsonl \
        --streamk-cases 7168x7168x7168@116 8192x8192x8192@116 16384x4096x14336@132 \
        4096x14336x4096@132 32768x1024x4096@100 2>&1 | grep -v Warning | tee $OUT/probe.txt
    echo "probe done at $SECONDS s"
fi
