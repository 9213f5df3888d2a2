"""compute-sanitizer (memcheck, racecheck, synccheck, initcheck) over mkrt's kernels at
small shapes, one process per (tool, case):

    PYTHONPATH=$PWD python3 experiments/sanitize.py --out experiments/results/sanitize.jsonl

Each case first runs once without the sanitizer (it must pass: this also fills the JIT
cache), then under each tool. A row per (tool, case): the errors the tool reported (its
ERROR SUMMARY), whether the case's own check passed, the time. Waits carry a 120 s bound:
a tool slows kernels, and ranks of an emulated world wait for each other's kernels.

World cases can also run as one process per rank under mpiexec and a private MPS daemon
(``--processes``), every rank under the tool, or with ``--tool-ranks 0 1 ..`` one run per
listed rank with only that rank under it (a rank's kernels wait for the others', whose
kernels and proxy copies then run at full speed).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import signal
import subprocess
import sys
import time

TOOLS = ["memcheck", "racecheck", "synccheck", "initcheck"]
#: the cases' own bounded waits (ms); under racecheck and initcheck a multi-node case's
#: proxy copies can take minutes to arrive: MKRT_SANITIZE_WAIT_MS raises it
TIMEOUT_MS = float(os.environ.get("MKRT_SANITIZE_WAIT_MS", 120_000))
#: CTAs per rank of the world ops' kernels (default: the op's, the rank's SM share). Fewer
#: CTAs, the same code: under racecheck and initcheck every CTA's accesses are tracked,
#: and the multi-node cases with a full SM share did not finish in minutes
CTAS = int(os.environ["MKRT_SANITIZE_CTAS"]) if os.environ.get("MKRT_SANITIZE_CTAS") else None
#: set in the processes of ``--processes``: the case's world is one process per rank
PROCESSES = os.environ.get("MKRT_SANITIZE_PROCESSES") == "1"


def _world(layout: str):
    """The case's world: emulated in this process, or (``--processes``) this process's
    rank of an mpiexec world split into nodes of the layout's size."""
    import mkrt
    if not PROCESSES:
        return mkrt.init(emulate=layout)
    world = mkrt.init()
    if world.layout != layout:
        raise RuntimeError(f"sanitize: this mpiexec world is {world.layout}, the case needs {layout}")
    return world


def _per_rank(world, seed: int, shape, scale: float = 1.0):
    """Every rank's random bf16 array (drawn from seed + rank, so each process can make all
    of them for the reference) and this process's ranks' ones."""
    import cupy
    import numpy as np

    from mkrt.arrays import bfloat16
    every = [cupy.asarray(np.random.default_rng(seed + rank).standard_normal(shape, dtype=np.float32)
                          * scale).astype(bfloat16) for rank in range(world.size)]
    return every, [every[info.rank] for info in world.local]


def _gar(layout, fuse, m=192, n=256, k=128, unfused_gemm="cublas", epilogue=None):
    """GEMM+AllReduce, fused or unfused; the unfused path's GEMM by cuBLAS (whose sm90
    kernels store C with TMA, which initcheck does not track) or by mkrt's engine with its
    `epilogue`: "tma" (TMA stores, like cuBLAS's) or "direct" (plain stores: what the
    all-reduce then reads is tracked). The pair tells initcheck's reports on the
    all-reduce's reads of C apart: TMA-stored or really unwritten."""
    def case():
        import cupy
        import numpy as np

        import mkrt
        from mkrt.kernels import gemm_allreduce as gar
        from mkrt.kernels.gemm import to_float32
        options = {} if epilogue is None else {"gemm_options": {"epilogue": epilogue}}
        world = _world(layout)
        every_a, a = _per_rank(world, 10, (m, k))
        every_b, b = _per_rank(world, 100, (k, n), 1 / 8)
        op = mkrt.GemmAllReduce(world, fuse=fuse, ctas=CTAS, timeout_ms=TIMEOUT_MS)
        outs = op(a, b) if fuse else op.unfused(a, b, gemm=unfused_gemm, **options)
        outs = op(a, b) if fuse else op.unfused(a, b, gemm=unfused_gemm, **options)  # a second epoch
        world.synchronize()
        ref = gar.reference(every_a, every_b, dtype=np.float32)
        error = max(float(cupy.linalg.norm(to_float32(o) - ref) / cupy.linalg.norm(ref)) for o in outs)
        world.close()
        return error < 2e-2
    return case


def _allgather(layout, group="world"):
    def case():
        import cupy
        import numpy as np

        import mkrt
        world = _world(layout)
        x = [cupy.full(3000, info.rank, np.int32) for info in world.local]
        op = mkrt.AllGather(world, group=group, ctas=CTAS, timeout_ms=TIMEOUT_MS)
        outs = op(x)
        outs = op(x)
        world.synchronize()
        ranks = world.size if group == "world" else world.ranks_per_node
        ok = all(o.shape == (ranks, 3000) for o in outs)
        if group == "world":
            ok = ok and all(np.array_equal(o.get()[:, 0], np.arange(world.size)) for o in outs)
        world.close()
        return ok
    return case


def _gemm(m=300, n=520, k=64, b_layout="kn"):
    def case():
        import cupy
        import numpy as np

        import mkrt
        from mkrt.arrays import bfloat16
        from mkrt.kernels import gemm
        from mkrt.kernels.gemm import to_float32
        rng = np.random.default_rng(2)
        a = cupy.asarray(rng.standard_normal((m, k), dtype=np.float32)).astype(bfloat16)
        shape = (k, n) if b_layout == "kn" else (n, k)
        b = cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(bfloat16)
        c = mkrt.gemm(a, b, b_layout=b_layout)
        ref = gemm.reference(a, b, b_layout=b_layout)
        return float(cupy.linalg.norm(to_float32(c) - ref) / cupy.linalg.norm(ref)) < 2e-2
    return case


def _tp_pair(op_name, layout, m=256, n=384, k=128):
    """GEMM+ReduceScatter (A: [m, k] per rank) or AllGather+GEMM (A: [m / W, k] per rank)."""
    def case():
        import cupy

        import mkrt
        from mkrt.kernels import allgather_gemm, gemm_reducescatter
        from mkrt.kernels.gemm import to_float32
        world = _world(layout)
        rows = m if op_name == "gemm_reducescatter" else m // world.size
        every_a, a = _per_rank(world, 30, (rows, k))
        every_b, b = _per_rank(world, 300, (k, n), 1 / 8)
        if op_name == "gemm_reducescatter":
            op = mkrt.GemmReduceScatter(world, fuse=True, ctas=CTAS, timeout_ms=TIMEOUT_MS)
            refs = [gemm_reducescatter.reference(every_a, every_b, info.rank) for info in world.local]
        else:
            op = mkrt.AllGatherGemm(world, fuse=True, ctas=CTAS, timeout_ms=TIMEOUT_MS)
            refs = [allgather_gemm.reference(every_a, w) for w in b]
        op(a, b)
        outs = op(a, b)                                       # a second epoch
        world.synchronize()
        error = max(float(cupy.linalg.norm(to_float32(o) - r) / cupy.linalg.norm(r))
                    for o, r in zip(outs, refs))
        world.close()
        return error < 2e-2
    return case


def _probe_timeout():
    """The bounded wait giving up (the error path every kernel shares), then a released wait."""
    def case():
        import cupy
        import numpy as np

        import mkrt
        from mkrt.kernels.probe import ProbeSpec, wait_for_flag
        world = mkrt.init(emulate="1x1")
        block = world.status(0)
        flag = cupy.zeros(1, np.uint64)
        seen = wait_for_flag(flag, 5, world_status=block.device_ptr,
                             host_flag=block.host_flag_ptr, flag_id=7, timeout_ms=50, ctas=2)
        try:
            world.synchronize()
            timed_out = False
        except mkrt.CommTimeout:
            timed_out = True
        world.close()
        world = mkrt.init(emulate="1x1")
        block = world.status(0)
        ProbeSpec().function("set_flag", 0)((1,), (32,), (flag, np.uint64(9)))
        released = wait_for_flag(flag, 9, world_status=block.device_ptr,
                                 host_flag=block.host_flag_ptr, flag_id=7, timeout_ms=TIMEOUT_MS)
        world.synchronize()
        world.close()
        return timed_out and list(seen.get()) == [2**64 - 1] * 2 and int(released.get()[0]) == 9
    return case


def _proxy_ce():
    """Proxy test kernels post puts and signals through the `ce` transport."""
    def case():
        import cupy
        import numpy as np

        from mkrt.proxy import REGION_DEVICE, Proxy, QueueSet, new_region_table, set_region
        from mkrt.proxy.kernels import ProxyKernelsSpec, raise_status, status_words
        from mkrt.proxy.transports.ce import CopyEngineTransport
        chunk, ctas, count = 256, 2, 8
        src = cupy.random.randint(0, 256, chunk * ctas * count, dtype=np.uint8)
        dst = cupy.zeros_like(src)
        flags = cupy.zeros(8, dtype=np.uint64)
        regions = new_region_table(2, 2)
        set_region(regions, 0, 0, src.data.ptr, src.nbytes, REGION_DEVICE)
        set_region(regions, 1, 0, dst.data.ptr, dst.nbytes, REGION_DEVICE)
        set_region(regions, 1, 1, flags.data.ptr, flags.nbytes, REGION_DEVICE)
        qs = QueueSet(2, 64, [0, 0], memory="pinned")
        status = status_words()
        with Proxy(qs, regions, CopyEngineTransport(0), threads=1):
            fn = ProxyKernelsSpec().function("post_puts", 0)
            result = cupy.zeros(ctas, dtype=np.uint64)
            fn((ctas,), (32,), (qs.device_descriptors(), np.int32(2), np.uint32(1), np.uint32(1),
                                flags, np.uint64(chunk), np.int32(count), np.int32(1),
                                *status.args, np.uint64(TIMEOUT_MS * 1_000_000), result))
            cupy.cuda.Device(0).synchronize()
            raise_status(status)
        qs.close()
        return bool(cupy.array_equal(src, dst))
    return case


def _attention(head_dim=64, causal=True):
    """mkrt.attention at an odd length (a partial query tile and key block), GQA."""
    def case():
        import cupy
        import numpy as np

        from mkrt.arrays import bfloat16
        from mkrt.kernels import attention as A
        from mkrt.kernels.gemm import from_float32
        rng = cupy.random.default_rng(4)
        q, k, v = (from_float32(rng.standard_normal((1, 200, h, head_dim), dtype=np.float32), bfloat16)
                   for h in (4, 2, 2))
        out, lse = A.attention(q, k, v, causal=causal)
        ref, _ = A.reference(q, k, v, causal=causal)
        cupy.cuda.Device().synchronize()
        error = float(cupy.abs(out.astype(cupy.float32) - ref).max() / cupy.abs(ref).max())
        return error < 2e-2
    return case


def _ring(layout):
    """mkrt.RingAttention, causal, two calls (a second epoch)."""
    def case():
        import cupy
        import numpy as np

        import mkrt
        from mkrt.arrays import bfloat16
        from mkrt.kernels import attention as A
        from mkrt.kernels import ring_attention as RA
        from mkrt.kernels.gemm import from_float32
        world = mkrt.init(emulate=layout)
        rng = cupy.random.default_rng(5)
        S = 2 * world.size * 130
        q, k, v = (from_float32(rng.standard_normal((1, S, h, 64), dtype=np.float32), bfloat16)
                   for h in (2, 1, 1))
        parts = [[RA.shard(x, info.rank, world.size, causal=True) for info in world.local]
                 for x in (q, k, v)]
        op = mkrt.RingAttention(world, timeout_ms=TIMEOUT_MS)
        op(*parts, causal=True)
        outs, _ = op(*parts, causal=True)                 # a second epoch
        world.synchronize()
        ref, _ = A.reference(q, k, v, causal=True)
        got = RA.unshard(outs, causal=True)
        error = float(cupy.abs(got.astype(cupy.float32) - ref).max() / cupy.abs(ref).max())
        op.close()
        world.close()
        return error < 2e-2
    return case


def _grouped_gemm():
    """mkrt.grouped_gemm over groups of 0, 1, 70 and 129 rows (empty groups, partial tiles)."""
    def case():
        import cupy
        import numpy as np

        from mkrt.arrays import bfloat16
        from mkrt.kernels import grouped_gemm as GG
        from mkrt.kernels.gemm import from_float32, to_float32
        rng = cupy.random.default_rng(6)
        sizes = [0, 1, 70, 129]
        x = from_float32(rng.standard_normal((sum(sizes), 136), dtype=np.float32), bfloat16)
        w = from_float32(rng.standard_normal((len(sizes), 200, 136), dtype=np.float32) / 8, bfloat16)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        out = GG.grouped_gemm(x, w, offsets)
        ref = GG.reference(x, w, offsets)
        cupy.cuda.Device().synchronize()
        return float(cupy.linalg.norm(to_float32(out) - ref) / cupy.linalg.norm(ref)) < 1e-2
    return case


def _moe(layout):
    """mkrt.MoE (dispatch, grouped GEMMs, combine) with a rank that holds no tokens, two calls."""
    def case():
        import numpy as np

        import mkrt
        from mkrt.kernels import moe as M
        from mkrt.kernels.gemm import to_float32
        world = mkrt.init(emulate=layout)
        tokens = [37, 0] + [20] * (world.size - 2)
        experts = 2 * world.size
        dev, expected = M.random_problem(world.size, tokens, 2, 64, 32, experts, seed=7)
        op = mkrt.MoE(world, experts=experts, capacity=max(tokens), timeout_ms=TIMEOUT_MS)
        args = (dev["x"], dev["ids"], dev["weights"], dev["w1"], dev["w2"])
        op(*args)
        ys = op(*args)                                   # a second epoch
        world.synchronize()
        ok = all(np.abs(to_float32(y).get() - want).max() <= 3e-2 * np.abs(want).max()
                 for y, want in zip(ys, expected) if want.size)
        op.close()
        world.close()
        return ok
    return case


CASES = {
    "gemm_300x520x64_kn": _gemm(),
    "gemm_129x127x24_nk": _gemm(129, 127, 24, "nk"),
    "allgather_1x2": _allgather("1x2"),
    "allgather_2x2": _allgather("2x2"),
    "gemm_allreduce_fused_1x2": _gar("1x2", True),
    "gemm_allreduce_fused_2x2": _gar("2x2", True),
    "gemm_allreduce_unfused_1x2": _gar("1x2", False),
    "gemm_allreduce_unfused_2x2": _gar("2x2", False, m=256),
    # (ceaa97b's "gemm_allreduce_unfused_mkrt_gemm_2x2" was the first: "auto" picks "tma" here)
    "gemm_allreduce_unfused_mkrt_tma_2x2": _gar("2x2", False, m=256, unfused_gemm="mkrt", epilogue="tma"),
    "gemm_allreduce_unfused_mkrt_direct_2x2": _gar("2x2", False, m=256, unfused_gemm="mkrt",
                                                   epilogue="direct"),
    # one node, no proxy: in one process every writer of the staging is under the tool, as
    # one process per rank only the watched rank's are
    "gemm_allreduce_unfused_mkrt_direct_1x2": _gar("1x2", False, unfused_gemm="mkrt", epilogue="direct"),
    "gemm_reducescatter_fused_1x2": _tp_pair("gemm_reducescatter", "1x2"),
    "gemm_reducescatter_fused_2x2": _tp_pair("gemm_reducescatter", "2x2"),
    "allgather_gemm_fused_1x2": _tp_pair("allgather_gemm", "1x2"),
    "allgather_gemm_fused_2x2": _tp_pair("allgather_gemm", "2x2"),
    "allgather_node_2x2": _allgather("2x2", group="node"),
    "probe_wait_timeout": _probe_timeout(),
    "proxy_ce_puts": _proxy_ce(),
    "attention_d64_causal": _attention(64, True),
    "attention_d128": _attention(128, False),
    "ring_attention_1x2": _ring("1x2"),
    "ring_attention_2x2": _ring("2x2"),
    "grouped_gemm": _grouped_gemm(),
    "moe_1x2": _moe("1x2"),
}


#: cases that also run as one process per rank (``--processes``)
PROCESS_CASES = {name for name in CASES if name.startswith(
    ("gemm_allreduce_", "gemm_reducescatter_", "allgather_gemm_", "allgather_")) and
    re.search(r"_\d+x\d+$", name)}


def process_command(name: str, tool: str | None, copy_method: str,
                    tool_rank: int | None = None) -> tuple[list[str], dict]:
    """(command, environment) that run case `name` as one process per rank under mpiexec,
    each process under the tool when there is one (a tool then sees one rank's kernels),
    or with `tool_rank` only that rank's process: the others' kernels and proxy copies run
    at full speed, whatever the tool does to the scheduling of the one it watches."""
    from mkrt.launch import child_env, mpiexec_command
    nodes, per_node = (int(x) for x in re.search(r"_(\d+)x(\d+)$", name).groups())
    command = mpiexec_command(nodes * per_node, os.path.abspath(__file__), "--inner", name,
                              "--ce-copy-method", copy_method)
    if tool is not None and tool_rank is not None:
        command += ["--inner-tool", tool, "--inner-tool-rank", str(tool_rank)]
    elif tool is not None:
        at = command.index(sys.executable)
        command[at:at] = tool_prefix(tool)
    # Four processes under MPS failed at context creation (cudaSetDevice: out of memory,
    # 7aca30c) where the two-process tests pass; each MPS client asks for
    # CUDA_DEVICE_MAX_CONNECTIONS hardware queues (32 on the GPU machine). Ask for 8: a
    # guess at the cause, not yet confirmed on the GPU.
    env = child_env(MKRT_WORLD_RANKS_PER_NODE=str(per_node), MKRT_SANITIZE_PROCESSES="1",
                    CUDA_DEVICE_MAX_CONNECTIONS="8")
    return command, env


def tool_prefix(tool: str) -> list[str]:
    return [shutil.which("compute-sanitizer") or "compute-sanitizer", "--tool", tool,
            "--print-limit", "20", *(["--racecheck-report", "all"] if tool == "racecheck" else [])]


def use_ce_copy_method(method: str) -> None:
    """Make every `ce` transport of this process copy with `method` ("kernel": mkrt's batch
    copy kernel, the default; "each": one cuMemcpyAsync per put). Under the sanitizer the
    proxy's copy kernel did not run while instrumented kernels waited for it."""
    import functools

    from mkrt.proxy.transports import ce
    ce.CopyEngineTransport.__init__ = functools.partialmethod(ce.CopyEngineTransport.__init__,
                                                              copy_method=method)


def mpi_rank_from_env() -> int | None:
    """This process's rank as mpiexec set it (before MPI is initialised), or None."""
    for variable in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"):
        if os.environ.get(variable, "").isdigit():
            return int(os.environ[variable])
    return None


def inner(name: str, copy_method: str, tool: str | None = None, tool_rank: int | None = None) -> None:
    if tool is not None and tool_rank == mpi_rank_from_env() and not os.environ.get("MKRT_SANITIZE_WATCHED"):
        # this rank runs under the tool: the same command line (``-m mpi4py`` included) in
        # its place; the rank's environment goes with it, so MPI sees the same rank, and the
        # marker stops the copy from doing this again
        os.environ["MKRT_SANITIZE_WATCHED"] = "1"
        command = [*tool_prefix(tool), sys.executable, *sys.orig_argv[1:]]
        os.execvp(command[0], command)
    use_ce_copy_method(copy_method)
    ok = CASES[name]()
    print(f"SANITIZE_CASE {name} ok={ok}", flush=True)
    sys.exit(0 if ok else 3)


def one(tool: str | None, name: str, timeout_s: float, copy_method: str = "kernel",
        processes: dict | None = None, tool_rank: int | None = None) -> dict:
    """One run of case `name` (under `tool`, or plain): in one process, or with `processes`
    (the environment of a private MPS daemon, possibly empty) one process per rank, all
    under the tool or (`tool_rank`) one."""
    env, ranks = None, 1
    if processes is not None and name in PROCESS_CASES:
        command, env = process_command(name, tool, copy_method, tool_rank)
        env.update(processes)
        ranks = int(command[command.index("-n") + 1])
    else:
        command = [sys.executable, os.path.abspath(__file__), "--inner", name,
                   "--ce-copy-method", copy_method]
        if tool is not None:
            command = [*tool_prefix(tool), *command]
    start = time.perf_counter()
    output, code, timed_out = run_tree(command, env, timeout_s)
    for _ in range(3):
        # MPS turns new clients away for a while after one was killed (ac8a8da: a case that
        # began 1 s after the previous one's timeout failed at cudaSetDevice): wait, again
        if "cudaErrorDevicesUnavailable" not in output:
            break
        time.sleep(20)
        start = time.perf_counter()
        output, code, timed_out = run_tree(command, env, timeout_s)
    return dict(parse_output(output, name, ranks), tool=tool or "none", case=name,
                ce_copy_method=copy_method, processes=ranks if env is not None else 0,
                tool_rank=tool_rank if env is not None and tool is not None else None,
                seconds=time.perf_counter() - start, returncode=code, timed_out=timed_out,
                first_reports=first_reports(output), tail=output[-3000:])


def run_tree(command: list[str], env: dict | None, timeout_s: float) -> tuple[str, int | None, bool]:
    """(stdout and stderr together, exit code or None, timed out) of `command`, run in its
    own session so that a timeout ends the whole tree (mpiexec's ranks, the tool): a rank
    left behind kept the GPU busy and the next run failed at cudaSetDevice (ceaa97b)."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=env, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout_s)
        return output, process.returncode, False
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return output, None, True


def parse_output(output: str, name: str, ranks: int = 1) -> dict:
    """The tool's counts (summed over the processes of a case run as several) and whether
    every process's own check passed."""
    # the summary line only ("ERROR SUMMARY: 81900 errors were not printed" is not a count)
    errors = [int(x) for x in re.findall(r"ERROR SUMMARY: (\d+) errors?\s*$", output, re.MULTILINE)]
    races = [int(x) for x in re.findall(r"RACECHECK SUMMARY: (\d+) hazard", output)]
    return {"errors": sum(errors) if errors else None, "hazards": sum(races) if races else None,
            "case_ok": output.count(f"SANITIZE_CASE {name} ok=True") == ranks}


def first_reports(output: str, count: int = 15) -> list[str]:
    """The tool's first report lines (what was found and in which kernel), without the
    backtraces that fill the tail when there are many."""
    lines = [line.strip("= ").strip() for line in output.splitlines() if line.startswith("=========")]
    return [line for line in lines if line and not line.startswith(
        ("Host Frame", "Device Frame", "Saved host backtrace", "COMPUTE-SANITIZER"))][:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--inner")
    parser.add_argument("--tools", nargs="*", default=TOOLS)
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument("--ce-copy-method", choices=("kernel", "each"), default="kernel",
                        help="how the proxy's `ce` transport copies (multi-node cases)")
    parser.add_argument("--processes", action="store_true",
                        help="world cases as one process per rank under mpiexec (a private MPS "
                             "daemon lets their kernels run side by side; each tool sees one rank)")
    parser.add_argument("--tool-ranks", nargs="*", type=int, default=None,
                        help="with --processes: one run per listed rank, only that rank's "
                             "process under the tool")
    parser.add_argument("--inner-tool", help=argparse.SUPPRESS)
    parser.add_argument("--inner-tool-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="experiments/results/sanitize.jsonl")
    args = parser.parse_args()
    if args.inner:
        inner(args.inner, args.ce_copy_method, args.inner_tool, args.inner_tool_rank)
        return
    if args.processes:
        # one case at a time: each is W MPS clients, and 4 cases of 4 ranks at once failed
        # at context creation (out of memory, 932f011)
        args.parallel = 1
        from mkrt.launch import private_mps
        with private_mps() as mps_env:
            run_all(args, processes=mps_env or {})
    else:
        run_all(args)


def run_all(args, processes: dict | None = None) -> None:
    from mkrt.bench import append_jsonl, record
    # Without the tool first, in parallel (also fills the JIT cache the tool runs read).
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        runs = {name: pool.submit(one, None, name, 300, args.ce_copy_method, processes)
                for name in args.cases}
        plain = {name: run.result() for name, run in runs.items()}
    def write(row):
        print(f"{row['tool']:10s} {row['case']:28s} errors={row['errors']} hazards={row['hazards']} "
              f"case_ok={row['case_ok']} timed_out={row['timed_out']} {row['seconds']:.1f} s", flush=True)
        if row["errors"]:
            print(row["tail"][-2500:], flush=True)
        suffix = "" if row["ce_copy_method"] == "kernel" else f"_ce_{row['ce_copy_method']}"
        suffix += "_processes" if row["processes"] else ""
        suffix += f"_rank{row['tool_rank']}" if row.get("tool_rank") is not None else ""
        append_jsonl(args.out, [record("sanitize", f"{row['tool']}_{row['case']}{suffix}", "errors",
                                       float(row["errors"]) if row["errors"] is not None else None,
                                       0.0, "count", higher_is_better=False, ctas=CTAS,
                                       wait_ms=TIMEOUT_MS, **{
                                           k: v for k, v in row.items() if k not in ("case",)})])

    for row in plain.values():
        write(row)
    # Rows are written as each run ends: a caller's time limit keeps what finished.
    watched = args.tool_ranks if processes is not None and args.tool_ranks else [None]
    jobs = [(tool, name, rank) for tool in args.tools for name in args.cases
            if plain[name]["case_ok"] for rank in watched]
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        futures = [pool.submit(one, tool, name, args.timeout, args.ce_copy_method, processes, rank)
                   for tool, name, rank in jobs]
        for future in concurrent.futures.as_completed(futures):
            write(future.result())


if __name__ == "__main__":
    main()
