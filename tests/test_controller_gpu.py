"""The role board and its controller on the GPU (mkrt/kernels/device/roles.py), through
gemm_allreduce: CTAs that change role mid-launch lose no tile and reduce none twice,
results stay bit-identical to a static split, graph replays continue from what the
controller learned, a static board never moves, and the trace says what happened."""

from __future__ import annotations

import numpy as np
import pytest

from graph_checks import assert_same_bits, capture
from mkrt.kernels import gemm_allreduce as gar

pytestmark = pytest.mark.gpu     # every op below has a bounded wait (timeout_ms)


def rank_encoded(world, m, n, k):
    """f16 operands of small integers that depend on the rank: every partial and every
    sum is an exact integer (< 2048), so a tile lost, reduced twice or taken from the
    wrong rank shows as a wrong integer, not as rounding."""
    import cupy
    a_list, b_list = [], []
    rows = cupy.arange(m)[:, None]
    cols = cupy.arange(n)[None, :]
    ks = cupy.arange(k)
    for info in world.local:
        r = info.rank
        with cupy.cuda.Device(info.device):
            a_list.append(((rows + 2 * ks[None, :] + r) % 3).astype(np.float16))
            b_list.append(((cols.T + ks[None, :] * (r + 1)) % 2).astype(np.float16))   # [N, K]
    return a_list, b_list


def exact_sum(a_list, b_list):
    import cupy
    total = None
    for a, b in zip(a_list, b_list):
        part = cupy.asarray(a, dtype=cupy.float64) @ cupy.asarray(b, dtype=cupy.float64).T
        total = part if total is None else total + part
    return total


@pytest.mark.parametrize("layout", ["1x2", "2x2", "1x3"])
def test_role_changes_mid_launch_lose_no_tile(make_world, layout):
    """Started with one reduce CTA, the controller moves compute CTAs to the reduce queue
    during each launch and every CTA joins it at the end; 20 calls, each exact."""
    import cupy
    from mkrt.kernels.gemm import poison
    world = make_world(layout)
    m, n, k = 2048, 2304, 64
    a_list, b_list = rank_encoded(world, m, n, k)
    want = exact_sum(a_list, b_list)
    assert float(want.max()) < 2048            # exact in f16
    op = gar.GemmAllReduce(world, b_layout="nk", fuse=True, reduce_ctas=1, timeout_ms=20000)
    outs = [cupy.empty((m, n), np.float16) for _ in world.local]
    switches = 0
    for call in range(20):
        for out in outs:
            poison(out)
        op(a_list, b_list, out=outs)
        world.synchronize()
        for info, out in zip(world.local, outs):
            wrong = int(cupy.count_nonzero(out.astype(cupy.float64) != want))
            assert wrong == 0, f"call {call}, rank {info.rank}: {wrong} wrong outputs"
        switches += sum(s["last_switches"] for s in op.controller_state())
    states = op.controller_state()
    assert all(s["launches"] == 20 for s in states)
    assert all(1 <= s["learned"] <= s["ctas"] - 1 for s in states)
    # CTAs did change roles (at least those that joined the reduce queue at the end)
    assert switches > 0
    op.close()


@pytest.mark.parametrize("layout", ["1x2", "2x2"])
def test_adaptive_equals_static_bit_for_bit_eager_and_in_graphs(make_world, layout):
    """Which CTA computes or reduces a tile never changes its bits; a captured graph's
    replays go on from the board the eager calls left (launches counted on the GPU)."""
    import cupy
    from test_gemm_allreduce_gpu import operands
    world = make_world(layout)
    a_list, b_list = operands(world, 1536, 1280, 512, "nk", "bf16", seed=5)
    static = gar.GemmAllReduce(world, b_layout="nk", fuse=True, timeout_ms=20000, roles="static")
    adaptive = gar.GemmAllReduce(world, b_layout="nk", fuse=True, timeout_ms=20000)
    want = [o.copy() for o in static(a_list, b_list)]
    outs = [cupy.empty_like(w) for w in want]
    for _ in range(30):
        adaptive(a_list, b_list, out=outs)
    world.synchronize()
    assert_same_bits(outs, want)
    graph, stream = capture(lambda: adaptive(a_list, b_list, out=outs))
    for out in outs:
        out.fill(0)
    for _ in range(10):
        graph.launch(stream)
    stream.synchronize()
    world.synchronize()
    assert all(s["launches"] == 40 for s in adaptive.controller_state())
    assert_same_bits(outs, want)
    # the static board never moved a CTA
    for s in static.controller_state():
        assert s["last_switches"] == 0 and s["last_steps"] == 0 and s["static"]
        assert s["learned"] == static.last_plan.reduce_ctas
    static.close()
    adaptive.close()


def test_trace_records_every_role_change(make_world):
    """trace=True: each CTA's events start with its first role and end with 'done'; the
    CTAs that changed role are those the board counted; control steps were recorded and
    their targets kept a CTA in each role while compute tiles were left."""
    import cupy
    from test_gemm_allreduce_gpu import operands
    world = make_world("1x2")
    a_list, b_list = operands(world, 4096, 4096, 256, "nk", "bf16", seed=2)
    op = gar.GemmAllReduce(world, b_layout="nk", fuse=True, reduce_ctas=1, trace=True,
                           timeout_ms=20000)
    op(a_list, b_list)
    world.synchronize()
    op.role_trace(clear=True)                 # the first launch: compile time and all
    outs = op(a_list, b_list)
    traces = op.role_trace()
    states = op.controller_state()
    assert len(traces) == len(world.local)
    for trace, state in zip(traces, states):
        ctas = trace["ctas"]
        assert len(ctas) == state["ctas"]
        changed = 0
        for events in ctas:
            roles = [role for _, role in events]
            assert roles[0] in ("compute", "comm") and roles[-1] == "done", roles
            times = [t for t, _ in events]
            assert times == sorted(times)
            changed += roles[:2] == ["compute", "comm"]
        assert changed == state["last_switches"]
        for step in trace["steps"]:
            if step["compute_left"] > 0:
                assert 1 <= step["target"] <= state["ctas"] - 1
    expected = gar.reference(a_list, b_list, b_layout="nk")
    from mkrt.kernels.gemm import to_float32
    for out in outs:
        error = float(cupy.linalg.norm(to_float32(out).astype(cupy.float64) - expected)
                      / cupy.linalg.norm(expected))
        assert error < 1e-2
    op.close()


def test_search_mode_measures_launches_and_loses_no_tile(make_world):
    """roles="search": four launches under the rate rule, then a search by launch time (no
    moves within a launch); 40 calls, each exact; the board says it is searching (or has
    settled) on a split that keeps a CTA in each role."""
    import cupy
    world = make_world("1x2")
    m, n, k = 2048, 2304, 64
    a_list, b_list = rank_encoded(world, m, n, k)
    want = exact_sum(a_list, b_list)
    op = gar.GemmAllReduce(world, b_layout="nk", fuse=True, roles="search", timeout_ms=20000)
    outs = [cupy.empty((m, n), np.float16) for _ in world.local]
    for call in range(40):
        op(a_list, b_list, out=outs)
        world.synchronize()
        for info, out in zip(world.local, outs):
            assert int(cupy.count_nonzero(out.astype(cupy.float64) != want)) == 0, (call, info.rank)
    for state in op.controller_state():
        assert state["launches"] == 40 and state["search"] == 1 and state["searching"] == 1
        assert 1 <= state["learned"] <= state["ctas"] - 1
        assert 1 <= state["s_best"] <= state["ctas"] - 1 and state["s_best_ns"] > 0
        assert state["last_ns"] > 0
    op.close()


def test_allgather_gemm_search_keeps_every_result_bit_identical(make_world):
    """AllGather+GEMM with roles="search": the split between the gathering and compute CTAs
    changes between launches; the product never does (30 calls against the static op)."""
    import cupy
    from test_gemm_allreduce_gpu import operands
    import mkrt
    world = make_world("2x2")
    m_rows, n, k = 384, 768, 512
    a_list, b_list = operands(world, m_rows, n, k, "kn", "bf16", seed=9)
    static = mkrt.AllGatherGemm(world, fuse=True, timeout_ms=20000)
    searching = mkrt.AllGatherGemm(world, fuse=True, timeout_ms=20000, roles="search")
    want = [o.copy() for o in static(a_list, b_list)]
    outs = [cupy.empty_like(w) for w in want]
    splits = set()
    for _ in range(30):
        searching(a_list, b_list, out=outs)
        world.synchronize()
        for out, w in zip(outs, want):
            assert cupy.array_equal(out.view(cupy.uint16), w.view(cupy.uint16))
        splits.update(s["learned"] for s in searching.controller_state())
    states = searching.controller_state()
    assert len(states) == len(world.local) and static.controller_state() == []
    for state in states:
        assert state["launches"] == 30 and state["searching"] == 1
        assert 1 <= state["learned"] <= state["ctas"] - 1
    assert len(splits) > 1                       # the search tried more than one split
    static.close()
    searching.close()


def test_ring_attention_search_keeps_every_result_bit_identical(make_world):
    """Ring attention with roles="search": the gather/compute split moves between launches;
    O and LSE never change (20 calls against the static op, 1x2 causal)."""
    import cupy
    import mkrt
    from mkrt.arrays import bfloat16
    world = make_world("1x2")
    rng = cupy.random.default_rng(3)
    q, k, v = ([rng.standard_normal((1, 1024, 8, 128), dtype=np.float32).astype(bfloat16)
                for _ in world.local] for _ in range(3))
    static = mkrt.RingAttention(world, timeout_ms=20000)
    searching = mkrt.RingAttention(world, timeout_ms=20000, roles="search")
    outs, lses = static(q, k, v, causal=True)
    want = [(o.copy(), l.copy()) for o, l in zip(outs, lses)]
    for _ in range(20):
        outs, lses = searching(q, k, v, causal=True)
        world.synchronize()
        for o, l, (wo, wl) in zip(outs, lses, want):
            assert cupy.array_equal(o.view(cupy.uint16), wo.view(cupy.uint16))
            assert cupy.array_equal(l, wl)
    for state in searching.controller_state():
        assert state["launches"] == 20 and state["searching"] == 1
        assert 1 <= state["learned"] <= state["ctas"] - 1
    static.close()
    searching.close()
