"""mkrt.grouped_mlp (the experts' two GEMMs and SwiGLU in one launch) against the same work
in three steps, same run.

One rank's experts: G local experts, rows per expert from a routing of T tokens x top-k
(uniform or Zipf-skewed), w1 [G, 2I, H], w2 [G, H, I]. Baselines: (a) torch._grouped_mm,
SwiGLU in torch, torch._grouped_mm (what a PyTorch MoE layer runs); (b) mkrt's own
separate path (mkrt.grouped_gemm, SwiGLU, mkrt.grouped_gemm: what MoE(fused_experts=False)
launches). The row's baseline is the faster of the two. Every output is checked against
a float32 reference on fresh random data (output poisoned first), then the calls are timed
with CUDA events in turns (interleaved_ms, medians). FLOPs: 6 x rows x H x I.

Cases: SUITE (the tile rule's shapes: it was fitted on the grouped GEMM's rows, not on these)
and HELD_OUT (other models and token counts); both are judged, neither fitted here.

    PYTHONPATH=$PWD python3 experiments/grouped_mlp.py --out experiments/results/grouped_mlp.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mkrt.bench import append_jsonl, interleaved_ms, record  # noqa: E402

# (label, local experts, H, I, rows routed to this rank's experts, skew)
SUITE = [("deepseek_v3_t4096", 32, 7168, 2048, 4096 * 8 // 8, "uniform"),
         ("qwen3_30b_t8192", 16, 2048, 768, 8192 * 8 // 8, "zipf"),
         ("mixtral_t4096", 2, 4096, 14336, 4096 * 2 // 4, "uniform"),
         ("mixtral_t1024", 2, 4096, 14336, 1024 * 2 // 4, "uniform")]
HELD_OUT = [("deepseek_v3_t1024", 32, 7168, 2048, 1024 * 8 // 8, "zipf"),
            ("qwen3_30b_t1024", 16, 2048, 768, 1024 * 8 // 8, "uniform"),
            ("llama4_scout_t4096", 4, 5120, 8192, 4096 // 4, "uniform"),
            ("gpt_oss_120b_t4096", 32, 2880, 2880, 4096 * 4 // 4, "zipf")]


def sizes_for(groups, rows, skew, rng):
    p = np.full(groups, 1.0 / groups) if skew == "uniform" else 1.0 / np.arange(1, groups + 1) ** 1.1
    return rng.multinomial(rows, p / p.sum())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="two SUITE and two HELD_OUT cases")
    args = parser.parse_args()
    import torch

    import mkrt
    rng = np.random.default_rng(0)
    cases = [(c, "suite") for c in SUITE] + [(c, "held_out") for c in HELD_OUT]
    if args.quick:
        cases = cases[1:3] + cases[4:6]
    for (label, groups, H, I, rows, skew), role in cases:
        sizes = sizes_for(groups, rows, skew, rng)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
        x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
        w1 = torch.randn(groups, 2 * I, H, device="cuda", dtype=torch.bfloat16) / H ** 0.5
        w2 = torch.randn(groups, H, I, device="cuda", dtype=torch.bfloat16) / I ** 0.5
        ends = torch.tensor(offsets[1:], device="cuda", dtype=torch.int32)
        dev_offsets = torch.tensor(offsets, device="cuda", dtype=torch.int32)
        out = torch.empty(rows, H, device="cuda", dtype=torch.bfloat16)
        act = torch.empty(rows, I, device="cuda", dtype=torch.bfloat16)
        h = torch.empty(rows, 2 * I, device="cuda", dtype=torch.bfloat16)
        w1t, w2t = w1.transpose(-2, -1), w2.transpose(-2, -1)

        def torch_path():
            hh = torch._grouped_mm(x, w1t, offs=ends)
            return torch._grouped_mm(torch.nn.functional.silu(hh[:, :I]) * hh[:, I:], w2t, offs=ends)

        def separate():
            mkrt.grouped_gemm(x, w1, dev_offsets, out=h)
            act.copy_(torch.nn.functional.silu(h[:, :I]) * h[:, I:])
            return mkrt.grouped_gemm(act, w2, dev_offsets, out=out)

        def fused():
            return mkrt.grouped_mlp(x, w1, w2, dev_offsets, out=out, act=act)

        # float32 reference on the GPU, in torch (the sums of mkrt.kernels.moe_experts.reference)
        ref = torch.zeros(rows, H, device="cuda")
        for g in range(groups):
            a, b = int(offsets[g]), int(offsets[g + 1])
            if b > a:
                hh = x[a:b].float() @ w1[g].float().T
                ref[a:b] = (torch.nn.functional.silu(hh[:, :I]) * hh[:, I:]) @ w2[g].float().T
        errors = {}
        for name, call in (("fused", fused), ("separate", separate), ("torch", torch_path)):
            out.fill_(float("nan"))
            got = call().float()
            errors[name] = ((got - ref).abs().max() / ref.abs().max()).item()
        ms = interleaved_ms({"fused": fused, "separate": separate, "torch": torch_path},
                            iterations=args.iterations, rounds=args.rounds)
        best = min(("separate", "torch"), key=ms.get)
        flops = 6.0 * rows * H * I
        row = record("grouped_mlp", f"{label}_g{groups}_r{rows}", "tflops", flops / ms["fused"] / 1e9,
                     flops / ms[best] / 1e9, "TFLOP/s", role=role, baseline_name=best,
                     ms=ms["fused"], separate_ms=ms["separate"], torch_ms=ms["torch"],
                     errors=errors, correct=errors["fused"] < 2e-2,
                     timing="interleaved_ms medians")
        print(f"{row['case']} ({role}): fused {ms['fused']:.3f} ms, separate {ms['separate']:.3f}, "
              f"torch {ms['torch']:.3f}; x{row['ratio']:.3f} of {best}; errors "
              + ", ".join(f"{k} {v:.4f}" for k, v in errors.items()), flush=True)
        if args.out:
            append_jsonl(args.out, [row])


if __name__ == "__main__":
    main()
