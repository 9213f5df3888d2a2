"""Does the GEMM engine pay for claimed tiles as the attention engine does? A probe on one GPU.

AllGather+GEMM and gemm_allreduce's role queues hand their GEMM tiles out through
``roles::ClaimedWork`` (the producer claims a position and passes it to the consumer
warpgroups through a small shared-memory ring); ``mkrt.gemm`` deals them out (CTA c: c,
c + grid, ...). The attention engine's claimed builds ran about 5% slower than its
dealt-out builds even on the same tiles (experiments/attention_claim_probe.py). Two builds
of one plain GEMM configuration (no split-K, no clusters), timed in rotating rounds
(mkrt.bench.interleaved_ms) on each shape:

- dealt:  mkrt.gemm's kernel as it is;
- handed: the same kernel whose tiles go through ClaimedWork and its ring, in the dealt-out
          order (a queue that "claims" c, c + grid, ... without atomics): the same tiles on
          the same CTAs, so any difference is the claimed path's code.

Outputs of the two are compared bit for bit (and again after the timing, poisoned first).

    PYTHONPATH=$PWD python3 experiments/gemm_claim_probe.py --out experiments/results/gemm_claim_probe.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# the fixed deal behind the claimed interface (claim() c, c + ctas, ... without atomics)
from attention_claim_probe import HANDED_QUEUE, swap  # noqa: E402
from mkrt.bench import append_jsonl, interleaved_ms, record  # noqa: E402
from mkrt.kernels import gemm as G  # noqa: E402

PLAIN_PATH = "        mkrt::gemm::run_tiles<Cfg>(tma_a, tma_b, k, units, whole, dynamic_smem);\n    }\n}"
HANDED_PATH = """        __shared__ mkrt::roles::Ring ring;
        mkrt::roles::ring_init<Cfg::CONSUMERS>(ring);
        const mkrt::roles::ClaimedWork<mkrt::gemm::RasterWork, HandedQueue> handed{
            {units.cta, units.ctas, units.tiles_m * units.tiles_n}, units, &ring};
        mkrt::gemm::run_tiles<Cfg>(tma_a, tma_b, k, handed, whole, dynamic_smem);
    }
}"""


@dataclasses.dataclass(frozen=True)
class HandedGemmSpec(G.GemmSpec):
    family = "gemm_handed"

    def template(self):
        run_units = "template <class Whole>\n__device__ __forceinline__ void run_units("
        text = swap(G.GEMM.text, ((run_units, HANDED_QUEUE + run_units), (PLAIN_PATH, HANDED_PATH)))
        return dataclasses.replace(G.GEMM, text=text, requires=(*G.GEMM.requires, "roles"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8192x8192x8192,4096x14336x4096,2048x8192x8192,6144x6144x6144")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    import cupy
    import numpy as np

    from mkrt.arrays import bfloat16
    from mkrt.kernels.device import roles as _roles  # noqa: F401  (registers the roles piece)

    device = cupy.cuda.Device().id
    sms = cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"]
    rows = []
    for text in args.shapes.split(","):
        m, n, k = (int(x) for x in text.split("x"))
        rng = cupy.random.default_rng(m + n + k)
        a = G.from_float32(rng.standard_normal((m, k), dtype=np.float32), bfloat16)
        b = G.from_float32(rng.standard_normal((n, k), dtype=np.float32) / 8, bfloat16)
        plan = G.plan(m, n, k, b_layout="nk", sms=sms, block_m=128, block_n=256, cluster="", split_k=1,
                      stream_k=False)
        specs = {"dealt": plan.spec, "handed": HandedGemmSpec(**{f.name: getattr(plan.spec, f.name)
                                                                 for f in dataclasses.fields(plan.spec)})}
        stream = cupy.cuda.get_current_stream().ptr
        calls, outs = {}, {}
        for name, spec in specs.items():
            function = spec.function("gemm", device, spec.smem_bytes)
            call = G._PreparedGemm(dataclasses.replace(plan, spec=spec), function, device)
            out = cupy.full((m, n), np.nan, dtype=a.dtype)
            call.patch(a.data.ptr, b.data.ptr, out.data.ptr)
            call.run(stream)
            calls[name], outs[name] = call, out
        cupy.cuda.runtime.deviceSynchronize()
        same = bool((outs["handed"].view(np.uint16) == outs["dealt"].view(np.uint16)).all())
        ms = interleaved_ms({name: (lambda call=call: call.run(stream)) for name, call in calls.items()},
                            iterations=10, rounds=args.rounds, warmup=3)
        for name, call in calls.items():
            outs[name].fill(np.nan)
            call.run(stream)
        cupy.cuda.runtime.deviceSynchronize()
        same = same and bool((outs["handed"].view(np.uint16) == outs["dealt"].view(np.uint16)).all())
        tflops = {name: plan.flops / t / 1e9 for name, t in ms.items()}
        case = f"{m}x{n}x{k}"
        print(f"{case} ({plan.spec.uri}, grid {plan.grid}): TFLOP/s dealt {tflops['dealt']:.0f}, "
              f"handed {tflops['handed']:.0f}; handed/dealt {tflops['handed'] / tflops['dealt']:.3f}; "
              f"bit-identical: {same}", flush=True)
        rows.append(record("gemm_claim_probe", f"{case}_handed", "tflops", tflops["handed"], tflops["dealt"],
                           "TFLOP/s", baseline_name="dealt", spec=plan.spec.uri, grid=plan.grid,
                           identical_to_dealt=same, timing="interleaved_ms medians"))
    if args.out:
        append_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
