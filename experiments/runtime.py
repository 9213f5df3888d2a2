"""Host time per call of the world ops: back-to-back calls without synchronisation.

For `allgather` (4 KiB per rank), `gemm_allreduce` (256x256x256 per rank, out= given),
`gemm_reducescatter` (256x256x256 per rank, 256/W rows out), `allgather_gemm` (256/W
rows of A per rank, 256x256 B), `ring_attention` (causal, 128 rows per rank) and `moe`
(32 tokens per rank, top-2, H 256, I 128; five launches per call)
on emulated worlds 1x1, 1x2 and 1x4: 2000 calls in a row, no sync; host time per call
(and per rank) is the wall time of the loop. The GPU time per call (events around the
same loop after a sync) says whether the GPU kept up; a row where it did not is marked
gpu_bound. The same op captured once in a CUDA graph and replayed 2000 times gives the
replay cost. ``--profile`` adds a per-phase cProfile table (top functions by own time).

    PYTHONPATH=$PWD python3 experiments/runtime.py [--label after] [--profile notes.txt]

Run it against another checkout (the code before a change) with that checkout first on
PYTHONPATH and ``--label before``; rows go to experiments/results/runtime.jsonl.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def operands(world, op_name):
    import cupy
    import numpy as np
    from mkrt.arrays import bfloat16
    args, outs = [], []
    for info in world.local:
        with cupy.cuda.Device(info.device):
            rng = cupy.random.default_rng(info.rank)
            if op_name == "allgather":
                args.append((rng.standard_normal(1024, dtype=np.float32),))
                outs.append(cupy.empty((world.size, 1024), np.float32))
            elif op_name == "gemm":                    # the engine alone: world-1 overhead
                a = rng.standard_normal((256, 256), dtype=np.float32).astype(bfloat16)
                b = rng.standard_normal((256, 256), dtype=np.float32).astype(bfloat16)
                args.append((a, b))
                outs.append(cupy.empty((256, 256), bfloat16))
            elif op_name == "gemm_reducescatter":      # 256 rows in all, W-way scattered
                a = rng.standard_normal((256, 256), dtype=np.float32).astype(bfloat16)
                b = rng.standard_normal((256, 256), dtype=np.float32).astype(bfloat16)
                args.append((a, b))
                outs.append(cupy.empty((256 // world.size, 256), bfloat16))
            elif op_name == "allgather_gemm":          # 256 rows in all, W-way gathered
                a = rng.standard_normal((256 // world.size, 256), dtype=np.float32).astype(bfloat16)
                b = rng.standard_normal((256, 256), dtype=np.float32).astype(bfloat16)
                args.append((a, b))
                outs.append(cupy.empty((256 // world.size * world.size, 256), bfloat16))
            else:
                a = rng.standard_normal((256, 256), dtype=np.float32).astype(bfloat16)
                b = rng.standard_normal((256, 256), dtype=np.float32).astype(bfloat16)
                args.append((a, b))
                outs.append(cupy.empty((256, 256), bfloat16))
    return args, outs


def build_other(world, op_name):
    """Ring attention (causal, 64-row chunks, 2 query heads on 1, D 64) and MoE (32 tokens
    per rank, top-2 of 2 experts per rank, H 256, I 128): (call, op)."""
    import cupy
    import numpy as np

    import mkrt
    from mkrt.arrays import bfloat16
    from mkrt.kernels import moe as M
    from mkrt.kernels import ring_attention as RA
    one = len(world.local) == 1
    pick = (lambda values: values[0]) if one else (lambda values: values)   # noqa: E731
    if op_name == "ring_attention":
        rng = cupy.random.default_rng(3)
        S = 2 * world.size * 64
        q, k, v = (rng.standard_normal((1, S, h, 64), dtype=np.float32).astype(bfloat16)
                   for h in (2, 1, 1))
        parts = [pick([RA.shard(t, info.rank, world.size, causal=True) for info in world.local])
                 for t in (q, k, v)]
        outs = pick([cupy.empty((1, 128, 2, 64), bfloat16) for _ in world.local])
        lses = pick([cupy.empty((1, 2, 128), np.float32) for _ in world.local])
        op = mkrt.RingAttention(world)
        return (lambda: op(*parts, causal=True, out=outs, lse=lses)), op
    experts = 2 * world.size
    dev, _ = M.random_problem(world.size, [32] * world.size, 2, 256, 128, experts, seed=4)
    args = [pick(dev[name]) for name in ("x", "ids", "weights", "w1", "w2")]
    outs = pick([cupy.empty((32, 256), bfloat16) for _ in world.local])
    op = mkrt.MoE(world, experts=experts, capacity=32)
    return (lambda: op(*args, out=outs)), op


def build(world, op_name):
    import mkrt
    if op_name in ("ring_attention", "moe"):
        return build_other(world, op_name)
    if op_name == "gemm":
        if world.size != 1:
            raise ValueError("the gemm baseline runs on a world of one rank (1x1)")
        args, outs = operands(world, op_name)
        (a, b), = args
        return (lambda: mkrt.gemm(a, b, outs[0], b_layout="nk")), None
    ops = {"allgather": mkrt.AllGather, "gemm_allreduce": mkrt.GemmAllReduce,
           "gemm_reducescatter": getattr(mkrt, "GemmReduceScatter", None),
           "allgather_gemm": getattr(mkrt, "AllGatherGemm", None)}
    if ops[op_name] is None:
        raise ValueError(f"this checkout has no {op_name}")
    op = ops[op_name](world)
    args, outs = operands(world, op_name)
    per_arg = list(zip(*args))
    if len(world.local) == 1:
        call_args = [x[0] for x in per_arg]
        out = outs[0]
    else:
        call_args = [list(x) for x in per_arg]
        out = outs
    if op_name == "allgather" and world.size != world.ranks_per_node:
        out = None      # the code before the change gathered a node, not the world
    return lambda: op(*call_args, out=out), op


def measure(world, op_name, calls):
    import cupy
    call, op = build(world, op_name)
    for _ in range(50):
        call()
    world.synchronize()
    stream = cupy.cuda.get_current_stream()
    start_event, end_event = cupy.cuda.Event(), cupy.cuda.Event()
    start_event.record(stream)
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    host = (time.perf_counter() - t0) / calls * 1e6
    end_event.record(stream)
    world.synchronize()
    gpu = cupy.cuda.get_elapsed_time(start_event, end_event) * 1e3 / calls
    replay = None
    try:
        graph_stream = cupy.cuda.Stream(non_blocking=True)
        with graph_stream:
            graph_stream.begin_capture()
            call()
            graph = graph_stream.end_capture()
        graph.upload(graph_stream)
        graph.launch(graph_stream)
        graph_stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            graph.launch(graph_stream)
        replay = (time.perf_counter() - t0) / calls * 1e6
        graph_stream.synchronize()
        world.synchronize()
    except Exception as error:      # noqa: BLE001 - a path that cannot be captured says so
        print(f"  graph capture failed: {error!r}", flush=True)
    return call, host, gpu, replay


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["1x1", "1x2", "1x4"])
    parser.add_argument("--ops", nargs="+", default=["allgather", "gemm_allreduce"],
                        choices=["allgather", "gemm_allreduce", "gemm_reducescatter",
                                 "allgather_gemm", "ring_attention", "moe", "gemm"],
                        help="gemm: mkrt.gemm alone on 1x1, the floor of the world ops' 1x1 rows")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--label", default="after")
    parser.add_argument("--profile", default=None, help="write per-phase cProfile tables here")
    parser.add_argument("--out", default=str(ROOT / "experiments" / "results" / "runtime.jsonl"))
    args = parser.parse_args()

    import mkrt
    from mkrt.bench import append_jsonl, record
    rows, profiles = [], []
    for layout in args.layouts:
        world = mkrt.init(emulate=layout)
        for op_name in args.ops:
            if op_name == "gemm" and world.size != 1:
                continue                          # the engine alone: a one-rank floor only
            call, host, gpu, replay = measure(world, op_name, args.calls)
            ranks = len(world.local)
            bound = "gpu" if gpu > 1.1 * host else "host"
            print(f"{args.label:7s} {layout:4s} {op_name:15s} host {host:7.1f} us/call "
                  f"{host / ranks:6.1f} us/rank | gpu {gpu:7.1f} us/call ({bound}-bound) | "
                  f"graph replay {replay if replay is None else round(replay, 1)} us", flush=True)
            case = f"{layout}_{op_name}"
            common = dict(label=args.label, layout=layout, op=op_name, ranks=ranks,
                          calls=args.calls, bound=bound, gpu_us_per_call=gpu,
                          host_us_per_call=host, mkrt_file=mkrt.__file__)
            rows.append(record("runtime", case, "host_us_per_rank", host / ranks, 10.0, "us",
                               higher_is_better=False, **common))
            if replay is not None:
                rows.append(record("runtime", case, "graph_replay_us", replay, None, "us",
                                   higher_is_better=False, **common))
            if args.profile:
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(args.calls):
                    call()
                profiler.disable()
                world.synchronize()
                text = io.StringIO()
                stats = pstats.Stats(profiler, stream=text).sort_stats("tottime")
                stats.print_stats(14)
                profiles.append(f"## {args.label} {layout} {op_name} ({args.calls} calls, "
                                f"cProfile, seconds in total)\n" + text.getvalue())
        world.close()
    append_jsonl(args.out, rows)
    if args.profile:
        Path(args.profile).write_text("\n".join(profiles))
    return 0


if __name__ == "__main__":
    sys.exit(main())
