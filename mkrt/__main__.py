"""Command line: `python -m mkrt compile --all`, `demo`, `info`, `report [--check]`."""

from __future__ import annotations

import argparse
import sys
import time


def cmd_compile(args) -> int:
    from mkrt.errors import CompileError
    from mkrt.kernels.registry import all_specs
    specs = all_specs()
    if args.filter:
        specs = [(m, s) for m, s in specs if args.filter in s.uri]
    print(f"{'kernel spec':56} {'entry':24} {'regs':>4} {'spill':>6} {'stack':>6} "
          f"{'smem':>6} {'dyn smem':>8} {'compile s':>9}")
    failures = 0
    for module, spec in specs:
        try:
            build = spec.build(check_spills=not args.allow_spills)
        except CompileError as error:
            failures += 1
            print(f"{spec.uri:56} FAILED: {str(error).splitlines()[0]}")
            continue
        dynamic = getattr(spec, "smem_bytes", 0)     # what the launcher asks for
        for entry, res in sorted(build.resources.items()):
            print(f"{spec.uri:56} {entry:24} {res.registers:>4} {res.spills:>6} "
                  f"{res.stack_frame:>6} {res.static_shared:>6} {dynamic:>8} {build.seconds:>9.2f}")
    print(f"{len(specs)} specs, {failures} failed")
    return 1 if failures else 0


def gpu_diagnosis() -> str:
    """Why this process sees no usable GPU, in one line (asks the driver, not the runtime:
    without a driver the CUDA runtime says "driver version is insufficient" too)."""
    import ctypes
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return ("no NVIDIA driver here (libcuda.so.1 not found): kernels need a Hopper GPU "
                "(sm_90) and a driver for CUDA 13")
    version = ctypes.c_int(0)
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value < 13000:
        return (f"the NVIDIA driver supports CUDA {version.value // 1000}.{version.value % 1000 // 10}; "
                "mkrt needs a driver for CUDA 13 (the R580 series or newer)")
    status = libcuda.cuInit(0)
    if status == 100:       # CUDA_ERROR_NO_DEVICE
        return "the NVIDIA driver sees no GPU (check CUDA_VISIBLE_DEVICES and the container's devices)"
    if status != 0:
        return f"the NVIDIA driver failed to start (cuInit returned {status})"
    return "the driver starts but CuPy sees no GPU (check CUDA_VISIBLE_DEVICES)"


def hopper_problem() -> str | None:
    """None when GPU 0 is a Hopper (sm_90); else what it is."""
    import cupy
    capability = int(cupy.cuda.Device(0).compute_capability)     # "90" on an H100 / H200
    if capability // 10 != 9:
        return (f"GPU 0 has compute capability {capability // 10}.{capability % 10}; mkrt's "
                "kernels are built for Hopper (sm_90a: wgmma, TMA) and do not load elsewhere")
    return None


def cpu_checks() -> list[tuple[str, bool, str]]:
    """What runs without a GPU besides compiling: (what, passed, detail) per check."""
    import numpy as np

    from mkrt.errors import ROLE_NAMES
    from mkrt.kernels import gemm, gemm_allreduce
    from mkrt.kernels.device.sync import STATUS_HEADER_WORDS, STATUS_RECORD_WORDS
    from mkrt.status import decode_records
    from mkrt.world import emulated_world
    checks = []
    world = emulated_world("2x4", gpus=0)
    ok = (world.size == 8 and world.nodes == 2 and world.ranks[5].node == 1
          and world.ranks[5].local_rank == 1)
    checks.append(("world layout: emulated 2x4 has 8 ranks on 2 nodes", ok, repr(world)))
    g = gemm.plan(8192, 8192, 512, sms=132)
    checks.append(("gemm planner: 8192x8192x512 on 132 SMs", g.tiles == 2048 and g.grid == 132,
                   f"{g.spec.uri}, {g.tiles} tiles, grid {g.grid}"))
    for nodes, per_node in ((1, 2), (2, 2)):
        p = gemm_allreduce.plan(8192, 8192, 512, nodes=nodes, ranks_per_node=per_node,
                                ctas=132 // (nodes * per_node), ranks_per_gpu=nodes * per_node)
        problems = p.check()
        checks.append((f"gemm_allreduce plan on {nodes}x{per_node}: every tile reduced and sent "
                       "exactly once, no wait cycle", not problems,
                       "; ".join(problems) or f"{'fused' if p.fused else 'unfused'} ({p.reason}), "
                       f"{p.compute_ctas} compute + {p.reduce_ctas} reduce CTAs"))
    words = np.zeros(STATUS_HEADER_WORDS + 2 * STATUS_RECORD_WORDS, np.uint64)
    record = words[STATUS_HEADER_WORDS + STATUS_RECORD_WORDS:]
    record[:8] = [5, ROLE_NAMES.index("reduce"), 17, 3, 42, 12, 11, (1 << 63) | 7]
    decoded = decode_records(words, 2)
    ok = list(decoded) == [1] and (decoded[1].rank, decoded[1].role, decoded[1].expected,
                                   decoded[1].seen) == (5, "reduce", 12, 11)
    checks.append(("status block: a wait record decodes into mkrt.CommTimeout's fields", ok,
                   str(decoded.get(1, "nothing decoded"))))
    return checks


def cmd_demo(args) -> int:
    from mkrt.world import visible_gpus
    gpus = visible_gpus()
    if gpus == 0:
        print(f"mkrt demo: no usable CUDA GPU: {gpu_diagnosis()}.\n"
              "Running what works without one: (1) compile every kernel spec for sm_90a with "
              "NVRTC (no GPU needed; nothing is launched), (2) CPU checks of planners, "
              "world layouts and error records.\n")
        status = cmd_compile(argparse.Namespace(filter=None, allow_spills=False))
        print()
        checks = cpu_checks()
        for what, ok, detail in checks:
            print(f"{'ok    ' if ok else 'FAILED'} {what}\n       {detail}")
            status |= 0 if ok else 1
        print(f"\nRan: compile-only builds (above) and {len(checks)} CPU checks "
              f"({sum(ok for _, ok, _ in checks)} passed). Not run: no kernel was launched and "
              "nothing was timed.\nOn a machine with a Hopper GPU this command runs "
              "gemm_allreduce on an emulated world, checks it against a float32 reference and "
              "times it against cuBLAS + all-reduce.")
        return status
    problem = hopper_problem()
    if problem:
        print(f"mkrt demo: {problem}")
        return 1
    layout = args.layout or f"1x{max(2, gpus)}"
    if args.op == "allgather":
        return demo_allgather(layout, args.mib)
    return demo_gemm_allreduce(layout, args.shape)


def demo_gemm_allreduce(layout: str, shape: str) -> int:
    import cupy
    import numpy as np

    import mkrt
    from mkrt.arrays import bfloat16
    from mkrt.bench import median_ms
    from mkrt.kernels.gemm import to_float32
    from mkrt.kernels.gemm_allreduce import GemmAllReduce, reference
    m, n, k = (int(v) for v in shape.lower().split("x"))
    world = mkrt.init(emulate=layout)
    op = GemmAllReduce(world, fuse=True)
    auto = GemmAllReduce(world)
    a_list, b_list = [], []
    for info in world.local:
        with cupy.cuda.Device(info.device):
            rng = cupy.random.default_rng(info.rank)
            a_list.append(rng.standard_normal((m, k), dtype=np.float32).astype(bfloat16))
            b_list.append((rng.standard_normal((k, n), dtype=np.float32) / 8).astype(bfloat16))
    outs = op(a_list, b_list)
    world.synchronize()
    expected = reference(a_list, b_list, dtype=cupy.float32)
    errors = [float(cupy.linalg.norm(to_float32(o) - expected) / cupy.linalg.norm(expected))
              for o in outs]
    fused_ms = median_ms(lambda: op(a_list, b_list, out=outs), iters=20)
    unfused_ms = median_ms(lambda: op.unfused(a_list, b_list, out=outs), iters=20)
    auto(a_list, b_list, out=outs)
    world.synchronize()
    p = op.last_plan
    print(f"mkrt demo: gemm_allreduce on emulated {world.layout}, C = sum_r A_r[{m}x{k}] @ B_r[{k}x{n}]")
    print(f"  worst relative error vs float32: {max(errors):.2e} (bound 1e-2)")
    print(f"  fused   {fused_ms * 1e3:9.1f} us   ({p.compute_ctas} compute + {p.reduce_ctas} reduce CTAs per rank)")
    print(f"  unfused {unfused_ms * 1e3:9.1f} us   (cuBLAS per rank, then mkrt all-reduce)")
    print(f"  ratio (unfused / fused): {unfused_ms / fused_ms:.2f}x; planner's choice: "
          f"{'fused' if auto.last_plan.fused else 'unfused'} ({auto.last_plan.reason})")
    print("  (one GPU: ranks share its SMs and memory; this shows overlap and protocol cost, not NVLink)")
    op.close()
    auto.close()
    world.close()
    return 0 if max(errors) < 1e-2 else 1


def demo_allgather(layout: str, mib: float) -> int:
    import cupy
    import numpy as np

    import mkrt
    from mkrt.bench import median_ms
    world = mkrt.init(emulate=layout)
    op = mkrt.AllGather(world)
    count = int(mib * 2**20) // 4
    inputs = []
    for info in world.local:
        with cupy.cuda.Device(info.device):
            inputs.append(cupy.random.standard_normal(count, dtype=np.float32))
    outputs = op(inputs)
    world.synchronize()
    # World-wide: every rank holds every rank's input, in rank order.
    expected = cupy.stack(inputs)
    ok = all(bool(cupy.array_equal(out, expected)) for out in outputs)
    ms = median_ms(lambda: op(inputs), warmup=5, iters=30)
    written = sum(o.nbytes for o in outputs)
    source = cupy.empty(written // 4, np.float32)
    target = cupy.empty_like(source)
    device_to_device = cupy.cuda.runtime.memcpyDeviceToDevice

    def memcpy():
        cupy.cuda.runtime.memcpyAsync(target.data.ptr, source.data.ptr, written,
                                      device_to_device, cupy.cuda.get_current_stream().ptr)
    base_ms = median_ms(memcpy, warmup=5, iters=30)
    print(f"mkrt demo: allgather on emulated {world.layout} ({world}), {mib:g} MiB per rank")
    print(f"  correct: {ok}")
    print(f"  allgather {ms * 1e3:9.1f} us  {written / ms / 1e6:8.1f} GB/s written")
    print(f"  memcpy    {base_ms * 1e3:9.1f} us  {written / base_ms / 1e6:8.1f} GB/s (same bytes, D2D)")
    print(f"  ratio (memcpy time / allgather time): {base_ms / ms:.2f}x")
    op.close()
    world.close()
    return 0 if ok else 1


def cmd_info(args) -> int:
    from mkrt import envs
    from mkrt.jit.compiler import compiler_version, include_dirs
    from mkrt.world import visible_gpus
    gpus = visible_gpus()
    print(f"GPUs visible: {gpus}" + ("" if gpus else f" ({gpu_diagnosis()})"))
    print(f"compiler: {compiler_version()}  arch: {envs.get('MKRT_JIT_ARCH')}")
    print(f"include dirs: {include_dirs()}")
    print(f"cache: {envs.get('MKRT_JIT_CACHE_DIR')}")
    return 0


def report_arguments(parser) -> None:
    from mkrt.report import add_arguments
    add_arguments(parser)


def cmd_report(args) -> int:
    from mkrt.report import main as report_main
    return report_main(args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mkrt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("compile", help="compile kernel specs for sm_90a and print resources")
    p.add_argument("--all", action="store_true", help="every default spec (the default)")
    p.add_argument("--filter", help="only specs whose URI contains this")
    p.add_argument("--allow-spills", action="store_true", help="do not fail on register spills")
    p.set_defaults(run=cmd_compile)
    p = sub.add_parser("demo", help="run the showcase op (checks + timing); without a GPU: "
                       "compile-only builds and CPU checks")
    p.add_argument("--layout", help="emulated world NxG (default 1x<GPUs, at least 2>)")
    p.add_argument("--op", choices=["gemm_allreduce", "allgather"], default="gemm_allreduce")
    p.add_argument("--shape", default="8192x8192x512", help="gemm_allreduce MxNxK (K per rank)")
    p.add_argument("--mib", type=float, default=64.0, help="allgather: MiB per rank")
    p.set_defaults(run=cmd_demo)
    p = sub.add_parser("info", help="GPUs, compiler, include paths, cache")
    p.set_defaults(run=cmd_info)
    p = sub.add_parser("report", help="regenerate README.md's results table from "
                       "experiments/results/*.jsonl (--check: fail if it is out of date)")
    report_arguments(p)
    p.set_defaults(run=cmd_report)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    status = args.run(args)
    if args.command not in ("info", "report"):
        print(f"({time.perf_counter() - start:.1f} s)")
    return status


if __name__ == "__main__":
    sys.exit(main())
