"""The Hopper GEMM engine: compile checks and planning on the CPU, correctness on a GPU."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mkrt.arrays import bfloat16
from mkrt.kernels import gemm as G


# ---- CPU ------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", G.default_specs(), ids=lambda s: s.uri)
def test_default_specs_compile_without_spills(spec):
    build = spec.build(check_spills=True)
    resources = build.resources["gemm"]
    assert resources.spills == 0 and resources.stack_frame == 0, resources
    # wgmma serialisation would show up as a ptxas performance warning
    assert "serialized" not in build.log, build.log


def test_uri_names_every_code_changing_field():
    spec = G.GemmSpec("f16", "kn", 128, 128, 6, "direct")
    assert spec.uri == "gemm_f16_kn_bm128_bn128_s6_direct_sm90a"
    assert G.GemmSpec().uri == "gemm_bf16_nk_bm128_bn256_s3_tma_sm90a"
    assert spec.threads == 384
    assert spec.smem_bytes == 1024 + 6 * (128 + 128) * 128 + 6 * 16
    assert G.GemmSpec(epilogue="tma").smem_bytes == 1024 + 3 * 384 * 128 + 128 * 256 * 2 + 3 * 16
    assert G.max_stages(128, 256, "tma") == 3 and G.max_stages(128, 256, "direct") == 4
    for spec in G.default_specs():
        assert spec.smem_bytes <= G.SMEM_LIMIT


@pytest.mark.parametrize("kwargs", [dict(dtype="f32"), dict(b_layout="mk"), dict(block_m=96),
                                    dict(block_n=320), dict(block_n=100), dict(stages=1),
                                    dict(stages=6), dict(stages=4, epilogue="tma"),
                                    dict(epilogue="smem"), dict(block_m=256, block_n=256),
                                    dict(block_m=512, block_n=128), dict(cluster="m4")])
def test_spec_refuses_bad_configurations(kwargs):
    with pytest.raises(ValueError, match="^mkrt.gemm:"):
        G.GemmSpec(**kwargs)


def test_plan_tiles_and_grid():
    p = G.plan(8192, 8192, 8192, sms=132)
    assert (p.tiles_m, p.tiles_n, p.grid) == (64, 32, 132)
    p = G.plan(257, 513, 72, sms=132)
    assert (p.tiles_m, p.tiles_n, p.grid) == (3, 3, 9)
    p = G.plan(100, 30, 8, b_layout="kn", sms=100)
    assert p.pad_n == 32 and p.grid == 1
    assert G.plan(100, 30, 8, b_layout="nk").pad_n == 30
    assert G.plan(8192, 8192, 512, sms=116).grid == 116
    assert G.plan(64, 64, 64).spec.epilogue == "tma"
    assert G.plan(64, 63, 64).spec.epilogue == "direct"
    assert G.plan(64, 63, 64).spec.stages == 4
    with pytest.raises(ValueError, match="^mkrt.gemm: epilogue='tma' needs n % 8 == 0; got n=63"):
        G.plan(64, 63, 64, epilogue="tma")


@pytest.mark.parametrize("m,n,k,sms,match", [(0, 8, 8, 1, "m=0"), (8, 8, 12, 1, "k=12"),
                                             (8, 8, 8, 0, "sms=0"), (8, -1, 8, 1, "n=-1")])
def test_plan_refuses_bad_shapes(m, n, k, sms, match):
    with pytest.raises(ValueError, match=f"^mkrt.gemm: {match}"):
        G.plan(m, n, k, sms=sms)


def test_check_operands():
    bf, f16 = bfloat16, np.float16
    assert G.check_operands((5, 16), (16, 7), bf, bf, "kn") == (5, 7, 16, "bf16")
    assert G.check_operands((5, 16), (7, 16), f16, f16, "nk") == (5, 7, 16, "f16")
    with pytest.raises(ValueError, match="^mkrt.gemm: .*disagree on K: 16 != 7"):
        G.check_operands((5, 16), (16, 7), bf, bf, "nk")
    with pytest.raises(TypeError, match="^mkrt.gemm: a has dtype f32"):
        G.check_operands((5, 16), (16, 7), np.float32, np.float32, "kn")
    with pytest.raises(TypeError, match="^mkrt.gemm: a is bf16 but b is f16"):
        G.check_operands((5, 16), (16, 7), bf, f16, "kn")
    with pytest.raises(ValueError, match="^mkrt.gemm: b_layout='mn'"):
        G.check_operands((5, 16), (16, 7), bf, bf, "mn")
    with pytest.raises(ValueError, match="^mkrt.gemm: a and b must be 2-D"):
        G.check_operands((5, 16, 1), (16, 7), bf, bf, "kn")
    with pytest.raises(ValueError, match=r"^mkrt.gemm: out.shape=\(5, 8\)"):
        G.check_operands((5, 16), (16, 7), bf, bf, "kn", out_shape=(5, 8), out_dtype=bf)
    with pytest.raises(TypeError, match="^mkrt.gemm: out has dtype f16"):
        G.check_operands((5, 16), (16, 7), bf, bf, "kn", out_shape=(5, 7), out_dtype=f16)


def test_host_arrays_are_refused_before_any_launch():
    a = np.ones((8, 8), dtype=np.float16)
    with pytest.raises(TypeError, match="host numpy array"):
        G.gemm(a, a)


def test_bf16_bit_conversions_on_host():
    x = np.array([1.0, -2.5, 3.14159, 1e-3, 65504.0], dtype=np.float32)
    y = G.from_float32(x, bfloat16)
    assert y.dtype == bfloat16
    np.testing.assert_array_equal(y, x.astype(bfloat16))
    np.testing.assert_array_equal(G.to_float32(y), x.astype(bfloat16).astype(np.float32))
    assert np.isnan(G.to_float32(G.poison(y.copy()))).all()
    assert np.isnan(G.poison(np.zeros(3, np.float16)).astype(np.float32)).all()


def test_reference_layouts_on_host():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((5, 16)).astype(np.float32)
    b = rng.standard_normal((16, 7)).astype(np.float32)
    np.testing.assert_allclose(G.reference(a, b, b_layout="kn"), a @ b, rtol=1e-6)
    np.testing.assert_allclose(G.reference(a, b.T.copy(), b_layout="nk"), a @ b, rtol=1e-6)


# ---- GPU ------------------------------------------------------------------------------

def _random(shape, dtype, seed):
    import cupy
    rng = cupy.random.default_rng(seed)
    return G.from_float32(rng.standard_normal(shape, dtype=cupy.float32), dtype)


def _np_dtype(name):
    return bfloat16 if name == "bf16" else np.dtype(np.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,b_layout,dtype", G.test_cases(),
                         ids=lambda v: str(v))
@pytest.mark.parametrize("epilogue", ["auto", "direct"])
def test_gemm_matches_float32_reference(m, n, k, b_layout, dtype, epilogue):
    import cupy
    seed = 7 * m + 13 * n + k + (b_layout == "kn")
    a = _random((m, k), _np_dtype(dtype), seed)
    b = _random((k, n) if b_layout == "kn" else (n, k), _np_dtype(dtype), seed + 1)
    out = G.poison(cupy.empty((m, n), dtype=_np_dtype(dtype)))
    result = G.gemm(a, b, out, b_layout=b_layout, epilogue=epilogue)
    assert result is out
    got = G.to_float32(out)
    assert not bool(cupy.isnan(got).any()), "unwritten outputs (NaN poison survived)"
    ref = G.reference(a, b, b_layout=b_layout)
    error = float(cupy.linalg.norm(got - ref) / cupy.linalg.norm(ref))
    assert error <= 1e-2, f"relative Frobenius error {error:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("sms", [1, 7, 100, 116])
@pytest.mark.parametrize("epilogue", ["tma", "direct"])
def test_gemm_with_fewer_ctas(sms, epilogue):
    import cupy
    a = _random((1000, 520), bfloat16, 1)
    b = _random((776, 520), bfloat16, 2)
    out = G.poison(cupy.empty((1000, 776), dtype=bfloat16))
    G.gemm(a, b, out, b_layout="nk", sms=sms, group_m=3, epilogue=epilogue)
    got = G.to_float32(out)
    ref = G.reference(a, b, b_layout="nk")
    assert not bool(cupy.isnan(got).any())
    assert float(cupy.linalg.norm(got - ref) / cupy.linalg.norm(ref)) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("block_m,block_n", [(128, 192), (128, 128), (64, 256), (64, 128), (256, 128)])
@pytest.mark.parametrize("b_layout,epilogue", [("nk", "tma"), ("kn", "direct")])
def test_every_tile_configuration_matches_the_reference(block_m, block_n, b_layout, epilogue):
    """The tiles experiments/gemm_tune.py sweeps, on a shape with partial tiles on every
    side (M, N, K not multiples of the tile or of 64)."""
    import cupy
    m, n, k = 333, 712, 264
    a = _random((m, k), bfloat16, 5)
    b = _random((k, n) if b_layout == "kn" else (n, k), bfloat16, 6)
    out = G.poison(cupy.empty((m, n), dtype=bfloat16))
    G.gemm(a, b, out, b_layout=b_layout, block_m=block_m, block_n=block_n, epilogue=epilogue)
    got = G.to_float32(out)
    ref = G.reference(a, b, b_layout=b_layout)
    assert not bool(cupy.isnan(got).any())
    assert float(cupy.linalg.norm(got - ref) / cupy.linalg.norm(ref)) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("block_n", [144, 160, 176, 208, 224, 240])
@pytest.mark.parametrize("cluster,dtype", [("", "bf16"), ("m2", "f16"), ("m2", "bf16")])
def test_trimmed_widths_match_the_reference(block_n, cluster, dtype):
    """Tiles trimmed to a multiple of 16 (B [N, K], direct stores), alone and in clusters of
    two, on a shape with partial tiles on every side and an odd tile-row count (the last
    pair's second tile lies past M)."""
    import cupy
    m, n, k = 333, 1001, 4104
    a = _random((m, k), _np_dtype(dtype), 11)
    b = _random((n, k), _np_dtype(dtype), 12)
    out = G.poison(cupy.empty((m, n), dtype=_np_dtype(dtype)))
    G.gemm(a, b, out, b_layout="nk", block_m=128, block_n=block_n, cluster=cluster, split_k=1)
    got = G.to_float32(out)
    ref = G.reference(a, b, b_layout="nk")
    assert not bool(cupy.isnan(got).any())
    assert float(cupy.linalg.norm(got - ref) / cupy.linalg.norm(ref)) <= 1e-2


#: the issue's odd sizes: M and N from ODD_SIZES, K from ODD_K
ODD_SIZES = (1, 7, 127, 129, 1000, 4097)
ODD_K = (8, 24, 4104)


def _configurations(b_layout):
    """Every configuration the rule or a tuned table can name for a layout: each tile, alone
    and in pairs, whole and in 2 parts of K; with B [N, K] the trimmed widths too."""
    from mkrt.kernels import gemm_rule
    configs = [dict(block_m=bm, block_n=bn, cluster=cluster, split_k=split)
               for bm, bn in gemm_rule.TILES for cluster in gemm_rule.CLUSTERS for split in (1, 2)]
    if b_layout == "nk":
        configs += [dict(block_m=128, block_n=width, cluster=cluster, split_k=1)
                    for width in gemm_rule.TRIM_WIDTHS for cluster in gemm_rule.CLUSTERS]
    return configs


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("b_layout", ["nk", "kn"])
def test_every_configuration_on_odd_sizes_matches_float64(dtype, b_layout):
    """M, N in ODD_SIZES and K in ODD_K (108 shapes), each against one float64 product, with
    every configuration of _configurations (outputs poisoned first)."""
    import cupy
    failures = []
    configs = _configurations(b_layout)
    for m in ODD_SIZES:
        for n in ODD_SIZES:
            for k in ODD_K:
                a = _random((m, k), _np_dtype(dtype), m + 3 * n + 7 * k)
                b = _random((k, n) if b_layout == "kn" else (n, k), _np_dtype(dtype), m + n + k + 1)
                b64 = G.to_float32(b).astype(cupy.float64)
                ref = G.to_float32(a).astype(cupy.float64) @ (b64 if b_layout == "kn" else b64.T)
                norm = max(float(cupy.linalg.norm(ref)), 1e-30)
                out = cupy.empty((m, n), dtype=_np_dtype(dtype))
                for config in configs:
                    G.poison(out)
                    G.gemm(a, b, out, b_layout=b_layout, split_tail=False, **config)
                    got = G.to_float32(out).astype(cupy.float64)
                    error = float(cupy.linalg.norm(got - ref)) / norm
                    if not error <= 1e-2:           # NaN (an unwritten output) fails too
                        failures.append(f"{m}x{n}x{k} {config}: {error:.2e}")
    assert not failures, f"{len(failures)} failures: " + "; ".join(failures[:10])


@pytest.mark.gpu
def test_gemm_allocates_output_and_refuses_before_launch():
    import cupy
    a = _random((64, 64), bfloat16, 3)
    b = _random((64, 32), bfloat16, 4)
    c = G.gemm(a, b)
    assert c.shape == (64, 32) and c.dtype == bfloat16
    with pytest.raises(ValueError, match="^mkrt.gemm: .*not C-contiguous"):
        G.gemm(a[:, ::2], b[::2])
    with pytest.raises(ValueError, match="^mkrt.gemm: k=60"):
        G.gemm(a.view(cupy.uint16)[:, :60].copy().view(bfloat16),
               b.view(cupy.uint16)[:60].copy().view(bfloat16))
    with pytest.raises(ValueError, match="^mkrt.gemm: sms=999"):
        G.gemm(a, b, sms=999)


def test_split_k_plan():
    p = G.plan(64, 4096, 8192, sms=132, split_k=4)
    assert (p.spec.epilogue, p.spec.split, p.splits, p.grid) == ("direct", "splitk", 4,
                                                                 min(132, p.tiles * 4))
    assert (p.whole_units, p.split_slots) == (0, p.tiles)                # every tile split
    assert G.plan(64, 4096, 100 * 8, split_k=64).splits == 13          # one part per k-block at most
    p = G.plan(64, 4096, 8192)
    assert (p.splits, p.spec.split, p.whole_units, p.split_slots) == (1, "", p.tiles, 0)
    for bad, match in ((dict(split_k=0), "split_k"), (dict(split_k=2.0), "split_k"),
                       (dict(split_k=True), "split_k"), (dict(epilogue="splitk"), "epilogue"),
                       (dict(split_tail=True), "split_k > 1"), (dict(split_k=2, split_tail=1), "split_tail")):
        with pytest.raises(ValueError, match=match):
            G.plan(64, 4096, 8192, **bad)


def test_split_tail_plan():
    """split_tail: the full waves run whole tiles, only the last partial wave is split."""
    # 24 x 20 = 480 tiles on 132 SMs: 3 whole waves (396 tiles), 84 tiles in 3 parts
    p = G.plan(3000, 5000, 7000, block_m=128, block_n=256, split_k=3, split_tail=True)
    assert (p.spec.epilogue, p.spec.split, p.grid) == ("tma", "splitk", 132)
    assert (p.units, p.whole_units, p.split_slots) == (480, 396, 84)
    # clusters: 12 pair rows x 20 = 240 units on 66 clusters: 3 waves whole, 42 split pairs
    p = G.plan(3000, 5000, 7000, block_m=128, block_n=256, split_k=3, split_tail=True, cluster="m2")
    assert (p.grid, p.units, p.whole_units, p.split_slots) == (132, 240, 198, 84)
    # the cluster grid cut to what the GPU holds (as _PreparedGemm does) moves the tail
    cut = dataclasses.replace(p, grid=112)                       # 56 clusters: 4 whole waves
    assert (cut.whole_units, cut.split_slots) == (224, 32)
    # a whole number of waves has no tail: nothing split, the plain kernel
    p = G.plan(128 * 12, 256 * 11, 1024, block_m=128, block_n=256, split_k=4, split_tail=True)
    assert (p.splits, p.spec.split, p.split_tail, p.whole_units) == (1, "", False, 132)
    # fewer tiles than SMs: every tile is in the tail
    p = G.plan(256, 1024, 4096, block_m=128, block_n=256, split_k=4, split_tail=True)
    assert (p.whole_units, p.split_slots, p.grid) == (0, 8, 32)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,split_k,b_layout,options", [
    (16, 4096, 8192, 4, "nk", {}), (100, 776, 1000, 3, "kn", {}), (333, 712, 264, 5, "nk", {}),
    (64, 512, 128, 8, "nk", {}),
    # only the last wave split (odd edges, both layouts, TMA and direct whole stores)
    (3000, 5000, 1000, 3, "nk", dict(split_tail=True, block_m=128, block_n=256)),
    (1999, 2056, 520, 2, "kn", dict(split_tail=True, block_m=128, block_n=192, sms=37)),
    (1000, 1001, 776, 4, "nk", dict(split_tail=True, block_m=64, block_n=128, sms=50)),
    # clusters of two with the tail split (odd tile rows: the last pair's second tile is empty)
    (1664, 5000, 1000, 3, "nk", dict(split_tail=True, block_m=128, block_n=256, cluster="m2")),
    (1200, 3000, 640, 2, "kn", dict(split_tail=True, block_m=128, block_n=192, cluster="m2", sms=42)),
    (333, 712, 264, 3, "nk", dict(cluster="m2")),
])
def test_split_k_matches_the_reference_and_repeats_bit_for_bit(m, n, k, split_k, b_layout, options):
    """Parts of a tile's K on different CTAs, added in a fixed order: right against float32,
    and the same bits on every call (whichever part arrives last)."""
    import cupy
    a = _random((m, k), bfloat16, 11)
    b = _random((k, n) if b_layout == "kn" else (n, k), bfloat16, 12)
    out = G.poison(cupy.empty((m, n), dtype=bfloat16))
    p = G.call_plan(a, b, out, b_layout=b_layout, split_k=split_k, **options)
    assert p.splits == min(split_k, -(-k // 64)) and p.split_slots > 0
    if options.get("split_tail"):
        assert p.whole_units > 0
    G.gemm(a, b, out, b_layout=b_layout, split_k=split_k, **options)
    first = out.copy()
    got = G.to_float32(out)
    ref = G.reference(a, b, b_layout=b_layout)
    assert not bool(cupy.isnan(got).any())
    assert float(cupy.linalg.norm(got - ref) / cupy.linalg.norm(ref)) <= 1e-2
    # every element, not only the norm: a tile stored twice or never shows here
    assert float(cupy.abs(got - ref).max()) <= 0.02 * float(cupy.abs(ref).max())
    for _ in range(20):
        G.gemm(a, b, out, b_layout=b_layout, split_k=split_k, **options)
    assert bool((out.view(cupy.uint16) == first.view(cupy.uint16)).all())


@pytest.mark.gpu
def test_split_k_on_two_streams_at_once_keeps_the_parts_apart():
    """One signature launched on two streams that run at once (an emulated world's ranks
    on one GPU): each stream's parts meet in a workspace of its own, so neither adds the
    other's parts."""
    import cupy
    m, n, k = 64, 4096, 4096
    a1, a2 = _random((m, k), bfloat16, 21), _random((m, k), bfloat16, 22)
    b = _random((n, k), bfloat16, 23)
    want1, want2 = G.reference(a1, b, b_layout="nk"), G.reference(a2, b, b_layout="nk")
    out1 = G.poison(cupy.empty((m, n), dtype=bfloat16))
    out2 = G.poison(cupy.empty((m, n), dtype=bfloat16))
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    # the operands, poison and references were made on the null stream, which streams
    # created non-blocking do not wait for
    cupy.cuda.Device().synchronize()
    for _ in range(50):
        for stream, a, out in ((streams[0], a1, out1), (streams[1], a2, out2)):
            G.gemm(a, b, out, b_layout="nk", block_m=64, block_n=128, split_k=4, stream=stream)
    for stream in streams:
        stream.synchronize()
    for out, want in ((out1, want1), (out2, want2)):
        got = G.to_float32(out)
        assert float(cupy.abs(got - want).max()) <= 0.02 * float(cupy.abs(want).max())


@pytest.mark.gpu
def test_split_k_captured_first_on_a_stream_then_eager_there():
    """A stream whose first split-K launch is captured into a graph: the graph zeroes a
    workspace of its own at each replay, and the eager launches after it on that stream get
    one zeroed eagerly (they inherited the graph's, never zeroed outside it, before)."""
    import cupy
    m, n, k = 64, 4096, 4096
    a, b = _random((m, k), bfloat16, 24), _random((n, k), bfloat16, 25)
    want = G.reference(a, b, b_layout="nk")
    out = G.poison(cupy.empty((m, n), dtype=bfloat16))
    options = dict(b_layout="nk", block_m=64, block_n=128, split_k=4)
    G.gemm(a, b, out, **options)                    # prepared on the null stream
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()
    stream.begin_capture()
    G.gemm(a, b, out, stream=stream, **options)
    graph = stream.end_capture()
    for run in [lambda: graph.launch(stream)] * 3 + [lambda: G.gemm(a, b, out, stream=stream, **options)] * 3:
        G.poison(out)
        cupy.cuda.Device().synchronize()
        run()
        stream.synchronize()
        got = G.to_float32(out)
        assert float(cupy.abs(got - want).max()) <= 0.02 * float(cupy.abs(want).max())


@pytest.mark.parametrize("b_layout", ["nk", "kn"])
@pytest.mark.parametrize("block_m,block_n,epilogue", [(128, 256, "tma"), (128, 128, "direct"),
                                                      (64, 256, "tma")])
def test_cluster_pairs_compile_without_spills(b_layout, block_m, block_n, epilogue):
    """Clusters of two CTAs sharing B by TMA multicast: every tile builds for sm_90a with
    the registers of the one-CTA build and no spills."""
    p = G.plan(3000, 5000, 7000, b_layout=b_layout, block_m=block_m, block_n=block_n,
               epilogue=epilogue, cluster="m2")
    assert p.spec.uri.endswith("_m2_sm90a") and p.grid % 2 == 0
    resources = p.spec.build(check_spills=True).resources["gemm"]
    assert resources.spill_stores == resources.spill_loads == resources.stack_frame == 0


def test_cluster_plan():
    # 3 tile rows: 2 pair rows x 20 columns = 40 clusters, 80 CTAs at most
    assert G.plan(300, 5000, 64, cluster="m2").grid == 80
    assert G.plan(8192, 8192, 64, sms=131, cluster="m2").grid == 130      # whole clusters
    assert G.plan(300, 5000, 640, cluster="m2", split_k=2).spec.uri.endswith("_m2_splitk_sm90a")
    for bad, match in ((dict(cluster="m4"), "cluster"), (dict(cluster="m2", sms=1), "sms")):
        with pytest.raises(ValueError, match=match):
            G.plan(300, 5000, 64, **bad)


_CLUSTER_CHECK = r"""
import sys
import cupy
import numpy as np
from mkrt.arrays import bfloat16
from mkrt.kernels import gemm as G
failures = []
for case in sys.argv[1:]:
    m, n, k, b_layout, block_m, block_n = case.split(",")
    m, n, k, block_m, block_n = int(m), int(n), int(k), int(block_m), int(block_n)
    rng = cupy.random.default_rng(m + n + k)
    a = G.from_float32(rng.standard_normal((m, k), dtype=np.float32), bfloat16)
    b = G.from_float32(rng.standard_normal((k, n) if b_layout == "kn" else (n, k), dtype=np.float32), bfloat16)
    out = G.poison(cupy.empty((m, n), dtype=bfloat16))
    call = lambda: G.gemm(a, b, out, b_layout=b_layout, block_m=block_m, block_n=block_n, cluster="m2")
    call()
    first = out.copy()
    got = G.to_float32(out)
    ref = G.reference(a, b, b_layout=b_layout)
    error = float(cupy.linalg.norm(got - ref) / max(float(cupy.linalg.norm(ref)), 1e-30))
    for _ in range(10):
        call()
    same = bool((out.view(cupy.uint16) == first.view(cupy.uint16)).all())
    if bool(cupy.isnan(got).any()) or not error <= 1e-2 or not same:
        failures.append(f"{case}: error {error}, repeats identical {same}")
print("CLUSTER_CHECK", "ok" if not failures else "; ".join(failures))
"""


@pytest.mark.gpu
def test_cluster_pairs_match_the_reference():
    """Pairs of CTAs sharing each B load: odd tile-row counts (the last pair's second tile
    past M), partial tiles, both layouts, two tiles, against float32; the same bits on
    every call. In a child process with a time limit: the engine's waits inside a cluster
    have no bound of their own, so a multicast that never lands must fail, not hang."""
    import subprocess
    import sys

    from mkrt.launch import child_env
    cases = [f"{m},{n},{k},{layout},{bm},{bn}"
             for m, n, k in [(300, 520, 64), (129, 127, 24), (4097, 1000, 4104), (1, 8, 8),
                             (2000, 3000, 1000)]
             for layout in ("nk", "kn") for bm, bn in ((128, 256), (64, 128))]
    result = subprocess.run([sys.executable, "-c", _CLUSTER_CHECK, *cases], env=child_env(),
                            capture_output=True, text=True, timeout=240)
    assert "CLUSTER_CHECK ok" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]


def test_l2_promotion_is_128_bytes_on_rows_off_a_sector_only(monkeypatch):
    # K = 7000: rows of 14,000 bytes, every other one 16 bytes off a 32-byte sector
    assert G.l2_promotion((7000 * 2,)) == 2
    assert G.l2_promotion((4040 * 2,)) == 2 and G.l2_promotion((4048 * 2,)) == 3
    assert G.l2_promotion((7168 * 2,)) == 3 and G.l2_promotion((8192 * 2, 8192 * 2 * 64)) == 3
    assert G.l2_promotion((8192 * 2, 7000 * 2)) == 2           # any stride off a sector
    monkeypatch.setattr(G, "L2_PROMOTION", 1)
    assert G.l2_promotion((7000 * 2,)) == 1 == G.l2_promotion((8192 * 2,))


@pytest.mark.gpu
def test_programmatic_launches_wait_for_the_kernels_before_them(monkeypatch):
    """mkrt.gemm launches as a programmatic dependent (PDL): a chain of GEMMs, each reading
    the one before's output, and GEMMs reading what a CuPy kernel just wrote, give the same
    bits as plain launches."""
    import cupy
    m, n = 1536, 1536
    rng = cupy.random.default_rng(31)
    w = G.from_float32(rng.standard_normal((n, n), dtype=cupy.float32) / 40, bfloat16)
    seeds = [_random((m, n), bfloat16, 32 + i) for i in range(3)]

    def chain():
        results = []
        for seed in seeds:
            x = cupy.empty_like(seed)
            x.view(cupy.uint16)[...] = seed.view(cupy.uint16)   # a CuPy kernel writes it
            for _ in range(8):
                x = G.gemm(x, w, b_layout="nk")      # each reads the output before it
            results.append(x)
        cupy.cuda.Device().synchronize()
        return results
    G._PREPARED.clear()
    monkeypatch.setattr(G, "PROGRAMMATIC_LAUNCH", False)
    plain = chain()
    G._PREPARED.clear()
    monkeypatch.setattr(G, "PROGRAMMATIC_LAUNCH", True)
    programmatic = chain()
    assert all(call.launch.programmatic for call in G._PREPARED.values())
    for p_out, q_out in zip(plain, programmatic):
        assert bool(cupy.isfinite(G.to_float32(p_out)).all())
        assert bool((p_out.view(cupy.uint16) == q_out.view(cupy.uint16)).all())


@pytest.mark.parametrize("tiles,k_blocks,grid", [(96, 24, 132), (1568, 112, 116), (1568, 112, 132),
                                                 (64, 65, 7), (3, 1, 132), (5, 7, 3), (264, 16, 132)])
def test_stream_k_items_compute_every_k_block_once_and_share_the_tail_evenly(tiles, k_blocks, grid):
    items = G.stream_k_items(tiles, k_blocks, min(grid, tiles * k_blocks))
    grid = len(items)
    whole = tiles // grid * grid
    seen = {}
    for c, cta_items in enumerate(items):
        shared = 0
        for i, (tile, begin, end, part, parts) in enumerate(cta_items):
            assert 0 <= begin < end <= k_blocks and 0 <= part < parts
            if tile < whole:                       # the full waves: CTA c takes c, c + grid, ...
                assert (tile, begin, end, parts) == (c + i * grid, 0, k_blocks, 1)
            else:
                shared += end - begin
            for kb in range(begin, end):
                assert (tile, kb) not in seen, (tile, kb)
                seen[(tile, kb)] = (c, part, parts)
        if tiles > whole:                           # each CTA's share of the rest: within 1
            assert abs(shared - (tiles - whole) * k_blocks / grid) <= 1
    assert len(seen) == tiles * k_blocks
    for tile in range(tiles):                       # a tile's parts: CTAs in order, 0 .. parts-1
        owners = sorted({seen[(tile, kb)][:2] for kb in range(k_blocks)})
        parts = {seen[(tile, kb)][2] for kb in range(k_blocks)}
        assert len(parts) == 1 and [p for _, p in owners] == list(range(parts.pop()))


def test_stream_k_plan():
    # 7168^3 in 128x256 tiles on 116 SMs: 1568 tiles, 13 full waves, 60 tiles shared out
    p = G.plan(7168, 7168, 7168, sms=116, stream_k=True)
    assert (p.spec.split, p.stream_k, p.grid, p.whole_units, p.split_slots) == \
        ("streamk", True, 116, 1508, 60)
    assert p.splits == max(item[4] for items in G.stream_k_items(1568, 112, 116) for item in items)
    assert p.spec.epilogue == "tma" and p.spec.uri.endswith("_streamk_sm90a")
    # below one wave: every tile shared out, on every SM
    p = G.plan(1536, 1536, 1536, block_n=192, stream_k=True)
    assert (p.grid, p.whole_units, p.split_slots) == (132, 0, 96) and p.splits >= 2
    # whole waves: nothing to share, a plain launch
    assert G.plan(128 * 66, 512, 1024, sms=132, stream_k=True).spec.split == ""
    for kwargs, match in ((dict(split_k=2), "split_k=1"), (dict(cluster="m2"), "cluster=''"),
                          (dict(block_n=240), "whole tiles")):
        with pytest.raises(ValueError, match=match):
            G.plan(3000, 5000, 7000, stream_k=True, **kwargs)
    with pytest.raises(ValueError, match="one CTA per tile"):
        G.GemmSpec("bf16", "nk", 128, 256, 3, "tma", "m2", "streamk")
    with pytest.raises(ValueError, match="stream_k"):
        G.plan(64, 64, 64, stream_k=1)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,sms", [(1536, 1536, 1536, None), (333, 1001, 4104, 7),
                                       (2048, 2048, 512, 100), (1, 300, 128, None),
                                       (4097, 1000, 24, 116), (3000, 5000, 7000, 116)])
@pytest.mark.parametrize("b_layout", ["nk", "kn"])
def test_stream_k_matches_the_reference_and_repeats_bit_for_bit(m, n, k, sms, b_layout):
    import cupy
    a = _random((m, k), bfloat16, 41)
    b = _random((k, n) if b_layout == "kn" else (n, k), bfloat16, 42)
    out = G.poison(cupy.empty((m, n), dtype=bfloat16))
    G.gemm(a, b, out, b_layout=b_layout, sms=sms, stream_k=True)
    got = G.to_float32(out)
    ref = G.reference(a, b, b_layout=b_layout)
    assert not bool(cupy.isnan(got).any())
    assert float(cupy.linalg.norm(got - ref) / cupy.linalg.norm(ref)) <= 1e-2
    first = out.copy()
    for _ in range(20):
        G.gemm(a, b, out, b_layout=b_layout, sms=sms, stream_k=True)
    assert bool((out.view(cupy.uint16) == first.view(cupy.uint16)).all())


@pytest.mark.gpu
def test_the_rules_stream_k_runs_by_default_and_gives_way_to_explicit_options(monkeypatch):
    import cupy
    monkeypatch.setenv("MKRT_GEMM_STREAM_K_RULE", "1")
    m, n, k, sms = 2048, 1024, 4096, 12      # 64 tiles of 128 x 256: 5 waves and a third
    a = _random((m, k), bfloat16, 43)
    b = _random((n, k), bfloat16, 44)
    out = G.poison(cupy.empty((m, n), dtype=bfloat16))
    assert G.call_plan(a, b, out, b_layout="nk", sms=sms).stream_k
    G.gemm(a, b, out, b_layout="nk", sms=sms)
    ref = G.reference(a, b, b_layout="nk")
    assert float(cupy.linalg.norm(G.to_float32(out) - ref) / cupy.linalg.norm(ref)) <= 1e-2
    first = out.copy()
    G.gemm(a, b, out, b_layout="nk", sms=sms)
    assert bool((out.view(cupy.uint16) == first.view(cupy.uint16)).all())
    # asked for whole tiles, a tile of its own or split-K: no stream-K
    for options in (dict(stream_k=False), dict(block_n=192), dict(split_k=1), dict(epilogue="direct")):
        assert not G.call_plan(a, b, out, b_layout="nk", sms=sms, **options).stream_k, options
