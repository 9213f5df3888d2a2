"""Bounded run-ahead (mkrt/pacing.py): where the proxy's traffic is GPU work, many calls
back to back without synchronisation finish instead of stalling the proxy."""

from __future__ import annotations

import numpy as np
import pytest

import mkrt

pytestmark = pytest.mark.gpu


def _operands(world, m, n, k):
    import cupy

    from mkrt.arrays import bfloat16
    rng = cupy.random.default_rng(5)
    a = [rng.standard_normal((m, k), dtype=np.float32).astype(bfloat16) for _ in world.local]
    b = [(rng.standard_normal((n, k), dtype=np.float32) / 8).astype(bfloat16) for _ in world.local]
    return a, b


def test_unfused_calls_back_to_back_on_2x2_do_not_stall(make_world):
    """Before pacing, this loop stalled after 118 to 545 calls (CommTimeout)."""
    import cupy

    from mkrt.kernels import gemm_allreduce as gar
    from mkrt.kernels.gemm import to_float32
    world = make_world("2x2")
    op = mkrt.GemmAllReduce(world, b_layout="nk", timeout_ms=10000)
    a, b = _operands(world, 640, 896, 1152)
    outs = [cupy.empty((640, 896), a[0].dtype) for _ in world.local]
    for gemm in ("cublas", "mkrt"):
        for _ in range(1500):
            op.unfused(a, b, out=outs, gemm=gemm)
        world.synchronize()
    pacers = [world.running_service("pacer", d) for d in {info.device for info in world.local}]
    assert all(p is not None and p.calls >= 3000 and p.recorded >= 3000 // p.stride
               for p in pacers)
    reference = gar.reference(a, b, b_layout="nk")
    for out in outs:
        error = float(cupy.linalg.norm(to_float32(out).astype(cupy.float64) - reference)
                      / cupy.linalg.norm(reference))
        assert error < 2e-2


def test_no_pacing_where_nodes_do_not_share_a_host_through_copies(make_world):
    """One node: no proxy traffic, so the host is never held back."""
    world = make_world("1x2")
    op = mkrt.GemmAllReduce(world, b_layout="nk", timeout_ms=10000)
    a, b = _operands(world, 256, 256, 128)
    for _ in range(40):
        op(a, b)
    world.synchronize()
    assert all(world.running_service("pacer", info.device) is None for info in world.local)


def test_capture_is_not_paced(make_world):
    """A call captured into a graph records no pacing event, even where one was due (a
    host wait inside a capture is an error); replays then give the eager result."""
    import cupy
    world = make_world("2x2")
    op = mkrt.GemmAllReduce(world, fuse=True, b_layout="nk", timeout_ms=10000)
    a, b = _operands(world, 256, 256, 128)
    outs = [cupy.empty((256, 256), a[0].dtype) for _ in world.local]
    op(a, b, out=outs)
    world.synchronize()
    eager = [o.copy() for o in outs]
    pacer = world.running_service("pacer", world.local[0].device)
    pacer.calls += pacer.stride - 1 - pacer.calls % pacer.stride   # the next call records
    before = pacer.recorded
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        op(a, b, out=outs)
        graph = stream.end_capture()
    assert pacer.recorded == before
    for _ in range(3):
        graph.launch(stream)
    stream.synchronize()
    world.synchronize()
    assert all(bool((o == e).all()) for o, e in zip(outs, eager))
