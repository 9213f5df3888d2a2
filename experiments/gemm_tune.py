"""The GEMM engine's tile configurations on a 30-shape suite, against torch.matmul in the
same run: the data a tile-selection rule is fitted on (FIT) and judged on (HELD_OUT).

The two sets never mix: a rule's parameters come from FIT rows only; HELD_OUT rows say
how the rule does on shapes it was not fitted on (every configuration is timed on every
shape, so any rule's pick can be scored from the same run). Each (shape, configuration)
is checked against a float32 result on fresh random data (output poisoned first); then
every configuration of the shape and torch.matmul (cuBLASLt) on the same operands are
timed with CUDA events after warm-up, taking turns in --repeats rounds of --iterations
launches (median per configuration; rounds, because timed one after the other the first
configuration of a shape ran up to 17% faster than in rounds: the GPU's clocks drift
under sustained load).

    MKRT_JIT_CACHE_DIR=/tmp/mkrt-cache PYTHONPATH=$PWD python3 experiments/gemm_tune.py \\
        --out experiments/results/gemm_tune.jsonl [--table]

``--table`` also writes the fastest configuration per shape to ``gemm_table.json`` in the
JIT cache folder (``MKRT_JIT_CACHE_DIR``). ``--compile-only`` builds every configuration
for sm_90a (no GPU needed) and prints registers, spills and shared memory.

``--fit --judge-only`` judges the committed fit on the rows instead (writes nothing).
``--fit`` (no GPU) fits the rule's wave model (mkrt/kernels/gemm_rule.py) on the FIT rows
of ``--out`` (of ``--commit`` if given), writes ``mkrt/kernels/gemm_rule_fit.json``, and
judges it on the HELD_OUT rows: per shape, the measured time of the model's pick against
the fastest configuration measured and against torch.matmul.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: shapes (M, N, K) the rule is fitted on: the issue's measured shapes and LLM projections
FIT = [(8192, 8192, 8192), (6144, 6144, 6144), (4096, 14336, 4096), (2048, 2048, 2048),
       (3000, 5000, 7000), (512, 16384, 16384), (32768, 1024, 4096), (1024, 8192, 28672),
       (12288, 12288, 1536), (16384, 4096, 14336), (128, 4096, 4096), (64, 14336, 4096),
       (8192, 1024, 8192), (1000, 1000, 1000), (4096, 4096, 512)]
#: shapes the rule is judged on and never fitted on
HELD_OUT = [(4096, 4096, 4096), (2048, 8192, 8192), (8000, 7936, 4096), (16, 8192, 8192),
            (96, 28672, 8192), (256, 4096, 14336), (1536, 1536, 1536), (5000, 3000, 2000),
            (3072, 12288, 3072), (24576, 8192, 1024), (8192, 28672, 8192), (640, 896, 1152),
            (2504, 2500, 2504), (7168, 7168, 7168), (4096, 1024, 1024)]
#: (block_m, block_n) tiles of the engine (one or two consumer warpgroups of 64 rows): the
#: ones mkrt.kernels.gemm_rule may choose
CONFIGS = [(128, 256), (128, 192), (128, 128), (64, 256), (64, 128), (256, 128)]


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", nargs="+", default=["fit", "held_out"],
                        choices=("fit", "held_out"))
    parser.add_argument("--shapes", nargs="*", help="MxNxK ... instead of the sets")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "f16"))
    parser.add_argument("--b-layout", default="nk", choices=("nk", "kn"))
    parser.add_argument("--sms", type=int, default=None, help="grid cap (default: every SM)")
    parser.add_argument("--group-m", type=int, nargs="+", default=[8])
    parser.add_argument("--split-k", type=int, nargs="+", default=[2, 4, 8],
                        help="split-K parts also tried where the default tile leaves SMs idle")
    parser.add_argument("--tail-split", type=int, nargs="*", default=[2, 3, 4],
                        help="split-K parts of the last partial wave's tiles (split_tail), tried "
                             "for every tile (and cluster) whose tiles leave such a wave")
    parser.add_argument("--cluster", action="store_true",
                        help="also time each tile with clusters of two CTAs sharing B "
                             "(cluster='m2'; the fit rates them where rows have them)")
    parser.add_argument("--trim", action="store_true",
                        help="also time each shape's trimmed width (gemm_rule.trimmed_width: "
                             "128-row tiles as narrow as take the waves of 128x256; direct "
                             "stores; with --cluster, clustered too)")
    parser.add_argument("--configs", nargs="*", default=None,
                        help="only these tiles, e.g. 128x256 64x128 (default: every tile)")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--table", action="store_true",
                        help="write the fastest configuration per shape to the JIT cache folder")
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--fit", action="store_true", help="fit and judge the rule (no GPU)")
    parser.add_argument("--judge-only", action="store_true",
                        help="with --fit: judge the committed fit on the rows, write nothing")
    parser.add_argument("--commit", default=None, nargs="+",
                        help="--fit: rows of these commits only; with several, each (shape, "
                             "configuration) is its median over them")
    parser.add_argument("--out", default="experiments/results/gemm_tune.jsonl")
    return parser.parse_args()


def shapes_of(args) -> list[tuple[str, tuple[int, int, int]]]:
    if args.shapes:
        return [("given", tuple(int(x) for x in s.split("x"))) for s in args.shapes]
    sets = {"fit": FIT, "held_out": HELD_OUT}
    return [(name, shape) for name in args.sets for shape in sets[name]]


def compile_only(args) -> None:
    from mkrt.kernels import gemm as G
    for epilogue in ("tma", "direct"):
        for block_m, block_n in CONFIGS:
            spec = G.plan(256, 256, 256, dtype=args.dtype, b_layout=args.b_layout,
                          block_m=block_m, block_n=block_n, epilogue=epilogue).spec
            build = spec.build(check_spills=True)
            print(f"{spec.uri:48s} stages={spec.stages} smem={spec.smem_bytes} "
                  f"{build.resources.get('gemm')}", flush=True)


def sweep(args) -> None:
    import cupy
    import torch

    from mkrt import envs
    from mkrt.bench import append_jsonl, interleaved_ms, record
    from mkrt.kernels import gemm as G
    from mkrt.kernels import gemm_rule
    torch_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    sms = args.sms or cupy.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    best = {}
    for set_name, (m, n, k) in shapes_of(args):
        b_shape = (k, n) if args.b_layout == "kn" else (n, k)
        a = cupy.from_dlpack(torch.randn((m, k), dtype=torch_dtype, device="cuda"))
        b = cupy.from_dlpack(torch.randn(b_shape, dtype=torch_dtype, device="cuda") / 8)
        out = cupy.empty((m, n), dtype=a.dtype)
        ta, tb = torch.from_dlpack(a), torch.from_dlpack(b)
        tb = tb if args.b_layout == "kn" else tb.t()
        # torch.matmul as a model calls it (with out= it took up to 1.7x longer on small
        # shapes at 89b664c: a weaker baseline than experiments/gemm.py's)
        calls = {"torch": lambda: torch.matmul(ta, tb)}
        reference = G.reference(a, b, b_layout=args.b_layout, dtype=np.float32)
        case = f"{m}x{n}x{k}"
        checked = {}
        tiles = [(bm, bn) for bm, bn in CONFIGS if not args.configs or f"{bm}x{bn}" in args.configs]
        clusters = ("", "m2") if args.cluster else ("",)
        variants = [(bm, bn, g, 1, c, False) for c in clusters for bm, bn in tiles
                    for g in args.group_m]
        if args.trim and args.b_layout == "nk":
            for c in clusters:
                width = gemm_rule.trimmed_width(m, n, sms, c)
                if width:
                    variants.append((128, width, args.group_m[0], 1, c, False))
        for split_k in args.split_k:
            # split-K only where the default tile leaves SMs idle
            if split_k > 1 and G.plan(m, n, k, sms=sms).tiles < sms:
                variants += [(bm, bn, args.group_m[0], split_k, "", False) for bm, bn in tiles]
        for split_k in args.tail_split:
            # the last wave's tiles split, where there is a whole wave before a partial one
            variants += [(bm, bn, args.group_m[0], split_k, c, True) for c in clusters
                         for bm, bn in tiles
                         if gemm_rule.wave_terms(m, n, k, sms, (bm, bn), split_k, c,
                                                 args.b_layout, split_tail=True)]
        for (block_m, block_n, group_m, split_k, cluster, split_tail) in variants:
            config = gemm_rule.config_name(
                gemm_rule.Choice(block_m, block_n, split_k, cluster, split_tail), group_m)
            call = functools.partial(G.gemm, a, b, out, b_layout=args.b_layout, sms=args.sms,
                                     group_m=group_m, block_m=block_m, block_n=block_n,
                                     split_k=split_k, split_tail=split_tail, cluster=cluster)
            G.poison(out)
            call()
            error = float(cupy.linalg.norm(G.to_float32(out) - reference)
                          / cupy.linalg.norm(reference))
            if not math.isfinite(error) or error > 1e-2:
                print(f"{set_name:8s} {case:18s} {config:12s} WRONG (error {error:.2e})",
                      flush=True)
                append_jsonl(args.out, [record(
                    "gemm_tune", case, "wrong", 1.0, None, "count", set=set_name,
                    config=config, block_m=block_m, block_n=block_n, group_m=group_m,
                    error=error)])
                continue
            calls[config] = call
            checked[config] = dict(block_m=block_m, block_n=block_n, group_m=group_m,
                                   split_k=split_k, split_tail=split_tail, cluster=cluster,
                                   error=error)
        measured = interleaved_ms(calls, iterations=args.iterations, rounds=args.repeats,
                                  warmup=args.warmup)
        torch_us = 1e3 * measured.pop("torch")
        times = {config: 1e3 * ms for config, ms in measured.items()}
        flops = 2.0 * m * n * k
        for config, us in times.items():
            print(f"{set_name:8s} {case:18s} {config:12s} {us:9.1f} us "
                  f"{flops / us / 1e6:6.1f} TFLOP/s  x torch {torch_us / us:5.3f}", flush=True)
            append_jsonl(args.out, [record(
                "gemm_tune", case, "us", us, torch_us, "us", higher_is_better=False,
                set=set_name, config=config, sms=sms, dtype=args.dtype,
                b_layout=args.b_layout, tflops=flops / us / 1e6, timing="interleaved rounds",
                baseline_name="torch.matmul", **checked[config])])
        if times:
            winner = min(times, key=times.get)
            best[gemm_rule.table_key(m, n, k, args.dtype, args.b_layout, sms)] = winner
            print(f"{set_name:8s} {case:18s} best {winner} x torch "
                  f"{torch_us / times[winner]:.3f}", flush=True)
        a = b = out = ta = tb = reference = calls = None   # free this shape's memory
        cupy.get_default_memory_pool().free_all_blocks()
    if args.table:
        path = envs.get("MKRT_JIT_CACHE_DIR") / "gemm_table.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        table = json.loads(path.read_text()) if path.exists() else {}
        table.update(best)
        path.write_text(json.dumps(table, indent=1, sort_keys=True))
        print(f"wrote {len(best)} entries to {path}")


# ---- the rule's fit (no GPU) ----------------------------------------------------------

def _configuration(row):
    from mkrt.kernels.gemm_rule import Choice
    split_k = int(row.get("split_k", 1))
    return Choice(int(row["block_m"]), int(row["block_n"]), split_k, row.get("cluster") or "",
                  bool(row.get("split_tail")) and split_k > 1)


def _by_case(rows) -> dict:
    """Rows grouped by shape ("MxNxK"), in order of first appearance."""
    by_case: dict = {}
    for row in rows:
        by_case.setdefault(row["case"], []).append(row)
    return by_case


#: how much faster than every configuration without split-K a split must have been on a
#: shape to count as a win (two configurations of one shape differ by 1-3% between runs)
SPLIT_MARGIN = 0.03


def winning_splits(rows, split_tail: bool = False) -> list[int]:
    """The split-K part counts (of every tile, or with split_tail of the last wave's
    tiles) that were the fastest configuration of at least one shape of `rows` by more
    than SPLIT_MARGIN over the fastest configuration without split-K (and 1 for every
    tile): the only ones the rule may choose."""
    won = set()
    for measured in _by_case(rows).values():
        fastest = min(measured, key=lambda r: float(r["value"]))
        c = _configuration(fastest)
        plain = [float(r["value"]) for r in measured if _configuration(r).split_k == 1]
        if (c.split_k > 1 and c.split_tail == split_tail
                and (not plain or float(fastest["value"]) < (1 - SPLIT_MARGIN) * min(plain))):
            won.add(c.split_k)
    return sorted(won if split_tail else won | {1})


#: the partial-wave costs fit_model tries (1: a partial wave as long as a full one)
PARTIAL_COSTS = tuple(i / 20 for i in range(21))


def fit_model(rows, partial_costs=PARTIAL_COSTS) -> dict:
    """Least squares (relative errors) of the wave model's terms on `rows` (measured times
    of (shape, configuration)): 1 / rate per tile (and per tile with clusters, where rows
    have them), the split-K cost, the cost of a row loaded an odd 16 bytes off a sector,
    the tail split's summing cost, a fixed launch cost; for each of `partial_costs` (what
    a last partial wave costs, the model's one nonlinear parameter), keeping the one with
    the least squared error.
    Split-K part counts that never won a shape of `rows` are left out of the fit and of
    the rule (``splits``, ``tail_splits``): a measured split-K far slower than the model's
    linear fix-up cost would otherwise pull every tile's rate."""
    from mkrt.kernels import gemm_rule
    splits, tail_splits = winning_splits(rows), winning_splits(rows, split_tail=True)
    rows = [r for r in rows
            if _configuration(r).split_k in (tail_splits if _configuration(r).split_tail else splits)]
    measured = {gemm_rule.rate_key(c[:2], c.cluster) for c in map(_configuration, rows)}
    named = list(gemm_rule.TILES) + [(128, gemm_rule.TRIM_WIDTHS[0])]    # and "128xT"
    tiles = [key for key in (gemm_rule.rate_key(tile, cluster) for cluster in gemm_rule.CLUSTERS
                             for tile in named) if key in measured]
    columns = tiles + ["split_cost", "row_cost", "tail_cost", "launch_us"]
    best = None
    for partial_cost in partial_costs:
        matrix = []
        for row in rows:
            m, n, k = (int(x) for x in row["case"].split("x"))
            c = _configuration(row)
            terms = gemm_rule.wave_terms(m, n, k, int(row["sms"]), c[:2], c.split_k, c.cluster,
                                         row.get("b_layout", "nk"), c.split_tail, partial_cost)
            if terms is None:
                continue
            x = [0.0] * len(columns)
            work, x[-4], x[-3], x[-2] = terms
            x[tiles.index(gemm_rule.rate_key(c[:2], c.cluster))] = work
            x[-1] = 1.0
            us = float(row["value"])
            matrix.append([v / us for v in x])       # relative: every shape counts alike
        matrix = np.array(matrix)
        solution = np.linalg.lstsq(matrix, np.ones(len(matrix)), rcond=None)[0]
        error = float(np.sum((matrix @ solution - 1.0) ** 2))
        if best is None or error < best[0]:
            best = (error, partial_cost, solution, len(matrix))
    _, partial_cost, solution, count = best
    inverse = {t: float(v) for t, v in zip(tiles, solution)}
    return {"rates": {t: 1.0 / v for t, v in inverse.items() if v > 0},
            "split_cost": max(0.0, float(solution[-4])), "row_cost": max(0.0, float(solution[-3])),
            "tail_cost": max(0.0, float(solution[-2])), "launch_us": max(0.0, float(solution[-1])),
            "partial_cost": partial_cost, "splits": splits, "tail_splits": tail_splits,
            "rows": count}


def judge(rows, fit) -> list[dict]:
    """Per shape of `rows`: the model's pick, its measured time (None: not measured), the
    fastest measured configuration, and torch.matmul's time."""
    from mkrt.kernels import gemm_rule
    out = []
    for case, measured in _by_case(rows).items():
        m, n, k = (int(x) for x in case.split("x"))
        sms = int(measured[0]["sms"])
        pick = gemm_rule.best_configuration(m, n, k, sms, fit, measured[0].get("b_layout", "nk"))
        times = {_configuration(r): float(r["value"]) for r in measured}
        fastest = min(times, key=times.get)
        out.append({"case": case, "pick": pick, "pick_us": times.get(pick),
                    "fastest": fastest, "fastest_us": times[fastest],
                    "torch_us": float(measured[0]["baseline"])})
    return out


def pooled(rows) -> list[dict]:
    """One row per (set, shape, configuration, SMs): the first, with the median time over
    `rows` (sweeps of several runs; a median per configuration damps the run-to-run drift
    that one sweep carries into the fit)."""
    groups: dict = {}
    for row in rows:
        key = (row.get("set"), row["case"], row.get("config"), row.get("sms"))
        groups.setdefault(key, []).append(row)
    out = []
    for members in groups.values():
        row = dict(members[0])
        row["value"] = float(np.median([float(r["value"]) for r in members]))
        row["baseline"] = float(np.median([float(r["baseline"]) for r in members]))
        row["runs"] = len(members)
        out.append(row)
    return out


def fit_and_judge(args) -> None:
    rows = [json.loads(line) for line in Path(args.out).read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("experiment") == "gemm_tune" and r.get("metric") == "us"
            and (args.commit is None or r.get("commit") in args.commit)]
    if args.commit and len(args.commit) > 1:
        rows = pooled(rows)
    fit_rows = [r for r in rows if r.get("set") == "fit"]
    held = [r for r in rows if r.get("set") == "held_out"]
    if not fit_rows:
        raise SystemExit(f"gemm_tune --fit: no FIT rows in {args.out}")
    from mkrt.kernels import gemm_rule
    if args.judge_only:
        fit = gemm_rule.fitted_model()
        print(f"the committed fit ({fit.get('commit')}) judged on these rows")
    else:
        fit = fit_model(fit_rows)
        fit["commit"] = " ".join(args.commit) if args.commit else fit_rows[-1].get("commit")
        gemm_rule.FIT_PATH.write_text(json.dumps(fit, indent=1, sort_keys=True) + "\n")
        print(f"wrote {gemm_rule.FIT_PATH}: rates {fit['rates']}, split cost {fit['split_cost']:.3g}, "
              f"row cost {fit['row_cost']:.3g} us, tail cost {fit['tail_cost']:.3g} us, "
              f"tail splits {fit['tail_splits']}, partial wave {fit['partial_cost']:.2f}, "
              f"launch {fit['launch_us']:.1f} us ({fit['rows']} FIT rows)")
    for name, subset in (("FIT", fit_rows), ("HELD_OUT", held)):
        lines = judge(subset, fit)
        scored = [x for x in lines if x["pick_us"]]
        print(f"{name}: {len(lines)} shapes, the pick measured on {len(scored)}")
        for x in lines:
            pick = gemm_rule.config_name(x["pick"])
            got = f"{x['fastest_us'] / x['pick_us']:.3f} of fastest, {x['torch_us'] / x['pick_us']:.3f}x torch" \
                if x["pick_us"] else "pick not measured"
            print(f"  {x['case']:18s} pick {pick:12s} {got}")
        if scored:
            geo = math.exp(sum(math.log(x["torch_us"] / x["pick_us"]) for x in scored) / len(scored))
            print(f"  geomean x torch {geo:.3f}; worst of fastest "
                  f"{min(x['fastest_us'] / x['pick_us'] for x in scored):.3f}")


def main() -> None:
    args = parse()
    if args.fit:
        fit_and_judge(args)
    elif args.compile_only:
        compile_only(args)
    else:
        sweep(args)


if __name__ == "__main__":
    main()
