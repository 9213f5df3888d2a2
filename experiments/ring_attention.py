"""Ring attention on an emulated world on one GPU, against its baselines in the same run.

For each shape (B, sequence per rank, Hq, Hkv, D, causal) and layout, the whole world's
call is timed on the caller's stream (CUDA events, warm-up, medians over rounds in which
every variant below takes a turn, each round starting one further on: mkrt.bench.interleaved_ms):

* ``ring``: mkrt.RingAttention (one persistent kernel per rank);
* ``(a) allgather+sdpa``: mkrt.allgather of K and V, each rank's K/V put back in sequence
  order, then torch SDPA per query chunk on the full K/V with the fastest backend that
  runs (cuDNN, flash, efficient: each tried, the best kept);
* ``(b) per-step ring``: the ring-flash-attn scheme without its transfers (the chunks are
  already on the GPU): per rank, per visible (query chunk, key chunk) pair one
  mkrt.attention call returning (O, LSE), merged step by step in fp32 (CuPy);
* ``(c) floor``: mkrt.attention on the whole sequence in one call (the same work, no
  communication).

On one GPU the emulated ranks share the SMs: the figures are the world's aggregate
throughput (all ranks' FLOPs over the world's time), not per-GPU figures of a real ring.
Rows: experiments/results/ring_attention.jsonl (value: ring TFLOP/s, baseline: (a)),
with the floor's figure in each row.

    PYTHONPATH=$PWD python3 experiments/ring_attention.py --layouts 1x2 1x4 2x2 \
        --out experiments/results/ring_attention.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.attention import shapes  # noqa: E402
from mkrt.bench import append_jsonl, interleaved_ms, record, repeated  # noqa: E402

# (B, rows per rank, Hq, Hkv, D, causal): the reference's sweep and Llama-3 70B GQA
SUITE = [(4, s, 16, 16, 128, c) for s in (768, 3072, 6144, 12288) for c in (False, True)]
SUITE += [(1, 4096, 64, 8, 128, True)]


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["1x2", "1x4", "2x2"])
    parser.add_argument("--shapes", default="suite", help="'suite' or B:S:Hq:Hkv:D:causal,...")
    parser.add_argument("--comm-ctas", nargs="+", default=["default"],
                        help="communication CTAs per rank to time ('default': the op's rule)")
    parser.add_argument("--bands", nargs="+", default=["rule"],
                        help="tile bands to time: 'rule' (the op's: K/V in the rank's share of "
                             "the L2), 'whole' (as if each rank had the whole L2), or a number")
    parser.add_argument("--stages", nargs="+", default=["default"],
                        help="K/V stages of the engine to time ('default': the op's, 2, 3)")
    parser.add_argument("--own", nargs="+", default=["default"],
                        help="where each rank's compute reads its own K/V: 'default' (the op's), "
                             "'direct' (the inputs) or 'gathered' (its copy in the gathered buffer)")
    parser.add_argument("--slots", nargs="+", default=["none"],
                        help="K/V slots per rank to time: 'none' (every rank's K/V gathered) or "
                             "a number (RingAttention(slots=k), one-node layouts only)")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="")
    parser.add_argument("--plot", default="", help="write a PNG of TFLOP/s against rows per rank")
    return parser.parse_args()


def plot(rows, path):
    """TFLOP/s of the ring, (a) and the floor against rows per rank, one panel per layout
    and causal/non-causal."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot")
        return
    panels = sorted({(r["layout"], bool(r["causal"])) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2), squeeze=False)
    for ax, (layout, causal) in zip(axes[0], panels):
        mine = sorted((r for r in rows if r["layout"] == layout and bool(r["causal"]) == causal),
                      key=lambda r: r["rows"])
        x = [r["rows"] for r in mine]
        for key, label in (("value", "ring"), ("baseline", "(a) all-gather + SDPA"),
                           ("per_step_tflops", "(b) per-step ring"), ("floor_tflops", "floor")):
            ax.plot(x, [r.get(key) or float("nan") for r in mine], marker="o", label=label)
        ax.set_title(f"{layout} {'causal' if causal else 'non-causal'}")
        ax.set_xlabel("rows per rank")
        ax.set_ylabel("TFLOP/s (world, one GPU)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    args = parse()
    import cupy
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    import mkrt
    from mkrt.kernels import attention as A
    from mkrt.kernels import ring_attention as RA
    from mkrt.kernels import ring_attention_plan as R

    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    recorded = []
    for layout in args.layouts:
        world = mkrt.init(emulate=layout)
        W = world.size
        ops = {(c, b, st, own, k): mkrt.RingAttention(
                   world, timeout_ms=20000, comm_ctas=None if c == "default" else int(c),
                   band=int(b) if b.isdigit() else None, stages=None if st == "default" else int(st),
                   slots=None if k == "none" else int(k),
                   **({} if own == "default" else {"direct_own": own == "direct"}))
               for c in args.comm_ctas for b in args.bands for st in args.stages for own in args.own
               for k in args.slots if k == "none" or world.nodes == 1}
        gather = mkrt.AllGather(world, timeout_ms=20000)
        for B, rows, Hq, Hkv, D, causal in shapes(args.shapes, SUITE):
            c, S = rows // 2, rows * W
            case = f"{layout}_b{B}_s{rows}_h{Hq}_kv{Hkv}_d{D}" + ("_causal" if causal else "")
            gen = torch.Generator(device="cuda").manual_seed(rows + Hq)
            full = [torch.randn(B, S, h, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                    for h in (Hq, Hkv, Hkv)]
            q, k, v = (cupy.from_dlpack(x) for x in full)
            qs, ks, vs = ([RA.shard(x, r, W, causal=causal) for r in range(W)] for x in (q, k, v))
            outs = [cupy.empty_like(x) for x in qs]
            lses = [cupy.empty((B, Hq, rows), cupy.float32) for _ in qs]
            problem = A.check_operands(q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype,
                                       causal=causal)
            flops = problem.flops
            problem_of_rank = A.check_operands((B, rows, Hq, D), (B, rows, Hkv, D), (B, rows, Hkv, D),
                                               q.dtype, q.dtype, q.dtype, causal=causal)

            # correctness of this run's rings against the engine on the whole sequence
            whole, _ = mkrt.attention(q, k, v, causal=causal)
            errors = {}
            for name, op in ops.items():
                if name[1] == "whole":           # read when the op first sees this shape
                    op.band = A.kv_band(B, Hkv, D, S, share=1)
                for x in outs:
                    x.fill(float("nan"))         # poisoned: a tile left unwritten shows
                op(qs, ks, vs, causal=causal, out=outs, lse=lses)
                world.synchronize()
                got = RA.unshard(outs, causal=causal).astype(cupy.float32)
                errors[name] = float(cupy.abs(got - whole.astype(cupy.float32)).max()
                                     / cupy.abs(whole.astype(cupy.float32)).max())
            # timed below, every ring, the floor and the baselines in rotating rounds
            calls = {("ring", *name): repeated(lambda op=op: op(qs, ks, vs, causal=causal, out=outs, lse=lses),
                                               args.iterations) for name, op in ops.items()}
            calls["floor"] = repeated(lambda: mkrt.attention(q, k, v, causal=causal), args.iterations)

            # (a): gather K and V, each rank's copy back in sequence order, SDPA per chunk
            order = [i for r in range(W) for i in R.chunks_of(r, W, causal)]   # gathered chunk -> seq chunk
            inverse = torch.tensor([order.index(i) for i in range(2 * W)], device="cuda")
            flat_k = [x.reshape(-1) for x in ks]
            flat_v = [x.reshape(-1) for x in vs]
            q_torch = [torch.from_dlpack(x).transpose(1, 2) for x in qs]

            def baseline(backend):
                gk, gv = gather(flat_k), gather(flat_v)
                for r in range(W):
                    kk, vv = (torch.from_dlpack(g[r]).view(W, B, 2, c, Hkv, D)
                              .permute(1, 0, 2, 3, 4, 5).reshape(B, 2 * W, c, Hkv, D)
                              .index_select(1, inverse).reshape(B, S, Hkv, D).transpose(1, 2)
                              for g in (gk, gv))
                    for slot, qc in enumerate(R.chunks_of(r, W, causal)):
                        qq = q_torch[r][:, :, slot * c:(slot + 1) * c]
                        if causal:
                            keys = (qc + 1) * c
                            mask = causal_lower_right(c, keys)
                            torch.nn.functional.scaled_dot_product_attention(
                                qq, kk[:, :, :keys], vv[:, :, :keys], attn_mask=mask,
                                enable_gqa=Hq != Hkv)
                        else:
                            torch.nn.functional.scaled_dot_product_attention(
                                qq, kk, vv, enable_gqa=Hq != Hkv)
            # (b): per-step calls and LSE merges, no transfers
            order = R.plan(world.nodes, world.ranks_per_node, causal=causal).order

            def per_step():
                for r in range(W):
                    for slot, qc in enumerate(R.chunks_of(r, W, causal)):
                        qq = qs[r][:, slot * c:(slot + 1) * c]
                        o_acc = lse_acc = None
                        for source in order[r]:
                            for kslot, kc in enumerate(R.chunks_of(source, W, causal)):
                                kind = R.mask_kind(qc, kc, causal)
                                if kind == R.SKIPPED:
                                    continue
                                o, lse = mkrt.attention(qq, ks[source][:, kslot * c:(kslot + 1) * c],
                                                        vs[source][:, kslot * c:(kslot + 1) * c],
                                                        causal=kind == R.DIAGONAL)
                                o = o.astype(cupy.float32)
                                if o_acc is None:
                                    o_acc, lse_acc = o, lse
                                    continue
                                top = cupy.maximum(lse_acc, lse)
                                w1, w2 = cupy.exp(lse_acc - top), cupy.exp(lse - top)
                                total = w1 + w2
                                o_acc = (o_acc * cupy.moveaxis(w1 / total, 1, 2)[..., None]
                                         + o * cupy.moveaxis(w2 / total, 1, 2)[..., None])
                                lse_acc = top + cupy.log(total)
            calls["per_step"] = repeated(per_step, args.iterations)
            for name, backend in backends.items():
                try:
                    with sdpa_kernel(backend):
                        baseline(backend)
                    world.synchronize()
                    calls[name] = repeated(lambda backend=backend: baseline(backend), args.iterations,
                                           lambda backend=backend: sdpa_kernel(backend))
                except RuntimeError:
                    pass
            # each call once with nothing else in flight: a first call may load a module,
            # plan a cuDNN graph or grow a memory pool, and on an emulated world with nodes
            # such a device-waiting CUDA call holds back the proxy's copies of a fused op in
            # flight (at 6fcc451 the 2x2 baseline's all-gather timed out in the warm-up)
            for call in calls.values():
                call()
                world.synchronize()
            # rotating rounds (interleaved_ms): this GPU's clocks drift down under load, so
            # whatever is timed first gains (until 6885d2f the rings were timed first)
            ms_of = {key: t / args.iterations for key, t in interleaved_ms(
                calls, iterations=1, rounds=max(args.repeats, len(calls)), warmup=1).items()}
            ring_ms = {name: ms_of[("ring", *name)] for name in ops}
            floor_ms, per_step_ms = ms_of["floor"], ms_of["per_step"]
            theirs = {name: ms_of.get(name) for name in backends}
            best = min((t for t in theirs.values() if t), default=None)
            for name, op in ops.items():
                ring_tflops = flops / ring_ms[name] / 1e9
                error = errors[name]
                comm, band, stages, own, slots = name
                label = case + ("" if comm == "default" else f"_comm{comm}") + \
                    ("" if band == "rule" else f"_band{band}") + \
                    ("" if stages == "default" else f"_s{stages}") + \
                    ("" if own == "default" else f"_own{own}") + \
                    ("" if slots == "none" else f"_slots{op.slots}")
                row = record("ring_attention", label, "tflops", ring_tflops,
                             flops / best / 1e9 if best else None, "TFLOP/s", ms=ring_ms[name],
                             baseline_name="allgather+sdpa (best backend)", baseline_ms=theirs,
                             floor_tflops=flops / floor_ms / 1e9, of_floor=floor_ms / ring_ms[name],
                             per_step_tflops=flops / per_step_ms / 1e9,
                             x_per_step=per_step_ms / ring_ms[name],
                             max_rel_error=error, correct=error < 2e-2, layout=layout,
                             rows=rows, causal=causal, ctas=op.split()[0], comm_ctas=op.split()[1],
                             stages=op.spec(problem_of_rank).stages,
                             own="direct" if op.direct_own else "gathered", slots=op.slots,
                             band=op.band_for(problem_of_rank, world.local[0].rank),
                             note="emulated ranks share one GPU: aggregate throughput",
                             timing="interleaved_ms medians")
                print(f"{label}: ring {ring_tflops:.0f} TFLOP/s (comm {op.split()[1]} of "
                      f"{op.split()[0]}, band {row['band']}), (a) "
                      f"{'-' if not best else f'{flops / best / 1e9:.0f}'} "
                      f"({', '.join(f'{n} {t:.2f} ms' for n, t in theirs.items() if t)}), floor "
                      f"{flops / floor_ms / 1e9:.0f}, (b) {flops / per_step_ms / 1e9:.0f}; "
                      f"x(a) {row['ratio'] or float('nan'):.3f}, x(b) {row['x_per_step']:.3f}, "
                      f"of floor {row['of_floor']:.3f}, err {error:.4f}", flush=True)
                recorded.append(row)
                if args.out:
                    append_jsonl(args.out, [row])
        for op in ops.values():
            op.close()
        gather.close()
        world.close()
    if args.plot and recorded:
        plot(recorded, args.plot)


if __name__ == "__main__":
    main()
