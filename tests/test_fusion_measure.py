"""fuse="measure": GemmAllReduce times both paths once per size class and keeps the
faster (the timing and the bookkeeping, with the paths stubbed: no GPU)."""

from __future__ import annotations

import time

import numpy as np
import pytest

import mkrt
from mkrt.controller import fusion
from mkrt.kernels import gemm_allreduce as gar
from mkrt.world import World


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def measured(monkeypatch):
    """An op on emulated 1x2 whose paths advance a fake clock by a set cost per call."""
    monkeypatch.setattr(World, "sm_count", lambda self, rank: 66)
    clock = _Clock()
    monkeypatch.setattr(time, "perf_counter", clock)
    world = mkrt.init(emulate="1x2")
    op = mkrt.GemmAllReduce(world, fuse="measure", b_layout="nk")
    cost = {"fused": 100e-6, "unfused": 130e-6}
    calls = []

    def path(name):
        def run(call, *args, **kwargs):
            if name == "fused":
                assert call.plan.fused, "the fused kernel runs from a fused plan"
            calls.append(name)
            clock.now += cost[name]
        return run

    monkeypatch.setattr(op, "_run", path("fused"))
    monkeypatch.setattr(op, "_unfused", path("unfused"))

    def settle(m, n=1024, k=512):
        p = op.plan_for(m, n, k, "bf16")
        call = gar._PreparedCall(p, np.dtype(np.float16), (m, k), (n, k), (m, n))
        calls.clear()
        op._settle_fusion(call, [None, None], [None, None], [None, None])
        return call, list(calls)

    yield op, cost, settle
    world.close()


def test_the_faster_path_is_kept_per_size_class(measured):
    op, cost, settle = measured
    call, calls = settle(1000)
    per_path = 1 + fusion.ROUNDS * fusion.CALLS
    assert calls.count("fused") == calls.count("unfused") == per_path
    assert call.settled and call.plan.fused and call.plan.reason.startswith("measured")
    assert op.measured.times[(1024, 1024, 512, "float16")] == pytest.approx((100.0, 130.0))
    # Another M of the same class (513 .. 1024): settled without timing anything.
    call, calls = settle(600)
    assert calls == [] and call.plan.fused and "size class" in call.plan.reason
    # A new class is measured again; now the unfused path is the faster.
    cost["fused"] = 200e-6
    call, calls = settle(1100)
    assert len(calls) == 2 * per_path and call.settled and not call.plan.fused


def test_a_shape_the_fused_kernel_cannot_run_is_not_timed(measured, monkeypatch):
    op, _, settle = measured
    op.b_layout = "kn"                       # B rows of 1001 elements: no TMA for them
    call, calls = settle(512, n=1001)
    assert calls == [] and call.settled and not call.plan.fused


def test_processes_settle_alike_on_the_slowest_figures(measured):
    op, _, settle = measured

    class _Comm:                              # another process measured the fused path slower
        def allgather(self, mine):
            return [mine, (150.0, 120.0)]

    op.world.comm = _Comm()
    call, _ = settle(2000)
    assert not call.plan.fused
    assert op.measured.times[(2048, 1024, 512, "float16")] == pytest.approx((150.0, 130.0))


def test_measure_is_an_accepted_option_and_others_are_not():
    world = mkrt.init(emulate="1x2")
    assert mkrt.GemmAllReduce(world, fuse="measure").fuse == "measure"
    # the default measures; "model" is the cost model's pick without timing
    assert mkrt.GemmAllReduce(world).fuse == "measure"
    assert mkrt.AllGatherGemm(world).fuse == "measure"
    assert mkrt.GemmAllReduce(world, fuse="model").fuse == "model"
    assert mkrt.GemmAllReduce(world, fuse=True).fuse is True
    with pytest.raises(TypeError, match="fuse"):
        mkrt.GemmAllReduce(world, fuse="Measure")


def test_capturing_a_shape_whose_buffers_must_be_remade_is_refused(monkeypatch):
    """A graph cannot record the sync and the flag reset a new buffer layout needs: the op
    says so before anything launches."""
    monkeypatch.setattr(World, "sm_count", lambda self, rank: 66)
    world = mkrt.init(emulate="1x2")
    op = mkrt.GemmAllReduce(world, b_layout="nk")
    p = op.plan_for(640, 512, 128, "bf16")
    op._layout_key = ("another layout",)
    monkeypatch.setattr(op, "capturing", lambda: True)
    with pytest.raises(ValueError, match="before capturing"):
        op._ensure_buffers(p)
    world.close()


def test_a_size_class_settled_fused_keeps_shapes_the_kernel_cannot_run_unfused(monkeypatch):
    """GemmReduceScatter on 2x2: 1024 rows (512 per node, whole tiles) settle fused; 1000
    rows, in the same size class, split a tile between the nodes and stay unfused."""
    monkeypatch.setattr(World, "sm_count", lambda self, rank: 33)
    clock = _Clock()
    monkeypatch.setattr(time, "perf_counter", clock)
    world = mkrt.init(emulate="2x2")
    op = mkrt.GemmReduceScatter(world, fuse="measure", b_layout="nk")

    def cost(seconds):
        def run(*args, **kwargs):
            clock.now += seconds
        return run
    monkeypatch.setattr(op, "_run", cost(1e-4))
    monkeypatch.setattr(op, "_unfused", cost(2e-4))
    plans = {}
    for m in (1024, 1000):
        p = op.plan_for(m, 1024, 512, "bf16")
        call = gar._PreparedCall(p, np.dtype(np.float16), (m, 512), (1024, 512),
                                 op.out_shape(m, 1024))
        op._settle_fusion(call, [None] * 4, [None] * 4, [None] * 4)
        assert call.settled
        plans[m] = call.plan
    assert plans[1024].fused and not plans[1000].fused
    assert len(op.measured.times) == 1
    world.close()


def test_allgather_gemm_settles_the_same_way(monkeypatch):
    """AllGatherGemm(fuse="measure") on emulated 2x2: both paths timed once per size class
    (its M is the gathered rows), the faster kept; the timed calls gather into the op's own
    buffer, not the caller's gathered_out."""
    monkeypatch.setattr(World, "sm_count", lambda self, rank: 33)
    clock = _Clock()
    monkeypatch.setattr(time, "perf_counter", clock)
    world = mkrt.init(emulate="2x2")
    op = mkrt.AllGatherGemm(world, fuse="measure", b_layout="nk")
    gathered = []

    def fused(call, *args):
        assert call.plan.fused
        clock.now += 3e-4

    def unfused(call, a_list, b_list, outs, gathered_out):
        gathered.append(gathered_out)
        clock.now += 2e-4
    monkeypatch.setattr(op, "_run", fused)
    monkeypatch.setattr(op, "_unfused", unfused)
    from mkrt.kernels import allgather_gemm as agg
    for rows in (256, 200):                  # 1024 and 800 gathered rows: one size class
        p = op.plan_for(rows * 4, 512, 256, "bf16")
        call = agg._PreparedCall(p, np.dtype(np.float16), (rows, 256), (512, 256), (rows * 4, 512))
        op._settle_fusion(call, [None] * 4, [None] * 4, [None] * 4)
        assert call.settled and not call.plan.fused and "measured" in call.plan.reason
    assert list(op.measured.times) == [(1024, 512, 256, "float16")]
    assert op.measured.times[(1024, 512, 256, "float16")] == pytest.approx((300.0, 200.0))
    assert gathered and all(g is None for g in gathered)
    world.close()
