"""mkrt.MoE on an emulated world (one node or several) on one GPU, against an unfused pipeline, same run.

Baseline (what a careful PyTorch user writes, with the real per-destination splits): the
routing's splits read on the host; each rank's rows sorted by expert and copied to the
expert's holder (an all-to-all of exactly the routed rows: device copies between the
emulated ranks); torch._grouped_mm with w1, SwiGLU, torch._grouped_mm with w2 (a
per-expert cuBLAS loop where _grouped_mm does not run); the rows copied back; the weighted
sum. Both paths are checked against each other, then timed over the whole world's call
(CUDA events, median). On one GPU the ranks share the SMs and the copies are local: the
ratios are the world's aggregate, not a real node's. On worlds of several nodes each row
also gives the bytes of token rows that cross between nodes per rank: routed (mkrt: a
token goes once to each other node holding one of its experts) against broadcast (every
node's tokens to every other node, as the reference does), from mkrt/kernels/moe_plan.py.

    PYTHONPATH=$PWD python3 experiments/moe.py --out experiments/results/moe.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mkrt.bench import append_jsonl, interleaved_ms, record  # noqa: E402

# (model, H, I, experts, k); layouts and tokens per rank from the command line
MODELS = {"deepseek_v3": (7168, 2048, 256, 8), "qwen3_30b_a3b": (2048, 768, 128, 8),
          "mixtral_8x7b": (4096, 14336, 8, 2)}


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["1x4"])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--tokens", nargs="+", type=int, default=[128, 1024, 4096])
    parser.add_argument("--experts-cap", type=int, default=64,
                        help="use at most this many experts (memory on one GPU); k shrinks to fit")
    parser.add_argument("--experts-kernels", nargs="+", default=["separate"],
                        choices=["separate", "fused"],
                        help="the experts' stage: three launches (separate) or one (fused: "
                             "MoE(fused_experts=True)); a row each, timed in the same rounds")
    parser.add_argument("--route-ctas", nargs="+", type=int, default=[],
                        help="with --experts-kernels fused: also time these routing-CTA counts "
                             "(MoE(route_ctas=)), a row each")
    parser.add_argument("--out", default="")
    parser.add_argument("--plot", default="", help="PNG of the rows in --out (after the run)")
    parser.add_argument("--plot-only", action="store_true",
                        help="no run: plot the rows already in --out (any machine with matplotlib)")
    return parser.parse_args()


def plot(rows: list[dict], path: str) -> None:
    """TFLOP/s per rank of mkrt.MoE and of the baseline against tokens per rank, a panel
    per emulated world, a line per model (newest row of each case)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot")
        return
    newest = {r["case"]: r for r in rows}
    layouts = sorted({r["layout"] for r in newest.values()})
    models = sorted({r["case"].split("_e")[0].split("_", 1)[1] for r in newest.values()})
    fig, axes = plt.subplots(1, len(layouts), figsize=(4.2 * len(layouts), 3.4), squeeze=False)
    for ax, layout in zip(axes[0], layouts):
        mine = [r for r in newest.values() if r["layout"] == layout]
        for color, model in enumerate(models):
            line = sorted((r for r in mine if f"_{model}_e" in r["case"]),
                          key=lambda r: int(r["case"].rsplit("_t", 1)[1]))
            if not line:
                continue
            x = [int(r["case"].rsplit("_t", 1)[1]) for r in line]
            world = int(layout.split("x")[0]) * int(layout.split("x")[1])
            ax.plot(x, [r["value"] / world for r in line], marker="o", color=f"C{color}",
                    label=f"{model} mkrt")
            ax.plot(x, [r["baseline"] / world for r in line], marker="x", linestyle="--",
                    color=f"C{color}", label=f"{model} baseline")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{layout} emulated on one GPU")
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("TFLOP/s per rank")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main():
    args = parse()
    if args.plot_only:
        import json
        plot([json.loads(line) for line in Path(args.out).read_text().splitlines()], args.plot)
        return
    import torch

    import mkrt
    from mkrt.kernels import moe_plan
    rng = np.random.default_rng(0)
    for layout in args.layouts:
        world = mkrt.init(emulate=layout)
        W = world.size
        for model in args.models:
            H, I, experts, k = MODELS[model]
            experts = max(W, min(experts, args.experts_cap) // W * W)
            k = min(k, experts)
            per = experts // W
            w1 = [torch.randn(per, 2 * I, H, device="cuda", dtype=torch.bfloat16) / H ** 0.5 for _ in range(W)]
            w2 = [torch.randn(per, H, I, device="cuda", dtype=torch.bfloat16) / I ** 0.5 for _ in range(W)]
            for tokens in args.tokens:
                case = f"{layout}_{model}_e{experts}_k{k}_t{tokens}"
                x = [torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16) for _ in range(W)]
                ids = [torch.tensor(np.stack([rng.choice(experts, k, replace=False) for _ in range(tokens)]),
                                    device="cuda", dtype=torch.int32) for _ in range(W)]
                weights = [torch.rand(tokens, k, device="cuda") for _ in range(W)]
                ops = {kind: mkrt.MoE(world, experts=experts, capacity=tokens, timeout_ms=30000,
                                      fused_experts=kind == "fused") for kind in args.experts_kernels}
                if "fused" in args.experts_kernels:
                    for count in args.route_ctas:
                        ops[f"fused_r{count}"] = mkrt.MoE(world, experts=experts, capacity=tokens,
                                                          timeout_ms=30000, fused_experts=True,
                                                          route_ctas=count)
                outputs = {kind: op(x, ids, weights, w1, w2) for kind, op in ops.items()}
                world.synchronize()

                def baseline():
                    outs = []
                    flat = [i.reshape(-1).long() for i in ids]
                    order = [torch.argsort(f, stable=True) for f in flat]
                    # the all-to-all: every rank's rows for expert holder d, in expert order
                    received = []
                    for d in range(W):
                        parts, groups = [], torch.zeros(per, dtype=torch.int64)
                        for s in range(W):
                            sel = order[s][(flat[s][order[s]] // per) == d]
                            parts.append(x[s][sel // k])
                            groups += torch.bincount(flat[s][sel].cpu() - d * per, minlength=per)
                        rows = torch.cat(parts)
                        # grouped by expert across sources: sort the concatenation by expert
                        experts_of = torch.cat([flat[s][order[s]][(flat[s][order[s]] // per) == d]
                                                for s in range(W)]) - d * per
                        resort = torch.argsort(experts_of, stable=True)
                        ends = torch.cumsum(groups, 0).to(device="cuda", dtype=torch.int32)
                        h = torch._grouped_mm(rows[resort], w1[d].transpose(-2, -1), offs=ends)
                        act = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
                        o = torch._grouped_mm(act, w2[d].transpose(-2, -1), offs=ends)
                        back = torch.empty_like(o)
                        back[resort] = o
                        received.append(back)
                    # back to the sources, weighted sum
                    for s in range(W):
                        y = torch.zeros(tokens, H, device="cuda", dtype=torch.float32)
                        for d in range(W):
                            sel = order[s][(flat[s][order[s]] // per) == d]
                            start = sum(int(((flat[p] // per) == d).sum()) for p in range(s))
                            rows = received[d][start:start + sel.numel()].float()
                            y.index_add_(0, sel // k, rows * weights[s].reshape(-1)[sel, None])
                        outs.append(y.to(torch.bfloat16))
                    return outs
                traffic = {}
                if world.nodes > 1:
                    plan = moe_plan.plan([i.cpu().numpy() for i in ids], experts=experts,
                                         nodes=world.nodes, ranks_per_node=world.ranks_per_node)
                    traffic = {f"internode_bytes_per_rank_{name}": value / W
                               for name, value in plan.traffic(H).items()}
                expected = baseline()
                # rotating rounds (interleaved_ms): clocks drift under load, and until
                # 6885d2f-era commits mkrt was always timed first
                calls = {kind: (lambda op=op: op(x, ids, weights, w1, w2)) for kind, op in ops.items()}
                ms_of = interleaved_ms({**calls, "baseline": baseline}, iterations=3, rounds=6)
                theirs = ms_of["baseline"]
                flops = 6.0 * H * I * tokens * k * W         # per (token, choice): w1 4HI, w2 2HI
                for kind, ys in outputs.items():
                    error = max(((torch.from_dlpack(y).float() - e.float()).abs().max()
                                 / e.float().abs().max()).item() for y, e in zip(ys, expected))
                    ours = ms_of[kind]
                    name = case + ("" if kind == "separate" else f"_{kind}")
                    row = record("moe", name, "tflops", flops / ours / 1e9, flops / theirs / 1e9,
                                 "TFLOP/s", ms=ours, baseline_ms=theirs, max_rel_error=error,
                                 correct=error < 3e-2, layout=layout, experts_kernel=kind,
                                 baseline_name="host splits + copies + torch._grouped_mm",
                                 note="emulated ranks share one GPU: aggregate throughput",
                                 timing="interleaved_ms medians", **traffic)
                    print(f"{name}: mkrt {ours:.3f} ms, baseline {theirs:.3f} ms, x {row['ratio']:.3f}, "
                          f"err {error:.4f}", flush=True)
                    if args.out:
                        append_jsonl(args.out, [row])
                for op in ops.values():
                    op.close()
        world.close()
    if args.plot and args.out:
        import json
        plot([json.loads(line) for line in Path(args.out).read_text().splitlines()], args.plot)


if __name__ == "__main__":
    main()
