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
    "reduce_ctas": st.none(), "fuse": st.sampled_from([None, True, False, "measure"]),
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


# ---- everything else checked before a launch: ops' options, init, envs, specs, arrays ----

import contextlib  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402

import mkrt  # noqa: E402
from mkrt import envs  # noqa: E402
from mkrt.jit import cache as jit_cache  # noqa: E402
from mkrt.kernels import allgather as ag  # noqa: E402
from mkrt.kernels import gemm_allreduce as gar  # noqa: E402
from mkrt.world import World  # noqa: E402

MAX_GRID = 2**31 - 1           # CUDA's gridDim.x limit: most CTAs of one launch
#: texts os.environ can hold (no NUL, no lone surrogates)
ENV_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                   max_size=12)


@contextlib.contextmanager
def cpu_ops():
    """Ops built to the end on a machine without a GPU: the symmetric flags, the compile
    and the proxy (what follows the checks) are stubbed; every check runs as written."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ag, "flags", lambda world, count, name="flags": None)
        mp.setattr(ag.AllGatherSpec, "build", lambda self, **kw: None)
        mp.setattr(World, "proxy", lambda self: None)
        yield mp


@contextlib.contextmanager
def emulated(layout):
    world = mkrt.init(emulate=layout)
    try:
        yield world
    finally:
        world.close()


def assert_timeout_valid(op):
    """The kernels take the bound as u64 nanoseconds (Op.context_params)."""
    assert isinstance(op.timeout_ms, float) and math.isfinite(op.timeout_ms)
    assert 1 <= int(op.timeout_ms * 1e6) < 2**64


LAYOUTS = st.sampled_from(["1x1", "1x2", "1x4", "2x1", "2x2", "3x2"])
TIMEOUTS = st.one_of(st.none(), st.floats(1e-3, 1e7), st.integers(1, 10**6))
BAD_TIMEOUTS = st.one_of(st.floats(-1e9, 0), st.integers(-5, 0),
                         st.just(None))   # nan, inf, 1e300, "abc", [1]: known bugs below
GOOD_AG = st.fixed_dictionaries({
    "group": st.sampled_from(ag.GROUPS), "ctas": st.one_of(st.none(), st.integers(1, 264)),
    "threads": st.sampled_from(range(64, 513, 32)), "timeout_ms": TIMEOUTS,
    "muted_rank": st.none()})
BAD_AG = {"group": st.one_of(st.text(max_size=6), st.none(), st.just(["world"]), st.just("World")),
          "ctas": st.one_of(st.integers(-3, 0), st.just(0.5)),
          "threads": st.sampled_from([0, 32, 63, 65, 544, 1024, -512, True]),
          "timeout_ms": BAD_TIMEOUTS, "muted_rank": st.integers(-3, 8)}


@FAST
@given(layout=LAYOUTS, config=one_field_spoiled(GOOD_AG, BAD_AG))
def test_allgather_options_build_a_runnable_op_or_a_clean_error(layout, config):
    with emulated(layout) as world, cpu_ops():
        op = outcome(lambda: mkrt.AllGather(world, **config))
        if op is None:
            return
        event("an op")
        assert op.group in ag.GROUPS and op.N * op.G == (world.size if op.group == "world"
                                                         else world.ranks_per_node)
        assert op.ctas is None or (isinstance(op.ctas, int) and 1 <= op.ctas <= MAX_GRID)
        threads = op.spec.threads
        assert isinstance(threads, int) and threads % 32 == 0 and 64 <= threads <= 512
        assert 1 <= op.G <= ag.MAX_NODE_RANKS and -1 <= op.muted_rank < world.size
        assert op.layout.words == ag.FlagLayout(op.G, op.N).words > 0
        assert_timeout_valid(op)


GOOD_GAR_OPTIONS = st.fixed_dictionaries({
    "b_layout": st.sampled_from(["kn", "nk"]), "ctas": st.one_of(st.none(), st.integers(2, 132)),
    "reduce_ctas": st.none(), "fuse": st.sampled_from([None, True, False]),
    "group_m": st.integers(1, 64), "timeout_ms": TIMEOUTS,
    "roles": st.sampled_from(["adaptive", "static", "search"]), "trace": st.booleans(),
    "block_n": st.sampled_from([128, 192, 256, None])})
BAD_COUNTS = st.one_of(st.integers(-3, 0), st.floats(-2, 300), st.sampled_from(["4", True, [2]]),
                      st.just(2**40))
BAD_GAR_OPTIONS = {"b_layout": st.one_of(st.text(max_size=3), st.none(), st.just(["kn"])),
                   "timeout_ms": st.one_of(BAD_TIMEOUTS, st.sampled_from(
                       [float("nan"), float("inf"), 1e300, "abc", [1]])),
                   "ctas": BAD_COUNTS, "reduce_ctas": BAD_COUNTS, "group_m": BAD_COUNTS,
                   "fuse": st.sampled_from(["no", "yes", 2, -1, [True]]),
                   "roles": st.sampled_from(["Adaptive", "dynamic", None, 3, ["static"]]),
                   "trace": st.sampled_from(["yes", 2, None]),
                   "block_n": st.sampled_from([64, 320, 256.0, True, "256", 0])}


@FAST
@given(layout=LAYOUTS, config=one_field_spoiled(GOOD_GAR_OPTIONS, BAD_GAR_OPTIONS),
       kind=st.sampled_from(["GemmAllReduce", "GemmReduceScatter"]))
def test_gemm_allreduce_options_build_a_runnable_op_or_a_clean_error(layout, config, kind):
    with emulated(layout) as world:
        op = outcome(lambda: getattr(mkrt, kind)(world, **config))
        if op is None:
            return
        event("an op")
        assert op.b_layout in ("kn", "nk") and op.fuse in (True, False, "measure", "model")
        assert op.ctas is None or (isinstance(op.ctas, int) and 1 <= op.ctas <= MAX_GRID)
        assert op.reduce_ctas is None or (isinstance(op.reduce_ctas, int) and op.reduce_ctas >= 1)
        assert isinstance(op.group_m, int) and 1 <= op.group_m < 2**31    # an int32 argument
        assert op.roles in ("adaptive", "static", "search") and op.trace in (True, False)
        assert op.block_n is None or (type(op.block_n) is int and op.block_n in (128, 192, 256))
        assert_timeout_valid(op)


@settings(max_examples=60, deadline=None)
@given(layout=st.sampled_from(["1x2", "1x4", "2x2"]),
       options=GOOD_GAR_OPTIONS.map(lambda o: dict(o, ctas=o["ctas"] and min(o["ctas"], 66))),
       reduce_ctas=st.one_of(st.none(), st.integers(-1, 140)),
       m=SIZES, n=SIZES, k=K_SIZES, dtype=st.sampled_from(["bf16", "f16"]))
def test_gemm_allreduce_plan_for_a_call_is_runnable_or_refused(layout, options, reduce_ctas,
                                                               m, n, k, dtype):
    """What a call plans before it launches (GemmAllReduce.plan_for), on a machine whose
    ranks each get 66 SMs (an H200 shared by two ranks; ctas within that share, which the
    constructor checks where ranks have GPUs)."""
    with emulated(layout) as world, pytest.MonkeyPatch.context() as mp:
        mp.setattr(World, "sm_count", lambda self, rank: 66)
        op = outcome(lambda: mkrt.GemmAllReduce(world, **dict(options, reduce_ctas=reduce_ctas)))
        if op is None:
            assert reduce_ctas is not None and reduce_ctas < 1    # refused where it is made
            return
        p = outcome(lambda: op.plan_for(m, n, k, dtype))
        if p is None:
            return
        event("a plan")
        assert 1 <= p.m < 2**31 and 1 <= p.n < 2**31 and 8 <= p.k < 2**31 and p.k % 8 == 0
        assert 1 <= p.reduce_ctas < p.ctas <= 66 and p.compute_ctas >= 1
        assert (p.nodes, p.G) == (world.nodes, world.ranks_per_node)
        assert p.block_n in (128, 192, 256) and p.block_n == (options["block_n"] or p.block_n)
        if p.fused and op.b_layout == "kn":
            assert p.n % 8 == 0              # TMA rows of B: 16 bytes
        if options["fuse"] in (True, False):
            assert p.fused == (options["fuse"] and not (op.b_layout == "kn" and n % 8))
        gar.spec_for(p)                       # the kernel of the plan exists


@FAST
@given(emulate=st.one_of(st.from_regex(r"\s*[0-9]{1,2}\s*[xX*]\s*[0-9]{1,2}\s*", fullmatch=True),
                         st.text(max_size=8), st.none()),
       gpus=st.sampled_from([None, 0]), with_comm=st.booleans())
def test_init_builds_a_consistent_world_or_a_clean_error(emulate, gpus, with_comm):
    with_comm = with_comm and emulate is not None     # comm= alone: an MPI world (not here)
    world = outcome(lambda: mkrt.init(emulate=emulate, gpus=gpus,
                                      comm=object() if with_comm else None))
    if world is None:
        assert with_comm or emulate                   # init() alone always makes a world
        return
    try:
        event("a world")
        assert not with_comm and world.emulated
        expected = parse_layout(emulate) if emulate else (1, 1)   # no GPU: 1x1 by default
        assert (world.nodes, world.ranks_per_node) == expected
        assert world.size == expected[0] * expected[1] and mkrt.current_world() is world
        for r, info in enumerate(world.ranks):
            assert (info.rank, info.node, info.local_rank) == (r, *divmod(r, expected[1]))
            assert info.device is None                 # no GPU here
    finally:
        world.close()


#: variable -> what a value that passes must satisfy (end to end: what reads it)
def _log_level_ok(value):
    import logging
    return isinstance(logging.getLevelName(value.upper()), int)


ENV_VALUES = st.one_of(ENV_TEXT, st.from_regex(r"\s*[-+]?[0-9]{0,4}(\.[0-9]{0,3})?\s*", fullmatch=True),
                       st.sampled_from(["1", "0", "true", "off", "-1", "1e3", "1_000", "debug",
                                        "INFO", "1x2", "sm_90a", " 2x4 "]))


@FAST
@given(name=st.sampled_from(["MKRT_JIT_PTXAS_CHECK", "MKRT_JIT_DEBUG", "MKRT_SYNC_CHECK",
                             "MKRT_WAIT_TIMEOUT_MS", "MKRT_WORLD_RANKS_PER_NODE",
                             "MKRT_EMULATE", "MKRT_JIT_ARCH", "MKRT_LOG_LEVEL"]),
       value=ENV_VALUES)
def test_environment_values_parse_or_are_refused(name, value):
    if name == "MKRT_WAIT_TIMEOUT_MS" and value.strip().lower().lstrip("+-") in (
            "nan", "inf", "infinity"):
        return                                      # KNOWN_BUGS
    if name == "MKRT_WORLD_RANKS_PER_NODE" and value.strip().startswith("-"):
        return                                      # KNOWN_BUGS
    if name == "MKRT_LOG_LEVEL" or "/" in value:
        return                                      # KNOWN_BUGS (log level, arch with a /)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(name, value)
        parsed = outcome(lambda: envs.get(name))
        if parsed is None:
            return
        event("a value")
        if name in ("MKRT_JIT_PTXAS_CHECK", "MKRT_JIT_DEBUG", "MKRT_SYNC_CHECK"):
            assert isinstance(parsed, bool)
        elif name == "MKRT_WAIT_TIMEOUT_MS":       # what an op makes of it
            with emulated("1x1") as world, cpu_ops():
                op = outcome(lambda: mkrt.AllGather(world))
                if op is not None:
                    assert parsed > 0
                    assert_timeout_valid(op)
        elif name == "MKRT_WORLD_RANKS_PER_NODE":
            assert isinstance(parsed, int) and parsed >= 0
        elif name == "MKRT_EMULATE":               # what init() makes of it
            world = outcome(lambda: mkrt.init())
            if world is not None:
                world.close()
                assert world.size >= 1 and (not value.strip() or parse_layout(value))
        elif name == "MKRT_JIT_ARCH":              # names the cache entry of every kernel
            uri = ag.AllGatherSpec(512).uri
            assert jit_cache.entry_dir(uri, "key").parent == jit_cache.cache_dir()


SPEC_INTS = st.one_of(st.integers(-2, 300), st.sampled_from([64, 128, 192, 256, 512]))


@FAST
@given(kind=st.sampled_from(["gemm", "gemm_allreduce", "allgather"]),
       dtype=st.sampled_from(["bf16", "f16", "f32", "", None]),
       b_layout=st.sampled_from(["kn", "nk", "mk", None]),
       block_m=st.sampled_from([64, 128, 0, 96, 256]), block_n=SPEC_INTS, stages=st.integers(-1, 9),
       epilogue=st.sampled_from(["tma", "direct", "auto", None]),
       mode=st.sampled_from(["gemm", "copy", "x"]), threads=SPEC_INTS)
def test_kernel_specs_are_valid_or_refused_and_uris_name_them(kind, dtype, b_layout, block_m,
                                                              block_n, stages, epilogue, mode,
                                                              threads):
    """Specs are the JIT's cache key: a spec that exists has fields the kernel takes and a
    URI that is one path component and differs from every other spec's."""
    from mkrt.kernels import gemm as gemm_module

    def make(**change):
        values = dict(dict(dtype=dtype, b_layout=b_layout, block_m=block_m, block_n=block_n,
                           stages=stages, epilogue=epilogue, mode=mode, threads=threads), **change)
        if kind == "gemm":
            return gemm_module.GemmSpec(*(values[f] for f in (
                "dtype", "b_layout", "block_m", "block_n", "stages", "epilogue")))
        if kind == "gemm_allreduce":
            return gar.GemmAllReduceSpec(*(values[f] for f in (
                "dtype", "b_layout", "block_m", "block_n", "stages", "mode")))
        return ag.AllGatherSpec(threads=values["threads"])

    spec = outcome(make)
    if spec is None:
        return
    event(f"a {kind} spec")
    assert "/" not in spec.uri and spec.uri.startswith(spec.family)
    if kind == "allgather":
        assert spec.threads % 32 == 0 and 64 <= spec.threads <= 512
        other = outcome(lambda: make(threads=threads + 32))
    else:
        engine = spec if kind == "gemm" else spec.engine
        assert engine.stages >= 2 and engine.smem_bytes <= gemm_module.SMEM_LIMIT
        assert engine.block_n % 64 == 0 and 64 <= engine.block_n <= 256
        other = outcome(lambda: make(stages=stages - 1))
    if other is not None:
        assert other != spec and other.uri != spec.uri


@FAST
@given(nodes=st.integers(-2, 6), per_node=st.integers(-2, 6))
def test_allgather_plan_is_exactly_once_or_refused(nodes, per_node):
    transfers = outcome(lambda: ag.plan(nodes, per_node))
    if transfers is None:
        assert nodes < 1 or per_node < 1
        return
    R = nodes * per_node
    delivered = sorted((t.block, t.dst) for t in transfers if t.kind in ("push", "forward"))
    assert delivered == [(b, r) for b in range(R) for r in range(R)]
    assert all(0 <= t.src < R and 0 <= t.dst < R for t in transfers)


HOST_THINGS = st.one_of(
    st.builds(lambda shape, dtype: np.zeros(shape, dtype),
              st.lists(st.integers(0, 4), max_size=3), DTYPES),
    st.sampled_from([None, 3, 2.5, "x", b"x", [1, 2], (), {}]))


@FAST
@given(x=HOST_THINGS, as_list=st.booleans(), layout=st.sampled_from(["1x1", "1x2"]),
       which=st.sampled_from(["allgather", "gemm_allreduce", "check_array"]))
def test_host_arrays_are_refused_before_any_launch(x, as_list, layout, which):
    """Without a GPU nothing is a device array: every entry point that takes arrays
    refuses host ones (numpy, lists, scalars) with a clean TypeError/ValueError."""
    from mkrt.arrays import check_array
    with emulated(layout) as world, cpu_ops():
        arg = [x] * world.size if as_list else x
        if which == "allgather":
            call = lambda: mkrt.AllGather(world)(arg)             # noqa: E731
        elif which == "gemm_allreduce":
            call = lambda: mkrt.GemmAllReduce(world)(arg, arg)    # noqa: E731
        else:
            call = lambda: check_array(x, "x", dtype=np.float16, ndim=2)   # noqa: E731
        assert outcome(call) is None


# ---- bugs the fuzzing found (each fixed; kept as regression tests) -----------------------

def _gar(world, **kw):
    return mkrt.GemmAllReduce(world, **kw)


def _ag(world, **kw):
    with cpu_ops():
        return mkrt.AllGather(world, **kw)


def _checked_op(make, **kw):
    """Fails (AssertionError) when an invalid option passes the op's checks."""
    with emulated("1x2") as world:
        op = outcome(lambda: make(world, **kw))
        if op is None:
            return
        assert_timeout_valid(op)
        assert op.ctas is None or (isinstance(op.ctas, int) and 1 <= op.ctas <= MAX_GRID)
        if isinstance(op, mkrt.GemmAllReduce):
            assert isinstance(op.group_m, int) and 1 <= op.group_m < 2**31
            assert op.fuse in (True, False, "measure", "model")
            assert op.reduce_ctas is None or (isinstance(op.reduce_ctas, int) and op.reduce_ctas >= 1)
        else:
            assert isinstance(op.spec.threads, int)


OP_BUGS = [
    pytest.param(_gar, dict(group_m=0), id="gar-group_m=0 (device divides by it)"),
    pytest.param(_gar, dict(group_m=-3), id="gar-group_m=-3"),
    pytest.param(_gar, dict(group_m=2**40), id="gar-group_m=2**40 (int32 argument)"),
    pytest.param(_gar, dict(ctas=0), id="gar-ctas=0"),
    pytest.param(_gar, dict(ctas=-1), id="gar-ctas=-1"),
    pytest.param(_gar, dict(ctas=2.5), id="gar-ctas=2.5"),
    pytest.param(_gar, dict(ctas="x"), id="gar-ctas='x'"),
    pytest.param(_gar, dict(reduce_ctas=-1), id="gar-reduce_ctas=-1"),
    pytest.param(_gar, dict(fuse="no"), id="gar-fuse='no' (truthy: fused)"),
    pytest.param(_gar, dict(muted_rank="x"), id="gar-muted_rank='x' (bare int() error)"),
    pytest.param(_gar, dict(timeout_ms=float("nan")), id="gar-timeout_ms=nan"),
    pytest.param(_ag, dict(timeout_ms=float("nan")), id="ag-timeout_ms=nan"),
    pytest.param(_ag, dict(timeout_ms=float("inf")), id="ag-timeout_ms=inf"),
    pytest.param(_ag, dict(timeout_ms=1e300), id="ag-timeout_ms=1e300 (u64 ns overflow)"),
    pytest.param(_ag, dict(timeout_ms="abc"), id="ag-timeout_ms='abc' (bare float() error)"),
    pytest.param(_ag, dict(ctas=2.5), id="ag-ctas=2.5"),
    pytest.param(_ag, dict(ctas=2**31), id="ag-ctas=2**31 (past gridDim.x)"),
    pytest.param(_ag, dict(ctas="4"), id="ag-ctas='4' (bare TypeError)"),
    pytest.param(_ag, dict(threads=512.0), id="ag-threads=512.0"),
    pytest.param(_ag, dict(threads="512"), id="ag-threads='512' (bare TypeError)"),
    pytest.param(_ag, dict(threads=None), id="ag-threads=None (bare TypeError)"),
    pytest.param(_ag, dict(muted_rank="x"), id="ag-muted_rank='x' (bare TypeError)"),
]


@pytest.mark.parametrize("make,kw", OP_BUGS)
def test_fixed_bug_op_options(make, kw):
    _checked_op(make, **kw)


@pytest.mark.parametrize("kw", [dict(emulate=5), dict(emulate=b"1x2"),
                                dict(emulate="1x2", gpus="2"), dict(emulate="1x2", gpus=-1),
                                dict(comm=object())],
                         ids=["emulate=5", "emulate=b'1x2'", "gpus='2'", "gpus=-1", "comm=object()"])
def test_fixed_bug_init(kw):
    world = outcome(lambda: mkrt.init(**kw))
    if world is not None:
        world.close()
        assert all(info.device is None or info.device >= 0 for info in world.ranks)


@pytest.mark.parametrize("name,value", [
    ("MKRT_WAIT_TIMEOUT_MS", "nan"), ("MKRT_WAIT_TIMEOUT_MS", "inf"),
    ("MKRT_WAIT_TIMEOUT_MS", "1e400"), ("MKRT_WORLD_RANKS_PER_NODE", "-2"),
    ("MKRT_LOG_LEVEL", "bogus"), ("MKRT_JIT_ARCH", "sm_90a/../../elsewhere")])
def test_fixed_bug_environment(name, value):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(name, value)
        if name == "MKRT_LOG_LEVEL":
            outcome(mkrt._configure_logging)          # runs at `import mkrt`
            return
        parsed = outcome(lambda: envs.get(name))
        if parsed is None:
            return
        if name == "MKRT_WAIT_TIMEOUT_MS":
            with emulated("1x1") as world:
                op = outcome(lambda: _ag(world))
                if op is not None:
                    assert_timeout_valid(op)
        elif name == "MKRT_WORLD_RANKS_PER_NODE":
            assert parsed >= 0
        else:
            uri = ag.AllGatherSpec(512).uri
            assert jit_cache.entry_dir(uri, "key").parent == jit_cache.cache_dir()


@pytest.mark.parametrize("make", [
    lambda: ag.AllGatherSpec(threads=96.0),
    lambda: gemm.plan(1024, 1024, 1024, stages=2.5).spec,
    lambda: gemm.plan(1024, 1024, 1024, block_n=128.0).spec,
    lambda: gar.GemmAllReduceSpec("bf16", "kn", 128, 256, 3.0, "gemm")],
    ids=["allgather-threads=96.0", "gemm.plan-stages=2.5", "gemm.plan-block_n=128.0",
         "gemm_allreduce-stages=3.0"])
def test_fixed_bug_float_spec_fields(make):
    import dataclasses
    spec = outcome(make)
    if spec is not None:
        assert all(type(getattr(spec, f.name)) is int for f in dataclasses.fields(spec)
                   if f.type in ("int", int))


def test_fixed_bug_allgather_plan_float():
    outcome(lambda: ag.plan(2.5, 2))


GOOD_AGG_OPTIONS = st.fixed_dictionaries({
    "b_layout": st.sampled_from(["kn", "nk"]), "ctas": st.one_of(st.none(), st.integers(2, 132)),
    "comm_ctas": st.one_of(st.none(), st.integers(1, 8)),
    "fuse": st.sampled_from([None, True, False, "measure"]),
    "group_m": st.integers(1, 64), "timeout_ms": TIMEOUTS})
BAD_AGG_OPTIONS = dict({k: v for k, v in BAD_GAR_OPTIONS.items()
                        if k not in ("roles", "trace", "block_n")},
                       comm_ctas=BAD_COUNTS)
del BAD_AGG_OPTIONS["reduce_ctas"]


@FAST
@given(layout=LAYOUTS, config=one_field_spoiled(GOOD_AGG_OPTIONS, BAD_AGG_OPTIONS))
def test_allgather_gemm_options_build_a_runnable_op_or_a_clean_error(layout, config):
    with emulated(layout) as world:
        op = outcome(lambda: mkrt.AllGatherGemm(world, **config))
        if op is None:
            return
        event("an op")
        assert op.b_layout in ("kn", "nk") and op.fuse in (True, False, "measure", "model")
        assert op.ctas is None or (isinstance(op.ctas, int) and 2 <= op.ctas <= MAX_GRID)
        assert op.comm_ctas is None or (isinstance(op.comm_ctas, int) and op.comm_ctas >= 1)
        assert isinstance(op.group_m, int) and 1 <= op.group_m < 2**31
        assert_timeout_valid(op)


@FAST
@given(nodes=st.integers(-1, 5), per_node=st.integers(-1, 9), m=SIZES, n=SIZES, k=K_SIZES,
       ctas=st.integers(-1, 140), comm_ctas=st.one_of(st.none(), st.integers(-1, 20)),
       b_layout=st.sampled_from(["kn", "nk"]))
def test_allgather_gemm_plan_is_runnable_or_refused(nodes, per_node, m, n, k, ctas, comm_ctas,
                                                    b_layout):
    from mkrt.kernels import allgather_gemm as agg
    p = outcome(lambda: agg.plan(m, n, k, nodes=nodes, ranks_per_node=per_node, ctas=ctas,
                                 comm_ctas=comm_ctas, b_layout=b_layout))
    if p is None:
        return
    event("a plan")
    assert p.world * p.rows == p.m and p.rows >= 1 and p.k % 8 == 0
    assert 1 <= p.comm_ctas < p.ctas and (b_layout == "nk" or p.n % 8 == 0)
    if p.world <= 16 and p.tiles_m <= 64:
        assert p.check() == []


@FAST
@given(nodes=st.integers(1, 4), per_node=st.integers(1, 8), m=SIZES, n=st.integers(1, 5000),
       k=st.integers(1, 512).map(lambda x: 8 * x), reduce_ctas=st.integers(1, 30),
       fuse=st.sampled_from([None, True, False]))
def test_reducescatter_plan_is_runnable_or_refused(nodes, per_node, m, n, k, reduce_ctas, fuse):
    p = outcome(lambda: gar_plan.plan(m, n, k, nodes=nodes, ranks_per_node=per_node, ctas=32,
                                      reduce_ctas=reduce_ctas, fuse=fuse,
                                      collective="reducescatter"))
    if p is None:
        return
    event("a plan")
    world = nodes * per_node
    assert p.m % world == 0 and p.kept_rows * world == p.m
    if p.fused and world > 1:
        assert p.whole_node_tiles
        if p.tiles <= 2000:
            assert p.check() == []


# ---- attention, ring attention, grouped GEMM, MoE -----------------------------------
# Each generator makes a valid call half the time and spoils one of its parts otherwise,
# so both the accepted and the refused paths are exercised (see the events).

F16_OR_BF16 = st.sampled_from([np.dtype(np.float16), bfloat16])
ODD_DIMS = st.one_of(st.integers(-1, 9), st.sampled_from([0, 96, 4096, 2**31]))


@st.composite
def attention_call(draw):
    B, Sq, Sk = draw(st.integers(1, 4)), draw(st.integers(1, 300)), draw(st.integers(1, 300))
    Hkv, group, D = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4])), \
        draw(st.sampled_from([64, 128]))
    dtype = draw(F16_OR_BF16)
    shapes = [[B, Sq, Hkv * group, D], [B, Sk, Hkv, D], [B, Sk, Hkv, D]]
    dtypes, causal = [dtype] * 3, draw(st.booleans())
    if draw(st.booleans()):
        what = draw(st.sampled_from(["shape", "rank", "dtype", "causal"]))
        if what == "shape":
            shapes[draw(st.integers(0, 2))][draw(st.integers(0, 3))] = draw(ODD_DIMS)
        elif what == "rank":
            shapes[draw(st.integers(0, 2))].append(1)
        elif what == "dtype":
            dtypes[draw(st.integers(0, 2))] = draw(DTYPES)
        else:
            causal = draw(st.sampled_from([1, "yes", None, 0.0]))
    return shapes, dtypes, causal


@FAST
@given(call=attention_call())
def test_attention_operands_are_runnable_or_refused(call):
    from mkrt.kernels import attention as A
    (q, k, v), dtypes, causal = call
    p = outcome(lambda: A.check_operands(q, k, v, *dtypes, causal=causal))
    if p is None:
        return
    event("a problem")
    assert len(q) == len(k) == 4 and tuple(k) == tuple(v) and q[0] == k[0] and q[3] == k[3]
    assert p.head_dim in A.HEAD_DIMS and p.heads % p.kv_heads == 0
    assert min(p.batches, p.sq, p.sk, p.heads, p.kv_heads) >= 1 and isinstance(causal, bool)
    assert np.dtype(dtypes[0]) in (np.dtype(np.float16), bfloat16)
    assert len({np.dtype(d) for d in dtypes}) == 1 and p.flops > 0


@FAST
@given(config=one_field_spoiled(
    st.fixed_dictionaries({"dtype": st.sampled_from(["bf16", "f16"]),
                           "head_dim": st.sampled_from([64, 128]),
                           "block_kv": st.sampled_from([64, 128, 192, 256]),
                           "stages": st.integers(2, 5), "pingpong": st.sampled_from([0, 1])}),
    {"dtype": st.sampled_from(["f32", 3]), "head_dim": st.one_of(st.integers(-1, 300), st.just(64.0)),
     "block_kv": st.integers(-1, 400), "stages": st.integers(-1, 8), "pingpong": st.integers(-1, 3)}))
def test_attention_specs_fit_shared_memory_or_are_refused(config):
    from mkrt.kernels import attention as A
    spec = outcome(lambda: A.AttentionSpec(**config))
    if spec is None:
        return
    event("a spec")
    assert spec.smem_bytes <= A.SMEM_LIMIT and spec.stages >= 2 and spec.pingpong in (0, 1)
    assert spec.block_kv in A.KEY_BLOCKS and spec.head_dim in A.HEAD_DIMS


@st.composite
def grouped_call(draw):
    G, N, K = draw(st.integers(1, 8)), draw(st.integers(1, 300)), 8 * draw(st.integers(1, 64))
    sizes = draw(st.lists(st.integers(0, 50), min_size=G, max_size=G))
    R = sum(sizes) + draw(st.integers(0, 5))
    start = draw(st.integers(0, R - sum(sizes)))
    offsets = list(start + np.concatenate([[0], np.cumsum(sizes)]))
    x, w, dtypes = [R, K], [G, N, K], [draw(F16_OR_BF16)] * 2
    if draw(st.booleans()):
        what = draw(st.sampled_from(["x", "w", "dtype", "offsets"]))
        if what == "x":
            x[draw(st.integers(0, 1))] = draw(ODD_DIMS)
        elif what == "w":
            w[draw(st.integers(0, 2))] = draw(st.one_of(ODD_DIMS, st.just(2000)))
        elif what == "dtype":
            dtypes[draw(st.integers(0, 1))] = draw(DTYPES)
        else:
            offsets = draw(st.lists(st.integers(-5, R + 5), min_size=0, max_size=G + 2))
    return x, w, dtypes, offsets


@FAST
@given(call=grouped_call())
def test_grouped_gemm_operands_and_offsets_are_runnable_or_refused(call):
    from mkrt.kernels import grouped_gemm as GG
    x, w, dtypes, offsets = call
    checked = outcome(lambda: GG.check_operands(x, w, *dtypes))
    if checked is None:
        return
    rows, n, k, groups, _ = checked
    assert k % 8 == 0 and 1 <= groups <= GG.MAX_GROUPS and n >= 1 and rows >= 0
    host = outcome(lambda: GG.check_host_offsets(offsets, groups, rows))
    if host is None:
        return
    event("offsets")
    assert len(host) == groups + 1 and host.dtype == np.int32
    assert np.all(np.diff(host) >= 0) and host[0] >= 0 and host[-1] <= rows


@st.composite
def moe_call(draw):
    T, k, per = draw(st.integers(0, 50)), draw(st.integers(1, 8)), draw(st.integers(1, 4))
    H, I = 8 * draw(st.integers(1, 64)), 8 * draw(st.integers(1, 64))
    shapes = [[T, H], [T, k], [T, k], [per, 2 * I, H], [per, H, I]]
    dtypes = [bfloat16, np.dtype(np.int32), np.dtype(np.float32), bfloat16, bfloat16]
    if draw(st.booleans()):
        i = draw(st.integers(0, 4))
        if draw(st.booleans()):
            shapes[i][draw(st.integers(0, len(shapes[i]) - 1))] = draw(ODD_DIMS)
        else:
            dtypes[i] = draw(DTYPES)
    return list(zip(shapes, dtypes)), per


@FAST
@given(call=moe_call())
def test_moe_operands_are_runnable_or_refused(call):
    from mkrt.kernels import moe as M
    args, per_rank = call
    shape = outcome(lambda: M.check_operands(*args, experts_per_rank=per_rank))
    if shape is None:
        return
    event("a shape")
    assert 1 <= shape.k <= 8 and shape.hidden % 8 == 0 and shape.inter % 8 == 0
    assert shape.per_rank == per_rank and shape.tokens >= 0


@FAST
@given(layout=st.sampled_from(["1x1", "1x2", "1x3", "1x4", "2x1", "2x2"]),
       experts_per_rank=st.integers(1, 8), config=one_field_spoiled(
           st.fixed_dictionaries({"capacity": st.integers(1, 5000),
                                  "receive_rows": st.one_of(st.none(), st.integers(1, 1 << 20)),
                                  "ctas": st.integers(1, 64)}),
           {"capacity": st.sampled_from([-1, 0, 1 << 25, 2.5]),
            "receive_rows": st.sampled_from([-1, 0, 1 << 27]),
            "ctas": st.sampled_from([-1, 0, 80, 2.5]), "experts": st.sampled_from([-2, 0, 7, 2000])}))
def test_moe_options_build_an_op_or_a_clean_error(layout, experts_per_rank, config):
    nodes, per_node = (int(v) for v in layout.split("x"))
    config = {"experts": experts_per_rank * nodes * per_node, **config}
    with emulated(layout) as world:
        op = outcome(lambda: mkrt.MoE(world, **config))
        if op is None:
            return
        event("an op")
        assert op.experts % world.size == 0 and op.layout.N == world.nodes
        assert 1 <= op.receive_rows <= 1 << 26 and 1 <= op.ctas <= 64


@FAST
@given(layout=st.sampled_from(["1x2", "1x4", "2x2", "3x1"]),
       ctas=st.one_of(st.none(), st.integers(-1, 200)),
       comm_ctas=st.one_of(st.none(), st.integers(-1, 40)),
       slots=st.one_of(st.none(), st.integers(-1, 40), st.booleans()),
       trace=st.sampled_from([False, True, 1, None]))
def test_ring_attention_options_build_an_op_or_a_clean_error(layout, ctas, comm_ctas, slots, trace):
    with emulated(layout) as world:
        op = outcome(lambda: mkrt.RingAttention(world, ctas=ctas, comm_ctas=comm_ctas, slots=slots,
                                                trace=trace))
        if op is None:
            return
        assert isinstance(trace, bool) and (slots is None or not isinstance(slots, bool))
        # slots: at least one, at most one per source that takes one
        assert op.slots == 0 if slots is None else 1 <= op.slots <= max(1, world.size - world.nodes)
        split = outcome(op.split)
        if split is None:
            return
        event("a split")
        total, comm = split
        assert 1 <= comm < total


def test_fixed_bug_grouped_gemm_negative_rows():
    """Found by the fuzzing of 2026-12-03: x of shape (-1, 8) with offsets [0, 0] passed."""
    from mkrt.kernels import grouped_gemm as GG
    with pytest.raises(ValueError, match="negative row count"):
        GG.check_operands((-1, 8), (1, 1, 8), np.float16, np.float16, 1)
