#!/bin/bash
# The next two device calls (about 9 min each with the start, at most 8 files under $OUT),
# most important first:   MKRT_BENCH_COMMIT=<commit> bash experiments/pending_device_run.sh A
# then the same with B (and C). Nothing here has run on a GPU yet (no machine could be had in the
# twentieth and twenty-first sessions).
# A:
# 0. GPU tests of mkrt.grouped_mlp (the experts' two GEMMs and SwiGLU in one launch, never run);
# 1. GPU tests of the gathering role's new inter-node path (4317030: one put per chunk as
#    soon as it is copied, forwards per landed chunk) through AllGather+GEMM (1x2 .. 2x3,
#    3x1, muted ranks) and ring attention (own K/V in place, direct_own=True, and from the
#    gathered copy; the trace build), the K/V-slot tests left to B;
# 2. the ring at 4096 rows per rank on 1x2, 1x4, 2x2, causal or not, own K/V gathered and
#    direct: of floor against b7b6849 (2x2 0.751 / 0.582, 1x4 0.901 / 0.855, 1x2 0.865 /
#    0.735), where the inter-node block went as one put after the whole own copy;
# 3. AllGather+GEMM on 2x2 against unfused (tp_pair --quick): it lost on every projection
#    shape at ceaa97b (0.93-0.98), the cost in the blocks from the other node;
# 4. where the ring's time goes on 2x2 (experiments/ring_trace.py) with 32 and 28 CTAs
#    per rank (the proxy's copies run on the SMs the ranks leave free);
# 5. the attention engine's GPU tests (its loads take their map from the work list; its
#    work lists may resume tiles now, compiled out of its own builds).
# B:
# 1. the bounded ring's GPU tests (RingAttention(slots=k), never run; in a process of
#    their own, so a fault cannot take the others down);
# 2. its time (slots 1, 2) against the gathered ring at 4096 rows per rank, 1x2 and 1x4;
# 3. its trace beside the gathered ring's (1x4, causal);
# 4. the proxy's and gemm_allreduce's 2x2 GPU tests (the ce transport's signals now wait
#    with their puts, 61ca72f);
# 5. where the gathered ring's time goes on 1x2 and 1x4.
# E (next): the K/V-slot fix, the fused MoE's 2x2 failure, routing CTAs 4/8/16 on 1x4.
# D (ran at d26052d: experiments/results/pending_device_run_d26052d.log): MoE's and grouped_mlp's GPU tests, the
# AllGather+GEMM and ring tests, grouped_mlp --quick, MoE 1x4 fused or not, the ring on 2x2.
# C:
# 1. MoE's GPU tests, fused_experts among them, and mkrt.grouped_mlp's;
# 2. grouped_mlp against the three-launch path and torch._grouped_mm (experiments/grouped_mlp.py);
# 3. MoE on 1x4 with the experts fused or not, against the unfused pipeline (experiments/moe.py).
source experiments/device_prelude.sh log.txt
trace() {   # layouts, shapes, CTAs per rank, own K/V variants, raw file
    timeout ${TRACE_S:-90} python3 experiments/ring_trace.py --layouts $1 --shapes $2 --calls 3 \
        --repeats 3 --own $4 --ctas $3 --out $OUT/ring_trace.jsonl --raw $OUT/$5 2>&1 | \
        grep -v Warning | tee -a $LOG
}
ring() {    # layouts, extra options
    timeout ${RING_S:-120} python3 experiments/ring_attention.py --layouts $1 \
        --shapes 4:4096:16:16:128:1,4:4096:16:16:128:0 $2 --iterations 3 --repeats 3 \
        --out $OUT/ring_attention.jsonl 2>&1 | grep -v Warning | grep -v "return torch" | \
        grep -v "F.scaled_dot" | tee -a $LOG
}
if [ "$1" = E ]; then
    # after D (run at d26052d): the K/V-slot fix (ba47dba), the fused MoE's 2x2 failure, its
    # routing CTAs on Qwen3
    timeout ${PROBE_S:-60} python3 experiments/slots_probe.py 2>&1 | grep "call0" | tee -a $LOG
    timeout ${SLOT_TEST_S:-150} python3 -m pytest -q -m gpu tests/test_ring_attention_gpu.py -k slots \
        -p no:cacheprovider --tb=line 2>&1 | grep -E "^/|passed|failed" | tee -a $LOG
    timeout ${MOE_TEST_S:-60} python3 -m pytest -q -m gpu tests/test_moe.py -k "keep_one_epoch and 2x2" \
        -p no:cacheprovider --tb=short 2>&1 | grep -E "test_moe.py:[0-9]+|^E  " | head -12 | tee -a $LOG
    timeout ${MOE_S:-150} python3 experiments/moe.py --layouts 1x4 --models qwen3_30b_a3b mixtral_8x7b \
        --tokens 1024 --experts-kernels separate fused --route-ctas 8 16 --out $OUT/moe.jsonl 2>&1 | \
        grep -v Warning | tee -a $LOG
    echo "E done at $SECONDS s" | tee -a $LOG
    exit 0
fi
if [ "$1" = D ]; then
    # one call for a short budget: the newest code's GPU tests first, then one number each
    timeout ${MOE_TEST_S:-150} python3 -m pytest -q -m gpu tests/test_moe_experts.py tests/test_moe.py \
        -p no:cacheprovider 2>&1 | grep -v Warning | tail -8 | tee -a $LOG
    echo "moe tests done at $SECONDS s" | tee -a $LOG
    timeout ${TEST_S:-120} python3 -m pytest -q -m gpu tests/test_allgather_gemm_gpu.py \
        tests/test_ring_attention_gpu.py -k "not across_processes and not slots" -p no:cacheprovider \
        2>&1 | grep -v Warning | tail -6 | tee -a $LOG
    echo "ag/ring tests done at $SECONDS s" | tee -a $LOG
    timeout ${MLP_S:-60} python3 experiments/grouped_mlp.py --quick --out $OUT/grouped_mlp.jsonl 2>&1 | \
        grep -v Warning | tee -a $LOG
    echo "grouped_mlp done at $SECONDS s" | tee -a $LOG
    timeout ${MOE_S:-60} python3 experiments/moe.py --layouts 1x4 --models mixtral_8x7b qwen3_30b_a3b \
        --tokens 1024 --experts-kernels separate fused --out $OUT/moe.jsonl 2>&1 | \
        grep -v Warning | tee -a $LOG
    echo "moe done at $SECONDS s" | tee -a $LOG
    RING_S=${RING_S:-70} ring "2x2" "--own gathered"
    echo "ring done at $SECONDS s" | tee -a $LOG
    exit 0
fi
if [ "$1" = C ]; then
    # the experts in one launch: MoE's GPU tests with it, its time alone and inside MoE
    timeout ${MOE_TEST_S:-150} python3 -m pytest -q -m gpu tests/test_moe.py tests/test_moe_experts.py \
        -p no:cacheprovider 2>&1 | grep -v Warning | tail -6 | tee -a $LOG
    echo "moe tests done at $SECONDS s" | tee -a $LOG
    timeout ${MLP_S:-150} python3 experiments/grouped_mlp.py --out $OUT/grouped_mlp.jsonl 2>&1 | \
        grep -v Warning | tee -a $LOG
    echo "grouped_mlp done at $SECONDS s" | tee -a $LOG
    timeout ${MOE_S:-200} python3 experiments/moe.py --layouts 1x4 --models qwen3_30b_a3b mixtral_8x7b \
        --tokens 1024 4096 --experts-kernels separate fused --out $OUT/moe.jsonl 2>&1 | \
        grep -v Warning | tee -a $LOG
    echo "moe done at $SECONDS s" | tee -a $LOG
    exit 0
fi
if [ "$1" = B ]; then
    timeout ${SLOT_TEST_S:-150} python3 -m pytest -q -m gpu tests/test_ring_attention_gpu.py -k slots \
        -p no:cacheprovider 2>&1 | grep -v Warning | tail -6 | tee -a $LOG
    echo "slot tests done at $SECONDS s" | tee -a $LOG
    ring "1x2 1x4" "--slots none 1 2"
    echo "slots done at $SECONDS s" | tee -a $LOG
    trace 1x4 4:4096:16:16:128:1 default "slots2 direct" ring_trace_raw_slots.jsonl
    echo "slots trace done at $SECONDS s" | tee -a $LOG
    timeout ${PROXY_TEST_S:-80} python3 -m pytest -q -m gpu tests/test_proxy_gpu.py \
        tests/test_gemm_allreduce_gpu.py -k "ce or 2x2 or ping" -p no:cacheprovider 2>&1 | \
        grep -v Warning | tail -3 | tee -a $LOG
    echo "proxy tests done at $SECONDS s" | tee -a $LOG
    trace "1x2 1x4" 4:4096:16:16:128:1,4:4096:16:16:128:0 default "direct gathered" ring_trace_raw.jsonl
    echo "trace 1x2 1x4 done at $SECONDS s" | tee -a $LOG
    exit 0
fi
timeout ${EXPERTS_TEST_S:-90} python3 -m pytest -q -m gpu tests/test_moe_experts.py \
    -p no:cacheprovider 2>&1 | grep -v Warning | tail -6 | tee -a $LOG
echo "grouped_mlp tests done at $SECONDS s" | tee -a $LOG
timeout ${TEST_S:-170} python3 -m pytest -q -m gpu tests/test_allgather_gemm_gpu.py \
    tests/test_ring_attention_gpu.py -k "not across_processes and not slots" -p no:cacheprovider \
    2>&1 | grep -v Warning | tail -4 | tee -a $LOG
echo "tests done at $SECONDS s" | tee -a $LOG
ring "1x2 1x4 2x2" "--own gathered direct"
echo "ring done at $SECONDS s" | tee -a $LOG
timeout ${TP_S:-100} python3 experiments/tp_pair.py --ops allgather_gemm --layouts 2x2 --quick \
    --rounds 3 --out $OUT/tp_pair.jsonl 2>&1 | grep -v Warning | tee -a $LOG
echo "tp_pair done at $SECONDS s" | tee -a $LOG
trace 2x2 4:4096:16:16:128:1,4:4096:16:16:128:0 "default 28" "direct gathered" ring_trace_raw.jsonl
echo "trace 2x2 done at $SECONDS s" | tee -a $LOG
timeout ${ATT_TEST_S:-75} python3 -m pytest -q -m gpu tests/test_attention.py \
    -p no:cacheprovider 2>&1 | grep -v Warning | tail -3 | tee -a $LOG
echo "attention tests done at $SECONDS s" | tee -a $LOG
