"""API fuzzing on the CPU: everything checked before a launch, under random inputs.

The rule for each checked entry point: it either returns something the kernel can run
(checked here against the kernel's own limits), or raises ValueError / TypeError with a
message that names the area (``mkrt...``). Nothing else may escape, and nothing that the
kernel cannot run may pass.
"""

from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import event  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mkrt.arrays import bfloat16  # noqa: E402
from mkrt.kernels import gemm  # noqa: E402
from mkrt.kernels import gemm_allreduce_plan as gar_plan  # noqa: E402
from mkrt.world import parse_layout  # noqa: E402

FAST = settings(max_examples=150, deadline=None)
SIZES = st.one_of(st.integers(-3, 40), st.integers(1, 1 << 16),
                  st.sampled_from([0, 1, 7, 8, 127, 128, 129, 4096, 2**31 - 1, 2**31]))
K_SIZES = st.one_of(SIZES, st.integers(1, 2048).map(lambda x: 8 * x))   # valid K often
DTYPES = st.sampled_from([np.float16, np.float32, np.int32, np.float64, bfloat16])


def outcome(call):
    """What `call()` returns, or None when it refused cleanly: ValueError or TypeError
    with a message naming its area. Anything else fails the test."""
    try:
        return call()
    except (ValueError, TypeError) as error:
        assert str(error).startswith("mkrt"), f"error without its area: {error!r}"
        return None


@st.composite
def one_field_spoiled(draw, good, bad):
    """A valid configuration, half the time with one field replaced by a doubtful value."""
    config = draw(good)
    if draw(st.booleans()):
        field = draw(st.sampled_from(sorted(bad)))
        config[field] = draw(bad[field])
    return config


GOOD_GEMM = st.fixed_dictionaries({
    "m": st.integers(1, 1 << 15), "n": st.integers(1, 1 << 15),
    "k": st.integers(1, 2048).map(lambda x: 8 * x), "sms": st.integers(1, 300),
    "group_m": st.integers(1, 64), "block_n": st.sampled_from([64, 128, 192, 256]),
    "stages": st.one_of(st.none(), st.integers(2, 6)),
    "epilogue": st.sampled_from(["auto", "tma", "direct"]),
    "b_layout": st.sampled_from(["kn", "nk"]), "dtype": st.sampled_from(["bf16", "f16"])})
BAD_GEMM = {"m": SIZES, "n": SIZES, "k": K_SIZES, "sms": st.integers(-2, 0),
            "group_m": st.integers(-1, 0), "block_n": st.sampled_from([0, 32, 320]),
            "stages": st.integers(0, 12), "epilogue": st.just("bogus"),
            "b_layout": st.just("mk"), "dtype": st.just("f32")}


@FAST
@given(config=one_field_spoiled(GOOD_GEMM, BAD_GEMM))
def test_gemm_plan_returns_a_runnable_plan_or_a_clean_error(config):
    p = outcome(lambda: gemm.plan(**config))
    if p is None:
        return
    m, n, k, sms, layout = (config[f] for f in ("m", "n", "k", "sms", "b_layout"))
    event("a plan")
    assert 1 <= m < 2**31 and 1 <= n < 2**31 and 8 <= k < 2**31 and k % 8 == 0
    assert p.spec.smem_bytes <= gemm.SMEM_LIMIT and p.spec.stages >= 2
    assert 1 <= p.grid <= min(sms, p.tiles)
    assert p.tiles == -(-m // p.spec.block_m) * -(-n // p.spec.block_n)
    if p.spec.epilogue == "tma":
        assert n % 8 == 0                  # TMA stores need 16-byte rows of C
    assert p.pad_n % 8 == 0 or layout == "nk"


@FAST
@given(a_shape=st.lists(st.integers(0, 300), min_size=1, max_size=3),
       b_shape=st.lists(st.integers(0, 300), min_size=1, max_size=3),
       a_dtype=DTYPES, b_dtype=DTYPES, layout=st.sampled_from(["kn", "nk", "x"]))
def test_gemm_operand_checks(a_shape, b_shape, a_dtype, b_dtype, layout):
    checked = outcome(lambda: gemm.check_operands(tuple(a_shape), tuple(b_shape), a_dtype,
                                                  b_dtype, layout))
    if checked is not None:
        m, n, k, name = checked
        assert name in ("bf16", "f16") and np.dtype(a_dtype) == np.dtype(b_dtype)
        assert (m, k) == tuple(a_shape)
        assert (k, n) == tuple(b_shape) if layout == "kn" else (n, k) == tuple(b_shape)


GOOD_GAR = st.fixed_dictionaries({
    "m": st.integers(1, 3000), "n": st.integers(1, 3000),
    "k": st.integers(1, 512).map(lambda x: 8 * x), "nodes": st.integers(1, 4),
    "ranks_per_node": st.integers(1, 8), "ctas": st.integers(2, 40),
    "reduce_ctas": st.none(), "fuse": st.sampled_from([None, True, False]),
    "ranks_per_gpu": st.integers(1, 8), "b_layout": st.sampled_from(["kn", "nk"])})
BAD_GAR = {"m": st.integers(-1, 0), "n": st.sampled_from([0, 2**31]), "k": st.integers(-8, 12),
           "nodes": st.sampled_from([0, 33]), "ranks_per_node": st.sampled_from([0, 33, 64]),
           "ctas": st.integers(0, 1), "reduce_ctas": st.integers(-1, 41),
           "b_layout": st.just("zz")}


@settings(max_examples=60, deadline=None)
@given(config=one_field_spoiled(GOOD_GAR, BAD_GAR))
def test_gemm_allreduce_plan_is_exactly_once_and_stall_free_or_refused(config):
    p = outcome(lambda: gar_plan.plan(**config))
    if p is None:
        return
    m, n, k, nodes, per_node, ctas, layout = (
        config[f] for f in ("m", "n", "k", "nodes", "ranks_per_node", "ctas", "b_layout"))
    event("a plan")
    assert m >= 1 and n >= 1 and k >= 8 and k % 8 == 0 and layout in ("kn", "nk")
    if nodes * per_node == 1:
        assert not p.fused
        return
    assert 1 <= p.reduce_ctas < p.ctas == ctas
    if p.tiles * nodes * per_node <= 4000:      # keeps the schedule play-out quick
        event("a plan whose schedule was played out")
        assert p.check() == []


@FAST
@given(text=st.one_of(st.text(max_size=12), st.from_regex(r"\s*-?\d{1,3}\s*[xX*]\s*-?\d{1,3}\s*")))
def test_world_layouts_parse_or_are_refused(text):
    layout = outcome(lambda: parse_layout(text))
    if layout is not None:
        nodes, per_node = layout
        assert nodes >= 1 and per_node >= 1
