"""The attention engine: compile checks, argument checks and the reference on the CPU;
correctness, strided inputs and repeatability on a GPU."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from mkrt.arrays import bfloat16
from mkrt.kernels import attention as A
from mkrt.kernels import ring_attention_plan as R

BF16 = bfloat16


# ---- CPU ------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", A.default_specs(), ids=lambda s: s.uri)
def test_default_specs_compile_without_spills(spec):
    build = spec.build(check_spills=True)
    resources = build.resources["attention_forward"]
    assert resources.spills == 0 and resources.stack_frame == 0, resources
    assert "serialized" not in build.log, build.log


def test_spec_uri_and_shared_memory():
    spec = A.AttentionSpec("bf16", 128, 128, 2)
    assert spec.uri == "attention_bf16_d128_bkv128_s2_pp0_c2_q0_sm90a"
    assert A.AttentionSpec("f16", 64, 64, 4, 1).uri == "attention_f16_d64_bkv64_s4_pp1_c2_q0_sm90a"
    three = A.AttentionSpec("bf16", 64, 128, 3, 1, 3)
    assert (three.threads, three.block_q) == (512, 192)
    assert three.smem_bytes == 1024 + 192 * 64 * 2 + 2 * 3 * 128 * 64 * 2 + (2 + 4 * 3) * 8 + 8
    # Q, two stages of K and V, barriers: q full/empty and per stage k/v full and empty, the claimed position
    assert spec.smem_bytes == 1024 + 128 * 128 * 2 + 2 * 2 * 128 * 128 * 2 + (2 + 4 * 2) * 8 + 8
    for spec in A.default_specs():
        assert spec.smem_bytes <= A.SMEM_LIMIT


def test_tiles_are_dealt_out_unless_claimed_is_asked_for():
    # claimed tiles ran 4-9% slower on even tiles; claiming costs registers that three
    # consumers, and the producer above 128-key blocks, do not have
    assert A.AttentionSpec("bf16", 128, 128, 2).claimed == 0
    assert A.AttentionSpec("bf16", 128, 128, 2, claimed=1).uri.endswith("_c2_q1_sm90a")
    assert all(spec.claimed == 0 for spec in A.default_specs())
    assert A.can_claim(128, 2) and A.can_claim(64, 2)
    assert not (A.can_claim(192, 2) or A.can_claim(176, 2) or A.can_claim(128, 3))
    with pytest.raises(ValueError, match="claimed=1 needs 2 consumer warpgroups"):
        A.AttentionSpec("bf16", 128, 192, 2, claimed=1)
    with pytest.raises(ValueError, match="claimed=1 needs"):
        A.AttentionSpec("bf16", 64, 128, 3, 1, 3, claimed=1)
    with pytest.raises(ValueError, match="claimed=2; expected 0 or 1"):
        A.AttentionSpec(claimed=2)
    with pytest.raises(TypeError, match="claimed must be an int"):
        A.AttentionSpec(claimed=True)
    with pytest.raises(ValueError, match="claimed=-1; expected 0 or 1"):
        A.AttentionSpec(claimed=-1)


@pytest.mark.parametrize("spec", [dataclasses.replace(s, claimed=1) for s in A.default_specs()
                                  if A.can_claim(s.block_kv, s.consumers)],
                         ids=lambda s: s.uri)
def test_claimed_builds_compile_without_spills(spec):
    resources = spec.build(check_spills=True).resources["attention_forward"]
    assert resources.spills == 0 and resources.stack_frame == 0, resources


@pytest.mark.parametrize("kwargs", [dict(dtype="f32"), dict(head_dim=96), dict(block_kv=100),
                                    dict(block_kv=320), dict(block_kv=96), dict(stages=1), dict(stages=4),
                                    dict(pingpong=2), dict(consumers=4)])
def test_spec_refuses_bad_configurations(kwargs):
    with pytest.raises(ValueError, match="^mkrt.attention:"):
        A.AttentionSpec(**kwargs)


F16 = np.dtype(np.float16)


@pytest.mark.parametrize("shapes,dtypes,match", [
    (((1, 8, 2, 64), (1, 8, 2, 64), (1, 8, 2, 64)), (np.float32,) * 3, "q has dtype f32"),
    (((1, 8, 2, 64), (1, 8, 2, 64), (1, 8, 2, 64)), (F16, F16, BF16), "one dtype"),
    (((8, 2, 64), (1, 8, 2, 64), (1, 8, 2, 64)), (F16,) * 3, "4 dimensions"),
    (((1, 8, 2, 64), (1, 8, 2, 64), (1, 9, 2, 64)), (F16,) * 3, "differ in shape"),
    (((2, 8, 2, 64), (1, 8, 2, 64), (1, 8, 2, 64)), (F16,) * 3, "batch"),
    (((1, 8, 2, 64), (1, 8, 2, 128), (1, 8, 2, 128)), (F16,) * 3, "head dim 64, k and v 128"),
    (((1, 8, 2, 96), (1, 8, 2, 96), (1, 8, 2, 96)), (F16,) * 3, "head dim 96"),
    (((1, 8, 3, 64), (1, 8, 2, 64), (1, 8, 2, 64)), (F16,) * 3, "not a multiple"),
    (((1, 0, 2, 64), (1, 8, 2, 64), (1, 8, 2, 64)), (F16,) * 3, "empty"),
])
def test_bad_operands_are_refused(shapes, dtypes, match):
    with pytest.raises((TypeError, ValueError), match=match):
        A.check_operands(*shapes, *dtypes)


def test_causal_and_scale_are_checked():
    shape = (1, 8, 2, 64)
    with pytest.raises(TypeError, match="causal"):
        A.check_operands(shape, shape, shape, F16, F16, F16, causal="yes")
    assert A.check_scale(None, 128) == 1 / math.sqrt(128)
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale"):
            A.check_scale(bad, 64)
    with pytest.raises(TypeError, match="scale"):
        A.check_scale("0.1", 64)


def test_strides_a_tensor_map_can_read():
    A.check_strides("q", (2, 16, 4, 64), (16384, 1024, 128, 2), 2)         # contiguous
    A.check_strides("q", (2, 16, 4, 64), (3 * 16384, 3 * 1024, 128, 2), 2)  # out of packed QKV
    with pytest.raises(ValueError, match="contiguous head dim"):
        A.check_strides("k", (2, 16, 4, 64), (16384, 1024, 256, 4), 2)
    with pytest.raises(ValueError, match="multiple of 16"):
        A.check_strides("v", (2, 16, 4, 64), (16384, 1000, 128, 2), 2)


def test_flops_count_the_visible_pairs():
    p = A.check_operands((2, 100, 4, 64), (2, 100, 4, 64), (2, 100, 4, 64), F16, F16, F16)
    assert p.flops == 4 * 2 * 4 * 100 * 100 * 64
    c = A.check_operands((1, 100, 1, 64), (1, 100, 1, 64), (1, 100, 1, 64), F16, F16, F16, causal=True)
    assert c.flops == 4 * 64 * (100 * 101 / 2)
    tall = A.check_operands((1, 10, 1, 64), (1, 4, 1, 64), (1, 4, 1, 64), F16, F16, F16, causal=True)
    assert tall.flops == 4 * 64 * (1 + 2 + 3 + 4 * 7)


@pytest.mark.parametrize("shape", [(2, 4096, 16, 16, 128), (1, 8192, 64, 8, 128), (3, 700, 12, 4, 64),
                                   (1, 100000, 4, 1, 128)])
def test_tile_order_deals_every_tile_once_in_bands_that_fit_l2(shape):
    B, S, Hq, Hkv, D = shape
    for causal in (False, True):
        p = A.check_operands((B, S, Hq, D), (B, S, Hkv, D), (B, S, Hkv, D), F16, F16, F16, causal=causal)
        order = A.tile_order(p)
        q_blocks = -(-S // A.BLOCK_Q)
        assert sorted(order) == [(b, h, q) for b in range(B) for h in range(Hq) for q in range(q_blocks)]
        # a band's key heads: K and V within KV_L2_BYTES (or one head that alone is larger)
        group, per_band = Hq // Hkv, q_blocks * p.band * (Hq // Hkv)
        assert p.band == 1 or p.band * 2 * S * D * 2 <= A.KV_L2_BYTES
        for start in range(0, len(order), per_band):
            band = order[start:start + per_band]
            assert len({(b, h // group) for b, h, _ in band}) <= p.band
            # inside a band the heaviest query blocks come first
            assert [q for _, _, q in band] == sorted((q for _, _, q in band), reverse=True)
    # bands of 10 key heads at 2 MB of K and V each; one band of the 8 GQA heads
    assert A.check_operands((2, 4096, 16, 128), (2, 4096, 16, 128), (2, 4096, 16, 128), F16, F16, F16).band == 10
    assert A.check_operands((1, 8192, 64, 128), (1, 8192, 8, 128), (1, 8192, 8, 128), F16, F16, F16).band == 5


def _head_work_get(p, t, block_q):
    """HeadWork::get's index arithmetic (attention.py's kernel source), line for line, for
    queue position t (the queue's count, q_blocks x batches x heads, ends it)."""
    group, q_blocks = p.heads // p.kv_heads, -(-p.sq // block_q)
    units = p.batches * p.kv_heads
    if t >= q_blocks * p.batches * p.heads:
        return None
    per_band = q_blocks * p.band * group
    b = t // per_band
    width = min(p.band, units - b * p.band) * group
    r = t - b * per_band
    q_block = q_blocks - 1 - r // width
    w = r - (r // width) * width
    unit = b * p.band + w // group
    batch = unit // p.kv_heads
    kv_head = unit - batch * p.kv_heads
    return batch, kv_head * group + (w - (w // group) * group), q_block


@pytest.mark.parametrize("shape", [(3, 700, 12, 4, 64), (2, 4096, 16, 16, 128), (5, 9000, 8, 2, 128)])
def test_the_kernels_tile_arithmetic_matches_tile_order(shape, monkeypatch):
    B, S, Hq, Hkv, D = shape
    for budget in (1, 3 * 2 * S * D * 2, A.KV_L2_BYTES):     # bands of 1, of 3 (a partial last), default
        monkeypatch.setattr(A, "KV_L2_BYTES", budget)
        p = A.check_operands((B, S, Hq, D), (B, S, Hkv, D), (B, S, Hkv, D), F16, F16, F16)
        for block_q in (128, 192):      # two or three consumer warpgroups
            order = A.tile_order(p, block_q)
            assert [_head_work_get(p, t, block_q) for t in range(len(order))] == order
            assert _head_work_get(p, len(order), block_q) is None


def _cta_loads(p, deal, block_q, block_kv):
    cost = [A.tile_blocks(p, block_q, block_kv, q) + 1 for _, _, q in A.tile_order(p, block_q)]
    return [sum(cost[t] for t in deal[:, c] if t >= 0) for c in range(deal.shape[1])], cost


@pytest.mark.parametrize("shape", [(4, 4096, 16, 16, 128, 128, 128), (4, 4096, 16, 16, 64, 192, 128),
                                   (1, 8192, 64, 8, 128, 128, 128), (2, 8192, 32, 32, 64, 192, 128),
                                   (1, 3000, 8, 1, 64, 192, 128), (3, 700, 12, 4, 64, 128, 64)])
def test_planned_deal_runs_every_tile_once_and_balances_causal_tiles(shape):
    B, S, Hq, Hkv, D, block_q, block_kv = shape
    p = A.check_operands((B, S, Hq, D), (B, S, Hkv, D), (B, S, Hkv, D), F16, F16, F16, causal=True)
    ctas = min(p.tiles(block_q), 132)
    deal = A.deal_tiles(p, block_q, block_kv, ctas)
    assert deal.dtype == np.int32 and deal.shape[1] == ctas
    dealt = deal[deal >= 0]
    assert sorted(dealt.tolist()) == list(range(p.tiles(block_q)))
    # a CTA's tiles are a prefix of its column (the kernel stops at the first -1)
    for c in range(ctas):
        column = deal[:, c].tolist()
        assert -1 not in column or all(t == -1 for t in column[column.index(-1):])
    loads, cost = _cta_loads(p, deal, block_q, block_kv)
    cyclic = [sum(cost[c::ctas]) for c in range(ctas)]
    # never worse than the cyclic deal; within a tile of the mean (a greedy deal's bound)
    assert max(loads) <= max(cyclic)
    assert max(loads) <= sum(cost) / ctas + max(cost)
    if S >= 4096:       # the suite's causal shapes: the busiest CTA within 2% of the mean
        assert max(loads) <= 1.02 * sum(cost) / ctas
    # the cyclic deal left >= 3% at these shapes: the test would see a plan that changed nothing
    if shape[:5] in ((4, 4096, 16, 16, 128), (4, 4096, 16, 16, 64)):
        assert max(cyclic) >= 1.03 * sum(cost) / ctas


def test_even_tiles_and_many_rounds_keep_the_cyclic_deal():
    p = A.check_operands((4, 4096, 16, 128), (4, 4096, 16, 128), (4, 4096, 16, 128), F16, F16, F16)
    assert A.deal_tiles(p, 128, 128, 132) is None
    long = A.check_operands((8, 32768, 16, 128), (8, 32768, 16, 128), (8, 32768, 16, 128), F16, F16, F16,
                            causal=True)
    assert long.tiles(128) > A.DEAL_MAX_ROUNDS * 132 and A.deal_tiles(long, 128, 128, 132) is None


def test_tile_blocks_matches_the_kernels_causal_count():
    # HeadWork::get: min(kv_blocks, last_query / BKV + 1), last_query = q_row + q_rows - 1
    p = A.check_operands((1, 1000, 2, 64), (1, 700, 2, 64), (1, 700, 2, 64), F16, F16, F16, causal=True)
    for block_q, block_kv in ((128, 128), (192, 64), (128, 176)):
        kv_blocks = -(-700 // block_kv)
        for q in range(-(-1000 // block_q)):
            last = q * block_q + min(block_q, 1000 - q * block_q) - 1
            assert A.tile_blocks(p, block_q, block_kv, q) == min(kv_blocks, last // block_kv + 1)


def test_reference_matches_the_float64_ring_reference():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 9, 4, 64))
    k = rng.standard_normal((2, 13, 2, 64))
    v = rng.standard_normal((2, 13, 2, 64))
    for causal in (False, True):
        o, lse = A.reference(q, k, v, causal=causal, dtype=np.float64)
        o64, lse64 = R.attention(q, k, v, causal=causal)
        np.testing.assert_allclose(o, o64, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse, lse64, rtol=1e-12)
    # a row that sees no key: O = 0, LSE = -inf
    o, lse = A.reference(q, k, v, causal=True, q_offset=0, k_offset=5, dtype=np.float64)
    assert np.all(o[:, :5] == 0) and np.all(np.isneginf(lse[:, :, :5]))


# ---- GPU ------------------------------------------------------------------------------

def _random(cupy, shape, dtype, seed):
    from mkrt.kernels.gemm import from_float32
    rng = cupy.random.default_rng(seed)
    return from_float32(rng.standard_normal(shape, dtype=np.float32), dtype)


def _check(q, k, v, causal, out, lse, dtype, scale=None):
    import cupy
    from mkrt.kernels.gemm import to_float32
    ref_o, ref_lse = A.reference(q, k, v, causal=causal, scale=scale)
    got = to_float32(cupy.ascontiguousarray(out))
    assert bool(cupy.isfinite(got).all()), "O has non-finite values (unwritten rows?)"
    error = float(cupy.abs(got - ref_o).max()) / max(float(cupy.abs(ref_o).max()), 1e-3)
    assert error < (2e-2 if dtype == "bf16" else 4e-3), error
    lse_error = float(cupy.abs(lse - ref_lse).max())
    assert lse_error < 2e-3 * max(1.0, float(cupy.abs(ref_lse).max())), lse_error


@pytest.mark.gpu
@pytest.mark.parametrize("case", A.test_cases(), ids=lambda c: "x".join(map(str, c[:6])) +
                         ("_causal" if c[6] else "") + "_" + c[7])
def test_matches_the_reference(case):
    import cupy
    from mkrt.kernels.gemm import poison
    B, Sq, Sk, Hq, Hkv, D, causal, dtype_name = case
    dtype = BF16 if dtype_name == "bf16" else np.float16
    q = _random(cupy, (B, Sq, Hq, D), dtype, 1)
    k = _random(cupy, (B, Sk, Hkv, D), dtype, 2)
    v = _random(cupy, (B, Sk, Hkv, D), dtype, 3)
    out = poison(cupy.empty((B, Sq, Hq, D), dtype=dtype))
    lse = cupy.full((B, Hq, Sq), np.nan, dtype=np.float32)
    A.attention(q, k, v, causal=causal, out=out, lse=lse)
    cupy.cuda.Device().synchronize()
    _check(q, k, v, causal, out, lse, dtype_name)


@pytest.mark.gpu
def test_strided_views_of_a_packed_projection_and_a_custom_scale():
    import cupy
    B, S, H, D = 2, 333, 4, 128
    qkv = _random(cupy, (B, S, 3, H, D), BF16, 4)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert not q.flags.c_contiguous
    out, lse = A.attention(q, k, v, causal=True, scale=0.05)
    _check(q, k, v, True, out, lse, "bf16", scale=0.05)


@pytest.mark.gpu
def test_repeated_calls_are_bit_identical_and_fewer_sms_agree():
    import cupy
    q = _random(cupy, (1, 1500, 8, 64), BF16, 5)
    k = _random(cupy, (1, 1500, 2, 64), BF16, 6)
    v = _random(cupy, (1, 1500, 2, 64), BF16, 7)
    first, first_lse = A.attention(q, k, v, causal=True)
    first, first_lse = first.copy(), first_lse.copy()
    # every call writes every tile: each call's output poisoned first and kept (the CTAs
    # claim tiles from a counter that the last CTA out of a launch zeroes for the next)
    outs = [cupy.full_like(first, float("nan")) for _ in range(50)]
    lses = [cupy.full_like(first_lse, float("nan")) for _ in range(50)]
    for out, lse in zip(outs, lses):
        A.attention(q, k, v, causal=True, out=out, lse=lse)
    for out, lse in zip(outs, lses):
        assert bool((out.view(cupy.uint16) == first.view(cupy.uint16)).all())
        assert bool((lse == first_lse).all())
    few, few_lse = A.attention(q, k, v, causal=True, sms=7)
    assert bool((few.view(cupy.uint16) == first.view(cupy.uint16)).all())


@pytest.mark.gpu
def test_calls_on_several_streams_at_once_each_write_every_tile():
    """Each stream has its own tile counter: launches overlapping on four streams, no
    synchronisation between calls, all outputs identical to a lone call's."""
    import cupy
    q = _random(cupy, (2, 2000, 8, 128), BF16, 8)
    k = _random(cupy, (2, 2000, 4, 128), BF16, 9)
    v = _random(cupy, (2, 2000, 4, 128), BF16, 10)
    first, _ = A.attention(q, k, v, causal=True)
    cupy.cuda.Device().synchronize()
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(4)]
    outs = [cupy.full_like(first, float("nan")) for _ in range(4 * 6)]
    cupy.cuda.Device().synchronize()
    for i, out in enumerate(outs):
        A.attention(q, k, v, causal=True, out=out, stream=streams[i % 4])
    cupy.cuda.Device().synchronize()
    for out in outs:
        assert bool((out.view(cupy.uint16) == first.view(cupy.uint16)).all())


@pytest.mark.gpu
def test_a_graph_captured_on_a_fresh_stream_replays_and_eager_calls_follow():
    """A launch captured on a stream that never ran one gets a tile counter zeroed by its
    graph; replays and later eager calls on that stream each write every tile."""
    import cupy
    q = _random(cupy, (2, 1000, 4, 64), BF16, 11)
    k = _random(cupy, (2, 1000, 2, 64), BF16, 12)
    v = _random(cupy, (2, 1000, 2, 64), BF16, 13)
    want = cupy.empty_like(q)
    A.attention(q, k, v, causal=True, out=want)           # prepared (and right) on the default stream
    out = cupy.full_like(want, float("nan"))
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()
    stream.begin_capture()
    A.attention(q, k, v, causal=True, out=out, stream=stream)
    graph = stream.end_capture()
    for _ in range(3):
        out.fill(float("nan"))
        cupy.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        assert bool((out.view(cupy.uint16) == want.view(cupy.uint16)).all())
    for _ in range(3):
        out.fill(float("nan"))
        cupy.cuda.Device().synchronize()
        A.attention(q, k, v, causal=True, out=out, stream=stream)
        stream.synchronize()
        assert bool((out.view(cupy.uint16) == want.view(cupy.uint16)).all())


@pytest.mark.gpu
def test_a_causal_signature_first_called_inside_a_capture_plans_its_deal_and_replays():
    """The planned deal of causal tiles is uploaded when a signature is first prepared; a
    first call inside a graph capture must upload it outside the capture."""
    import cupy
    from mkrt.kernels.gemm import to_float32
    q = _random(cupy, (3, 1111, 6, 128), BF16, 31)
    k = _random(cupy, (3, 1111, 3, 128), BF16, 32)
    v = _random(cupy, (3, 1111, 3, 128), BF16, 33)
    p = A.check_operands(q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, causal=True)
    assert A.deal_tiles(p, 128, 128, min(p.tiles(), 132)) is not None
    out = cupy.full_like(q, float("nan"))
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()
    stream.begin_capture()
    A.attention(q, k, v, causal=True, out=out, stream=stream)      # the signature's first call
    graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    want, _ = A.reference(q, k, v, causal=True)
    error = float(cupy.abs(to_float32(out) - want).max() / cupy.abs(want).max())
    assert error < 2e-2, error
    eager = cupy.full_like(q, float("nan"))
    A.attention(q, k, v, causal=True, out=eager)
    cupy.cuda.Device().synchronize()
    assert bool((out.view(cupy.uint16) == eager.view(cupy.uint16)).all())


def _same_bits_under(monkeypatch, setting: str, values, shapes, seed: int):
    """Causal attention of fresh inputs with the module attribute `setting` at each of
    `values` (prepared afresh each time): checked against the reference, and every
    output and LSE bit-identical to the first."""
    import cupy
    q, k, v = (_random(cupy, shape, BF16, seed + i) for i, shape in enumerate(shapes))
    outputs = []
    for value in values:
        monkeypatch.setattr(A, setting, value)
        monkeypatch.setattr(A, "_PREPARED", type(A._PREPARED)())
        out, lse = A.attention(q, k, v, causal=True)
        outputs.append((out.copy(), lse.copy()))
    _check(q, k, v, True, outputs[-1][0], outputs[-1][1], "bf16")
    for out, lse in outputs[1:]:
        assert bool((out.view(cupy.uint16) == outputs[0][0].view(cupy.uint16)).all())
        assert bool((lse == outputs[0][1]).all())


@pytest.mark.gpu
def test_planned_and_cyclic_deals_give_the_same_bits(monkeypatch):
    p = A.check_operands((2, 3000, 8, 64), (2, 3000, 2, 64), (2, 3000, 2, 64), BF16, BF16, BF16, causal=True)
    assert A.deal_tiles(p, 192, 128, min(p.tiles(192), 132)) is not None
    _same_bits_under(monkeypatch, "DEAL_MAX_ROUNDS", (A.DEAL_MAX_ROUNDS, 0),     # planned, then cyclic
                     [(2, 3000, 8, 64), (2, 3000, 2, 64), (2, 3000, 2, 64)], 41)


@pytest.mark.gpu
def test_bands_of_key_heads_change_the_order_not_the_bits(monkeypatch):
    # 2 batches x 3 key heads x 2 query heads each: bands of 1, 4 (a partial last band), all
    per_head = 2 * 600 * 128 * 2
    _same_bits_under(monkeypatch, "KV_L2_BYTES", [band * per_head for band in (1, 4, 6)],
                     [(2, 600, 6, 128), (2, 600, 3, 128), (2, 600, 3, 128)], 21)


@pytest.mark.gpu
def test_torch_in_torch_out():
    torch = pytest.importorskip("torch")
    q = torch.randn(2, 256, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 256, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 256, 8, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = A.attention(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape and lse.dtype == torch.float32
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
    assert (out.float() - expected.float()).abs().max().item() < 2e-2 * expected.abs().max().item()
    # torch's current stream is the one used, and given outputs are written in place
    side = torch.cuda.Stream()
    out2, lse2 = torch.full_like(out, float("nan")), torch.empty_like(lse)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got, got_lse = A.attention(q, k, v, causal=True, out=out2, lse=lse2)
    side.synchronize()
    assert got is out2 and got_lse is lse2
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    with pytest.raises(TypeError, match="CPU torch tensor"):
        A.attention(q.cpu(), k, v)
    # mixed torch and CuPy arguments take the DLPack path
    import cupy
    mixed, _ = A.attention(q, cupy.from_dlpack(k), cupy.from_dlpack(v), causal=True)
    assert torch.equal(torch.as_tensor(mixed, device="cuda"), out)


@pytest.mark.gpu
def test_bad_arrays_raise_before_launch():
    import cupy
    q = _random(cupy, (1, 64, 2, 64), BF16, 8)
    wide = _random(cupy, (1, 64, 2, 128), BF16, 9)
    with pytest.raises(ValueError, match="contiguous head dim"):
        A.attention(wide[..., ::2], q, q)
    A.attention(q, q, q, causal=True)
    with pytest.raises(TypeError, match="causal"):      # a prepared signature checks afresh
        A.attention(q, q, q, causal=1)
    with pytest.raises(ValueError, match="out is"):
        A.attention(q, q, q, out=cupy.empty((1, 64, 2, 32), dtype=BF16))
    with pytest.raises(ValueError, match="lse is"):
        A.attention(q, q, q, lse=cupy.empty((1, 64, 2), dtype=np.float32))
    with pytest.raises(TypeError, match="host numpy array"):
        A.attention(np.zeros((1, 64, 2, 64), np.float16), q, q)
    with pytest.raises(ValueError, match="sms"):
        A.attention(q, q, q, sms=0)


@pytest.mark.gpu
@pytest.mark.parametrize("options", [dict(block_kv=128, stages=2, pingpong=1),
                                     dict(block_kv=128, stages=3, pingpong=1, claimed=1),
                                     dict(block_kv=64, stages=4, pingpong=1, claimed=1),
                                     dict(block_kv=64, stages=4, pingpong=0),
                                     dict(block_kv=64, stages=4, pingpong=1),
                                     dict(block_kv=128, stages=2, pingpong=0),
                                     dict(block_kv=192, stages=2, pingpong=1),
                                     dict(block_kv=176, stages=2, pingpong=1),
                                     dict(block_kv=192, stages=3, pingpong=1),
                                     dict(block_kv=128, stages=3, pingpong=1, consumers=3),
                                     dict(block_kv=64, stages=4, pingpong=1, consumers=3)])
@pytest.mark.parametrize("case", [(2, 700, 700, 4, 2, 64, True), (1, 513, 1025, 2, 1, 128, False),
                                  (1, 1000, 1000, 2, 2, 128, True)])
def test_other_configurations_match_the_reference(case, options):
    import cupy
    B, Sq, Sk, Hq, Hkv, D, causal = case
    try:
        A.AttentionSpec("bf16", D, **options)
    except ValueError as error:        # three stages of 192 keys at head dim 128
        pytest.skip(str(error))
    q = _random(cupy, (B, Sq, Hq, D), BF16, 10)
    k = _random(cupy, (B, Sk, Hkv, D), BF16, 11)
    v = _random(cupy, (B, Sk, Hkv, D), BF16, 12)
    out, lse = A.attention(q, k, v, causal=causal, **options)
    _check(q, k, v, causal, out, lse, "bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(2, 1500, 1500, 8, 2, 128, True), (1, 900, 2000, 4, 4, 64, False)])
def test_claimed_and_dealt_out_tiles_give_the_same_bits(case):
    """Which CTA runs a tile does not change what it computes: claimed=1 and claimed=0 write
    identical O and LSE (over several launches, so the counter's reset is exercised too)."""
    import cupy
    B, Sq, Sk, Hq, Hkv, D, causal = case
    q = _random(cupy, (B, Sq, Hq, D), BF16, 20)
    k = _random(cupy, (B, Sk, Hkv, D), BF16, 21)
    v = _random(cupy, (B, Sk, Hkv, D), BF16, 22)
    dealt, dealt_lse = A.attention(q, k, v, causal=causal, block_kv=128, stages=2, pingpong=1, claimed=0)
    _check(q, k, v, causal, dealt, dealt_lse, "bf16")
    for _ in range(3):
        out = cupy.full_like(q, float("nan"))
        lse = cupy.full((B, Hq, Sq), float("nan"), dtype=np.float32)
        A.attention(q, k, v, causal=causal, block_kv=128, stages=2, pingpong=1, claimed=1,
                    out=out, lse=lse)
        assert cupy.array_equal(out.view(cupy.uint16), dealt.view(cupy.uint16))
        assert cupy.array_equal(lse.view(cupy.uint32), dealt_lse.view(cupy.uint32))
