"""Where a ring's time goes: the trace build of mkrt.RingAttention on an emulated world.

For each layout and shape: the ring, its trace build and the floor (mkrt.attention on the
whole sequence) are timed in rotating rounds (the trace's own cost shows), then the trace
build runs `--calls` more times, one call at a time, and the call with the median span is
summarised per rank (times in microseconds from the first CTA of any rank to start):

* ``start``: the rank's first and last CTA starts (launch skew between the ranks);
* ``copies``: when its communication CTAs were done copying (median, last);
* ``end``: when its CTAs were done (first, median, last: the spread is the tail);
* ``flag_wait``: what the producers waited for key blocks' flags (mean per CTA);
* ``starved``: what the first consumer warpgroups waited for loaded stages (mean per CTA:
  time with no keys for the tensor cores);
* ``tiles``: tiles per CTA (min, max);
* ``sources``: per source in the order the rank visits them, when its CTAs' producers
  first asked for one of its blocks (first CTA, median) and when one first saw it whole
  (first CTA): a source asked for long before it is whole held the compute up.

One row per case in experiments/results/ring_trace.jsonl (value: the traced call's span
in ms, baseline: the floor's ms; per-rank summaries in ``ranks``) and, with ``--raw``,
every CTA's record of that call in a JSON file.

    PYTHONPATH=$PWD python3 experiments/ring_trace.py --layouts 1x2 2x2 \
        --shapes 4:4096:16:16:128:1 --out experiments/results/ring_trace.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.attention import shapes  # noqa: E402
from mkrt.bench import append_jsonl, interleaved_ms, record, repeated  # noqa: E402
from mkrt.kernels.ring_trace import summarise  # noqa: E402

SUITE = [(4, 4096, 16, 16, 128, c) for c in (False, True)]


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["1x2", "1x4", "2x2"])
    parser.add_argument("--shapes", default="suite", help="'suite' or B:S:Hq:Hkv:D:causal,...")
    parser.add_argument("--calls", type=int, default=5, help="traced calls per case")
    parser.add_argument("--own", nargs="+", default=["direct"],
                        help="where the compute reads the rank's own K/V: 'direct' (inputs) "
                             "or 'gathered' (its copy); or 'slotsK': K/V slots (slots=K, the "
                             "own K/V in place); each traced and timed in the same rounds")
    parser.add_argument("--ctas", nargs="+", default=["default"],
                        help="CTAs per rank ('default': the rank's SM share); fewer leave SMs "
                             "to the proxy's copy kernels on a world of several nodes")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="")
    parser.add_argument("--raw", default="", help="write every CTA's record to this JSON file")
    return parser.parse_args()


def main():
    args = parse()
    import cupy
    import torch

    import mkrt
    from mkrt.kernels import attention as A
    from mkrt.kernels import ring_attention as RA

    for layout in args.layouts:
        world = mkrt.init(emulate=layout)
        W = world.size
        variants = [(own, ctas) for own in args.own for ctas in args.ctas]
        options = {variant: dict(timeout_ms=20000, direct_own=variant[0] == "direct",
                                 slots=int(variant[0][5:]) if variant[0].startswith("slots") else None,
                                 ctas=None if variant[1] == "default" else int(variant[1]))
                   for variant in variants}
        plain = {variant: mkrt.RingAttention(world, **options[variant]) for variant in variants}
        traced = {variant: mkrt.RingAttention(world, trace=True, **options[variant])
                  for variant in variants}
        for B, rows, Hq, Hkv, D, causal in shapes(args.shapes, SUITE):
            S = rows * W
            case = f"{layout}_b{B}_s{rows}_h{Hq}_kv{Hkv}_d{D}" + ("_causal" if causal else "")
            gen = torch.Generator(device="cuda").manual_seed(rows + Hq)
            full = [cupy.from_dlpack(torch.randn(B, S, h, D, device="cuda", dtype=torch.bfloat16,
                                                 generator=gen)) for h in (Hq, Hkv, Hkv)]
            q, k, v = full
            qs, ks, vs = ([RA.shard(x, r, W, causal=causal) for r in range(W)] for x in full)
            outs = [cupy.empty_like(x) for x in qs]
            lses = [cupy.empty((B, Hq, rows), cupy.float32) for _ in qs]
            flops = A.check_operands(q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype,
                                     causal=causal).flops
            # the trace builds' answers against the engine on the whole sequence
            whole, _ = mkrt.attention(q, k, v, causal=causal)
            errors = {}
            for variant, op in traced.items():
                for x in outs:
                    x.fill(float("nan"))
                op(qs, ks, vs, causal=causal, out=outs, lse=lses)
                world.synchronize()
                got = RA.unshard(outs, causal=causal).astype(cupy.float32)
                errors[variant] = float(cupy.abs(got - whole.astype(cupy.float32)).max()
                                    / cupy.abs(whole.astype(cupy.float32)).max())

            calls = {"floor": repeated(lambda: mkrt.attention(q, k, v, causal=causal), args.iterations)}
            for variant in variants:
                calls["ring", variant] = repeated(
                    lambda op=plain[variant]: op(qs, ks, vs, causal=causal, out=outs, lse=lses),
                    args.iterations)
                calls["traced", variant] = repeated(
                    lambda op=traced[variant]: op(qs, ks, vs, causal=causal, out=outs, lse=lses),
                    args.iterations)
            for call in calls.values():
                call()
                world.synchronize()
            ms = {key: t / args.iterations for key, t in interleaved_ms(
                calls, iterations=1, rounds=max(args.repeats, len(calls)), warmup=1).items()}
            for variant in variants:
                report(args, layout, case, variant, traced[variant], ms, errors[variant], flops, qs,
                       ks, vs, outs, lses, causal, rows)
        for op in [*plain.values(), *traced.values()]:
            op.close()
        world.close()


def report(args, layout, case, variant, traced, ms, error, flops, qs, ks, vs, outs, lses, causal,
           rows):
    """Trace `traced` over args.calls calls; print and record the median call's summary."""
    from mkrt.kernels import ring_attention as RA
    own, ctas = variant
    case = case + ("" if own == "direct" else f"_own{own}") + ("" if ctas == "default" else f"_ctas{ctas}")
    ring_ms, traced_ms = ms["ring", variant], ms["traced", variant]

    spans = []
    for _ in range(args.calls):
        traced(qs, ks, vs, causal=causal, out=outs, lse=lses)
        records = traced.trace()
        spans.append((summarise(records, traced.split()[0] - traced.split()[1],
                                traced.world.ranks_per_node, traced.world.nodes), records))
    spans.sort(key=lambda item: item[0][0])
    (span_us, ranks), records = spans[len(spans) // 2]
    row = record("ring_trace", case, "span_ms", span_us / 1e3, ms["floor"], "ms",
                 higher_is_better=False, ring_ms=ring_ms, traced_ms=traced_ms,
                 floor_ms=ms["floor"], of_floor=ms["floor"] / ring_ms,
                 trace_cost=traced_ms / ring_ms, max_rel_error=error, own=own,
                 correct=error < 2e-2, layout=layout, rows=rows, causal=causal,
                 ctas=traced.split()[0], comm_ctas=traced.split()[1],
                 floor_tflops=flops / ms["floor"] / 1e9, ring_tflops=flops / ring_ms / 1e9,
                 ranks=ranks, timing="interleaved_ms medians; span: globaltimer, median of "
                                     f"{args.calls} traced calls")
    print(f"{case}: ring {ring_ms:.3f} ms, traced {traced_ms:.3f}, floor "
          f"{ms['floor']:.3f} (of floor {row['of_floor']:.3f}); traced span "
          f"{span_us:.0f} us, err {error:.4f}", flush=True)
    for i, r in enumerate(ranks):
        print(f"  rank {i}: start {r['start_first']:.0f}-{r['start_last']:.0f}, copies "
              f"{r['copies_median'] or 0:.0f}/{r['copies_last'] or 0:.0f}, end "
              f"{r['end_first']:.0f}/{r['end_median']:.0f}/{r['end_last']:.0f}, flag wait "
              f"{r['flag_wait_mean']:.0f} (max {r['flag_wait_max']:.0f}), starved "
              f"{r['starved_mean']:.0f} (max {r['starved_max']:.0f}), tiles "
              f"{r['tiles_min']}-{r['tiles_max']}, {r['ns_per_cycle']:.3f} ns/cycle",
              flush=True)
        fmt = lambda x: "-" if x is None else f"{x:.0f}"      # noqa: E731
        print("    sources (asked first/median, whole first): " + "; ".join(
            f"{x['source']}: {fmt(x['reached_first'])}/{fmt(x['reached_median'])}, "
            f"{fmt(x['whole_first'])}" for x in r["sources"]), flush=True)
    if args.out:
        append_jsonl(args.out, [row])
    if args.raw:
        raw = {name: [x.tolist() for x in (rr[name] for rr in records)]
               for name in (*RA.TRACE_FIELDS, "source_reached_ns", "source_whole_ns")}
        with open(args.raw, "a") as handle:
            handle.write(json.dumps({"case": case, "commit": row["commit"], **raw}) + "\n")


if __name__ == "__main__":
    main()
