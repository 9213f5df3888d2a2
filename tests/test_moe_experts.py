"""The experts' MLPs in one launch (mkrt.grouped_mlp, MoE's fused expert stage): compile,
argument checks and the work list's wait order on the CPU; correctness against a float32
reference, repeatability and graph replay on a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from mkrt.arrays import bfloat16
from mkrt.kernels import moe_experts as ME


@pytest.mark.parametrize("spec", ME.default_specs(), ids=lambda s: s.uri)
def test_default_specs_compile_without_spills(spec):
    build = spec.build(check_spills=True)
    resources = build.resources["moe_experts"]
    assert resources.spills == 0, resources
    # the group prefix, beside the engine's dynamic share, within the limit
    assert 0 < resources.static_shared <= ME.STATIC_SMEM_BYTES, resources
    assert spec.smem_bytes + resources.static_shared <= 232448
    assert "serialized" not in build.log


B = bfloat16
F32 = np.dtype(np.float32)


@pytest.mark.parametrize("x,w1,w2,match", [
    (((64, 64), F32), ((2, 32, 64), B), ((2, 64, 16), B), "x has dtype f32"),
    (((64, 64), B), ((2, 32, 64), B), ((2, 64, 16), np.float16), "w2 has dtype f16"),
    (((64, 64), B), ((32, 64), B), ((2, 64, 16), B), r"\[G, 2I, H\]"),
    (((64, 64), B), ((2, 32, 72), B), ((2, 64, 16), B), "disagree"),
    (((64, 64), B), ((2, 32, 64), B), ((2, 64, 8), B), "disagree"),
    (((64, 64), B), ((2, 32, 64), B), ((3, 64, 16), B), "disagree"),
    (((64, 12), B), ((2, 32, 12), B), ((2, 12, 16), B), "H=12"),
    (((64, 64), B), ((2, 12, 64), B), ((2, 64, 6), B), "I=6"),
    (((64, 64), B), ((2000, 16, 64), B), ((2000, 64, 8), B), "2000 groups"),
])
def test_bad_operands_are_refused(x, w1, w2, match):
    with pytest.raises((TypeError, ValueError), match=match):
        ME.check_operands(x[0], w1[0], w2[0], x[1], w1[1], w2[1])


def test_spec_checks_and_words():
    with pytest.raises(ValueError, match="block_n"):
        ME.spec_for(128, 192)
    assert ME.spec_for(128).uri.startswith("moe_experts_bf16_nk_bm128_bn256_s")
    # one counter per m-tile: a group's partial last tile included
    assert ME.counter_words(1000, 4, 128) == ME.COUNTERS + 8 + 4


def test_word_layout_matches_the_device_code():
    text = ME.EXPERTS_TILES.text
    assert f"COUNT_BITS = {ME.COUNT_BITS};" in text
    assert (f"FINISHED = {ME.FINISHED}, CTAS_BEFORE = {ME.CTAS_BEFORE}, LAUNCHES = {ME.LAUNCHES}, "
            f"EXPERTS_DONE = {ME.EXPERTS_DONE}, COUNTERS = {ME.COUNTERS};") in text


def _order_cases():
    return [([128, 128], 256, 128, 128, 256), ([0, 1, 0, 300, 17], 136, 72, 64, 256),
            ([5] * 16, 128, 256, 64, 128), ([1000, 0, 3, 64], 512, 1000, 128, 256),
            ([1300, 0, 129], 1024, 2048, 128, 256)]


@pytest.mark.parametrize("case", _order_cases(), ids=str)
@pytest.mark.parametrize("bands", [(1, 1), (8, 2)])
def test_every_tile_once_and_no_wait_cycle_on_any_grid(case, bands):
    sizes, hidden, inter, block_m, block_n = case
    order = ME.tile_order(sizes, inter, hidden, block_m, block_n, *bands)
    m_tiles = sum(-(-r // block_m) for r in sizes if r > 0)
    for gemm, columns in ((1, -(-inter // (block_n // 2))), (2, -(-hidden // block_n))):
        tiles = [(m, n) for g, _, _, n, m in order if g == gemm]
        assert sorted(tiles) == [(m, n) for m in range(m_tiles) for n in range(columns)]
    # group and m-tile within it agree with the virtual m-tile
    firsts = np.concatenate([[0], np.cumsum([-(-r // block_m) if r > 0 else 0 for r in sizes])])
    assert all(firsts[g] + m == vm for _, g, m, _, vm in order)
    for ctas in (1, 2, 7, 33, 132):
        ME.replay(order, ctas)


def test_replay_catches_a_list_that_waits_on_itself():
    # the second GEMM's tiles first: a CTA waits for first-GEMM tiles behind it in its
    # own list (the order the kernel must never hand out)
    order = ME.tile_order([256], 128, 256, 128, 256)
    backwards = [t for t in order if t[0] == 2] + [t for t in order if t[0] == 1]
    with pytest.raises(RuntimeError, match="no CTA can go on"):
        ME.replay(backwards, 1)


def test_reference():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((10, 16)).astype(np.float32)
    w1 = rng.standard_normal((3, 8, 16)).astype(np.float32)
    w2 = rng.standard_normal((3, 16, 4)).astype(np.float32)
    out = ME.reference(x, w1, w2, [1, 4, 4, 9])
    h = x[4:9] @ w1[2].T
    act = h[:, :4] / (1 + np.exp(-h[:, :4])) * h[:, 4:]
    np.testing.assert_allclose(out[4:9], act @ w2[2].T, rtol=1e-5)
    assert not out[0].any() and not out[9].any()


# ---- GPU ------------------------------------------------------------------------------

def _operands(cupy, sizes, hidden, inter, seed, groups=None):
    from mkrt.kernels.gemm import from_float32
    rng = cupy.random.default_rng(seed)
    groups = groups or len(sizes)
    x = from_float32(rng.standard_normal((sum(sizes), hidden), dtype=np.float32), bfloat16)
    w1 = from_float32(rng.standard_normal((groups, 2 * inter, hidden), dtype=np.float32)
                      / np.sqrt(hidden), bfloat16)
    w2 = from_float32(rng.standard_normal((groups, hidden, inter), dtype=np.float32)
                      / np.sqrt(inter), bfloat16)
    return x, w1, w2, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)


def _error(out, ref, a, b):
    import cupy

    from mkrt.kernels.gemm import to_float32
    got, want = to_float32(out[a:b]), ref[a:b]
    return float(cupy.linalg.norm(got - want) / max(float(cupy.linalg.norm(want)), 1e-6))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ME.test_cases(), ids=lambda c: f"{len(c[0])}groups-{c[1]}-{c[2]}")
@pytest.mark.parametrize("block_m,block_n", [(64, 256), (128, 256), (64, 128), (128, 128)])
def test_matches_the_reference(case, block_m, block_n):
    import cupy

    from mkrt.kernels.gemm import poison, to_float32
    sizes, hidden, inter = case
    x, w1, w2, offsets = _operands(cupy, sizes, hidden, inter, seed=len(sizes) + hidden)
    out = poison(cupy.empty((x.shape[0], hidden), bfloat16))
    act = poison(cupy.empty((x.shape[0], inter), bfloat16))
    ME.grouped_mlp(x, w1, w2, offsets, out=out, act=act, block_m=block_m, block_n=block_n)
    cupy.cuda.Device().synchronize()
    assert bool(cupy.isfinite(to_float32(out)).all()), "rows left unwritten (still NaN)"
    assert _error(out, ME.reference(x, w1, w2, offsets), 0, x.shape[0]) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("sms", [None, 5])
def test_device_offsets_rows_outside_untouched_repeatable_and_graph_replay(sms):
    import cupy

    from mkrt.kernels.gemm import poison, to_float32
    sizes, hidden, inter = [0, 200, 77, 0, 300], 256, 384
    x, w1, w2, offsets = _operands(cupy, [13] + sizes + [9], hidden, inter, seed=5, groups=len(sizes))
    inner = cupy.asarray(offsets[1:-1])             # rows 0..12 and the last 9 are in no group
    out = poison(cupy.empty((x.shape[0], hidden), bfloat16))
    ME.grouped_mlp(x, w1, w2, inner, out=out, sms=sms)
    first = out.copy()
    a, b = int(offsets[1]), int(offsets[-2])
    assert _error(out, ME.reference(x, w1, w2, np.asarray(offsets[1:-1])), a, b) < 2e-2
    assert bool(cupy.isnan(to_float32(out[:a])).all()) and bool(cupy.isnan(to_float32(out[b:])).all())
    for _ in range(100):
        ME.grouped_mlp(x, w1, w2, inner, out=out, sms=sms)
    cupy.cuda.Device().synchronize()
    assert bool((out.view(np.uint16)[a:b] == first.view(np.uint16)[a:b]).all()), "calls differ"
    # captured once, replayed: each replay's counters start afresh
    stream = cupy.cuda.Stream(non_blocking=True)
    graph_out = poison(cupy.empty_like(out))
    act = cupy.empty((x.shape[0], inter), bfloat16)     # no allocation inside the capture
    with stream:
        ME.grouped_mlp(x, w1, w2, inner, out=graph_out, act=act, sms=sms)   # built before the capture
        stream.synchronize()
        stream.begin_capture()
        ME.grouped_mlp(x, w1, w2, inner, out=graph_out, act=act, sms=sms)
        graph = stream.end_capture()
    for _ in range(20):
        graph_out[...] = 0
        graph.launch(stream)
    stream.synchronize()
    assert bool((graph_out.view(np.uint16)[a:b] == first.view(np.uint16)[a:b]).all())


@pytest.mark.gpu
def test_agrees_with_the_two_grouped_gemms_and_swiglu():
    """The fused path against the separate one (grouped GEMM, SwiGLU of the rounded
    product, grouped GEMM): the same sums but for one rounding of the gate/up product."""
    import cupy

    from mkrt.kernels import grouped_gemm as GG
    from mkrt.kernels.gemm import from_float32, to_float32
    sizes, hidden, inter = [700, 0, 129, 1], 1024, 768
    x, w1, w2, offsets = _operands(cupy, sizes, hidden, inter, seed=11)
    fused = ME.grouped_mlp(x, w1, w2, offsets)
    h = to_float32(GG.grouped_gemm(x, w1, offsets))
    act = from_float32(h[:, :inter] / (1 + cupy.exp(-h[:, :inter])) * h[:, inter:], bfloat16)
    separate = GG.grouped_gemm(act, w2, offsets)
    ref = ME.reference(x, w1, w2, offsets)
    assert _error(fused, ref, 0, x.shape[0]) <= 1.1 * _error(separate, ref, 0, x.shape[0]) + 1e-3


@pytest.mark.gpu
def test_bad_arrays_raise_before_launch():
    import cupy
    x, w1, w2, offsets = _operands(cupy, [64, 64], 128, 64, seed=1)
    with pytest.raises(ValueError, match="C-contiguous"):
        ME.grouped_mlp(x[:, ::2], w1[:, :, ::2], w2[:, ::2], offsets)
    with pytest.raises(ValueError, match="out is"):
        ME.grouped_mlp(x, w1, w2, offsets, out=cupy.empty((128, 64), bfloat16))
    with pytest.raises(ValueError, match="act is"):
        ME.grouped_mlp(x, w1, w2, offsets, act=cupy.empty((128, 128), bfloat16))
    with pytest.raises(ValueError, match="nondecreasing"):
        ME.grouped_mlp(x, w1, w2, [0, 100, 64])
    with pytest.raises(ValueError, match="sms"):
        ME.grouped_mlp(x, w1, w2, offsets, sms=0)
