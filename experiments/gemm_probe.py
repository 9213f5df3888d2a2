"""Probes of the GEMM engine's open gaps, each against torch.matmul in the same run:

* ``grid``: clusters of two CTAs sharing B (``cluster="m2"``) ran at 0.4-0.6x of one-CTA
  tiles. Time both at fixed grids (8 .. every SM) to tell a grid cut by the cluster
  occupancy query from a slower pipeline per CTA (time x grid / k-steps = us per k-step);
  prints the grid the plan launches and the query's answer.
* ``k_offset``: K rows of 14000 bytes (K = 7000) cost 1.5x against 7168. Time the rule's
  tile on M x N x K with K - K0 = 0, 8, ..., 64 (row starts 16 .. 128 bytes off a
  128-byte line) to see which offsets cost and how much.
* ``kernels``: the names of the kernels torch.matmul runs on given shapes (cuBLAS names
  its tile, cluster shape and schedule), from torch.profiler.
* ``l2``: the tensor maps' L2 promotion (none, 64, 128, 256 bytes; mkrt used 256 for every
  map before this probe, now 128 on rows off a sector: gemm.l2_promotion) on rows
  off a sector and on aligned rows, each tile with and without clusters, in turns with
  torch.matmul: cuBLAS runs 3000x5000x7000 at the speed of 3000x5000x7168, mkrt does not.
* ``small``: shapes of one wave or less (1536^3 ran at 0.82-1.29x torch between runs, torch's
  time moving, not mkrt's): each side eager, as CUDA graphs of --graph-calls calls (GPU time
  without the host), and the host's time to enqueue one call without waiting, in turns;
  mkrt also as its prepared launch alone, programmatic (PDL) and plain.
* ``streamk``: the tiles after the full waves shared out by k-blocks (``stream_k=True``),
  against the same tile without it and against the rule's pick, on reduced grids and
  shapes of a wave or less, in turns with torch.matmul on the full chip.
* ``host``: a cProfile of 2000 back-to-back mkrt.gemm calls on the first --small-shapes
  shape, by own time (where the host path's microseconds go).
* ``odd_rows``: shapes whose rows start 16 bytes off a 32-byte sector (K = 8 mod 16)
  stay below torch (3000x5000x7000 at 0.85). Time, in turns with torch.matmul, each tile
  with and without clusters, with the TMA-store epilogue and with direct stores (which
  leave room for one or two more pipeline stages), at raster groups of 8 and 16 tile rows.

    PYTHONPATH=$PWD python3 experiments/gemm_probe.py --probes grid k_offset kernels \\
        --out $OUT/gemm_probe.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import math


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probes", nargs="+", default=["grid", "k_offset", "kernels"],
                        choices=("grid", "k_offset", "kernels", "odd_rows", "l2", "small", "host",
                                 "streamk"))
    parser.add_argument("--odd-shapes", nargs="+",
                        default=["3000x5000x7000", "4096x4096x4040", "8192x2048x3000"])
    parser.add_argument("--l2-shapes", nargs="+",
                        default=["3000x5000x7000", "3000x5000x7168", "4096x4096x4040",
                                 "4096x4096x4096"])
    parser.add_argument("--small-shapes", nargs="+",
                        default=["1536x1536x1536", "2048x2048x2048", "1000x1000x1000",
                                 "4096x1024x1024", "128x4096x4096", "16x8192x8192"])
    parser.add_argument("--graph-calls", type=int, default=20)
    parser.add_argument("--streamk-cases", nargs="+",
                        default=["7168x7168x7168@116", "7168x7168x7168@100", "3000x5000x7000@116",
                                 "1536x1536x1536@132", "8192x1024x8192@116", "12288x12288x1536@100",
                                 "32768x1024x4096@100", "2048x2048x2048@132"],
                        help="MxNxK@SMs")
    parser.add_argument("--grid-shapes", nargs="+", default=["8192x8192x8192", "3000x5000x7000"])
    parser.add_argument("--grid-configs", nargs="+", default=["128x256", "64x128"])
    parser.add_argument("--grids", type=int, nargs="+", default=[8, 32, 64, 96, 128, 132])
    parser.add_argument("--k-base", nargs="+", default=["4096x4096x4096", "3072x5120x7168"],
                        help="MxNxK0: K runs K0 - 64 .. K0 in steps of 8")
    parser.add_argument("--kernel-shapes", nargs="+",
                        default=["3000x5000x7000", "3000x5000x7168", "8192x8192x8192",
                                 "24576x8192x1024"])
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", required=True)
    return parser.parse_args()


def operands(m, n, k):
    import cupy
    import torch
    a = cupy.from_dlpack(torch.randn((m, k), dtype=torch.bfloat16, device="cuda"))
    b = cupy.from_dlpack(torch.randn((n, k), dtype=torch.bfloat16, device="cuda") / 8)
    return a, b


def torch_us(a, b, args) -> float:
    import torch

    from mkrt.bench import batch_ms
    ta, tb = torch.from_dlpack(a), torch.from_dlpack(b).t()
    out = torch.empty((a.shape[0], b.shape[0]), dtype=torch.bfloat16, device="cuda")
    return 1e3 * batch_ms(lambda: torch.matmul(ta, tb, out=out), iterations=args.iterations,
                          repeats=args.repeats, warmup=args.warmup)


def checked(call, out, a, b) -> float:
    """Relative error of one call's output against a float32 result (output poisoned)."""
    import cupy
    from mkrt.kernels import gemm as G
    G.poison(out)
    call()
    reference = G.reference(a, b, b_layout="nk")
    return float(cupy.linalg.norm(G.to_float32(out) - reference) / cupy.linalg.norm(reference))


def probe_grid(args, rows) -> None:
    import cupy
    from mkrt.bench import batch_ms, record
    from mkrt.kernels import gemm as G
    sms = cupy.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    for shape in args.grid_shapes:
        m, n, k = (int(x) for x in shape.split("x"))
        a, b = operands(m, n, k)
        out = cupy.empty((m, n), dtype=a.dtype)
        base = torch_us(a, b, args)
        for config in args.grid_configs:
            block_m, block_n = (int(x) for x in config.split("x"))
            for cluster in ("", "m2"):
                p = G.plan(m, n, k, b_layout="nk", sms=sms, block_m=block_m, block_n=block_n,
                           cluster=cluster)
                function = p.spec.function("gemm", 0, p.spec.smem_bytes)
                launched = G.cluster_grid(p.spec, function, p.grid, 0) if cluster else p.grid
                print(f"{shape} {config} cluster={cluster or '-'}: plan grid {p.grid}, "
                      f"launched {launched}, smem {p.spec.smem_bytes}", flush=True)
                steps = p.tiles * -(-k // 64)                    # k-steps of the whole grid
                for grid in args.grids:
                    grid = min(grid, p.grid) // 2 * 2 if cluster else min(grid, p.grid)
                    call_state = G._PreparedGemm(dataclasses.replace(p, grid=grid), function, 0)
                    grid = call_state.plan.grid          # clusters: cut to what the GPU holds

                    def call():
                        call_state.patch(a.data.ptr, b.data.ptr, out.data.ptr)
                        call_state.launch(cupy.cuda.get_current_stream().ptr)
                    error = checked(call, out, a, b)
                    us = 1e3 * batch_ms(call, iterations=args.iterations, repeats=args.repeats,
                                    warmup=args.warmup)
                    per_step = us * grid / steps
                    ok = math.isfinite(error) and error < 1e-2
                    print(f"  grid {grid:4d}: {us:9.1f} us  x torch {base / us:5.3f}  "
                          f"{per_step:6.3f} us per k-step per CTA  error {error:.1e}"
                          + ("" if ok else "  WRONG"), flush=True)
                    rows.append(record("gemm_probe", f"{shape} {config}{'_m2' if cluster else ''} "
                                       f"grid={grid}", "us", us, base, "us",
                                       higher_is_better=False, probe="grid", grid=grid,
                                       launched_grid=launched, per_step_us=per_step,
                                       error=error, baseline_name="torch.matmul"))
        a = b = out = None
        cupy.get_default_memory_pool().free_all_blocks()


def probe_k_offset(args, rows) -> None:
    import cupy
    from mkrt.bench import batch_ms, record
    from mkrt.kernels import gemm as G
    for base_shape in args.k_base:
        m, n, k0 = (int(x) for x in base_shape.split("x"))
        for k in range(k0 - 64, k0 + 1, 8):
            a, b = operands(m, n, k)
            out = cupy.empty((m, n), dtype=a.dtype)
            base = torch_us(a, b, args)
            call = lambda: G.gemm(a, b, out, b_layout="nk")  # noqa: E731
            p = G.call_plan(a, b, out, b_layout="nk")
            error = checked(call, out, a, b)
            us = 1e3 * batch_ms(call, iterations=args.iterations, repeats=args.repeats,
                                    warmup=args.warmup)
            offset = (k * 2) % 128
            print(f"{m}x{n}x{k} (rows {k * 2} B, {offset:3d} off a line) "
                  f"{p.spec.block_m}x{p.spec.block_n}: {us:8.1f} us, torch {base:8.1f} us, "
                  f"x torch {base / us:5.3f}  error {error:.1e}", flush=True)
            rows.append(record("gemm_probe", f"{m}x{n}x{k}", "us", us, base, "us",
                               higher_is_better=False, probe="k_offset", row_offset=offset,
                               tile=f"{p.spec.block_m}x{p.spec.block_n}", error=error,
                               baseline_name="torch.matmul"))
            a = b = out = None
            cupy.get_default_memory_pool().free_all_blocks()


def probe_kernels(args) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile
    for shape in args.kernel_shapes:
        m, n, k = (int(x) for x in shape.split("x"))
        ta = torch.randn((m, k), dtype=torch.bfloat16, device="cuda")
        tb = torch.randn((n, k), dtype=torch.bfloat16, device="cuda").t()
        torch.matmul(ta, tb)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.matmul(ta, tb)
            torch.cuda.synchronize()
        names = sorted({event.key for event in prof.key_averages()})
        print(f"torch.matmul {shape} (B [N, K]): {names}", flush=True)


def timed_against_torch(calls, configs, shape, experiment, probe, args) -> list:
    """Time `calls` (one of them "torch") in turns; print and return a row per configuration,
    fastest first, against torch.matmul."""
    from mkrt.bench import interleaved_ms, record
    us = {name: 1e3 * ms for name, ms in interleaved_ms(
        calls, iterations=args.iterations, rounds=args.repeats, warmup=args.warmup).items()}
    base = us.pop("torch")
    rows = []
    for name, value in sorted(us.items(), key=lambda item: item[1]):
        print(f"{shape} {name:28s} {value:8.1f} us  x torch {base / value:5.3f}", flush=True)
        rows.append(record(experiment, f"{shape} {name}", "us", value, base, "us",
                           higher_is_better=False, probe=probe, timing="interleaved rounds",
                           baseline_name="torch.matmul", **configs[name]))
    return rows


def probe_odd_rows(args, rows) -> None:
    import cupy
    import torch

    from mkrt.kernels import gemm as G
    for shape in args.odd_shapes:
        m, n, k = (int(x) for x in shape.split("x"))
        a, b = operands(m, n, k)
        out = cupy.empty((m, n), dtype=a.dtype)
        ta, tb = torch.from_dlpack(a), torch.from_dlpack(b).t()
        reference = G.reference(a, b, b_layout="nk")
        calls = {"torch": lambda: torch.matmul(ta, tb)}
        configs = {}
        for block_m, block_n in ((128, 256), (128, 192), (256, 128)):
            for cluster in ("", "m2"):
                for epilogue in ("tma", "direct"):
                    for group_m in (8, 16):
                        options = dict(b_layout="nk", block_m=block_m, block_n=block_n,
                                       cluster=cluster, epilogue=epilogue, group_m=group_m,
                                       split_k=1)
                        p = G.call_plan(a, b, out, **options)
                        name = (f"{block_m}x{block_n}{'_m2' if cluster else ''}_{epilogue}"
                                f"_s{p.spec.stages}_g{group_m}")
                        G.poison(out)
                        G.gemm(a, b, out, **options)
                        error = float(cupy.linalg.norm(G.to_float32(out) - reference)
                                      / cupy.linalg.norm(reference))
                        if not math.isfinite(error) or error > 1e-2:
                            print(f"{shape} {name}: WRONG, error {error}", flush=True)
                            continue
                        calls[name] = (lambda o=options: G.gemm(a, b, out, **o))
                        configs[name] = dict(options, stages=p.spec.stages, error=error)
        rows += timed_against_torch(calls, configs, shape, "gemm_odd_rows", "odd_rows", args)
        a = b = out = ta = tb = reference = calls = None
        cupy.get_default_memory_pool().free_all_blocks()


def probe_l2(args, rows) -> None:
    import cupy
    import torch

    from mkrt.kernels import gemm as G
    stream = cupy.cuda.get_current_stream().ptr
    default = G.L2_PROMOTION
    for shape in args.l2_shapes:
        m, n, k = (int(x) for x in shape.split("x"))
        a, b = operands(m, n, k)
        out = cupy.empty((m, n), dtype=a.dtype)
        ta, tb = torch.from_dlpack(a), torch.from_dlpack(b).t()
        calls = {"torch": lambda: torch.matmul(ta, tb)}
        configs = {}
        for block_n, cluster in ((256, "m2"), (256, ""), (192, "m2")):
            p = G.call_plan(a, b, out, b_layout="nk", block_m=128, block_n=block_n,
                            cluster=cluster, split_k=1)
            function = p.spec.function("gemm", 0, p.spec.smem_bytes)
            for promotion in (0, 1, 2, 3):
                G.L2_PROMOTION = promotion          # read when the maps are made (patch)
                prepared = G._PreparedGemm(p, function, 0)
                prepared.patch(a.data.ptr, b.data.ptr, out.data.ptr)
                call = (lambda c=prepared: c.run(stream))
                error = checked(call, out, a, b)
                name = f"128x{block_n}{'_m2' if cluster else ''}_l2p{promotion}"
                if not math.isfinite(error) or error > 1e-2:
                    print(f"{shape} {name}: WRONG, error {error}", flush=True)
                    continue
                calls[name] = call
                configs[name] = dict(block_m=128, block_n=block_n, cluster=cluster,
                                     l2_promotion=promotion, stages=p.spec.stages, error=error)
        G.L2_PROMOTION = default
        rows += timed_against_torch(calls, configs, shape, "gemm_l2_promotion", "l2", args)
        a = b = out = ta = tb = calls = None
        cupy.get_default_memory_pool().free_all_blocks()


def probe_small(args, rows) -> None:
    import time

    import cupy
    import numpy as np
    import torch

    from mkrt.bench import interleaved_ms, record
    from mkrt.kernels import gemm as G
    stream = cupy.cuda.Stream(non_blocking=True)
    torch_stream = torch.cuda.ExternalStream(stream.ptr)
    for shape in args.small_shapes:
        m, n, k = (int(x) for x in shape.split("x"))
        a, b = operands(m, n, k)
        out = cupy.empty((m, n), dtype=a.dtype)
        ta, tb = torch.from_dlpack(a), torch.from_dlpack(b).t()
        t_out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
        error = checked(lambda: G.gemm(a, b, out, b_layout="nk"), out, a, b)
        # the rule's launch prepared twice and run without mkrt.gemm's checks: as a
        # programmatic dependent launch (its set-up overlaps the previous kernel's tail) and
        # plainly, to tell the launch's part from the host path's
        from mkrt.kernels.launcher import KernelLaunch
        p = G.call_plan(a, b, out, b_layout="nk")
        prepared = {}
        for programmatic in (True, False):
            call = G._PreparedGemm(p, p.spec.function("gemm", 0, p.spec.smem_bytes), 0)
            launch = call.launch
            call.launch = KernelLaunch(launch.function, launch.grid, launch.block,
                                       launch.shared_mem, launch.params, programmatic=programmatic)
            call.patch(a.data.ptr, b.data.ptr, out.data.ptr)
            prepared[programmatic] = call
        pdl, plain = prepared[True], prepared[False]
        pdl_error = checked(lambda: pdl.run(stream.ptr), out, a, b)
        with stream, torch.cuda.stream(torch_stream):
            ours = lambda: G.gemm(a, b, out, b_layout="nk", stream=stream)   # noqa: E731
            theirs = lambda: torch.matmul(ta, tb, out=t_out)                  # noqa: E731
            ours_pdl = lambda: pdl.run(stream.ptr)                            # noqa: E731
            ours_plain = lambda: plain.run(stream.ptr)                        # noqa: E731
            for _ in range(3):
                ours(), theirs(), ours_pdl(), ours_plain()
            stream.synchronize()
            graphs = {}
            for name, call in (("mkrt", ours), ("torch", theirs), ("mkrt_pdl", ours_pdl),
                               ("mkrt_plain", ours_plain)):
                stream.begin_capture()
                for _ in range(args.graph_calls):
                    call()
                graphs[name] = stream.end_capture()
            host = {}
            for name, call in (("mkrt", ours), ("torch", theirs), ("mkrt_pdl", ours_pdl),
                               ("mkrt_plain", ours_plain)):
                samples = []
                for _ in range(5):
                    stream.synchronize()
                    start = time.perf_counter()
                    for _ in range(200):
                        call()
                    samples.append((time.perf_counter() - start) / 200 * 1e6)
                host[name] = float(np.median(samples))
                stream.synchronize()
            calls = {"mkrt": ours, "torch": theirs, "mkrt_pdl": ours_pdl, "mkrt_plain": ours_plain}
            calls.update({f"{name}_graph": (lambda g=graph: g.launch(stream))
                          for name, graph in graphs.items()})
            ms = interleaved_ms(calls, iterations=args.iterations, rounds=args.repeats,
                                warmup=args.warmup)          # on `stream`: the current one
        per_call = {name: 1e3 * v / (args.graph_calls if name.endswith("graph") else 1)
                    for name, v in ms.items()}
        print(f"{shape}: eager mkrt.gemm {per_call['mkrt']:.1f} us (prepared: PDL "
              f"{per_call['mkrt_pdl']:.1f}, plain {per_call['mkrt_plain']:.1f}), torch "
              f"{per_call['torch']:.1f}; graphs mkrt.gemm {per_call['mkrt_graph']:.1f} (PDL "
              f"{per_call['mkrt_pdl_graph']:.1f}, plain {per_call['mkrt_plain_graph']:.1f}), torch "
              f"{per_call['torch_graph']:.1f}; host enqueue mkrt.gemm {host['mkrt']:.1f} (PDL "
              f"{host['mkrt_pdl']:.1f}, plain {host['mkrt_plain']:.1f}), torch {host['torch']:.1f} us; "
              f"PDL error {pdl_error:.1e}", flush=True)
        for what, ours_us, theirs_us in (("eager", per_call["mkrt"], per_call["torch"]),
                                         ("graph", per_call["mkrt_graph"], per_call["torch_graph"]),
                                         ("host_enqueue", host["mkrt"], host["torch"]),
                                         ("eager_pdl", per_call["mkrt_pdl"], per_call["torch"]),
                                         ("graph_pdl", per_call["mkrt_pdl_graph"], per_call["torch_graph"]),
                                         ("host_enqueue_pdl", host["mkrt_pdl"], host["torch"]),
                                         ("eager_prepared_plain", per_call["mkrt_plain"], per_call["torch"]),
                                         ("graph_prepared_plain", per_call["mkrt_plain_graph"],
                                          per_call["torch_graph"]),
                                         ("host_enqueue_prepared_plain", host["mkrt_plain"], host["torch"])):
            rows.append(record("gemm_small", f"{shape} {what}", "us", ours_us, theirs_us, "us",
                               higher_is_better=False, probe="small", timing="interleaved rounds",
                               graph_calls=args.graph_calls, error=error,
                               baseline_name="torch.matmul (out=)"))
        a = b = out = ta = tb = t_out = graphs = calls = pdl = plain = prepared = None
        cupy.get_default_memory_pool().free_all_blocks()


def probe_streamk(args, rows) -> None:
    import cupy
    import torch

    from mkrt.kernels import gemm as G
    for case in args.streamk_cases:
        shape, sms = case.split("@")
        sms = int(sms)
        m, n, k = (int(x) for x in shape.split("x"))
        a, b = operands(m, n, k)
        out = cupy.empty((m, n), dtype=a.dtype)
        ta, tb = torch.from_dlpack(a), torch.from_dlpack(b).t()
        rule = G.call_plan(a, b, out, b_layout="nk", sms=sms)
        tile = dict(block_m=rule.spec.block_m, block_n=rule.spec.block_n)
        variants = {"rule": dict(), "tile": dict(tile, cluster="", split_k=1),
                    "streamk": dict(tile, stream_k=True)}
        calls = {"torch": lambda: torch.matmul(ta, tb)}
        configs = {}
        for name, options in variants.items():
            p = G.call_plan(a, b, out, b_layout="nk", sms=sms, **options)
            call = (lambda o=options: G.gemm(a, b, out, b_layout="nk", sms=sms, **o))
            error = checked(call, out, a, b)
            if not math.isfinite(error) or error > 1e-2:
                print(f"{case} {name}: WRONG, error {error}", flush=True)
                continue
            calls[name] = call
            configs[name] = dict(variant=name, sms=sms, block_m=p.spec.block_m, block_n=p.spec.block_n,
                                 cluster=p.spec.cluster, split=p.spec.split, splits=p.splits,
                                 grid=p.grid, whole_units=p.whole_units, error=error)
        rows += timed_against_torch(calls, configs, case, "gemm_streamk_probe", "streamk", args)
        a = b = out = ta = tb = calls = None
        cupy.get_default_memory_pool().free_all_blocks()


def profile_host(args) -> None:
    """Where mkrt.gemm's host time goes: cProfile of back-to-back calls (no sync), by own time."""
    import cProfile
    import io
    import pstats

    import cupy

    from mkrt.kernels import gemm as G
    m, n, k = (int(x) for x in args.small_shapes[0].split("x"))
    a, b = operands(m, n, k)
    out = cupy.empty((m, n), dtype=a.dtype)
    for _ in range(10):
        G.gemm(a, b, out, b_layout="nk")
    cupy.cuda.Device().synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(2000):
        G.gemm(a, b, out, b_layout="nk")
    profiler.disable()
    cupy.cuda.Device().synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
    print(f"cProfile of 2000 mkrt.gemm calls at {args.small_shapes[0]}:\n{text.getvalue()}", flush=True)


def main():
    args = parse()
    from mkrt.bench import append_jsonl
    rows: list = []
    if "kernels" in args.probes:
        probe_kernels(args)
    if "grid" in args.probes:
        probe_grid(args, rows)
    if "k_offset" in args.probes:
        probe_k_offset(args, rows)
    if "odd_rows" in args.probes:
        probe_odd_rows(args, rows)
    if "l2" in args.probes:
        probe_l2(args, rows)
    if "small" in args.probes:
        probe_small(args, rows)
    if "host" in args.probes:
        profile_host(args)
    if "streamk" in args.probes:
        probe_streamk(args, rows)
    append_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
