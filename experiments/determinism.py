"""Determinism at scale: many back-to-back calls of every world op give the same bits.

For each op on an emulated world (2x2 by default), on fixed random inputs: CALLS calls
without host synchronisation, and every EVERY calls a hash of every rank's output taken on
the GPU, in stream order (two 64-bit words: sums mod 2^64 of its 32-bit words times two
sets of odd position weights). Then the same op captured once in a CUDA graph
and replayed REPLAYS times, hashed the same way. Every hash must equal the first, and the
first output must match a float64 (or exact) reference. Rows go to
`experiments/results/determinism.jsonl`, one per op and mode:

    PYTHONPATH=$PWD python3 experiments/determinism.py --layout 2x2 --calls 10000
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import tempfile
import time


class Hasher:
    """Hashes of arrays into a preallocated table, on the current stream. The first use
    allocates CuPy temporaries; hash once (then synchronize) before timing anything."""

    def __init__(self, arrays, slots: int):
        import cupy
        self.words = [x.view(cupy.uint8).ravel().view(cupy.uint32) if x.nbytes % 4 == 0
                      else x.view(cupy.uint8).ravel() for x in arrays]
        positions = [cupy.arange(w.size, dtype=cupy.uint64) for w in self.words]
        self.weights = [(2 * p + 1, (p * cupy.uint64(0x9E3779B97F4A7C15)) | cupy.uint64(1))
                        for p in positions]
        self.table = cupy.zeros((slots, len(arrays), 2), dtype=cupy.uint64)
        self.used = 0

    def take(self) -> None:
        import cupy
        for i, (words, (w1, w2)) in enumerate(zip(self.words, self.weights)):
            wide = words.astype(cupy.uint64)
            self.table[self.used, i, 0] = (wide * w1).sum()     # sums wrap mod 2^64
            self.table[self.used, i, 1] = (wide * w2).sum()
        self.used += 1

    def distinct(self) -> int:
        """How many different hash rows were taken (1: every snapshot identical)."""
        rows = self.table[:self.used].get().reshape(self.used, -1)
        return len({row.tobytes() for row in rows})


def ops(world, args):
    """name -> (call(out) issuing one call, the outputs, check of the first output)."""
    import cupy
    import numpy as np

    import mkrt
    from mkrt.arrays import bfloat16
    from mkrt.kernels import allgather_gemm as agg
    from mkrt.kernels import gemm_allreduce as gar
    from mkrt.kernels import attention as attention_module
    from mkrt.kernels import gemm_reducescatter as grs
    from mkrt.kernels import ring_attention as ra
    from mkrt.kernels.gemm import to_float32
    rng = cupy.random.default_rng(11)
    m, n, k = args.shape
    a = [rng.standard_normal((m, k), dtype=np.float32).astype(bfloat16) for _ in world.local]
    b = [(rng.standard_normal((n, k), dtype=np.float32) / 8).astype(bfloat16) for _ in world.local]
    reference = gar.reference(a, b, b_layout="nk")

    def gar_check(outs):
        return max(float(cupy.linalg.norm(to_float32(o).astype(cupy.float64) - reference)
                         / cupy.linalg.norm(reference)) for o in outs) < 2e-2

    def close_to(outs, references):
        return max(float(cupy.linalg.norm(to_float32(o).astype(cupy.float64) - r)
                         / cupy.linalg.norm(r)) for o, r in zip(outs, references)) < 2e-2

    # The tensor-parallel pair on the same B: m rounded up so every node's rows are whole
    # 128-row tiles (the fused reduce-scatter's rule across nodes); all-gather+GEMM with
    # those rows split over the ranks.
    m_tp = -(-m // (128 * world.nodes)) * 128 * world.nodes
    a_tp = [rng.standard_normal((m_tp, k), dtype=np.float32).astype(bfloat16) for _ in world.local]
    ranks = [info.rank for info in world.local]
    rs_references = [grs.reference(a_tp, b, r, b_layout="nk") for r in ranks]
    a_rows = [x[:m_tp // world.size] for x in a_tp]
    ag_references = [agg.reference(a_rows, w, b_layout="nk") for w in b]

    x = [rng.standard_normal(args.gather_elems, dtype=np.float32) for _ in world.local]
    x_host = np.stack([v.get() for v in x])

    def gather_check(outs):
        return all(np.array_equal(o.get(), x_host) for o in outs)

    def node_check(outs):
        return all(np.array_equal(o.get(), x_host[world.node_ranks(info.node)])
                   for o, info in zip(outs, world.local))

    # ring attention, causal (zigzag), 256 rows per chunk, GQA 4 query heads on 2
    S = 2 * world.size * 256
    q_full, k_full, v_full = (rng.standard_normal((1, S, h, 64), dtype=np.float32).astype(bfloat16)
                              for h in (4, 2, 2))
    ring_parts = [[ra.shard(t, info.rank, world.size, causal=True) for info in world.local]
                  for t in (q_full, k_full, v_full)]
    ring_lse = [cupy.empty((1, 4, 512), np.float32) for _ in world.local]
    ring_full, _ = attention_module.reference(q_full, k_full, v_full, causal=True)
    ring_references = [ra.shard(ring_full, info.rank, world.size, causal=True) for info in world.local]

    # MoE: 48 tokens per rank, top-2 of 2 experts per rank, H 256, I 128
    from mkrt.kernels import moe as moe_module
    moe_dev, moe_expected = moe_module.random_problem(
        world.size, [48] * world.size, 2, 256, 128, 2 * world.size, seed=12)

    def moe_check(outs):
        return all(np.abs(to_float32(o).get() - want).max() <= 3e-2 * np.abs(want).max()
                   for o, want in zip(outs, moe_expected))

    fused = mkrt.GemmAllReduce(world, fuse=True, b_layout="nk", timeout_ms=args.timeout_ms)
    auto = mkrt.GemmAllReduce(world, b_layout="nk", timeout_ms=args.timeout_ms)
    gather = mkrt.AllGather(world, timeout_ms=args.timeout_ms)
    node = mkrt.AllGather(world, group="node", timeout_ms=args.timeout_ms)
    scatter = mkrt.GemmReduceScatter(world, fuse=True, b_layout="nk", timeout_ms=args.timeout_ms)
    gather_gemm = mkrt.AllGatherGemm(world, fuse=True, b_layout="nk", timeout_ms=args.timeout_ms)
    ring = mkrt.RingAttention(world, timeout_ms=args.timeout_ms)
    moe = mkrt.MoE(world, experts=2 * world.size, capacity=48, timeout_ms=args.timeout_ms)
    moe_fused = mkrt.MoE(world, experts=2 * world.size, capacity=48, timeout_ms=args.timeout_ms,
                         fused_experts=True)
    gar_outs = lambda: [cupy.empty((m, n), bfloat16) for _ in world.local]          # noqa: E731
    table = {
        "gemm_allreduce_fused": (lambda out: fused(a, b, out=out), gar_outs(), gar_check),
        "gemm_allreduce_unfused": (lambda out: fused.unfused(a, b, out=out, gemm=args.unfused_gemm), gar_outs(), gar_check),
        "gemm_allreduce_planner": (lambda out: auto(a, b, out=out), gar_outs(), gar_check),
        "gemm_reducescatter_fused": (
            lambda out: scatter(a_tp, b, out=out),
            [cupy.empty((m_tp // world.size, n), bfloat16) for _ in world.local],
            lambda outs: close_to(outs, rs_references)),
        "gemm_reducescatter_unfused": (
            lambda out: scatter.unfused(a_tp, b, out=out, gemm=args.unfused_gemm),
            [cupy.empty((m_tp // world.size, n), bfloat16) for _ in world.local],
            lambda outs: close_to(outs, rs_references)),
        "allgather_gemm_fused": (
            lambda out: gather_gemm(a_rows, b, out=out),
            [cupy.empty((m_tp, n), bfloat16) for _ in world.local],
            lambda outs: close_to(outs, ag_references)),
        "allgather_gemm_unfused": (
            lambda out: gather_gemm.unfused(a_rows, b, out=out),
            [cupy.empty((m_tp, n), bfloat16) for _ in world.local],
            lambda outs: close_to(outs, ag_references)),
        "ring_attention": (
            lambda out: ring(*ring_parts, causal=True, out=out, lse=ring_lse),
            [cupy.empty((1, 512, 4, 64), bfloat16) for _ in world.local],
            lambda outs: close_to(outs, ring_references)),
        "moe": (lambda out: moe(*(moe_dev[name] for name in ("x", "ids", "weights", "w1", "w2")),
                                out=out),
                [cupy.empty((48, 256), bfloat16) for _ in world.local], moe_check),
        # the whole call in one launch per rank
        "moe_fused": (lambda out: moe_fused(*(moe_dev[name] for name in ("x", "ids", "weights", "w1", "w2")),
                                            out=out),
                      [cupy.empty((48, 256), bfloat16) for _ in world.local], moe_check),
        "allgather_world": (lambda out: gather(x, out=out),
                            [cupy.empty((world.size, args.gather_elems), np.float32)
                             for _ in world.local], gather_check),
        "allgather_node": (lambda out: node(x, out=out),
                           [cupy.empty((world.ranks_per_node, args.gather_elems), np.float32)
                            for _ in world.local], node_check),
    }
    return table, {"gemm_allreduce": fused, "gemm_reducescatter": scatter}


class NativeStacks:
    """Once an op has run `seconds`, every thread's native stack, taken by attaching
    cuda-gdb (the device machine has no gdb): where the driver calls wait."""

    def __init__(self, seconds: float):
        import threading
        self.text = ""
        self._timer = threading.Timer(seconds, self._take) if seconds > 0 else None
        if self._timer:
            self._timer.daemon = True
            self._timer.start()

    def _take(self) -> None:
        import subprocess
        try:
            done = subprocess.run(["cuda-gdb", "-p", str(os.getpid()), "-batch", "-ex",
                                   "thread apply all bt 30"], capture_output=True, text=True,
                                  timeout=90)
            self.text = done.stdout + done.stderr
        except (OSError, subprocess.SubprocessError) as error:
            self.text = f"cuda-gdb failed: {error}"

    def cancel(self) -> None:
        if self._timer:
            self._timer.cancel()


def flag_words(world, table_ops) -> dict:
    """After a timeout: every rank's nonzero flag words of the gemm_allreduce kernels (epoch
    values; who is behind), read once the aborted launches have left."""
    import numpy as np
    world.synchronize()
    found = {}
    for op_name, op in table_ops.items():
        flags = getattr(op, "_buffers", {}).get("flags")
        if flags is None:
            continue
        for info in world.local:
            words = flags.view(info.rank, np.uint64, (flags.nbytes // 8,)).get()
            found[f"{op_name} rank {info.rank}"] = {
                int(i): int(words[i]) for i in np.flatnonzero(words)}
    return found


def run(args) -> None:
    import mkrt
    from mkrt.bench import append_jsonl, record
    world = mkrt.init(emulate=args.layout)
    table, table_ops = ops(world, args)
    for name in [n for n in list(table) if not args.only or n in args.only]:
        call, outs, check = table[name]
        # A watchdog dumps every thread's Python stack if the op runs past half its bound
        # without finishing a snapshot: what the host was doing while the kernels waited.
        dump = tempfile.TemporaryFile("w+")
        native = NativeStacks(args.native_stacks_s)
        if args.watchdog_s > 0:
            faulthandler.dump_traceback_later(args.watchdog_s, repeat=True, file=dump)
        try:
            run_op(args, world, name, call, outs, check)
        except mkrt.CommTimeout as error:
            # Recorded; the next op runs on a fresh world (this one's ops refuse calls now).
            faulthandler.cancel_dump_traceback_later()
            dump.seek(0)
            stacks = dump.read()[-6000:]
            print(f"{args.layout} {name:24s} TIMEOUT {error}\n{stacks}", flush=True)
            native.cancel()
            flags = flag_words(world, table_ops)
            print("records:", *error.records, "flags:", flags, sep="\n  ", flush=True)
            append_jsonl(args.out, [record(
                "determinism", f"{args.layout}_{name}_eager", "timeout", 1.0, None, "count",
                identical=False, first_output_correct=None, error=str(error)[:600],
                records=[str(r) for r in error.records], flags=flags, stacks=stacks,
                native_stacks=native.text[-12000:],
                unfused_gemm=args.unfused_gemm, sync_every=args.sync_every,
                max_connections=os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))])
            world.close()
            world = mkrt.init(emulate=args.layout)
            table, table_ops = ops(world, args)
        except Exception as error:                      # recorded; the other ops still run
            print(f"{args.layout} {name:24s} ERROR {type(error).__name__}: {error}", flush=True)
            append_jsonl(args.out, [record(
                "determinism", f"{args.layout}_{name}_eager", "error", 1.0, None, "count",
                identical=False, first_output_correct=None,
                error=f"{type(error).__name__}: {str(error)[:600]}")])
        finally:
            native.cancel()
            faulthandler.cancel_dump_traceback_later()
    world.close()


def run_op(args, world, name, call, outs, check) -> None:
    """Both modes of one op: eager calls, then replays of one captured call."""
    import cupy

    from mkrt.bench import append_jsonl, record
    for mode in ("eager", "graph"):
        if mode == "graph" and name.endswith("unfused") and args.unfused_gemm == "cublas":
            print(f"{args.layout} {name:24s} graph: skipped (CuPy cannot capture cuBLAS)")
            continue
        count = args.calls if mode == "eager" else args.replays
        for out in outs:
            out.fill(0)
        call(outs)                          # first call of the shape, then its check
        world.synchronize()
        correct = bool(check(outs))
        stream = cupy.cuda.get_current_stream()
        if mode == "graph":
            stream = cupy.cuda.Stream(non_blocking=True)
            with stream:
                stream.begin_capture()
                call(outs)
                graph = stream.end_capture()
            graph.upload(stream)
            stream.synchronize()
        hasher = Hasher(outs, count // args.every + 1)
        with stream:
            # CuPy's pool reuses memory per stream: allocate the temporaries now, not
            # while the op's kernels wait for the proxy (mkrt/DESIGN.md, "Runtime hazards").
            hasher.take()
        stream.synchronize()
        world.synchronize()
        hasher.used = 0
        start = time.perf_counter()
        with stream:
            for i in range(count):
                if mode == "eager":
                    call(outs)
                else:
                    graph.launch(stream)
                if (i + 1) % args.every == 0:
                    hasher.take()
                if args.sync_every and (i + 1) % args.sync_every == 0:
                    stream.synchronize()
        stream.synchronize()
        world.synchronize()
        seconds = time.perf_counter() - start
        distinct = hasher.distinct()
        ok = correct and distinct == 1
        print(f"{args.layout} {name:24s} {mode:5s} {count:6d} calls, {hasher.used:4d} hashes, "
              f"{distinct} distinct, first output {'right' if correct else 'WRONG'}, "
              f"{seconds:6.2f} s", flush=True)
        append_jsonl(args.out, [record(
            "determinism", f"{args.layout}_{name}_{mode}", "distinct_hashes", float(distinct),
            1.0, "count", higher_is_better=False, calls=count, hashes=hasher.used,
            every=args.every, first_output_correct=correct, identical=ok,
            shape=list(args.shape), gather_elems=args.gather_elems, seconds=seconds,
            unfused_gemm=args.unfused_gemm, sync_every=args.sync_every,
            max_connections=os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layout", default="2x2")
    parser.add_argument("--calls", type=int, default=10000)
    parser.add_argument("--replays", type=int, default=2000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--shape", type=int, nargs=3, default=[640, 896, 1152], metavar=("M", "N", "K"))
    parser.add_argument("--gather-elems", type=int, default=65536)
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--watchdog-s", type=float, default=0.0,
                        help="dump every thread's stack every this many seconds an op runs, "
                             "kept in the row when the op ends in a timeout (0: off)")
    parser.add_argument("--native-stacks-s", type=float, default=0.0,
                        help="attach cuda-gdb for native stacks once an op runs this long "
                             "(0: off)")
    parser.add_argument("--timeout-ms", type=float, default=20000.0)
    parser.add_argument("--unfused-gemm", choices=("cublas", "mkrt"), default="cublas",
                        help="the GEMM of the unfused paths (cuBLAS cannot be captured in a "
                             "CUDA graph through CuPy: graph mode is skipped for it)")
    parser.add_argument("--sync-every", type=int, default=0,
                        help="synchronize the host every this many calls (0: never)")
    parser.add_argument("--out", default="experiments/results/determinism.jsonl")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
