"""mkrt.grouped_gemm against torch._grouped_mm and a per-group cuBLAS loop, same run.

MoE expert GEMMs of one rank: G local experts, rows per expert from a routing of T tokens
x top-k over E experts (uniform or Zipf-skewed), weights [G, N, K]. Every case is checked
against torch._grouped_mm's output, then mkrt, the baselines (and with --sweep-tiles every
tile) are timed with CUDA events in turns, round by round after warm-up (median per call:
timed one after the other, the first timed case ran up to 15% faster).

    PYTHONPATH=$PWD python3 experiments/grouped_gemm.py --out experiments/results/grouped_gemm.jsonl

``--sweep-tiles JSONL`` also times each case of SUITE and HELD_OUT with each tile shape of
TILES (rows of experiment grouped_gemm_tiles): the tile rule is fitted on SUITE's rows and
judged on HELD_OUT's. ``--clusters-out JSONL`` times, on SUITE and HELD_OUT, the rule's tile
and epilogue with clusters of two CTAs (pairs of m-tiles sharing each weight load) against
one CTA per tile (rows of experiment grouped_gemm_cluster): the cluster rule is set on
SUITE's rows and judged on HELD_OUT's. ``--epilogue-out JSONL`` writes the rule's tile with
TMA stores against direct stores, every case (experiment grouped_gemm_epilogue).
``--stream-k-out JSONL`` times, on SUITE and HELD_OUT, the rule's tile and 128x256 tiles
with the last wave shared out by k-blocks (stream-K, at most STREAM_K_PARTS parts a tail
tile) against the same tile without it, checks that repeated calls are bit-identical
(experiment grouped_gemm_stream_k): the stream-K rule is set on SUITE's rows and judged
on HELD_OUT's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mkrt.bench import append_jsonl, interleaved_ms, record  # noqa: E402

# (label, local experts, N, K, tokens routed to this rank's experts, skew)
SUITE = [("deepseek_v3_w1", 32, 4096, 7168, 4096 * 8 // 8, "uniform"),
         ("deepseek_v3_w2", 32, 7168, 2048, 4096 * 8 // 8, "uniform"),
         ("deepseek_v3_w1_decode", 32, 4096, 7168, 128 * 8 // 8, "uniform"),
         ("qwen3_30b_w1", 16, 1536, 2048, 8192 * 8 // 8, "zipf"),
         ("qwen3_30b_w2", 16, 2048, 768, 8192 * 8 // 8, "zipf"),
         ("mixtral_w1", 2, 28672, 4096, 4096 * 2 // 4, "uniform"),
         ("mixtral_w2", 2, 4096, 14336, 4096 * 2 // 4, "uniform")]

# Shapes the tile rule is judged on, not fitted on: other token counts of the same
# models, and two models named nowhere else (Llama 4 Scout: 16 experts, H 5120, I 8192,
# top-1, 4 ranks; gpt-oss-120b: 128 experts, H 2880, I 2880, top-4, 4 ranks).
HELD_OUT = [("mixtral_w1", 2, 28672, 4096, 1024 * 2 // 4, "uniform"),
            ("mixtral_w2", 2, 4096, 14336, 1024 * 2 // 4, "uniform"),
            ("mixtral_w2", 2, 4096, 14336, 16384 * 2 // 4, "uniform"),
            ("deepseek_v3_w1", 32, 4096, 7168, 2048 * 8 // 8, "zipf"),
            ("deepseek_v3_w2", 32, 7168, 2048, 16384 * 8 // 8, "uniform"),
            ("qwen3_30b_w1", 16, 1536, 2048, 2048 * 8 // 8, "uniform"),
            ("qwen3_30b_w2", 16, 2048, 768, 32768 * 8 // 8, "zipf"),
            ("llama4_scout_w1", 4, 16384, 5120, 4096 // 4, "uniform"),
            ("llama4_scout_w2", 4, 5120, 8192, 4096 // 4, "uniform"),
            ("gpt_oss_120b_w1", 32, 5760, 2880, 4096 * 4 // 4, "zipf"),
            ("gpt_oss_120b_w2", 32, 2880, 2880, 4096 * 4 // 4, "zipf")]


#: the tile shapes (block_m, block_n) --sweep-tiles times
TILES = [(64, 256), (128, 256), (64, 128), (128, 128)]
#: most parts of a tail tile --stream-k-out tries (grouped_gemm.STREAM_K_MAX_PARTS)
STREAM_K_PARTS = (4, 16, 132)


def sizes_for(groups, rows, skew, rng):
    if skew == "uniform":
        p = np.full(groups, 1.0 / groups)
    else:
        p = 1.0 / np.arange(1, groups + 1) ** 1.1
        p /= p.sum()
    return rng.multinomial(rows, p)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="")
    parser.add_argument("--iterations", type=int, default=10, help="calls per timed batch")
    parser.add_argument("--rounds", type=int, default=5, help="batches per call, in turns")
    parser.add_argument("--epilogue-out", default="", metavar="JSONL",
                        help="TMA stores against direct stores, every case, rows to JSONL "
                             "(experiment grouped_gemm_epilogue)")
    parser.add_argument("--clusters-out", default="", metavar="JSONL",
                        help="clusters of two against single CTAs, SUITE and HELD_OUT, rows to JSONL "
                             "(experiment grouped_gemm_cluster)")
    parser.add_argument("--sweep-tiles", default="", metavar="JSONL",
                        help="also time each tile shape of TILES on SUITE and HELD_OUT, rows to JSONL")
    parser.add_argument("--stream-k-out", default="", metavar="JSONL",
                        help="stream-K on the last wave against whole tiles, SUITE and HELD_OUT, rows "
                             "to JSONL (experiment grouped_gemm_stream_k)")
    parser.add_argument("--only-stream-k", action="store_true",
                        help="with --stream-k-out: time only the stream-K variants and the baselines")
    args = parser.parse_args()
    import torch

    import mkrt
    from mkrt.kernels import grouped_gemm as GG
    rng = np.random.default_rng(0)
    cases = [(case, "fit") for case in SUITE]
    if args.sweep_tiles or args.clusters_out or args.stream_k_out:
        cases += [(case, "held_out") for case in HELD_OUT]
    for (label, groups, n, k, rows, skew), role in cases:
        sizes = sizes_for(groups, rows, skew, rng)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(groups, n, k, device="cuda", dtype=torch.bfloat16) / 8
        ends = torch.tensor(offsets[1:], device="cuda", dtype=torch.int32)
        device_offsets = torch.tensor(offsets, device="cuda", dtype=torch.int32)
        out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
        wt = w.transpose(-2, -1)
        theirs = torch._grouped_mm(x, wt, offs=ends)
        mkrt.grouped_gemm(x, w, device_offsets, out=out)

        def error_of_out():        # out's largest error relative to torch's largest value
            return ((out.float() - theirs.float()).abs().max() / theirs.float().abs().max()).item()

        def checked(call):         # the error of call()'s output, out poisoned first
            out.fill_(float("nan"))
            call()
            return error_of_out()
        error = error_of_out()
        flops = 2.0 * rows * n * k

        def loop():
            for g in range(groups):
                a, b = int(offsets[g]), int(offsets[g + 1])
                if b > a:
                    torch.matmul(x[a:b], wt[g], out=out[a:b])
        calls = {"mkrt": lambda: mkrt.grouped_gemm(x, w, device_offsets, out=out),
                 "grouped_mm": lambda: torch._grouped_mm(x, wt, offs=ends), "loop": loop}
        if not args.only_stream_k:
            # the same tile with each epilogue, each checked first
            calls["mkrt_tma"] = lambda: mkrt.grouped_gemm(x, w, device_offsets, out=out, epilogue="tma")
            calls["mkrt_direct"] = lambda: mkrt.grouped_gemm(x, w, device_offsets, out=out, epilogue="direct")
            tma_error, direct_error = checked(calls["mkrt_tma"]), checked(calls["mkrt_direct"])
            # the rule's tile and epilogue with each cluster shape, each checked first
            calls["mkrt_m2"] = lambda: mkrt.grouped_gemm(x, w, device_offsets, out=out, cluster="m2")
            calls["mkrt_single"] = lambda: mkrt.grouped_gemm(x, w, device_offsets, out=out, cluster="")
            m2_error, single_error = checked(calls["mkrt_m2"]), checked(calls["mkrt_single"])
        stream_k = {}      # (tile, parts or 0 for whole tiles) -> (error, bit-identical)
        if args.stream_k_out:
            for tile in dict.fromkeys([GG.choose_tile(rows, groups, n, 132), (128, 256)]):
                for parts in (0,) + STREAM_K_PARTS:
                    def stream_k_call(tile=tile, parts=parts):
                        GG.STREAM_K_MAX_PARTS = parts or GG.STREAM_K_MAX_PARTS
                        mkrt.grouped_gemm(x, w, device_offsets, out=out, block_m=tile[0],
                                          block_n=tile[1], stream_k=parts > 0)
                    tile_error = checked(stream_k_call)
                    first = out.clone()
                    for _ in range(5):
                        stream_k_call()
                    stream_k[(tile, parts)] = (tile_error, bool(torch.equal(first.view(torch.int16),
                                                                          out.view(torch.int16))))
                    calls[("stream_k", tile, parts)] = stream_k_call
        tile_errors = {}
        if args.sweep_tiles:
            for block_m, block_n in TILES:
                def tile_call(block_m=block_m, block_n=block_n):
                    mkrt.grouped_gemm(x, w, device_offsets, out=out, block_m=block_m, block_n=block_n)
                tile_errors[(block_m, block_n)] = checked(tile_call)
                calls[(block_m, block_n)] = tile_call
        ms_of = interleaved_ms(calls, iterations=args.iterations, rounds=args.rounds)
        ours_ms, grouped_ms, loop_ms = ms_of["mkrt"], ms_of["grouped_mm"], ms_of["loop"]
        best_ms = min(grouped_ms, loop_ms)
        def versus(experiment, ours, theirs, errors, baseline_name):
            """A row of variant `ours` against variant `theirs` of the same case (ms),
            each also against the best of torch."""
            return record(experiment, f"{label}_{rows}rows_{skew}", "ms", ms_of[f"mkrt_{ours}"],
                          ms_of[f"mkrt_{theirs}"], "ms", higher_is_better=False, set=role,
                          **{f"{ours}_ratio_vs_torch": best_ms / ms_of[f"mkrt_{ours}"],
                             f"{theirs}_ratio_vs_torch": best_ms / ms_of[f"mkrt_{theirs}"],
                             "max_rel_error": errors[0], f"{theirs}_max_rel_error": errors[1]},
                          rule_ratio_vs_torch=best_ms / ours_ms, group_rows=[int(r) for r in sizes],
                          groups=groups, n=n, k=k, rows=rows, skew=skew, label=label,
                          timing="interleaved rounds", baseline_name=baseline_name)
        if args.stream_k_out:   # each tile with stream-K against without, every case
            rows_out = []
            for (tile, parts), (tile_error, identical) in stream_k.items():
                if not parts:
                    continue
                whole_ms = ms_of[("stream_k", tile, 0)]
                shared_ms = ms_of[("stream_k", tile, parts)]
                rows_out.append(record(
                    "grouped_gemm_stream_k", f"{label}_{rows}rows_{skew}_bm{tile[0]}_bn{tile[1]}_p{parts}",
                    "ms", shared_ms, whole_ms, "ms", higher_is_better=False, block_m=tile[0],
                    block_n=tile[1], max_parts=parts, set=role, rule_tile=list(GG.choose_tile(rows, groups, n, 132)),
                    stream_k_ratio_vs_torch=best_ms / shared_ms, whole_ratio_vs_torch=best_ms / whole_ms,
                    rule_ratio_vs_torch=best_ms / ours_ms, max_rel_error=tile_error,
                    whole_max_rel_error=stream_k[(tile, 0)][0], bit_identical=identical,
                    correct=tile_error < 1e-2 and identical, group_rows=[int(r) for r in sizes],
                    groups=groups, n=n, k=k, rows=rows, skew=skew, label=label,
                    timing="interleaved rounds", baseline_name="the same tile without stream-K"))
            append_jsonl(args.stream_k_out, rows_out)
            print(f"  {role} {label} rows={rows} {skew}: x torch rule {best_ms / ours_ms:.3f}; " +
                  "; ".join(f"{r['block_m']}x{r['block_n']} p{r['max_parts']} {r['stream_k_ratio_vs_torch']:.3f}"
                            f" (whole {r['whole_ratio_vs_torch']:.3f}{'' if r['correct'] else ' WRONG'})"
                            for r in rows_out), flush=True)
        if args.only_stream_k:
            continue
        if args.epilogue_out:   # the default tile with TMA stores against direct stores, every case
            append_jsonl(args.epilogue_out, [versus("grouped_gemm_epilogue", "tma", "direct",
                                                    (tma_error, direct_error),
                                                    "the same tile with direct stores")])
        if args.clusters_out:     # clusters of two against one CTA per tile, every case
            append_jsonl(args.clusters_out, [versus("grouped_gemm_cluster", "m2", "single",
                                                    (m2_error, single_error),
                                                    "the rule's tile and epilogue, one CTA per tile")])
            print(f"  {role} {label} rows={rows} {skew}: pairs x torch {best_ms / ms_of['mkrt_m2']:.3f}, "
                  f"single x torch {best_ms / ms_of['mkrt_single']:.3f} (errors {m2_error:.4f}, "
                  f"{single_error:.4f})", flush=True)
        if args.sweep_tiles:
            sweep = []
            for (block_m, block_n), tile_error in tile_errors.items():
                sweep.append(record(
                    "grouped_gemm_tiles", f"{label}_{rows}rows_{skew}_bm{block_m}_bn{block_n}", "ms",
                    ms_of[(block_m, block_n)], best_ms, "ms", higher_is_better=False, block_m=block_m,
                    block_n=block_n, set=role, default_ms=ours_ms, max_rel_error=tile_error,
                    correct=tile_error < 1e-2, group_rows=[int(r) for r in sizes], groups=groups, n=n,
                    k=k, rows=rows, skew=skew, label=label, timing="interleaved rounds",
                    baseline_name="best of torch._grouped_mm and a per-group cuBLAS loop"))
            times = ", ".join(f"{r['block_m']}x{r['block_n']} {r['value']:.4f}" for r in sweep)
            print(f"  {role} {label} rows={rows} {skew}: {times} ms; default {ours_ms:.4f} ms, "
                  f"best torch {best_ms:.4f} ms", flush=True)
            append_jsonl(args.sweep_tiles, sweep)
        if role == "held_out":
            continue
        row = record("grouped_gemm", f"{label}_{rows}rows", "tflops", flops / ours_ms / 1e9,
                     flops / best_ms / 1e9, "TFLOP/s", ms=ours_ms, grouped_mm_ms=grouped_ms,
                     cublas_loop_ms=loop_ms, groups=groups, n=n, k=k, rows=rows, skew=skew,
                     max_rel_error=error, correct=error < 1e-2, timing="interleaved rounds",
                     tma_ms=ms_of["mkrt_tma"], tma_ratio=best_ms / ms_of["mkrt_tma"],
                     tma_max_rel_error=tma_error,
                     baseline_name="best of torch._grouped_mm and a per-group cuBLAS loop")
        print(f"{label} rows={rows}: mkrt {flops / ours_ms / 1e9:.0f} TFLOP/s, _grouped_mm "
              f"{flops / grouped_ms / 1e9:.0f}, loop {flops / loop_ms / 1e9:.0f}; x best "
              f"{row['ratio']:.3f}; TMA stores x best {best_ms / ms_of['mkrt_tma']:.3f} "
              f"(err {tma_error:.4f}); err {error:.4f}", flush=True)
        if args.out:
            append_jsonl(args.out, [row])


if __name__ == "__main__":
    main()
