"""The verbs path of a world on the GPU (MKRT_TRANSPORT=verbs over the loopback NIC):
real kernels post commands, the compiled verbs loop builds and posts work requests, the
stand-in NIC copies with cuMemcpyAsync. Results must equal the `ce` path bit for bit; a
completion error mid-run must end in an exception, never a hang."""

from __future__ import annotations

import time

import numpy as np
import pytest

import mkrt

pytestmark = pytest.mark.gpu


@pytest.fixture
def verbs_env(monkeypatch):
    def use(transport, provider="loopback"):
        monkeypatch.setenv("MKRT_TRANSPORT", transport)
        monkeypatch.setenv("MKRT_VERBS_PROVIDER", provider)
    return use


def _operands(world, m, n, k, seed=0):
    import cupy

    from mkrt.arrays import bfloat16
    rng = cupy.random.default_rng(seed)
    a = [rng.standard_normal((m, k), dtype=np.float32).astype(bfloat16) for _ in world.local]
    b = [(rng.standard_normal((n, k), dtype=np.float32) / 4).astype(bfloat16) for _ in world.local]
    return a, b


def _run_gemm_allreduce(layout, calls, fuse=True):
    world = mkrt.init(emulate=layout)
    try:
        op = mkrt.GemmAllReduce(world, fuse=fuse, b_layout="nk", timeout_ms=20000)
        a, b = _operands(world, 640, 512, 256)
        outs = None
        for _ in range(calls):
            outs = op(a, b)
        world.synchronize()
        return world.proxy(), [o.get() for o in outs]
    finally:
        world.close()


@pytest.mark.parametrize("provider", ["loopback", "loopback_efa"])
@pytest.mark.parametrize("layout", ["2x2", "2x1", "3x1"])
def test_gemm_allreduce_over_verbs_equals_ce_bit_for_bit(verbs_env, layout, provider):
    """RC queue pairs, and an EFA SRD endpoint (delivery out of order; each flag written by
    the sender once its data has completed)."""
    from mkrt.proxy.verbs_world import VerbsWorldProxy
    verbs_env("ce")
    _, ce = _run_gemm_allreduce(layout, 3)
    verbs_env("verbs", provider)
    proxy, verbs = _run_gemm_allreduce(layout, 3)
    assert isinstance(proxy, VerbsWorldProxy)
    assert all(t.efa == (provider == "loopback_efa") for t in proxy.transports.values())
    for x, y in zip(ce, verbs):
        assert np.array_equal(x.view(np.uint16), y.view(np.uint16))


@pytest.mark.parametrize("provider", ["loopback", "loopback_efa"])
def test_allgather_over_verbs_equals_ce(verbs_env, provider):
    import cupy
    results = []
    for transport in ("ce", "verbs"):
        verbs_env(transport, provider)
        world = mkrt.init(emulate="2x2")
        try:
            x = [cupy.arange(5000, dtype=np.float32) + 1000 * info.rank for info in world.local]
            op = mkrt.AllGather(world, timeout_ms=20000)
            for _ in range(20):
                outs = op(x)
            world.synchronize()
            results.append([o.get() for o in outs])
        finally:
            world.close()
    for x, y in zip(*results):
        assert np.array_equal(x, y)
    assert np.array_equal(results[1][0][3], np.arange(5000, dtype=np.float32) + 3000)


def test_many_calls_without_sync_over_verbs(verbs_env):
    """Credits wrap and completions return across hundreds of calls (paced, unsynchronised)."""
    verbs_env("verbs")
    _, outs = _run_gemm_allreduce("2x2", 300)
    verbs_env("ce")
    _, ce = _run_gemm_allreduce("2x2", 1)
    assert all(np.array_equal(x.view(np.uint16), y.view(np.uint16)) for x, y in zip(outs, ce))


def test_completion_error_mid_run_raises_and_never_hangs(verbs_env):
    """The loopback NIC fails a work request of rank 0's queue pair to rank 2 after the
    first call: the next calls end in CommTimeout or a ProxyError naming the request."""
    verbs_env("verbs")
    world = mkrt.init(emulate="2x2")
    try:
        op = mkrt.GemmAllReduce(world, fuse=True, b_layout="nk", timeout_ms=2000)
        a, b = _operands(world, 640, 512, 256)
        op(a, b)
        world.synchronize()
        qp = world.proxy().transports[0].qps[2]
        from mkrt.proxy.transports.loopback_nic import Q_POSTED
        qp.nic.fail_after(qp.index, int(qp.nic.qps[qp.index][1][Q_POSTED]) + 2)
        start = time.perf_counter()
        with pytest.raises((mkrt.CommTimeout, mkrt.MkrtError)) as caught:
            for _ in range(5):
                op(a, b)
            world.synchronize()
        assert time.perf_counter() - start < 30
        text = str(caught.value) + "".join(str(e) for e in [caught.value.__cause__] if e)
        assert "rank" in text
        # the world builds a new op afterwards, on a fresh proxy, and it is right
        op2 = mkrt.GemmAllReduce(world, fuse=True, b_layout="nk", timeout_ms=20000)
        outs = op2(a, b)
        world.synchronize()
        from mkrt.kernels import gemm_allreduce as gar
        from mkrt.kernels.gemm import to_float32
        import cupy
        expected = gar.reference(a, b, b_layout="nk")
        for out in outs:
            error = float(cupy.linalg.norm(to_float32(out).astype(cupy.float64) - expected)
                          / cupy.linalg.norm(expected))
            assert error < 1e-2
    finally:
        world.close()


def test_across_processes_through_the_loopback_nic():
    """Two processes, one host split into two nodes: every byte between them goes through
    the compiled verbs loop and the loopback NIC (aliases of the peer's registrations)."""
    import re
    import subprocess
    from pathlib import Path

    from mkrt.launch import child_env, mpiexec_command, private_mps
    script = str(Path(__file__).with_name("mpi_verbs_loopback.py"))
    # Both processes share this GPU: under MPS their persistent kernels run side by side
    # (without it they take turns, and each waits out its bound for the other's data).
    with private_mps() as mps_env:
        env = child_env(MKRT_WORLD_RANKS_PER_NODE="1", MKRT_TRANSPORT="verbs",
                        MKRT_VERBS_PROVIDER="loopback", **(mps_env or {}))
        result = subprocess.run(mpiexec_command(2, script), env=env, capture_output=True,
                                text=True, timeout=300)
    assert result.returncode == 0, f"(MPS: {'on' if mps_env else 'not available'}) " + \
        result.stdout[-3000:] + result.stderr[-3000:]
    match = re.search(r"MPI_VERBS_LOOPBACK ranks=2 layout=2x1 verbs=1 worst_error=(\S+) "
                      r"gathered_exact=1", result.stdout)
    assert match and float(match.group(1)) < 1e-2, result.stdout[-2000:]
