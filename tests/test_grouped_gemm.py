"""The grouped GEMM (MoE's expert GEMMs): compile and argument checks on the CPU;
correctness against a float32 reference on a GPU (empty groups, one-row groups, ragged
and hot groups, offsets from the device)."""

from __future__ import annotations

import numpy as np
import pytest

from mkrt.arrays import bfloat16
from mkrt.kernels import grouped_gemm as GG

F16 = np.dtype(np.float16)


@pytest.mark.parametrize("spec", GG.default_specs(), ids=lambda s: s.uri)
def test_default_specs_compile_without_spills(spec):
    build = spec.build(check_spills=True)
    resources = build.resources["grouped_gemm"]
    assert resources.spills == 0 and resources.stack_frame == 0, resources
    assert "serialized" not in build.log


@pytest.mark.parametrize("x,w,match", [
    (((64, 64), np.float32), ((2, 32, 64), np.float32), "dtype f32"),
    (((64, 64), F16), ((2, 32, 64), bfloat16), "one dtype"),
    (((64, 64), F16), ((32, 64), F16), r"\[G, N, K\]"),
    (((64, 64), F16), ((2, 32, 72), F16), "K=64, w has K=72"),
    (((64, 12), F16), ((2, 32, 12), F16), "multiple of 8"),
    (((64, 64), F16), ((2000, 8, 64), F16), "at most 1024"),
])
def test_bad_operands_are_refused(x, w, match):
    with pytest.raises((TypeError, ValueError), match=match):
        GG.check_operands(x[0], w[0], x[1], w[1])


def test_host_offsets_are_checked():
    assert GG.check_host_offsets([0, 3, 3, 10], 3, 10).dtype == np.int32
    for bad, match in (([0, 3, 10], "4 values"), ([0, 5, 3, 10], "nondecreasing"),
                       ([-1, 3, 5, 10], "nondecreasing"), ([0, 3, 5, 11], "nondecreasing"),
                       ([0.0, 1.5, 2.0, 3.0], "integers")):
        with pytest.raises((TypeError, ValueError), match=match):
            GG.check_host_offsets(bad, 3, 10)


def test_band_rule():
    # a weight that stays in L2 goes m-tile-major; one too large for it in bands of 8
    assert GG.band_m_tiles(1536, 2048) == 1 and GG.band_m_tiles(2048, 768) == 1      # Qwen3-30B
    assert GG.band_m_tiles(28672, 4096) == 8 and GG.band_m_tiles(4096, 14336) == 8   # Mixtral
    # the test cases run both orders, and the banded one with a band cut short
    banded = [c for c in GG.test_cases() if GG.band_m_tiles(c[1], c[2]) == 8]
    assert banded and any(-(-rows // 128) % 8 for rows in banded[0][0] if rows)
    assert any(GG.band_m_tiles(c[1], c[2]) == 1 for c in GG.test_cases())


@pytest.mark.parametrize("group_m", [1, 8])
def test_tile_order_covers_every_tile_once(group_m):
    rng = np.random.default_rng(group_m)
    for sizes in ([0, 1, 0, 300, 17], [1300, 0, 129], list(rng.integers(0, 2000, 12))):
        order = GG.tile_order(sizes, 1000, 128, 256, group_m)
        expected = {(g, m, nt) for g, rows in enumerate(sizes) for m in range(-(-rows // 128))
                    for nt in range(4)}
        assert sorted(t[:3] for t in order) == sorted(expected) and len(order) == len(expected)
        starts = np.concatenate([[0], np.cumsum(sizes)])
        assert all(starts[g] <= row < starts[g + 1] for g, _, _, row in order)
        # groups in order; inside a band, consecutive tiles share the n-tile (the weight tile)
        assert [t[0] for t in order] == sorted(t[0] for t in order)
    order = GG.tile_order([128 * 20], 1024, 128, 256, group_m)
    if group_m == 1:
        assert order[:4] == [(0, 0, n, 0) for n in range(4)]           # m-tile major
    else:
        assert [t[1:3] for t in order[:9]] == [(m, 0) for m in range(8)] + [(0, 1)]


@pytest.mark.parametrize("group_m", [1, 4])
def test_paired_tile_order_covers_every_tile_once_and_pairs_within_a_group(group_m):
    rng = np.random.default_rng(7 + group_m)
    for sizes in ([0, 1, 0, 300, 17], [1300, 0, 129], [256, 256], list(rng.integers(0, 2000, 12))):
        order = GG.tile_order(sizes, 1000, 128, 256, group_m, cluster_m=2)
        starts = np.concatenate([[0], np.cumsum(sizes)])
        real = [t for t in order if t[3] < starts[t[0] + 1]]
        ghosts = [t for t in order if t[3] >= starts[t[0] + 1]]
        expected = {(g, m, nt) for g, rows in enumerate(sizes) for m in range(-(-rows // 128))
                    for nt in range(4)}
        assert sorted(t[:3] for t in real) == sorted(expected) and len(real) == len(expected)
        # a tile past its group's rows only as the second of a pair, in groups of odd m-tiles
        odd = {g for g, rows in enumerate(sizes) if -(-rows // 128) % 2}
        assert sorted(t[:3] for t in ghosts) == sorted(
            (g, -(-sizes[g] // 128), nt) for g in odd for nt in range(4))
        # the two CTAs of a cluster: one group, one n-tile (one weight tile), m-tiles 2p, 2p + 1
        for first, second in zip(order[::2], order[1::2]):
            assert (first[0], first[2]) == (second[0], second[2])
            assert first[1] % 2 == 0 and second[1] == first[1] + 1


def test_tile_rule_counts_whole_waves():
    # Mixtral's w2 on a rank: 2 experts, 2048 rows, N 4096: 128x256 tiles make about 17 x 16 =
    # 272 tiles, a third wave of 8 on 132 SMs; 64x256 tiles make 33 x 16 = 528, four waves
    assert GG.expected_m_tiles(2048, 2, 128) == 17 and GG.expected_m_tiles(2048, 2, 64) == 33
    assert GG.choose_tile(2048, 2, 4096, 132) == (64, 256)
    # on 128 SMs: 3 waves of 128x256, or 5 of half tiles (64x256: 528, 128x128: 544); of the
    # two half tiles the more efficient
    assert GG.choose_tile(2048, 2, 4096, 128) == (128, 128)
    # decode: every expert one tile whatever its rows; the narrower row tile wastes less
    assert GG.expected_m_tiles(128, 32, 128) == GG.expected_m_tiles(128, 32, 64) == 32
    assert GG.choose_tile(128, 32, 4096, 132)[0] == 64
    assert GG.choose_tile(0, 8, 4096, 132) == (64, 256)       # nothing to do: any valid tile
    for rows, groups, n in ((1, 1, 8), (100000, 256, 7168), (4096, 32, 130)):
        assert GG.choose_tile(rows, groups, n, 132) in GG.TILE_EFFICIENCY
    # an explicit side keeps the other's old default
    assert GG._tile(2048, 2, 4096, 132, None, 128) == (128, 128)
    assert GG._tile(2048, 2, 4096, 132, 64, None) == (64, 256)


@pytest.mark.parametrize("tiles,ctas,k_blocks,max_parts", [
    (272, 132, 224, 16), (272, 132, 224, 132), (96, 132, 64, 4), (5, 132, 3, 16), (263, 132, 1, 8),
    (1, 7, 1000, 132), (264, 132, 16, 16), (40, 7, 5, 2)])
def test_stream_k_share_computes_every_k_block_once_within_the_workspace(tiles, ctas, k_blocks, max_parts):
    """GroupedStreamKWork's share (in Python): the full waves whole, the tail's k-blocks over
    at most max_parts CTAs a tail tile, every k-block once, each tile's parts in CTA order,
    and no tile with more parts than the slot width the workspace was sized for."""
    from mkrt.kernels.gemm import stream_k_items
    whole, sharing, splits = GG.stream_k_share(tiles, ctas, k_blocks, max_parts)
    tail = tiles - whole
    assert whole == tiles // ctas * ctas and sharing <= max(1, tail * max_parts) and sharing <= ctas
    items = stream_k_items(tiles, k_blocks, ctas, sharing, whole)
    seen = {}
    for c, cta_items in enumerate(items):
        for tile, begin, end, part, parts in cta_items:
            assert parts <= splits
            if parts > 1:
                assert tile >= whole and c < sharing
            for kb in range(begin, end):
                assert (tile, kb) not in seen
                seen[(tile, kb)] = (c, part)
    assert len(seen) == tiles * k_blocks
    for tile in range(whole, tiles):
        owners = sorted({seen[(tile, kb)] for kb in range(k_blocks)})
        assert [part for _, part in owners] == list(range(len(owners)))
    assert tail * splits <= GG.stream_k_slots(ctas, k_blocks, max_parts, tiles) or tail == 0


def test_stream_k_spec_and_options():
    spec = GG.spec_for("bf16", 128, 256, "direct", "", "streamk")
    assert spec.uri.endswith("_direct_streamk_sm90a") and spec.params()["STREAM_K"]
    assert not GG.spec_for("bf16", 128, 256).params()["STREAM_K"]
    with pytest.raises(ValueError, match="one CTA per tile"):
        GG.spec_for("bf16", 128, 256, "direct", "m2", "streamk")
    with pytest.raises(ValueError, match="split"):
        GG.spec_for("bf16", 128, 256, "direct", "", "splitk")
    with pytest.raises(ValueError, match="True, False or None"):
        GG._stream_k(1, 2048, 2, 4096, 14336, 132, (128, 256), "")
    with pytest.raises(ValueError, match="cluster"):
        GG._stream_k(True, 2048, 2, 4096, 14336, 132, (128, 256), "m2")
    with pytest.raises(ValueError, match="32-bit"):
        GG._stream_k(True, 2048, 2, 4096, 1 << 23, 132, (128, 256), "")
    assert GG._stream_k(False, 2048, 2, 4096, 14336, 132, (128, 256), "") is False
    with pytest.raises(ValueError, match="needs k"):
        GG.build(2048, 2, 4096, "bf16", 0, 132)


def test_block_m_rule_and_reference():
    assert GG.choose_block_m(256 * 8, 256) == 64 and GG.choose_block_m(4096, 8) == 128
    rng = np.random.default_rng(0)
    x = rng.standard_normal((10, 16)).astype(np.float32)
    w = rng.standard_normal((3, 5, 16)).astype(np.float32)
    out = GG.reference(x, w, [1, 4, 4, 9])
    np.testing.assert_allclose(out[1:4], x[1:4] @ w[0].T, rtol=1e-6)
    np.testing.assert_allclose(out[4:9], x[4:9] @ w[2].T, rtol=1e-6)
    assert not out[0].any() and not out[9].any()


# ---- GPU ------------------------------------------------------------------------------

def _operands(cupy, sizes, n, k, dtype, seed):
    from mkrt.kernels.gemm import from_float32
    rng = cupy.random.default_rng(seed)
    np_dtype = bfloat16 if dtype == "bf16" else np.float16
    x = from_float32(rng.standard_normal((sum(sizes), k), dtype=np.float32), np_dtype)
    w = from_float32(rng.standard_normal((len(sizes), n, k), dtype=np.float32) / 8, np_dtype)
    return x, w, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)


def _error(out, ref, offsets):
    import cupy

    from mkrt.kernels.gemm import to_float32
    a, b = int(offsets[0]), int(offsets[-1])
    got, want = to_float32(out[a:b]), ref[a:b]
    return float(cupy.linalg.norm(got - want) / max(float(cupy.linalg.norm(want)), 1e-6))


@pytest.mark.gpu
@pytest.mark.parametrize("case", GG.test_cases(), ids=lambda c: f"{len(c[0])}groups-{c[1]}x{c[2]}-{c[3]}")
@pytest.mark.parametrize("block_m,block_n", [(64, 256), (128, 256), (64, 128), (128, 128)])
@pytest.mark.parametrize("epilogue", ["direct", "tma"])
@pytest.mark.parametrize("cluster", ["", "m2"])
def test_matches_the_reference(case, block_m, block_n, epilogue, cluster):
    import cupy

    from mkrt.kernels.gemm import poison
    sizes, n, k, dtype = case
    if epilogue == "tma" and n % 8:
        pytest.skip("TMA stores need N % 8 == 0")
    x, w, offsets = _operands(cupy, sizes, n, k, dtype, seed=len(sizes) + n)
    out = poison(cupy.empty((x.shape[0], n), x.dtype))
    GG.grouped_gemm(x, w, offsets, out=out, block_m=block_m, block_n=block_n, epilogue=epilogue,
                    cluster=cluster)
    cupy.cuda.Device().synchronize()
    from mkrt.kernels.gemm import to_float32
    assert bool(cupy.isfinite(to_float32(out)).all()), "rows left unwritten (still NaN)"
    assert _error(out, GG.reference(x, w, offsets), offsets) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("epilogue", ["direct", "tma"])
@pytest.mark.parametrize("cluster", ["", "m2"])
def test_device_offsets_rows_outside_untouched_and_repeatable(epilogue, cluster):
    """Rows outside the groups keep their values (with TMA stores too: a tile that would
    cross its group's end is stored directly, so the neighbours' rows stay as they are;
    with clusters, a group's tile past its rows stores nothing)."""
    import cupy
    x, w, offsets = _operands(cupy, [40, 0, 300, 7], 264, 128, "bf16", seed=3)
    inner = cupy.asarray(np.array([8, 40, 40, 300, 320], np.int32))    # rows 8..320 only
    out = cupy.full((x.shape[0], 264), 7, dtype=cupy.uint16).view(x.dtype)
    first = GG.grouped_gemm(x, w, inner, out=out, epilogue=epilogue, block_m=64,
                            cluster=cluster).copy()
    assert bool((first.view(cupy.uint16)[:8] == 7).all()) and bool((first.view(cupy.uint16)[320:] == 7).all())
    for _ in range(20):
        again = GG.grouped_gemm(x, w, inner, out=out, epilogue=epilogue, block_m=64,
                                cluster=cluster)
    assert bool((again.view(cupy.uint16) == first.view(cupy.uint16)).all())
    assert _error(first, GG.reference(x, w, inner.get()), inner.get()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("case", GG.test_cases(), ids=lambda c: f"{len(c[0])}groups-{c[1]}x{c[2]}-{c[3]}")
@pytest.mark.parametrize("block_m,block_n,epilogue", [(128, 256, "direct"), (64, 128, "tma")])
@pytest.mark.parametrize("sms,max_parts", [(None, 16), (7, 3), (100, 132)])
def test_stream_k_matches_the_reference_and_repeats_bit_for_bit(case, block_m, block_n, epilogue,
                                                                sms, max_parts, monkeypatch):
    import cupy

    from mkrt.kernels.gemm import poison, to_float32
    sizes, n, k, dtype = case
    if epilogue == "tma" and n % 8:
        pytest.skip("TMA stores need N % 8 == 0")
    monkeypatch.setattr(GG, "STREAM_K_MAX_PARTS", max_parts)
    x, w, offsets = _operands(cupy, sizes, n, k, dtype, seed=len(sizes) + k)
    device_offsets = cupy.asarray(offsets)
    out = poison(cupy.empty((x.shape[0], n), x.dtype))
    call = dict(out=out, block_m=block_m, block_n=block_n, epilogue=epilogue, sms=sms, stream_k=True)
    first = GG.grouped_gemm(x, w, device_offsets, **call).copy()
    assert bool(cupy.isfinite(to_float32(first)).all()), "rows left unwritten (still NaN)"
    assert _error(first, GG.reference(x, w, offsets), offsets) < 1e-2
    for _ in range(3):
        again = GG.grouped_gemm(x, w, device_offsets, **call)
    assert bool((again.view(cupy.uint16) == first.view(cupy.uint16)).all())


@pytest.mark.gpu
def test_stream_k_leaves_rows_outside_the_groups_and_keeps_streams_apart():
    import cupy
    x, w, offsets = _operands(cupy, [300, 0, 1000, 7], 512, 4096, "bf16", seed=5)
    inner = cupy.asarray(np.array([8, 300, 300, 1300, 1307], np.int32))
    want = GG.reference(x, w, inner.get())
    outs = [cupy.full((x.shape[0], 512), 7, dtype=cupy.uint16).view(x.dtype) for _ in range(2)]
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    for _ in range(5):                 # one signature on two streams at once: own workspaces
        for out, stream in zip(outs, streams):
            GG.grouped_gemm(x, w, inner, out=out, stream_k=True, stream=stream)
    cupy.cuda.Device().synchronize()
    for out in outs:
        assert bool((out.view(cupy.uint16)[:8] == 7).all())
        assert bool((out.view(cupy.uint16)[1307:] == 7).all())
        assert _error(out, want, inner.get()) < 1e-2
    assert bool((outs[0].view(cupy.uint16) == outs[1].view(cupy.uint16)).all())


@pytest.mark.gpu
def test_against_torch_grouped_mm():
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("no torch._grouped_mm")
    sizes = [128, 256, 0, 384]
    x = torch.randn(sum(sizes), 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(len(sizes), 1024, 512, device="cuda", dtype=torch.bfloat16) / 8
    ends = torch.tensor(np.cumsum(sizes), device="cuda", dtype=torch.int32)
    theirs = torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)
    ours = GG.grouped_gemm(x, w, np.concatenate([[0], np.cumsum(sizes)]))
    assert isinstance(ours, torch.Tensor)
    assert ((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max()).item() < 1e-2
    # torch out= and device offsets (read through TorchView, no DLPack): out comes back as is
    out = torch.full_like(theirs, float("nan"))
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(sizes)]), device="cuda", dtype=torch.int32)
    assert GG.grouped_gemm(x, w, offsets, out=out) is out
    torch.cuda.synchronize()
    assert torch.equal(out, ours)
    with pytest.raises(ValueError, match="int32"):
        GG.grouped_gemm(x, w, offsets.to(torch.int64), out=out)
    with pytest.raises(ValueError, match="C-contiguous"):
        GG.grouped_gemm(x, w, offsets, out=torch.empty(theirs.shape[::-1], device="cuda", dtype=theirs.dtype).T)


@pytest.mark.gpu
def test_bad_arrays_raise_before_launch():
    import cupy
    x, w, offsets = _operands(cupy, [16, 16], 64, 64, "bf16", seed=1)
    with pytest.raises(ValueError, match="int32 array of 3"):
        GG.grouped_gemm(x, w, cupy.asarray(offsets.astype(np.int64)))
    with pytest.raises(ValueError, match="nondecreasing"):
        GG.grouped_gemm(x, w, [0, 20, 10])
    with pytest.raises(ValueError, match="out is"):
        GG.grouped_gemm(x, w, offsets, out=cupy.empty((32, 32), x.dtype))
    with pytest.raises(ValueError, match="block_m"):
        GG.grouped_gemm(x, w, offsets, block_m=96)
    with pytest.raises(ValueError, match="block_n"):
        GG.grouped_gemm(x, w, offsets, block_n=192)
    with pytest.raises(ValueError, match="epilogue"):
        GG.grouped_gemm(x, w, offsets, epilogue="splitk")
    with pytest.raises(ValueError, match="cluster"):
        GG.grouped_gemm(x, w, offsets, cluster="m4")
    with pytest.raises(ValueError, match="sms >= 2"):
        GG.grouped_gemm(x, w, offsets, cluster="m2", sms=1)
    x2, w2, offsets2 = _operands(cupy, [16, 16], 60, 64, "bf16", seed=1)
    with pytest.raises(ValueError, match="N % 8"):
        GG.grouped_gemm(x2, w2, offsets2, epilogue="tma")


def test_every_tile_fits_beside_the_kernels_own_shared_memory():
    """The kernel's static tile_prefix counts against the 227 KiB too: 128x128 tiles with the
    engine's 7 stages needed 234,612 bytes and failed to load (ac8a8da)."""
    from mkrt.kernels import gemm as gemm_module
    for block_m in (64, 128):
        for block_n in (128, 256):
            for epilogue in GG.EPILOGUES:
                spec = GG.spec_for("bf16", block_m, block_n, epilogue)
                assert spec.smem_bytes + GG.STATIC_SMEM_BYTES <= gemm_module.SMEM_LIMIT
                assert spec.stages >= (4 if epilogue == "direct" else 3)
    with pytest.raises(ValueError, match="shared memory"):
        GG.GroupedGemmSpec("bf16", "nk", 128, 128, 7)


def test_epilogue_rule():
    """TMA stores where groups average 256 rows or more and N allows them, direct below."""
    assert GG.choose_epilogue(4096, 32, 4096) == "direct"          # DeepSeek, 128 rows a group
    assert GG.choose_epilogue(8192, 16, 768) == "tma"              # Qwen3, 512
    assert GG.choose_epilogue(256 * 4, 4, 5120) == "tma"           # the threshold itself
    assert GG.choose_epilogue(256 * 4 - 1, 4, 5120) == "direct"
    assert GG.choose_epilogue(8192, 2, 4100) == "direct"           # N % 8: no TMA stores
    with pytest.raises(ValueError, match="N % 8"):
        GG._epilogue("tma", 8192, 2, 4100)
    assert GG._epilogue("direct", 8192, 2, 4096) == "direct"       # what is asked for wins
