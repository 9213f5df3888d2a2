"""Why do claimed tiles cost mkrt.attention 4-16% where tiles are even? A probe on one GPU.

Builds of the default head-dim-128 configuration (128-key blocks, 3 stages, pingpong),
timed in rounds that each start one build further on (mkrt.bench.interleaved_ms):

- dealt:   tiles dealt out (CTA c: c, c + ctas, ...), the default;
- claimed: the producer claims each tile from the counter (atomicAdd) and hands it to the
           consumers (AttentionSpec(claimed=1));
- handed:  the claimed build's code with the counter replaced by the fixed deal: the
           producer "claims" c, c + ctas, ... (no atomic, the same tiles as dealt) and hands
           them over the same way.

If handed runs like dealt, the cost is the claims at run time (their order or their
latency); if it runs like claimed, it is the claimed build's code. Two bisections of that
code: handed_noreset (no counter reset by the last CTA out) and handed_dc (the producer
hands over as claimed builds do, the consumers walk the dealt-out list themselves). And a
candidate fix: claimed_pout, the claimed build whose producer thread counts its CTA out
after its last claim, without the CTA-wide barrier of reset_when_last_out.
The handed build exists only here (a copy of the kernel source with the queue swapped).

    PYTHONPATH=$PWD python3 experiments/attention_claim_probe.py --out experiments/results/attention_claim_probe.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mkrt.bench import append_jsonl, interleaved_ms, record  # noqa: E402
from mkrt.kernels import attention as A  # noqa: E402

# The fixed deal behind the claimed build's interface: claim() is called by the producer
# thread only, once per tile, in order, so a counter of its own steps through c, c + ctas, ...
HANDED_QUEUE = r"""
struct HandedQueue {
    mutable int next;
    int ctas, count;
};
// found by argument-dependent lookup from roles::claimed_position (global namespace)
__device__ __forceinline__ int claim(const HandedQueue& q, int* left_because) {
    const int position = q.next;
    q.next += q.ctas;
    if (position >= q.count) { *left_because = 1; return -1; }
    return position;
}
"""


def swap(text: str, swaps) -> str:
    """`text` with each (old, new) replaced once, in order."""
    for old, new in swaps:
        if old not in text:
            raise RuntimeError(f"claim probe: the kernel source changed ({old[:60]!r} is gone)")
        text = text.replace(old, new, 1)
    return text


@dataclasses.dataclass(frozen=True)
class PatchedSpec(A.AttentionSpec):
    """mkrt.attention's kernel with `swaps` made in its source and `render_swaps` in the
    rendered text (which holds the engine's pieces too)."""
    swaps = ()
    render_swaps = ()

    def template(self):
        return dataclasses.replace(A.ATTENTION, text=swap(A.ATTENTION.text, self.swaps))

    def render(self):
        return swap(super().render(), self.render_swaps)


HANDED_SWAPS = (("struct HeadWork {", HANDED_QUEUE + "struct HeadWork {"),
                ("    mkrt::roles::CountedQueue queue;", "    HandedQueue queue;"),
                ("{counter, q_blocks * batches * heads}",
                 "{(int)blockIdx.x, (int)gridDim.x, q_blocks * batches * heads}"),
                ("deal, {nullptr, 0}};", "deal, {0, 0, 0}};"))      # the dealt-out branch


@dataclasses.dataclass(frozen=True)
class HandedSpec(PatchedSpec):
    family = "attention_handed"
    swaps = HANDED_SWAPS


@dataclasses.dataclass(frozen=True)
class HandedNoResetSpec(PatchedSpec):
    """handed, without the counter's reset by the last CTA out (a __syncthreads and an
    atomic at the end of every CTA; the handed order needs no counter)."""
    family = "attention_handed_noreset"
    swaps = HANDED_SWAPS + (("        mkrt::roles::reset_when_last_out(counter);", ""),)


@dataclasses.dataclass(frozen=True)
class HandedDealtConsumersSpec(PatchedSpec):
    """handed on the producer's side only: the consumers walk the dealt-out list
    themselves (the same tiles, since handed is the dealt-out order), never reading the
    handed position; the producer still claims, decodes and publishes each tile."""
    family = "attention_handed_dc"
    # the claimed branch's cta, ctas for get(); the consumers' claimed loop switched off
    swaps = HANDED_SWAPS + (("0, 0, band, nullptr, {(int)blockIdx.x",
                             "(int)blockIdx.x, (int)gridDim.x, band, nullptr, {(int)blockIdx.x"),)
    render_swaps = (("        if constexpr (Work::CLAIMED) {\n            // the first hand-over",
                     "        if constexpr (false) {\n            // the first hand-over"),)


# The counter's reset without the CTA-wide barrier before it: only the producer thread
# claims, so once it has made its last claim it can count its CTA out at once.
COUNT_OUT_BY_PRODUCER = r"""
__device__ __forceinline__ void count_out_by_producer(mkrt::u64* counter) {
    if (threadIdx.x == 0 &&
        atomicAdd((unsigned long long*)(counter + 1), 1ull) == (unsigned long long)(gridDim.x - 1)) {
        counter[0] = 0;
        counter[1] = 0;
    }
}
"""


@dataclasses.dataclass(frozen=True)
class ClaimedProducerOutSpec(PatchedSpec):
    """claimed (the counter's atomics), with the reset of count_out_by_producer."""
    family = "attention_claimed_pout"
    swaps = (("struct HeadWork {", COUNT_OUT_BY_PRODUCER + "struct HeadWork {"),
             ("        mkrt::roles::reset_when_last_out(counter);", "        count_out_by_producer(counter);"))


BUILDS = ("dealt", "claimed", "handed", "handed_noreset", "handed_dc", "claimed_pout")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4:4096:16:16:128:0,4:12288:16:16:128:0,4:4096:16:16:128:1")
    parser.add_argument("--turns", type=int, default=2, help="rounds per build (each build leads some)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    import cupy
    import numpy as np

    from mkrt.arrays import bfloat16
    from mkrt.kernels.gemm import from_float32

    device = cupy.cuda.Device().id
    sms = cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"]
    rows = []
    for text in args.shapes.split(","):
        B, S, Hq, Hkv, D, causal = (int(x) for x in text.split(":"))
        case = f"b{B}_s{S}_h{Hq}_kv{Hkv}_d{D}" + ("_causal" if causal else "")
        rng = cupy.random.default_rng(S + Hq)
        q, k, v = (from_float32(rng.standard_normal((B, S, h, D), dtype=np.float32), bfloat16)
                   for h in (Hq, Hkv, Hkv))
        problem = A.check_operands(q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, causal=bool(causal))
        base = dict(dtype="bf16", head_dim=D, block_kv=128, stages=2 if causal else 3, pingpong=1)
        builds = {"dealt": A.AttentionSpec(**base, claimed=0), "claimed": A.AttentionSpec(**base, claimed=1),
                  "handed": HandedSpec(**base, claimed=1), "handed_noreset": HandedNoResetSpec(**base, claimed=1),
                  "handed_dc": HandedDealtConsumersSpec(**base, claimed=1),
                  "claimed_pout": ClaimedProducerOutSpec(**base, claimed=1)}
        scale = 1.0 / np.sqrt(D)
        calls = {name: A._PreparedAttention(problem, spec, device, sms, scale) for name, spec in builds.items()}
        outputs = {}
        for name, call in calls.items():
            out = cupy.full((B, S, Hq, D), np.nan, dtype=q.dtype)
            lse = cupy.empty((B, Hq, S), dtype=np.float32)
            stream = cupy.cuda.get_current_stream().ptr
            call.patch(q, k, v, out, lse, stream)
            call.launch(stream)
            outputs[name] = (out, lse, stream)
        cupy.cuda.runtime.deviceSynchronize()
        same = {name: bool((outputs[name][0] == outputs["dealt"][0]).all()) for name in calls}
        # in rounds, each starting one build further on (clocks drift under load: a build
        # always timed first would be favoured; the probe of ddf93e3-0f477b1 timed them
        # in a fixed order, dealt first)
        best = interleaved_ms({name: (lambda call=call, name=name: call.launch(outputs[name][2]))
                               for name, call in calls.items()},
                              iterations=10, rounds=args.turns * len(calls), warmup=3)
        times = best
        # once more after the timing, poisoned first: a launch that claimed nothing (a
        # counter left unreset) would leave NaN and look fast
        for name, call in calls.items():
            outputs[name][0].fill(np.nan)
            call.launch(outputs[name][2])
        cupy.cuda.runtime.deviceSynchronize()
        same = {name: same[name] and bool((outputs[name][0] == outputs["dealt"][0]).all()) for name in calls}
        line = ", ".join(f"{name} {problem.flops / best[name] / 1e9:.0f}" for name in calls)
        print(f"{case}: TFLOP/s {line}; outputs equal to dealt: {same}")
        for name in BUILDS[1:]:
            rows.append(record("attention_claim_probe", f"{case}_{name}", "tflops",
                               problem.flops / best[name] / 1e9, problem.flops / best["dealt"] / 1e9,
                               "TFLOP/s", baseline_name="dealt", ms=times[name], dealt_ms=times["dealt"],
                               timing="interleaved_ms medians",
                               identical_to_dealt=same[name]))
    if args.out:
        append_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
