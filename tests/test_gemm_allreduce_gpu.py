"""GEMM+AllReduce on emulated worlds on one GPU: against a float64 reference, repeated
calls, CUDA graphs, the unfused baseline, input checks, a silent rank."""

from __future__ import annotations

import time

import numpy as np
import pytest

from graph_checks import assert_same_bits, capture
from mkrt.kernels import gemm_allreduce as gar

pytestmark = pytest.mark.gpu

# bf16 output rounding (2^-9 relative) plus bf16 partials summed once per node: the
# relative Frobenius error stays well under this bound (typically 3e-3).
REL_ERROR_BOUND = 1e-2


def operands(world, m, n, k, b_layout, dtype, seed=0):
    import cupy
    from mkrt.arrays import bfloat16
    np_dtype = bfloat16 if dtype == "bf16" else np.float16
    rng = cupy.random.default_rng(seed)
    a_list, b_list = [], []
    for info in world.local:
        with cupy.cuda.Device(info.device):
            a_list.append(rng.standard_normal((m, k), dtype=np.float32).astype(np_dtype))
            shape = (k, n) if b_layout == "kn" else (n, k)
            b_list.append((rng.standard_normal(shape, dtype=np.float32) / 4).astype(np_dtype))
    return a_list, b_list


def relative_error(result, expected):
    import cupy
    from mkrt.kernels.gemm import to_float32
    diff = to_float32(result).astype(cupy.float64) - expected
    return float(cupy.linalg.norm(diff) / cupy.linalg.norm(expected))


@pytest.mark.parametrize("case", gar.test_cases(), ids=lambda c: "-".join(map(str, c)))
def test_fused_matches_float64_reference(make_world, case):
    import cupy
    from mkrt.kernels.gemm import poison
    layout, m, n, k, b_layout, dtype = case
    world = make_world(layout)
    op = gar.GemmAllReduce(world, b_layout=b_layout, fuse=True, timeout_ms=10000)
    a_list, b_list = operands(world, m, n, k, b_layout, dtype, seed=hash(case) % 1000)
    outs = [poison(cupy.empty((m, n), a_list[0].dtype)) for _ in world.local]
    op(a_list, b_list, out=outs)
    world.synchronize()
    expected = gar.reference(a_list, b_list, b_layout=b_layout)
    for info, out in zip(world.local, outs):
        error = relative_error(out, expected)
        assert error < REL_ERROR_BOUND, f"rank {info.rank}: relative error {error:.2e}"
    # Every rank holds the same bits.
    for out in outs[1:]:
        assert cupy.array_equal(out.view(cupy.uint16), outs[0].view(cupy.uint16))
    op.close()


@pytest.mark.parametrize("layout", ["1x2", "2x2"])
def test_unfused_baseline_matches_reference(make_world, layout):
    world = make_world(layout)
    op = gar.GemmAllReduce(world, b_layout="nk", timeout_ms=10000)
    a_list, b_list = operands(world, 512, 512, 128, "nk", "bf16", seed=5)
    outs = op.unfused(a_list, b_list)
    world.synchronize()
    expected = gar.reference(a_list, b_list, b_layout="nk")
    for out in outs:
        assert relative_error(out, expected) < REL_ERROR_BOUND
    op.close()


@pytest.mark.parametrize("layout", ["1x2", "2x2"])
def test_hundred_calls_without_sync_are_identical(make_world, layout):
    import cupy
    world = make_world(layout)
    op = gar.GemmAllReduce(world, fuse=True, timeout_ms=10000)
    a_list, b_list = operands(world, 512, 768, 64, "kn", "bf16", seed=7)
    results = [op(a_list, b_list) for _ in range(100)]
    world.synchronize()
    expected = gar.reference(a_list, b_list)
    assert relative_error(results[0][0], expected) < REL_ERROR_BOUND
    for call in results[1:]:
        for first, again in zip(results[0], call):
            assert cupy.array_equal(first.view(cupy.uint16), again.view(cupy.uint16))
    op.close()


def test_graph_capture_and_replay(make_world):
    import cupy
    world = make_world("1x2")
    op = gar.GemmAllReduce(world, fuse=True, timeout_ms=10000)
    a_list, b_list = operands(world, 384, 512, 64, "kn", "bf16", seed=11)
    outs = [cupy.empty((384, 512), a_list[0].dtype) for _ in world.local]
    op(a_list, b_list, out=outs)
    world.synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        op(a_list, b_list, out=outs)
        graph = stream.end_capture()
    for replay in range(5):
        with stream:                     # new inputs and poisoned outputs, in stream order
            fresh_a, _ = operands(world, 384, 512, 64, "kn", "bf16", seed=100 + replay)
            for a, new in zip(a_list, fresh_a):
                a[...] = new
            for out in outs:
                out.fill(0)
        graph.launch(stream)
        stream.synchronize()
        world.synchronize()
        expected = gar.reference(a_list, b_list)
        for out in outs:
            assert relative_error(out, expected) < REL_ERROR_BOUND, f"replay {replay}"
    op.close()


def test_world_of_one_is_the_plain_gemm(make_world):
    import cupy
    import mkrt
    world = make_world("1x1")
    op = gar.GemmAllReduce(world, timeout_ms=10000)
    a_list, b_list = operands(world, 1000, 1024, 256, "kn", "bf16", seed=3)
    out = op(a_list[0], b_list[0])
    plain = mkrt.gemm(a_list[0], b_list[0])
    world.synchronize()
    assert cupy.array_equal(out.view(cupy.uint16), plain.view(cupy.uint16))


def test_bad_inputs_raise_before_launch(make_world):
    import cupy
    world = make_world("1x2")
    op = gar.GemmAllReduce(world, timeout_ms=2000)
    a_list, b_list = operands(world, 256, 256, 64, "kn", "bf16")
    with pytest.raises(ValueError, match="differs between ranks"):
        op([a_list[0], a_list[1][:, :56].copy()], [b_list[0], b_list[1][:56].copy()])
    with pytest.raises(ValueError, match="disagree on K"):
        op(a_list, [b[:32].copy() for b in b_list])
    with pytest.raises(TypeError, match="f32"):
        op([a.astype(np.float32) for a in a_list], b_list)
    with pytest.raises(ValueError, match="holds 2 ranks"):
        op(a_list[0], b_list[0])
    with pytest.raises(ValueError, match="out"):
        op(a_list, b_list, out=[cupy.empty((256, 255), a_list[0].dtype)] * 2)
    with pytest.raises(ValueError, match="C-contiguous"):
        op([a.T.copy().T for a in a_list], b_list)
    out = op(a_list, b_list)          # nothing launched above: the op still works
    world.synchronize()
    assert relative_error(out[0], gar.reference(a_list, b_list)) < REL_ERROR_BOUND


@pytest.mark.parametrize("layout,muted", [("1x2", 1), ("2x2", 3)])
def test_a_rank_that_never_signals_raises_comm_timeout(make_world, layout, muted):
    import mkrt
    world = make_world(layout)
    timeout_ms = 300
    op = gar.GemmAllReduce(world, fuse=True, timeout_ms=timeout_ms, muted_rank=muted)
    a_list, b_list = operands(world, 256, 512, 64, "kn", "bf16")
    start = time.perf_counter()
    op(a_list, b_list)
    with pytest.raises(mkrt.CommTimeout) as info:
        world.synchronize()
    assert time.perf_counter() - start < timeout_ms / 1e3 + 10
    record = info.value.record
    assert record.kernel == "gemm_allreduce" and record.expected == 1
    p = op.last_plan
    layout_words = p.flags
    # The waiter names what it waited for: the muted rank's arrival or one of its partials.
    muted_local = world.ranks[muted].local_rank
    named = {layout_words.arrive(muted_local)} | {layout_words.partial(muted_local, j)
                                                 for j in range(p.slots)}
    if world.nodes > 1:
        named |= {layout_words.node_arrive(world.ranks[muted].node)}
        named |= {layout_words.inter(world.ranks[muted].node, j) for j in range(p.slots)}
        named |= {layout_words.final_tile(t) for t in range(p.tiles)}
    assert record.flag in named, (record, sorted(named)[:8])
    with pytest.raises(mkrt.MkrtError, match="failed earlier"):
        op(a_list, b_list)


def test_unfused_nccl_is_refused_where_it_cannot_run(make_world):
    world = make_world("1x2")
    op = gar.GemmAllReduce(world, timeout_ms=5000)
    a_list, b_list = operands(world, 256, 256, 64, "kn", "bf16")
    with pytest.raises(ValueError, match="torch.distributed"):
        op.unfused(a_list, b_list, allreduce="nccl")      # emulated: no NCCL between ranks
    with pytest.raises(ValueError, match="allreduce='bogus'"):
        op.unfused(a_list, b_list, allreduce="bogus")
    out = op.unfused(a_list, b_list)                       # auto: mkrt's all-reduce
    world.synchronize()
    assert relative_error(out[0], gar.reference(a_list, b_list)) < REL_ERROR_BOUND


def test_shapes_that_come_back_after_the_buffers_were_remade(make_world):
    """A -> B -> A with different tile layouts: A's prepared launches must not keep
    pointers into buffers that B's call replaced (the layout key alone comes back)."""
    import cupy
    from mkrt.kernels.gemm import poison
    world = make_world("1x2")
    op = gar.GemmAllReduce(world, b_layout="nk", fuse=True, timeout_ms=10000)
    for step, (m, n, k) in enumerate([(512, 768, 128), (1024, 1024, 64), (512, 768, 128),
                                      (1024, 1024, 64)]):
        a_list, b_list = operands(world, m, n, k, "nk", "bf16", seed=step)
        outs = [poison(cupy.empty((m, n), a_list[0].dtype)) for _ in world.local]
        op(a_list, b_list, out=outs)
        world.synchronize()
        expected = gar.reference(a_list, b_list, b_layout="nk")
        for out in outs:
            assert relative_error(out, expected) < REL_ERROR_BOUND, f"step {step}"
    op.close()


@pytest.mark.parametrize("block_n", [128, 192])
@pytest.mark.parametrize("layout,m,n,k,b_layout", [("1x2", 300, 1000, 264, "nk"),
                                                   ("2x2", 512, 776, 128, "kn"),
                                                   ("1x3", 129, 520, 64, "nk")])
def test_narrower_tiles_match_float64_reference(make_world, block_n, layout, m, n, k, b_layout):
    """The fused kernel with 128 x 192 and 128 x 128 compute tiles (block_n): right against
    float64, every rank the same bits, a second call (next epoch) the same bits again."""
    import cupy
    from mkrt.kernels.gemm import poison
    world = make_world(layout)
    op = gar.GemmAllReduce(world, b_layout=b_layout, fuse=True, timeout_ms=10000, block_n=block_n)
    a_list, b_list = operands(world, m, n, k, b_layout, "bf16", seed=block_n + m)
    outs = [poison(cupy.empty((m, n), a_list[0].dtype)) for _ in world.local]
    op(a_list, b_list, out=outs)
    world.synchronize()
    assert op.last_plan.block_n == block_n
    expected = gar.reference(a_list, b_list, b_layout=b_layout)
    for info, out in zip(world.local, outs):
        error = relative_error(out, expected)
        assert error < REL_ERROR_BOUND, f"rank {info.rank}: relative error {error:.2e}"
    first = outs[0].copy()
    op(a_list, b_list, out=outs)
    world.synchronize()
    for out in outs:
        assert cupy.array_equal(out.view(cupy.uint16), first.view(cupy.uint16))
    op.close()


@pytest.mark.parametrize("layout", ["1x2", "2x2"])
def test_measured_fusion_settles_and_every_output_comes_from_its_path(make_world, layout):
    """fuse="measure": the first call times both paths and settles; that call's output and
    every later one are the settled path's bits (equal to a forced op of that path); a
    capture after settling records the settled path."""
    import cupy
    world = make_world(layout)
    op = gar.GemmAllReduce(world, b_layout="nk", fuse="measure", timeout_ms=10000)
    a_list, b_list = operands(world, 640, 512, 128, "nk", "bf16", seed=21)
    first = op(a_list, b_list)
    world.synchronize()
    plan = op.last_plan
    assert plan.reason.startswith("measured") and len(op.measured.times) == 1
    forced = gar.GemmAllReduce(world, b_layout="nk", fuse=plan.fused, timeout_ms=10000)
    reference = forced(a_list, b_list) if plan.fused else forced.unfused(a_list, b_list)
    again = [op(a_list, b_list) for _ in range(3)]
    # another M of the same size class (513 .. 1024): no timing, the same path
    a_small = [a[:600] for a in a_list]
    op(a_small, b_list)
    world.synchronize()
    assert op.last_plan.fused == plan.fused and len(op.measured.times) == 1
    for outs in [first, *again]:
        assert_same_bits(outs, reference)
    assert relative_error(first[0], gar.reference(a_list, b_list, b_layout="nk")) < REL_ERROR_BOUND
    outs = [cupy.empty((640, 512), a_list[0].dtype) for _ in world.local]
    # The 600-row call laid the buffers out for itself: capturing 640 rows now is refused
    # before anything is recorded; after one eager call it is captured.
    with pytest.raises(ValueError, match="before capturing"):
        capture(lambda: op(a_list, b_list, out=outs))
    op(a_list, b_list, out=outs)
    # the replay's stream is not ordered after the eager call (launches of one op must be:
    # each reads its epoch on the device); unsynchronised, the replay could start while the
    # eager call's last inter-node flags were in flight and run as the same epoch
    # (experiments/unordered_replay.py shows the CommTimeout that gives)
    world.synchronize()
    graph, stream = capture(lambda: op(a_list, b_list, out=outs))
    with stream:
        for out in outs:
            out.fill(0)
    graph.launch(stream)
    stream.synchronize()
    world.synchronize()
    assert_same_bits(outs, reference)
    op.close()
    forced.close()
