"""MoE: the dispatch kernel's landing order and its forwarding between nodes (Python
mirrors) against the plan, the protocol's schedule (no wait cycle, no buffer reused before
its reader is done), argument checks, compile; GPU tests against the float64 reference
with uniform, skewed, hot-expert routing and ranks without tokens, on one node and on
several."""

from __future__ import annotations

import numpy as np
import pytest

from mkrt.arrays import bfloat16
from mkrt.kernels import moe as M
from mkrt.kernels import moe_plan as P
from mkrt.kernels.schedule import find_stall, unordered_accesses

BF = bfloat16


routing = M.random_routing


def test_kernel_compiles_without_spills():
    build = M.MoeSpec().build(check_spills=True)
    for name in M.MoeSpec.entry_points:
        assert build.resources[name].spills == 0, build.resources


@pytest.mark.parametrize("block_m", [64, 128])
def test_fused_kernel_spills_only_at_its_calls(block_m):
    """moe_fused passes with its stated allowance, and the same source with its two
    out-of-line calls made straight-line code has no spills at all: what spills is kept
    across those calls, not in the tile loops."""
    from mkrt.jit.compiler import compile_cuda
    spec = M.fused_spec_for(block_m)
    build = spec.build(check_spills=True)
    assert 0 < build.resources["moe_fused"].spills <= spec.spill_allowance["moe_fused"]
    for name in ("moe_dispatch", "moe_combine", "moe_swiglu"):
        assert build.resources[name].spills == 0
    source = spec.render()
    calls = [source.index("        route(a, Context{"), source.index("    if (!rows_are_in(")]
    ends = [source.index("route_ctas);\n", calls[0]) + len("route_ctas);\n"),
            source.index("\n", calls[1]) + 1]
    straight = (source[:calls[0]] + "        if (threadIdx.x == 0) expert_words[5] = 1;\n"
                + source[ends[0]:calls[1]] + source[ends[1]:])
    resources = compile_cuda(spec.uri + "_no_calls", straight, options=spec.options()).resources
    assert resources["moe_fused"].spills == 0, resources["moe_fused"]


def test_fused_spec_and_route_ctas():
    assert M.fused_route_ctas(132, 16) == 16 and M.fused_route_ctas(33, 16) == 4
    assert M.fused_route_ctas(2, 16) == 1
    with pytest.raises(ValueError, match="block_n"):
        M.MoeFusedSpec("bf16", "nk", 128, 192, 4)
    with pytest.raises(ValueError, match="fused kernel's own shared memory"):
        M.MoeFusedSpec("bf16", "nk", 64, 128, 9)
    assert M.fused_spec_for(128).uri.startswith("moe_fused_bf16_nk_bm128_bn256_s")


@pytest.mark.parametrize("W,experts,k,kind", [(2, 4, 2, "uniform"), (4, 16, 4, "zipf"),
                                              (3, 12, 8, "uniform"), (4, 8, 2, "hot")])
def test_landing_order_is_the_plans(W, experts, k, kind):
    rng = np.random.default_rng(W * experts)
    ids = [routing(rng, t, k, experts, kind) for t in ([0] + [37] * (W - 1))]
    plan = P.plan(ids, experts=experts, nodes=1, ranks_per_node=W)
    assert plan.check(ids) == []
    received = M.landing(ids, experts)
    for rank, arrival in enumerate(plan.arrivals):
        want = [(int(s), int(t) * k + int(j))
                for s, t, j in zip(arrival.sources, arrival.tokens, arrival.slots)]
        assert received[rank] == want


WORLDS = [(2, 1), (2, 2), (3, 1), (2, 3), (4, 2), (3, 2)]


@pytest.mark.parametrize("nodes,G", WORLDS, ids=lambda v: str(v))
@pytest.mark.parametrize("k,kind", [(2, "uniform"), (8, "zipf"), (4, "hot")])
def test_forwarding_lands_every_row_where_the_plan_does(nodes, G, k, kind):
    """Across nodes, rows placed by their source (own node) and by the forwarding ranks
    (rows that crossed) fill each holder's rows exactly as the plan orders them, and the
    tokens each rank packs for a node are the plan's crossings, in token order."""
    W = nodes * G
    experts = W * max(2, -(-k // G))
    rng = np.random.default_rng(nodes * 100 + G * 10 + k)
    tokens = [0] + [int(rng.integers(1, 40)) for _ in range(W - 1)]
    ids = [routing(rng, t, k, experts, kind) for t in tokens]
    plan = P.plan(ids, experts=experts, nodes=nodes, ranks_per_node=G)
    assert plan.check(ids) == []
    sent, written = M.forwarding(ids, experts, nodes, G)
    landing = M.landing(ids, experts)
    for h in range(W):
        assert sorted(written[h]) == list(range(len(landing[h])))
        assert [written[h][row] for row in range(len(landing[h]))] == landing[h]
    crossings = sorted(plan.crossings)
    assert sorted((s, t, m) for (s, m), ts in sent.items() for t in ts) == crossings
    for ts in sent.values():
        assert ts == sorted(ts)


def test_flag_words_are_distinct():
    for W, N in [(2, 1), (4, 2), (6, 3), (16, 4)]:
        L = M.MoeFlags(W, N)
        words = ([f(s) for f in (L.arrive, L.counts_ready, L.rows_ready, L.back_ready,
                                 L.results_ready) for s in range(W)]
                 + [f(n) for f in (L.landed, L.weights_landed, L.partial_landed) for n in range(N)]
                 + [L.slots_ready()] + [L.slots_ready() + 1 + i for i in range(3 + N)]
                 + [L.launch_words(kernel) + i for kernel in (0, 1) for i in range(3)])
        assert sorted(words) == list(range(L.words))
    text = M.MOE.text
    for field in ("results_ready(int s) const { return 4 * W + s; }",
                  "slots_ready() const { return 5 * W + 3 * N; }",
                  "launch_words(int kernel) const { return slots_ready() + 4 + N + 3 * kernel; }"):
        assert field in text


@pytest.mark.parametrize("nodes,G", [(1, 2), (1, 4), (2, 1), (2, 2), (2, 3), (3, 2), (4, 2)],
                         ids=lambda v: str(v))
def test_protocol_has_no_wait_cycle_and_no_early_reuse(nodes, G):
    s = P.schedule(nodes, G, epochs=3)
    assert find_stall(s.workers, s.depends_on) == []
    problems, checked = unordered_accesses(s.workers, s.depends_on, s.reads, s.writes)
    assert problems == [] and checked > 0


def test_protocol_checks_catch_a_missing_wait():
    """Sending counts before every rank began the call would overwrite a row that a rank
    of the other node still reads for its previous call's forwarding; summing before the
    weights land reads stale weights."""
    s = P.schedule(2, 2, epochs=2)
    s.depends_on[("wait_arrive", 0, 2)] = []
    problems, _ = unordered_accesses(s.workers, s.depends_on, s.reads, s.writes)
    assert any("('counts', 3, 0)" in p for p in problems), problems
    s = P.schedule(2, 2, epochs=2)
    s.depends_on[("sums", 2, 0, 1)] = [("results_ready", p, 1) for p in (2, 3)]
    problems, _ = unordered_accesses(s.workers, s.depends_on, s.reads, s.writes)
    assert any("('weights_in', 2, 0)" in p for p in problems), problems


SHAPES = dict(x=((10, 64), BF), ids=((10, 2), np.int32), weights=((10, 2), np.float32),
              w1=((2, 64, 64), BF), w2=((2, 64, 32), BF))


@pytest.mark.parametrize("change,match", [
    (dict(x=((10, 64), np.float16)), "bf16"), (dict(ids=((10, 2), np.int64)), "int32"),
    (dict(weights=((10, 2), np.float16)), "float32"), (dict(ids=((9, 2), np.int32)), r"\[T, k\]"),
    (dict(ids=((10, 9), np.int32), weights=((10, 9), np.float32)), "1 to 8"),
    (dict(w1=((3, 64, 64), BF)), "hold 3 and 2 experts"), (dict(w2=((2, 64, 40), BF)), "expected w1"),
    (dict(x=((10, 60), BF), w1=((2, 64, 60), BF), w2=((2, 60, 32), BF)), "multiples of 8"),
])
def test_bad_operands_are_refused(change, match):
    args = {**SHAPES, **change}
    with pytest.raises((TypeError, ValueError), match=match):
        M.check_operands(args["x"], args["ids"], args["weights"], args["w1"], args["w2"],
                         experts_per_rank=2)


def test_op_checks_its_world_and_options():
    import mkrt
    world = mkrt.init(emulate="2x2", gpus=0)
    try:
        op = M.MoE(world, experts=8, capacity=16)
        assert op.layout == M.MoeFlags(4, 2) and op.experts_per_rank == 2
    finally:
        world.close()
    world = mkrt.init(emulate="1x3", gpus=0)
    try:
        with pytest.raises(ValueError, match="do not split"):
            M.MoE(world, experts=8, capacity=16)
        with pytest.raises(ValueError, match="capacity"):
            M.MoE(world, experts=6, capacity=0)
        op = M.MoE(world, experts=6, capacity=16)
        assert op.experts_per_rank == 2 and op.receive_rows == 2 * 16 * 8
        # no attribute of the op base class hides a method the call path uses
        for name in ("_routing_buffers", "_expert_buffers", "_ensure_buffers", "_run", "_args",
                     "per_rank", "dispatch", "combine"):
            assert callable(getattr(op, name)), name
        assert M.MoE(world, experts=6, capacity=1 << 24).receive_rows == 1 << 26
        assert M.MoE(world, experts=6, capacity=16, fused_experts=True).fused_experts
        assert M.MoE(world, experts=6, capacity=16, fused_experts=True, route_ctas=8).route_ctas == 8
        with pytest.raises(ValueError, match="route_ctas"):
            M.MoE(world, experts=6, capacity=16, route_ctas=0)
        with pytest.raises((TypeError, ValueError), match="fused_experts"):
            M.MoE(world, experts=6, capacity=16, fused_experts="yes")
    finally:
        world.close()


# ---- GPU ------------------------------------------------------------------------------

def _problem(cupy, world, tokens, k, H, I, experts, kind, seed):
    return M.random_problem(world.size, tokens, k, H, I, experts, kind, seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("case", M.test_cases(), ids=lambda c: f"{c[0]}-{c[6]}-k{c[2]}")
def test_matches_the_float64_reference(make_world, case):
    import cupy

    import mkrt
    from mkrt.kernels.gemm import to_float32
    layout, tokens, k, H, I, experts, kind = case
    world = make_world(layout)
    dev, expected = _problem(cupy, world, tokens, k, H, I, experts, kind, seed=sum(tokens))
    op = mkrt.MoE(world, experts=experts, capacity=max(tokens) or 1, timeout_ms=10000)
    ys = op(dev["x"], dev["ids"], dev["weights"], dev["w1"], dev["w2"])
    world.synchronize()
    for y, want in zip(ys, expected):
        assert y.shape == want.shape
        if want.size:
            error = np.abs(to_float32(y).get() - want).max() / max(np.abs(want).max(), 1e-6)
            assert error < 2e-2, error
    again = op(dev["x"], dev["ids"], dev["weights"], dev["w1"], dev["w2"])
    world.synchronize()
    for first, second in zip(ys, again):
        assert bool((first.view(cupy.uint16) == second.view(cupy.uint16)).all())


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in M.test_cases() if c[0] in ("1x2", "1x4", "2x2")][:5],
                         ids=lambda c: f"{c[0]}-{c[6]}-k{c[2]}")
def test_fused_experts_match_the_reference_and_the_separate_launches(make_world, case):
    """fused_experts=True (one launch of both GEMMs and SwiGLU) against the float64
    reference, bit-identical over calls, and close to the three launches (they round the
    w1 product to bf16 before SwiGLU; the fused path does not)."""
    import cupy

    import mkrt
    from mkrt.kernels.gemm import to_float32
    layout, tokens, k, H, I, experts, kind = case
    world = make_world(layout)
    dev, expected = _problem(cupy, world, tokens, k, H, I, experts, kind, seed=sum(tokens) + 1)
    ops = [mkrt.MoE(world, experts=experts, capacity=max(tokens) or 1, timeout_ms=10000,
                    fused_experts=fused) for fused in (True, False)]
    fused, separate = (op(dev["x"], dev["ids"], dev["weights"], dev["w1"], dev["w2"]) for op in ops)
    world.synchronize()
    for y, y_separate, want in zip(fused, separate, expected):
        assert y.shape == want.shape
        if want.size:
            scale = max(np.abs(want).max(), 1e-6)
            assert np.abs(to_float32(y).get() - want).max() / scale < 2e-2
            assert np.abs(to_float32(y).get() - to_float32(y_separate).get()).max() / scale < 2e-2
    for _ in range(3):
        again = ops[0](dev["x"], dev["ids"], dev["weights"], dev["w1"], dev["w2"])
    world.synchronize()
    for first, second in zip(fused, again):
        assert bool((first.view(cupy.uint16) == second.view(cupy.uint16)).all())


@pytest.mark.gpu
def test_over_capacity_and_bad_ids_raise(make_world):
    import cupy

    import mkrt
    world = make_world("1x2")
    dev, _ = _problem(cupy, world, [64, 64], 2, 128, 64, 4, "hot", seed=1)
    with pytest.raises(ValueError, match="topk_ids"):
        bad = [ids.copy() for ids in dev["ids"]]
        bad[1][0, 0] = 9
        mkrt.MoE(world, experts=4, capacity=64)(dev["x"], bad, dev["weights"], dev["w1"], dev["w2"])
    with pytest.raises(ValueError, match="capacity"):
        mkrt.MoE(world, experts=4, capacity=32)(dev["x"], dev["ids"], dev["weights"], dev["w1"], dev["w2"])
    small = mkrt.MoE(world, experts=4, capacity=64, receive_rows=40, timeout_ms=2000)
    with pytest.raises(mkrt.CommTimeout, match="receive capacity"):
        small(dev["x"], dev["ids"], dev["weights"], dev["w1"], dev["w2"])
        world.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("layout", ["1x2", "2x2"])
def test_a_muted_rank_ends_in_comm_timeout(make_world, layout, fused):
    """A rank that never sends its counts: the call ends in CommTimeout within its bound
    (no hang), naming a rank that waited; a new op on the world then runs right."""
    import time

    import cupy

    import mkrt
    from mkrt.kernels.gemm import to_float32
    world = make_world(layout)
    tokens = [32] * world.size
    dev, expected = _problem(cupy, world, tokens, 2, 128, 64, 2 * world.size, "uniform", seed=9)
    muted = mkrt.MoE(world, experts=2 * world.size, capacity=32, timeout_ms=500,
                     muted_rank=world.size - 1, fused_experts=fused)
    start = time.perf_counter()
    with pytest.raises(mkrt.CommTimeout):
        muted(dev["x"], dev["ids"], dev["weights"], dev["w1"], dev["w2"])
        world.synchronize()
    assert time.perf_counter() - start < 20
    op = mkrt.MoE(world, experts=2 * world.size, capacity=32, timeout_ms=10000, fused_experts=fused)
    ys = op(dev["x"], dev["ids"], dev["weights"], dev["w1"], dev["w2"])
    world.synchronize()
    for y, want in zip(ys, expected):
        assert np.abs(to_float32(y).get() - want).max() / np.abs(want).max() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("layout", ["1x4", "2x2"])
def test_fused_calls_and_dispatch_combine_alone_keep_one_epoch(make_world, layout, fused):
    """An op with the whole call in one launch (or five, fused=False), then dispatch() and
    combine() alone (their own launches), then the call again: each right (the launches
    share epochs)."""
    import cupy

    import mkrt
    from mkrt.kernels.gemm import to_float32
    world = make_world(layout)
    tokens, k, H, I, experts = [40, 0, 77, 13], 2, 128, 64, 8
    dev, expected = _problem(cupy, world, tokens, k, H, I, experts, "zipf", seed=6)
    op = mkrt.MoE(world, experts=experts, capacity=80, timeout_ms=10000, fused_experts=fused)

    def check(ys):
        for y, want in zip(ys, expected):
            if want.size:
                assert np.abs(to_float32(y).get() - want).max() / np.abs(want).max() < 2e-2
    check(op(dev["x"], dev["ids"], dev["weights"], dev["w1"], dev["w2"]))
    world.synchronize()
    dispatched = op.dispatch(dev["x"], dev["ids"])
    world.synchronize()
    results = [cupy.zeros((op.receive_rows, H), dtype=BF) for _ in dispatched]
    op.combine(results, dev["weights"])            # zeros: only the epochs matter here
    world.synchronize()
    for _ in range(3):
        ys = op(dev["x"], dev["ids"], dev["weights"], dev["w1"], dev["w2"])
    world.synchronize()
    check(ys)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["1x4", "2x2"])
def test_dispatch_and_combine_alone(make_world, layout):
    """Rows land where the plan says (across nodes too: forwarded by the node's rank with
    the source's local index); experts run outside mkrt; combine gives the MoE."""
    import cupy

    import mkrt
    from mkrt.kernels.gemm import from_float32, to_float32
    world = make_world(layout)
    tokens, k, H, I, experts = [40, 0, 77, 13], 2, 128, 64, 8
    dev, expected = _problem(cupy, world, tokens, k, H, I, experts, "zipf", seed=5)
    op = mkrt.MoE(world, experts=experts, capacity=80, timeout_ms=10000)
    dispatched = op.dispatch(dev["x"], dev["ids"])
    world.synchronize()
    # the dispatch waits for its combine: another call now is refused before launching
    with pytest.raises(ValueError, match="awaits its combine"):
        op.dispatch(dev["x"], dev["ids"])
    with pytest.raises(ValueError, match="awaits its combine"):
        op(dev["x"], dev["ids"], dev["weights"], dev["w1"], dev["w2"])
    landing = M.landing([i.get() for i in dev["ids"]], experts)
    results = []
    for rank, (received, offsets, sources) in enumerate(dispatched):
        rows = int(offsets[-1].get())
        assert rows == len(landing[rank])
        assert [tuple(r) for r in sources[:rows].get().tolist()] == [tuple(x) for x in landing[rank]]
        for row, (source, entry) in enumerate(landing[rank][:5]):
            want = dev["x"][source][entry // k]
            assert bool((received[row].view(cupy.uint16) == want.view(cupy.uint16)).all())
        # the experts, outside mkrt (float32), rows in place
        out = cupy.zeros((op.receive_rows, H), dtype=cupy.float32)
        bounds = offsets.get()
        for j in range(op.experts_per_rank):
            a, b = int(bounds[j]), int(bounds[j + 1])
            if b > a:
                g = to_float32(received[a:b]) @ to_float32(dev["w1"][rank][j]).T
                act = g[:, :I] / (1 + cupy.exp(-g[:, :I])) * g[:, I:]
                out[a:b] = act @ to_float32(dev["w2"][rank][j]).T
        results.append(from_float32(out, BF))
    with pytest.raises(ValueError, match="tokens per rank"):
        op.combine(results, [w[:1] for w in dev["weights"]])
    ys = op.combine(results, dev["weights"])
    world.synchronize()
    with pytest.raises(ValueError, match="needs a dispatch"):
        op.combine(results, dev["weights"])
    for y, want in zip(ys, expected):
        if want.size:
            assert np.abs(to_float32(y).get() - want).max() / np.abs(want).max() < 2e-2
