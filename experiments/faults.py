"""Fault injection: every fault ends in a clear exception within its bound, never a hang,
and the world builds a new op afterwards whose results are right.

Each entry of FAULTS injects one fault into an emulated world on the visible GPU(s) and
returns what happened; `tests/test_faults_gpu.py` runs the same table as GPU tests, and
this script counts it (faults tried, hangs, wrong results) into
`experiments/results/faults.jsonl`:

    PYTHONPATH=$PWD python3 experiments/faults.py --out experiments/results/faults.jsonl

A "hang" is a faulted call that did not end within its bound plus SLACK_S seconds (each
fault has a bounded wait, so in-process this counts slow aborts; a real hang would stop
the script, which its caller runs under `timeout`). A "wrong result" is a recovery op
whose output differs from a float64 reference, or a NaN/Inf input whose propagation is
not what IEEE arithmetic gives. The rank-process-exit fault needs mpiexec and lives in
tests/test_faults_gpu.py (script tests/mpi_faults.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from mkrt.kernels import gemm_allreduce as gar

SLACK_S = 10.0
TOLERANCE = 2e-2        # bf16 output of a K-term sum, relative (Frobenius)


@dataclasses.dataclass
class Outcome:
    raised: str = ""           # exception class, "" when the call returned
    message: str = ""
    seconds: float = 0.0       # from the faulted call to its end (exception or result)
    bound_s: float = 0.0       # the timeout that bounds it
    waiters: int = 0           # ranks whose wait record the exception carries
    recovered: bool = False    # a new op on the same world gave correct results
    recovery_error: float = float("nan")
    propagation_ok: bool = True   # NaN/Inf faults: the output is what IEEE arithmetic gives

    @property
    def hang(self) -> bool:
        return self.seconds > self.bound_s + SLACK_S

    @property
    def wrong(self) -> bool:
        return not self.recovered or not self.propagation_ok


# ---- operands and references ---------------------------------------------------------
def gar_operands(world, m, n, k, seed, poison=None):
    """Per local rank A [m, k] and B [k, n] in bf16; `poison(i, a_float32)` may edit rank
    i's A before rounding (NaN / Inf faults)."""
    import cupy
    import numpy as np

    from mkrt.arrays import bfloat16
    rng = cupy.random.default_rng(seed)
    a = []
    for i, _ in enumerate(world.local):
        x = rng.standard_normal((m, k), dtype=np.float32)
        if poison is not None:
            poison(i, x)
        a.append(x.astype(bfloat16))
    b = [(rng.standard_normal((k, n), dtype=np.float32) / 8).astype(bfloat16) for _ in world.local]
    return a, b


def relative_error(out, reference) -> float:
    import cupy

    from mkrt.kernels.gemm import to_float32
    got = to_float32(out).astype(cupy.float64)
    return float(cupy.linalg.norm(got - reference) / cupy.linalg.norm(reference))


def recover(world, outcome: Outcome, *, seed=7) -> Outcome:
    """After the fault: a new GemmAllReduce (fused) and a new AllGather on the same world,
    on fresh data, against references."""
    import cupy
    import numpy as np

    import mkrt
    world.check()                      # nothing left over from the fault
    a, b = gar_operands(world, 384, 512, 256, seed)
    outs = mkrt.GemmAllReduce(world, fuse=True, timeout_ms=10000)(a, b)
    world.synchronize()
    reference = gar.reference(a, b)
    worst = max(relative_error(o, reference) for o in outs)
    blocks = [cupy.full(1000, 17 * info.rank + 3, np.int32) for info in world.local]
    gathered = mkrt.AllGather(world, timeout_ms=10000)(blocks)
    world.synchronize()
    expected = np.repeat((17 * np.arange(world.size) + 3)[:, None], 1000, axis=1)
    gather_ok = all(np.array_equal(g.get(), expected) for g in gathered)
    outcome.recovery_error = worst
    outcome.recovered = worst < TOLERANCE and gather_ok
    return outcome


def expect_failure(call, bound_s: float) -> Outcome:
    """Run `call` (which issues work and synchronizes); it must raise."""
    start = time.perf_counter()
    outcome = Outcome(bound_s=bound_s)
    try:
        call()
    except Exception as error:     # noqa: BLE001 - the kind is part of the outcome
        outcome.raised = type(error).__name__
        outcome.message = str(error)
        outcome.waiters = len(getattr(error, "records", ()))
    outcome.seconds = time.perf_counter() - start
    return outcome


# ---- the faults ------------------------------------------------------------------------
def stalled_rank(layout: str, op_name: str):
    """One rank never signals (its launch does nothing): the others' waits give up."""
    def fault(make_world) -> Outcome:
        import cupy
        import numpy as np

        import mkrt
        world = make_world(layout)
        muted = world.size - 1
        timeout_ms = 300
        # The same call once without the fault first: the kernel is compiled and the
        # buffers and proxy exist, so the faulted call's time is the wait's, not setup's.
        if op_name == "gemm_allreduce":
            a, b = gar_operands(world, 256, 384, 128, 1)
            mkrt.GemmAllReduce(world, fuse=True, timeout_ms=10000)(a, b)
            world.synchronize()
            op = mkrt.GemmAllReduce(world, fuse=True, timeout_ms=timeout_ms, muted_rank=muted)
            call = lambda: (op(a, b), world.synchronize())             # noqa: E731
        else:
            x = [cupy.ones(4096, np.float32) for _ in world.local]
            mkrt.AllGather(world, timeout_ms=10000)(x)
            world.synchronize()
            op = mkrt.AllGather(world, timeout_ms=timeout_ms, muted_rank=muted)
            call = lambda: (op(x), world.synchronize())                # noqa: E731
        return recover(world, expect_failure(call, timeout_ms / 1e3))
    return fault


def proxy_killed_mid_run(make_world) -> Outcome:
    """The proxy threads stop (without draining) while fused 2x2 calls are in flight."""
    import mkrt
    world = make_world("2x2")
    a, b = gar_operands(world, 2048, 2048, 4096, 2)
    op = mkrt.GemmAllReduce(world, fuse=True, timeout_ms=1000)
    op(a, b)
    world.synchronize()

    def run():
        for call in range(20):
            op(a, b)
            if call == 3:
                for proxy in world.proxy().proxies.values():
                    proxy.kill()
        world.synchronize()
    return recover(world, expect_failure(run, 1.0))


def queue_full_proxy_stalled(make_world) -> Outcome:
    """A proxy that takes nothing: a kernel posting 10^7 commands fills the ring, and its
    wait for space gives up (flag -3)."""
    import cupy
    import numpy as np

    from mkrt.errors import CommTimeout
    from mkrt.proxy import REGION_HOST, Proxy, QueueSet, new_region_table, set_region
    from mkrt.proxy.kernels import ProxyKernelsSpec, raise_status, status_words
    from mkrt.proxy.transports.host import HostTransport
    world = make_world("2x2")
    qs = QueueSet(1, 16, [0], memory="pinned")
    flags = QueueSet(1, 2, [0], memory="pinned")
    regions = new_region_table(1, 2)
    set_region(regions, 0, 1, flags.memory.address, flags.memory.nbytes, REGION_HOST)
    status = status_words()
    function = ProxyKernelsSpec().function("post_signals", 0)
    proxy = Proxy(qs, regions, HostTransport(), threads=1)
    proxy.kill()

    # Set up before the timed call (the first cupy.full builds CuPy's fill kernel: 0.14 s).
    result = cupy.full(4, 7, dtype=np.uint64)
    descriptors = qs.device_descriptors()
    cupy.cuda.Device().synchronize()

    def run():
        function((4,), (32,), (descriptors, np.int32(1), np.uint32(0), np.uint32(1),
                               np.int32(10_000_000), *status.args, np.uint64(300_000_000), result))
        cupy.cuda.Device().synchronize()
        raise_status(status, timeout_ms=300)
    outcome = expect_failure(run, 0.3)
    proxy.close()
    qs.close()
    flags.close()
    if outcome.raised == CommTimeout.__name__ and "flag=-3" not in outcome.message:
        outcome.propagation_ok = False      # it must say: no space in the ring
    return recover(world, outcome)


def transport_refuses(what: str):
    """A command from the device names a region that is not registered, or an offset
    outside its region: the proxy refuses it (writes nothing), the host raises its error,
    the kernels' waits end."""
    def fault(make_world) -> Outcome:
        import mkrt
        from mkrt.proxy import queue as Q
        world = make_world("2x2")
        a, b = gar_operands(world, 512, 512, 256, 3)
        op = mkrt.GemmAllReduce(world, fuse=True, timeout_ms=1000)
        op(a, b)
        world.synchronize()
        service = world.proxy()
        inter = op._buffers["inter"]
        if what == "region":
            service.unregister(inter)
        else:            # the region shrinks to 64 bytes: every put lands out of it
            for rank, pointer in inter.host_pointers().items():
                Q.set_region(service.regions, rank, inter.region, pointer, 64)
        return recover(world, expect_failure(lambda: (op(a, b), world.synchronize()), 1.0))
    return fault


def nan_and_inf_inputs(make_world) -> Outcome:
    """NaN and Inf in A: the fused 2x2 call ends normally and C has NaN / Inf exactly where
    IEEE arithmetic puts them (the reference computes with the same inputs)."""
    import cupy

    import mkrt
    from mkrt.kernels.gemm import to_float32
    world = make_world("2x2")
    spots = {0: (3, slice(None), float("nan")), 1: (7, 5, float("inf")), 2: (11, 0, float("-inf"))}

    def poison(i, x):
        if i in spots:
            row, col, value = spots[i]
            x[row, col] = value
    a, b = gar_operands(world, 256, 384, 128, 4, poison)
    op = mkrt.GemmAllReduce(world, fuse=True, timeout_ms=5000)
    start = time.perf_counter()
    outcome = Outcome(bound_s=5.0)
    try:
        outs = op(a, b)
        world.synchronize()
    except Exception as error:     # noqa: BLE001
        outcome.raised, outcome.message = type(error).__name__, str(error)
        outcome.seconds = time.perf_counter() - start
        outcome.propagation_ok = False
        return recover(world, outcome)
    outcome.seconds = time.perf_counter() - start
    reference = gar.reference(a, b)
    ok = True
    for out in outs:
        got = to_float32(out).astype(cupy.float64)
        same_nan = bool(cupy.array_equal(cupy.isnan(got), cupy.isnan(reference)))
        same_inf = bool(cupy.array_equal(cupy.isinf(got) & (got > 0), cupy.isinf(reference) & (reference > 0))
                        and cupy.array_equal(cupy.isinf(got) & (got < 0), cupy.isinf(reference) & (reference < 0)))
        finite = cupy.isfinite(reference)
        error = float(cupy.linalg.norm(got[finite] - reference[finite]) / cupy.linalg.norm(reference[finite]))
        ok = ok and same_nan and same_inf and error < TOLERANCE
    # And allgather moves NaN payloads bit for bit.
    blocks = [cupy.full(512, float("nan"), cupy.float32) for _ in world.local]
    for i, block in enumerate(blocks):
        block.view(cupy.uint32)[:] = 0x7FC00000 + i    # distinct NaN payloads
    gathered = mkrt.AllGather(world, timeout_ms=5000)(blocks)
    world.synchronize()
    for g in gathered:
        ok = ok and all(int(g.view(cupy.uint32)[r, 0]) == 0x7FC00000 + r for r in range(world.size))
    outcome.propagation_ok = ok
    return recover(world, outcome)


def timeout_shorter_than_a_tile(make_world) -> Outcome:
    """A 1 µs bound on a call whose tiles take far longer: every wait may give up. It ends
    in CommTimeout (or, if no wait had to wait, correct results), within the bound."""
    import mkrt
    world = make_world("2x2")
    a, b = gar_operands(world, 2048, 2048, 8192, 5)
    op = mkrt.GemmAllReduce(world, fuse=True, timeout_ms=0.001)
    outcome = expect_failure(lambda: (op(a, b), world.synchronize()), 0.001)
    return recover(world, outcome)


FAULTS = {
    "stalled_rank_gemm_allreduce_1x2": stalled_rank("1x2", "gemm_allreduce"),
    "stalled_rank_gemm_allreduce_2x2": stalled_rank("2x2", "gemm_allreduce"),
    "stalled_rank_allgather_2x2": stalled_rank("2x2", "allgather"),
    "stalled_rank_allgather_3x1": stalled_rank("3x1", "allgather"),
    "proxy_killed_mid_run_2x2": proxy_killed_mid_run,
    "queue_full_proxy_stalled": queue_full_proxy_stalled,
    "transport_unregistered_region_2x2": transport_refuses("region"),
    "transport_offset_out_of_region_2x2": transport_refuses("offset"),
    "nan_and_inf_inputs_2x2": nan_and_inf_inputs,
    "timeout_shorter_than_a_tile_2x2": timeout_shorter_than_a_tile,
}

#: what each fault must raise ("" = returns normally); None = either
EXPECTED = {name: "CommTimeout" for name in FAULTS}
EXPECTED.update({"transport_unregistered_region_2x2": "ProxyError",
                 "transport_offset_out_of_region_2x2": "ProxyError",
                 "nan_and_inf_inputs_2x2": "",
                 "timeout_shorter_than_a_tile_2x2": None})


def judge(name: str, outcome: Outcome) -> list[str]:
    """What is wrong with `outcome` (empty when the fault was handled as promised)."""
    problems = []
    expected = EXPECTED[name]
    if expected is not None and outcome.raised != expected:
        problems.append(f"raised {outcome.raised or 'nothing'} ({outcome.message[:200]}), "
                        f"expected {expected or 'no exception'}")
    if expected and not outcome.message.startswith("mkrt"):
        problems.append(f"message does not name its area: {outcome.message[:200]}")
    if outcome.hang:
        problems.append(f"took {outcome.seconds:.1f} s for a {outcome.bound_s:g} s bound")
    if not outcome.propagation_ok:
        problems.append("output (or the error's text) is not what the fault should give")
    if not outcome.recovered:
        problems.append(f"a new op afterwards was wrong (error {outcome.recovery_error:.2e})")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="experiments/results/faults.jsonl")
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args()
    import mkrt
    from mkrt.bench import append_jsonl, record
    hangs = wrong = tried = 0
    for name, fault in FAULTS.items():
        if args.only and name not in args.only:
            continue
        worlds = []

        def make_world(layout):
            worlds.append(mkrt.init(emulate=layout))
            return worlds[-1]
        try:
            outcome = fault(make_world)
            problems = judge(name, outcome)
        except Exception as error:   # noqa: BLE001 - a fault that breaks the script is wrong
            outcome, problems = Outcome(raised=type(error).__name__, message=str(error)), [
                f"the experiment itself failed: {error!r}"]
        finally:
            for world in worlds:
                world.close()
        tried += 1
        hangs += outcome.hang
        wrong += bool(problems) and not outcome.hang
        print(f"{name:38s} raised {outcome.raised or '-':12s} in {outcome.seconds:6.3f} s "
              f"(bound {outcome.bound_s:g} s) waiters {outcome.waiters} recovered "
              f"{outcome.recovered} {'OK' if not problems else 'PROBLEM: ' + '; '.join(problems)}",
              flush=True)
        append_jsonl(args.out, [record("faults", name, "handled", float(not problems), None,
                                       "bool", raised=outcome.raised, message=outcome.message[:500],
                                       seconds=outcome.seconds, bound_s=outcome.bound_s,
                                       waiters=outcome.waiters, recovered=outcome.recovered,
                                       recovery_error=outcome.recovery_error, problems=problems)])
    print(f"faults tried {tried}, hangs {hangs}, wrong results {wrong}", flush=True)
    append_jsonl(args.out, [record("faults", "summary", "faults_tried", float(tried), None, "count",
                                   hangs=hangs, wrong=wrong)])


if __name__ == "__main__":
    main()
