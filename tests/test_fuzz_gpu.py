"""API fuzzing on the GPU: a bounded sample of random shapes, dtypes, layouts and options
through every public op, against references. Each example either raises ValueError /
TypeError before launching (then a new call on the same op still works) or matches the
reference; nothing else may happen (no CommTimeout, no wrong numbers).

The shared worlds (one per layout, made once) keep the sample fast; every op has a
bounded wait (timeout_ms) so a bad example ends in an error, not a hang."""

from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.gpu

SAMPLE = settings(max_examples=25, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.function_scoped_fixture])
ODD = st.one_of(st.integers(1, 300), st.sampled_from([1, 7, 127, 129, 1000, 4097]))
_WORLDS: dict = {}


def world_of(layout):
    import mkrt
    if layout not in _WORLDS:
        _WORLDS[layout] = mkrt.init(emulate=layout)
    return _WORLDS[layout]


@pytest.fixture(scope="module", autouse=True)
def _close_worlds():
    yield
    for world in _WORLDS.values():
        world.close()
    _WORLDS.clear()


def refused(error: Exception) -> bool:
    return isinstance(error, (ValueError, TypeError)) and str(error).startswith("mkrt")


def _float(x):
    import cupy

    from mkrt.kernels.gemm import to_float32
    return to_float32(x).astype(cupy.float64) if x.dtype.itemsize == 2 and x.dtype != np.float16 \
        else x.astype(cupy.float64)


@SAMPLE
@given(m=ODD, n=ODD, k=st.sampled_from([8, 24, 64, 136, 4104]),
       dtype=st.sampled_from(["bf16", "f16"]), b_layout=st.sampled_from(["kn", "nk"]))
def test_gemm_random_shapes_match_float64(m, n, k, dtype, b_layout):
    import cupy

    import mkrt
    from mkrt.arrays import bfloat16
    np_dtype = bfloat16 if dtype == "bf16" else np.float16
    rng = cupy.random.default_rng(m * 31 + n * 7 + k)
    a = rng.standard_normal((m, k), dtype=np.float32).astype(np_dtype)
    b = rng.standard_normal((k, n) if b_layout == "kn" else (n, k), dtype=np.float32).astype(np_dtype)
    try:
        c = mkrt.gemm(a, b, b_layout=b_layout)
    except Exception as error:          # noqa: BLE001 - judged below
        assert refused(error), repr(error)
        return
    b64 = _float(b) if b_layout == "kn" else _float(b).T
    reference = _float(a) @ b64
    error = float(cupy.linalg.norm(_float(c) - reference) / max(float(cupy.linalg.norm(reference)), 1e-30))
    assert c.shape == (m, n) and error < 1e-2, (m, n, k, dtype, b_layout, error)


def _operands(world, rows, n, k, b_layout):
    """Per rank: A [rows, k] and B ([k, n] or [n, k]), bf16, seeded by the shape."""
    import cupy

    from mkrt.arrays import bfloat16
    rng = cupy.random.default_rng(rows + 3 * n + 5 * k)
    a = [rng.standard_normal((rows, k), dtype=np.float32).astype(bfloat16) for _ in world.local]
    shape = (k, n) if b_layout == "kn" else (n, k)
    b = [(rng.standard_normal(shape, dtype=np.float32) / 4).astype(bfloat16) for _ in world.local]
    return a, b


def _sum_of_products(a, b, b_layout):
    """sum_r A_r @ B_r in float64, and sum_r |A_r| @ |B_r|: rounding scales with the terms,
    not with their sum (which may cancel), so errors are measured against the second."""
    products = [(_float(x), _float(y) if b_layout == "kn" else _float(y).T) for x, y in zip(a, b)]
    return sum(x @ y for x, y in products), sum(abs(x) @ abs(y) for x, y in products)


@SAMPLE
@given(layout=st.sampled_from(["1x2", "2x2", "1x4"]), m=ODD, n=ODD,
       k=st.sampled_from([8, 24, 64, 200]), b_layout=st.sampled_from(["kn", "nk"]),
       fuse=st.sampled_from([None, True, False]), reduce_ctas=st.sampled_from([None, 1, 3]))
def test_gemm_allreduce_random_options_match_float64(layout, m, n, k, b_layout, fuse, reduce_ctas):
    import cupy

    import mkrt
    world = world_of(layout)
    a, b = _operands(world, m, n, k, b_layout)
    try:
        op = mkrt.GemmAllReduce(world, b_layout=b_layout, fuse=fuse, reduce_ctas=reduce_ctas,
                                timeout_ms=10000)
        outs = op(a, b)
        world.synchronize()
    except Exception as error:          # noqa: BLE001
        assert refused(error), repr(error)
        return
    reference, magnitude = _sum_of_products(a, b, b_layout)
    scale = max(float(cupy.linalg.norm(magnitude)), 1e-30)
    for out in outs:
        error = float(cupy.linalg.norm(_float(out) - reference)) / scale
        assert out.shape == (m, n) and error < 1e-2, (layout, m, n, k, b_layout, fuse, error)
    op.close()


@SAMPLE
@given(layout=st.sampled_from(["1x2", "2x2", "3x1", "1x3"]),
       shape=st.lists(st.integers(0, 70), min_size=1, max_size=3).map(tuple),
       dtype=st.sampled_from([np.float32, np.float16, np.int8, np.int64, np.uint8]),
       group=st.sampled_from(["world", "node"]), ctas=st.sampled_from([None, 1, 5]))
def test_allgather_random_shapes_are_exact(layout, shape, dtype, group, ctas):
    import cupy

    import mkrt
    world = world_of(layout)
    x = [(cupy.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape) * 3 + 7 * info.rank)
         .astype(dtype) for info in world.local]
    try:
        outs = mkrt.AllGather(world, group=group, ctas=ctas, timeout_ms=10000)(x)
        world.synchronize()
    except Exception as error:          # noqa: BLE001
        assert refused(error), repr(error)
        return
    host = np.stack([v.get() for v in x]) if x else None
    for out, info in zip(outs, world.local):
        ranks = list(range(world.size)) if group == "world" else world.node_ranks(info.node)
        expected = np.stack([host[[i.rank for i in world.local].index(r)] for r in ranks])
        assert np.array_equal(out.get(), expected), (layout, shape, dtype, group, ctas)


#: the tensor-parallel pair's random options (rows: of A per rank for AllGather+GEMM, of
#: the output per rank for GEMM+ReduceScatter)
TP_OPTIONS = dict(layout=st.sampled_from(["1x2", "2x2", "1x4"]), rows=st.integers(1, 300), n=ODD,
                  k=st.sampled_from([8, 24, 64, 200]), b_layout=st.sampled_from(["kn", "nk"]),
                  fuse=st.sampled_from([None, True, False]))


@SAMPLE
@given(**TP_OPTIONS, roles=st.sampled_from(["adaptive", "static"]))
def test_gemm_reducescatter_random_options_match_float64(layout, rows, n, k, b_layout, fuse,
                                                         roles):
    """m = rows * world size (the op's own rule); each rank's rows of the sum."""
    import cupy

    import mkrt
    world = world_of(layout)
    m = rows * world.size
    a, b = _operands(world, m, n, k, b_layout)
    try:
        op = mkrt.GemmReduceScatter(world, b_layout=b_layout, fuse=fuse, timeout_ms=10000,
                                    roles=roles)
        outs = op(a, b)
        world.synchronize()
    except Exception as error:          # noqa: BLE001
        assert refused(error), repr(error)
        return
    reference, scale = _sum_of_products(a, b, b_layout)
    for info, out in zip(world.local, outs):
        mine = slice(info.rank * rows, (info.rank + 1) * rows)
        error = float(cupy.linalg.norm(_float(out) - reference[mine])) / max(
            float(cupy.linalg.norm(scale[mine])), 1e-30)
        assert out.shape == (rows, n) and error < 1e-2, (layout, m, n, k, b_layout, fuse, error)
    op.close()


@SAMPLE
@given(**TP_OPTIONS, gathered=st.booleans())
def test_allgather_gemm_random_options_match_float64(layout, rows, n, k, b_layout, fuse,
                                                     gathered):
    """Every rank's (A gathered) @ its own B; the gathered A returned exactly when asked."""
    import cupy

    import mkrt
    from mkrt.arrays import bfloat16
    world = world_of(layout)
    a, b = _operands(world, rows, n, k, b_layout)
    whole = [cupy.empty((rows * world.size, k), bfloat16) for _ in world.local] if gathered else None
    try:
        op = mkrt.AllGatherGemm(world, b_layout=b_layout, fuse=fuse, timeout_ms=10000)
        outs = op(a, b, gathered_out=whole)
        world.synchronize()
    except Exception as error:          # noqa: BLE001
        assert refused(error), repr(error)
        return
    full_a = cupy.concatenate(a, axis=0)
    for out, y in zip(outs, b):
        b64 = _float(y) if b_layout == "kn" else _float(y).T
        reference = _float(full_a) @ b64
        scale = max(float(cupy.linalg.norm(abs(_float(full_a)) @ abs(b64))), 1e-30)
        error = float(cupy.linalg.norm(_float(out) - reference)) / scale
        assert out.shape == (rows * world.size, n) and error < 1e-2, (layout, rows, n, k, error)
    if gathered:
        for x in whole:
            assert cupy.array_equal(x.view(cupy.uint16), full_a.view(cupy.uint16))
    op.close()


@SAMPLE
@given(B=st.integers(1, 3), sq=ODD, sk=ODD, kv_heads=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 3]), d=st.sampled_from([64, 128]), causal=st.booleans(),
       dtype=st.sampled_from(["bf16", "f16"]))
def test_attention_random_shapes_match_float32(B, sq, sk, kv_heads, group, d, causal, dtype):
    import cupy

    from mkrt.arrays import bfloat16
    from mkrt.kernels import attention as A
    from mkrt.kernels.gemm import from_float32, to_float32
    np_dtype = bfloat16 if dtype == "bf16" else np.float16
    rng = cupy.random.default_rng(sq * 7 + sk)
    q, k, v = (from_float32(rng.standard_normal((B, s, h, d), dtype=np.float32), np_dtype)
               for s, h in ((sq, kv_heads * group), (sk, kv_heads), (sk, kv_heads)))
    out, lse = A.attention(q, k, v, causal=causal)
    ref, ref_lse = A.reference(q, k, v, causal=causal)
    got = to_float32(out)
    assert bool(cupy.isfinite(got).all())
    assert float(cupy.abs(got - ref).max()) <= 2e-2 * max(float(cupy.abs(ref).max()), 1e-3)
    assert float(cupy.abs(lse - ref_lse).max()) < 2e-3 * max(1.0, float(cupy.abs(ref_lse).max()))


@SAMPLE
@given(sizes=st.lists(st.one_of(st.integers(0, 200), st.just(0)), min_size=1, max_size=12),
       n=ODD, k=st.sampled_from([8, 64, 136, 1024]), block_m=st.sampled_from([None, 64, 128]))
def test_grouped_gemm_random_groups_match_float32(sizes, n, k, block_m):
    import cupy

    from mkrt.arrays import bfloat16
    from mkrt.kernels import grouped_gemm as GG
    from mkrt.kernels.gemm import from_float32, to_float32
    if sum(sizes) == 0:
        sizes = sizes + [1]
    rng = cupy.random.default_rng(sum(sizes) + n)
    x = from_float32(rng.standard_normal((sum(sizes), k), dtype=np.float32), bfloat16)
    w = from_float32(rng.standard_normal((len(sizes), n, k), dtype=np.float32) / 8, bfloat16)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    out = GG.grouped_gemm(x, w, offsets, block_m=block_m)
    ref = GG.reference(x, w, offsets)
    error = float(cupy.linalg.norm(to_float32(out) - ref) / max(float(cupy.linalg.norm(ref)), 1e-6))
    assert error < 1e-2


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=st.sampled_from(["1x2", "1x4", "2x1", "2x2"]),
       tokens=st.lists(st.integers(0, 60), min_size=4, max_size=4),
       k=st.sampled_from([1, 2, 4]), per_rank=st.sampled_from([1, 2, 3]))
def test_moe_random_routing_matches_float64(layout, tokens, k, per_rank):
    import mkrt
    from mkrt.kernels import moe as M
    from mkrt.kernels.gemm import to_float32
    world = world_of(layout)
    W = world.size
    experts = per_rank * W
    tokens = tokens[:W]
    dev, expected = M.random_problem(W, tokens, min(k, experts), 64, 32, experts,
                                     seed=sum(tokens) + k)
    op = mkrt.MoE(world, experts=experts, capacity=max(max(tokens), 1), timeout_ms=10000)
    ys = op(dev["x"], dev["ids"], dev["weights"], dev["w1"], dev["w2"])
    world.synchronize()
    for y, want in zip(ys, expected):
        if want.size and np.abs(want).max() > 0:
            assert np.abs(to_float32(y).get() - want).max() / np.abs(want).max() < 3e-2
    op.close()


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=st.sampled_from(["1x2", "2x2", "1x3"]), chunk=st.sampled_from([1, 17, 64, 130, 257]),
       kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 2]), d=st.sampled_from([64, 128]),
       causal=st.booleans(), dtype=st.sampled_from(["bf16", "f16"]))
def test_ring_attention_random_shapes_match_float32(layout, chunk, kv_heads, group, d, causal, dtype):
    import cupy

    import mkrt
    from mkrt.arrays import bfloat16
    from mkrt.kernels import attention as A
    from mkrt.kernels import ring_attention as RA
    from mkrt.kernels.gemm import from_float32, to_float32
    world = world_of(layout)
    np_dtype = bfloat16 if dtype == "bf16" else np.float16
    S = 2 * world.size * chunk
    rng = cupy.random.default_rng(S * 3 + d + kv_heads)
    q, k, v = (from_float32(rng.standard_normal((1, S, h, d), dtype=np.float32), np_dtype)
               for h in (kv_heads * group, kv_heads, kv_heads))
    parts = [[RA.shard(t, info.rank, world.size, causal=causal) for info in world.local]
             for t in (q, k, v)]
    op = mkrt.RingAttention(world, timeout_ms=10000)
    outs, lses = op(*parts, causal=causal)        # every example is a valid call
    world.synchronize()
    ref, ref_lse = A.reference(q, k, v, causal=causal)
    got = to_float32(RA.unshard(outs, causal=causal))
    got_lse = RA.unshard(lses, causal=causal, axis=2)
    assert bool(cupy.isfinite(got).all())
    assert float(cupy.abs(got - ref).max()) <= 2e-2 * max(float(cupy.abs(ref).max()), 1e-3), \
        (layout, chunk, kv_heads, group, d, causal, dtype)
    assert float(cupy.abs(got_lse - ref_lse).max()) < 2e-3 * max(1.0, float(cupy.abs(ref_lse).max()))
    op.close()


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=st.sampled_from(["1x2", "1x3", "1x4", "2x2", "3x1"]),
       tokens=st.lists(st.integers(0, 90), min_size=4, max_size=4),
       k=st.sampled_from([1, 2, 3, 8]), per_rank=st.sampled_from([1, 2, 4]),
       hidden=st.sampled_from([8, 64, 136]))
def test_moe_dispatch_then_combine_with_identity_experts(layout, tokens, k, per_rank, hidden):
    """mkrt.moe_dispatch and mkrt.moe_combine alone: with every expert the identity (its
    results are the rows it received), each token comes back as (sum of its k weights) x
    its row, in fp32 before the one rounding: any lost, doubled or misrouted row shows."""
    import cupy

    import mkrt
    from mkrt.arrays import bfloat16
    from mkrt.kernels.gemm import from_float32, to_float32
    world = world_of(layout)
    W = world.size
    experts = per_rank * W
    k = min(k, experts)
    tokens = tokens[:W]
    capacity = max(max(tokens), 1)
    rng = np.random.default_rng(sum(tokens) * 7 + k + hidden)
    ids = [cupy.asarray(np.stack([rng.choice(experts, k, replace=False) for _ in range(t)])
                        .astype(np.int32) if t else np.zeros((0, k), np.int32)) for t in tokens]
    weights = [cupy.asarray(rng.random((t, k), dtype=np.float32)) for t in tokens]
    x = [from_float32(cupy.asarray(rng.standard_normal((t, hidden)), dtype=cupy.float32), bfloat16)
         for t in tokens]
    options = dict(experts=experts, capacity=capacity, world=world, timeout_ms=10000)
    dispatched = mkrt.moe_dispatch(x, ids, **options)
    results = [received.copy() for received, _, _ in dispatched]
    ys = mkrt.moe_combine(results, weights, **options)
    world.synchronize()
    for y, xr, w in zip(ys, x, weights):
        want = to_float32(xr) * w.sum(axis=1, keepdims=True)
        assert y.shape == xr.shape
        if want.size:
            error = float(cupy.abs(to_float32(y) - want).max()) / max(float(cupy.abs(want).max()), 1e-6)
            assert error < 1e-2, (layout, tokens, k, per_rank, hidden, error)
