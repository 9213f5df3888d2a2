"""Does `fuse=None` pick the faster path? GEMM+AllReduce fused vs unfused vs the planner.

Two committed shape sets (m = tokens, n = output features, k = input features per rank):
  calibration  the model is fitted on these (the reference's sweep, the old benchmark's
               LLM shapes, 12 seeded random shapes);
  held_out     never used for fitting: row-parallel projections (attention output and MLP
               down) of Llama-3 8B, Llama-3 70B, Mixtral 8x7B and Qwen2.5-72B at TP 2, 4 and 8
               with 512 to 16384 tokens, and 20 random odd shapes (another seed).
For each shape and emulated world, the three paths run interleaved in rounds (CUDA
events around back-to-back calls, so host time counts where it dominates); medians per
path. ratio_auto = min(fused, unfused) / auto: 1.0 when the planner picked the faster path.

    PYTHONPATH=$PWD python3 experiments/planner.py --layouts 1x2 1x4 2x2 --sets calibration held_out

Rows go to experiments/results/planner.jsonl; ``python3 experiments/planner.py --fit``
refits the fusion rule's time models (mkrt/controller/cost.py, written to
mkrt/controller/fusion_fit.json) on the calibration rows (no GPU) and judges them on
every set: would the rule's pick have been within 3% of the faster path measured in the
same run? (The rows of a run with fuse=None measure the same thing directly: ratio.)
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# hidden, intermediate of each model (row-parallel: K = that / TP, N = hidden)
MODELS = {"llama3_8b": (4096, 14336), "llama3_70b": (8192, 28672),
          "mixtral_8x7b": (4096, 14336), "qwen25_72b": (8192, 29568)}


def _random_shapes(seed: int, count: int) -> list[tuple[int, int, int, str]]:
    rng = random.Random(seed)
    shapes = []
    for i in range(count):
        m = rng.randint(200, 12000)
        n = rng.randint(200, 12000)
        k = 8 * rng.randint(16, 1200)
        shapes.append((m, n, k, f"random{seed}_{i}"))
    return shapes


def calibration() -> list[tuple[int, int, int, str]]:
    """A grid over K (the feature that matters most) crossed with sizes and widths, odd
    shapes, and the small end. The first version of this set (commit cc2daa8: the sweep,
    three LLM shapes, 12 random shapes) had too few aligned large-K shapes to fit; its
    rows stay in the results with set="calibration_v1"."""
    sizes = [(768, 2560), (3072, 6144), (12288, 2560), (1536, 12288), (6144, 6144)]
    grid = []
    for i, k in enumerate((384, 768, 1536, 3072, 6144, 12288)):
        for j in range(3):
            m, n = sizes[(i + j) % len(sizes)]
            grid.append((m, n, k, "grid"))
    small = [(256, 256, 256, "tiny"), (512, 2048, 256, "small"), (1024, 1536, 640, "small"),
             (2048, 2048, 128, "sweep"), (4096, 4096, 256, "sweep")]
    return grid + small + _random_shapes(1, 8) + _aligned_random_shapes(3, 30)


def _aligned_random_shapes(seed: int, count: int) -> list[tuple[int, int, int, str]]:
    """Shapes with the alignment of real layers, spread evenly in log size (added after
    the K grid alone left large M and mid K thin)."""
    rng = random.Random(seed)
    shapes = []
    for i in range(count):
        m = 128 * round(2 ** rng.uniform(1, 7))          # 256 .. 16384
        n = 256 * round(2 ** rng.uniform(2, 6))          # 1024 .. 16384
        k = 64 * round(2 ** rng.uniform(2, 8))           # 256 .. 16384
        shapes.append((m, n, k, f"aligned{seed}_{i}"))
    return shapes


def held_out() -> list[tuple[int, int, int, str]]:
    seen, shapes = set(), []
    for model, (hidden, inter) in MODELS.items():
        for tp in (2, 4, 8):
            for what, k in (("o_proj", hidden // tp), ("down", inter // tp)):
                for tokens in (512, 2048, 8192, 16384):
                    if tokens == 16384 and tp == 2:
                        continue        # keeps the run short: the largest shapes at TP 4, 8
                    key = (tokens, hidden, k)
                    if key not in seen:
                        seen.add(key)
                        shapes.append((tokens, hidden, k, f"{model}_{what}_tp{tp}"))
    return shapes + _random_shapes(2, 20)


SETS = {"calibration": calibration, "held_out": held_out}


def proxy_state(world) -> dict:
    """Per GPU: commands claimed by the kernels, consumed and completed by the proxy, per
    queue, and the proxy threads' counters (empty when the world has no proxy)."""
    service = world.running_service("proxy")
    if service is None:
        return {}
    out = {}
    for device, queue_set in service.queue_sets.items():
        try:
            heads = [int(h) for h in queue_set.device_heads()]
        except Exception as error:          # noqa: BLE001 - the device may be in error
            heads = repr(error)
        out[str(device)] = {"claimed": heads,
                            "consumed": [queue_set.tail(q) for q in range(queue_set.queues)],
                            "completed": [queue_set.done(q) for q in range(queue_set.queues)],
                            "proxy": service.proxies[device].stats}
    return out


def time_paths(world, paths: dict, rounds: int, batch: int) -> dict[str, float]:
    """Median microseconds per call of each path, the paths interleaved round by round."""
    from mkrt.bench import interleaved_ms
    # Each path's first calls, synchronized: a first cuBLAS call of a shape waits for the
    # device, and must not while fused kernels wait for the proxy (mkrt/DESIGN.md,
    # "Runtime hazards"; before this, 8 of 101 shapes on 2x2 timed out here).
    for call in paths.values():
        call()
        call()
        world.synchronize()
    # in turns, each round starting one path further on (mkrt.bench.interleaved_ms)
    ms = interleaved_ms(paths, iterations=batch, rounds=rounds, warmup=0)
    world.check()
    return {name: 1e3 * value for name, value in ms.items()}


def operands(world, m, n, k):
    """Each local rank's A [m, k] and B [n, k] (bf16, B as nn.Linear's weight), drawn from
    the shape, so every path and experiment of a shape gets the same numbers."""
    import cupy
    import numpy as np

    from mkrt.arrays import bfloat16
    rng = cupy.random.default_rng(m * 7 + n * 3 + k)
    a = [rng.standard_normal((m, k), dtype=np.float32).astype(bfloat16) for _ in world.local]
    b = [(rng.standard_normal((n, k), dtype=np.float32) / 8).astype(bfloat16) for _ in world.local]
    return a, b


def _ops(world):
    """(fused, planner's pick, measured) GemmAllReduce ops; B as [N, K] (every random N is
    allowed); a bounded wait of 5 s: a shape that times out costs little and is recorded."""
    import mkrt
    return tuple(mkrt.GemmAllReduce(world, fuse=fuse, b_layout="nk", timeout_ms=5000)
                 for fuse in (True, "model", "measure"))


def run(layouts, sets, rounds, batch, out_path, limit=None, start=0):
    import cupy

    import mkrt
    from mkrt.arrays import bfloat16
    from mkrt.bench import append_jsonl, record
    from mkrt.kernels.gemm import to_float32
    for layout in layouts:
        world = mkrt.init(emulate=layout)
        fused_op, auto_op, measure_op = _ops(world)
        for set_name in sets:
            shapes = SETS[set_name]()[start:limit]
            for m, n, k, family in shapes:
                a, b = operands(world, m, n, k)
                outs = {name: [cupy.empty((m, n), bfloat16) for _ in world.local]
                        for name in ("fused", "unfused", "auto", "measured")}
                paths = {"fused": lambda: fused_op(a, b, out=outs["fused"]),
                         "unfused": lambda: fused_op.unfused(a, b, out=outs["unfused"]),
                         "auto": lambda: auto_op(a, b, out=outs["auto"]),
                         # fuse="measure": its first call times both paths (not counted here)
                         "measured": lambda: measure_op(a, b, out=outs["measured"])}
                try:
                    times = time_paths(world, paths, rounds, batch)
                except mkrt.CommTimeout as error:
                    # Recorded, not hidden: the row says which shape timed out and where,
                    # and what the proxy had done (claimed vs consumed vs completed).
                    proxy = proxy_state(world)
                    print(f"{set_name:11s} {layout}_{m}x{n}x{k} TIMEOUT {error} proxy {proxy}", flush=True)
                    append_jsonl(out_path, [record("planner", f"{layout}_{m}x{n}x{k}", "timeout", 1.0,
                                                   None, "count", set=set_name, family=family,
                                                   layout=layout, m=m, n=n, k=k, error=str(error),
                                                   proxy=proxy)])
                    del a, b, outs, paths
                    world.close()
                    world = mkrt.init(emulate=layout)
                    fused_op, auto_op, measure_op = _ops(world)
                    continue
                fused_out = to_float32(outs["fused"][0])
                unfused_out = to_float32(outs["unfused"][0])
                difference = float(cupy.linalg.norm(fused_out - unfused_out)
                                    / cupy.linalg.norm(unfused_out))
                plan = auto_op.last_plan
                best = min(times["fused"], times["unfused"])
                case = f"{layout}_{m}x{n}x{k}"
                row = record("planner", case, "auto_vs_best", times["auto"], best, "us",
                             higher_is_better=False, set=set_name, family=family, layout=layout,
                             m=m, n=n, k=k, fused_us=times["fused"], unfused_us=times["unfused"],
                             auto_us=times["auto"], auto_fused=plan.fused,
                             fused_over_unfused=times["fused"] / times["unfused"],
                             reduce_ctas=plan.reduce_ctas, ctas=plan.ctas,
                             predicted_fused_us=plan.predicted_fused_us,
                             predicted_unfused_us=plan.predicted_unfused_us,
                             fused_vs_unfused_rel_diff=difference, rounds=rounds, batch=batch,
                             measured_us=times["measured"],
                             measured_fused=measure_op.last_plan.fused,
                             measured_vs_best=best / times["measured"])
                print(f"{set_name:11s} {case:24s} fused {times['fused']:9.1f} unfused "
                      f"{times['unfused']:9.1f} auto {times['auto']:9.1f} "
                      f"({'F' if plan.fused else 'U'}) best/auto {row['ratio']:.3f} "
                      f"best/measured {row['measured_vs_best']:.3f} "
                      f"diff {difference:.1e}", flush=True)
                append_jsonl(out_path, [row])
                del a, b, outs, paths
                cupy.get_default_memory_pool().free_all_blocks()
        fused_op.close()
        auto_op.close()
        measure_op.close()
        world.close()


def load_rows(path, commit=None):
    import json
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("experiment") == "planner"]
    if commit:
        rows = [r for r in rows if r["commit"] == commit]
    return rows


def times_of(row, fit):
    """(fused us, unfused us) the fitted models predict for a measured row, or None."""
    from mkrt.controller.cost import fitted_times
    nodes, per_node = (int(x) for x in row["layout"].split("x"))
    return fitted_times(row["layout"], row["m"], row["n"], row["k"], ctas=row["ctas"],
                        reduce_ctas=row["reduce_ctas"], ranks_per_gpu=nodes * per_node, fit=fit)


def judge(rows, fit) -> list[tuple[dict, bool, float]]:
    """(row, rule picks fused, best / time of the picked path) for measured rows."""
    out = []
    for row in rows:
        times = times_of(row, fit)
        if times is None:
            continue
        fused = times[0] < times[1]
        picked = row["fused_us"] if fused else row["unfused_us"]
        out.append((row, fused, min(row["fused_us"], row["unfused_us"]) / picked))
    return out


def fit(path, commit=None) -> dict:
    """Least-squares weights (relative error) of both time models, per layout, on the
    calibration rows."""
    import numpy as np

    from mkrt.controller.cost import fusion_terms
    rows = [r for r in load_rows(path, commit) if r["set"] == "calibration"]
    where = Path(path).resolve()
    where = where.relative_to(ROOT) if where.is_relative_to(ROOT) else where
    commits = sorted({r["commit"] for r in rows})
    out = {"fitted_on": f"{where}, set=calibration, commit {', '.join(commits)}: python3 "
                        f"experiments/planner.py --fit" + (f" --commit {commit}" if commit else ""),
           "layouts": {}}
    for layout in sorted({r["layout"] for r in rows}):
        mine = [r for r in rows if r["layout"] == layout]
        nodes, per_node = (int(x) for x in layout.split("x"))
        entry = {"ranks_per_gpu": nodes * per_node, "rows": len(mine)}
        for path_name, index in (("fused", 0), ("unfused", 1)):
            x = np.array([fusion_terms(r["m"], r["n"], r["k"], ctas=r["ctas"],
                                       reduce_ctas=r["reduce_ctas"],
                                       ranks_per_gpu=nodes * per_node)[index] for r in mine])
            y = np.array([r[f"{path_name}_us"] for r in mine])
            weights = np.linalg.lstsq(x / y[:, None], np.ones(len(y)), rcond=None)[0]
            entry[path_name] = [round(float(w), 6) for w in weights]
        out["layouts"][layout] = entry
    return out


def report(path, fit_result, commit=None):
    for set_name in SETS:
        rows = [r for r in load_rows(path, commit) if r["set"] == set_name]
        judged = judge(rows, fit_result)
        if not judged:
            continue
        worst = min(judged, key=lambda j: j[2])
        losing = [j for j in judged if j[2] < 0.97]
        print(f"{set_name}: {len(judged)} rows, the rule's pick within 3% of the faster path "
              f"on {len(judged) - len(losing)}; worst {worst[2]:.3f} at {worst[0]['case']}")
        for row, fused, ratio in losing:
            print(f"   {row['case']} picked {'fused' if fused else 'unfused'}: {ratio:.3f} "
                  f"(fused/unfused {row['fused_over_unfused']:.3f})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["1x2", "1x4", "2x2"])
    parser.add_argument("--sets", nargs="+", default=["calibration", "held_out"], choices=list(SETS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--limit", type=int, default=None, help="shapes [start, limit) of each set")
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "experiments" / "results" / "planner.jsonl"))
    parser.add_argument("--fit", action="store_true", help="refit the rule from --out (no GPU)")
    parser.add_argument("--commit", default=None, help="--fit: rows of this commit only")
    args = parser.parse_args()
    if args.fit:
        import json

        from mkrt.controller.cost import FIT_PATH
        result = fit(args.out, args.commit)
        FIT_PATH.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {FIT_PATH}: {result['fitted_on']}")
        report(args.out, result, args.commit)
        return 0
    run(args.layouts, args.sets, args.rounds, args.batch, args.out, args.limit, args.start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
