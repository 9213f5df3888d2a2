"""allgather on emulated worlds (one GPU is enough): values that name their source rank and
position, poisoned outputs, several nodes (through the proxy), the node-local option,
back-to-back calls without host sync, input checks, a silent rank.

Every op here has a timeout_ms: a wait that never ends raises mkrt.CommTimeout instead
of hanging the test."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

LAYOUTS = ["1x1", "1x2", "2x2", "2x3", "3x1"]


def rank_values(world, shape, dtype=np.float32, salt=0):
    """x[r][i] encodes (rank, i): every receiver can tell where each element came from."""
    import cupy
    count = int(np.prod(shape))
    out = []
    for info in world.local:
        with cupy.cuda.Device(info.device):
            if np.dtype(dtype) == np.float16:     # exact integers only up to 2048
                values = info.rank * 256 + (cupy.arange(count) * 7 + salt) % 256
            else:
                values = (info.rank + 1) * 1_000_000 + (cupy.arange(count) * 7 + salt) % 1_000_000
            out.append(values.astype(dtype).reshape(shape))
    return out


def expected_for(world, inputs, info, group="world"):
    import cupy
    ranks = range(world.size) if group == "world" else world.node_ranks(info.node)
    return cupy.stack([inputs[r] for r in ranks])


def poisoned(world, shape, dtype, rows):
    import cupy
    outs = []
    for info in world.local:
        with cupy.cuda.Device(info.device):
            outs.append(cupy.full((rows, *shape), 77, dtype))
    return outs


def check(world, inputs, outs, group="world", what="", op=None):
    """Every rank's output equals the stack of the inputs, on the caller's stream (no host
    sync first: the op orders its launches after the caller's work and the caller's later
    work after them). A mismatch says where each wrong value came from (rank, salt), whether
    it persists after a host sync, and the op's flag words."""
    import cupy
    for info, out in zip(world.local, outs):
        expected = expected_for(world, inputs, info, group)
        if cupy.array_equal(out, expected):
            continue
        bad = cupy.argwhere(out != expected)[:4].get().tolist()
        seen = [float(out[tuple(i)]) for i in bad]
        origin = [(int(v // 1_000_000) - 1, int((v % 1_000_000 - 7 * i[-1]) % 1_000_000))
                  for v, i in zip(seen, bad)]
        world.synchronize()
        after = "still wrong" if not cupy.array_equal(out, expected) else "right"
        flags = {}
        if op is not None:
            flags = {r.rank: op._flags.view(r.rank, np.uint64, (op.layout.words,)).get().tolist()
                     for r in world.local}
        raise AssertionError(f"{what} rank {info.rank}: wrong at {bad}: {seen} = (rank, salt) "
                             f"{origin}; after a host sync: {after}; flags {flags}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape,dtype", [((1 << 20,), np.float32), ((333, 7), np.float32),
                                          ((5,), np.int32), ((4096, 128), np.float16)])
def test_allgather_world_matches_reference(make_world, layout, shape, dtype):
    import mkrt
    world = make_world(layout)
    op = mkrt.AllGather(world, timeout_ms=5000)
    inputs = rank_values(world, shape, dtype)
    outs = poisoned(world, shape, dtype, world.size)    # every element must be written
    result = op(inputs, out=outs)
    world.synchronize()
    assert result is outs
    check(world, inputs, outs, what=layout)
    op.close()


@pytest.mark.parametrize("layout", ["2x2", "2x3", "3x1"])
def test_node_group_gathers_the_node_only(make_world, layout):
    import mkrt
    world = make_world(layout)
    op = mkrt.AllGather(world, group="node", timeout_ms=5000)
    inputs = rank_values(world, (3000,), np.float32, salt=1)
    outs = poisoned(world, (3000,), np.float32, world.ranks_per_node)
    op(inputs, out=outs)
    world.synchronize()
    check(world, inputs, outs, group="node")
    # the function form takes the option too, and the world-wide default differs
    node = mkrt.allgather(inputs, world=world, group="node", timeout_ms=5000)
    every = mkrt.allgather(inputs, world=world, timeout_ms=5000)
    world.synchronize()
    assert node[0].shape == (world.ranks_per_node, 3000) and every[0].shape == (world.size, 3000)
    check(world, inputs, node, group="node")
    check(world, inputs, every)
    op.close()


@pytest.mark.parametrize("layout", ["2x2", "2x3", "3x1"])
def test_hundred_calls_without_host_sync_each_see_their_inputs(make_world, layout):
    """Back to back, no host sync: each call's epoch keeps its data apart from the next."""
    import mkrt
    world = make_world(layout)
    op = mkrt.AllGather(world, ctas=8, timeout_ms=5000)
    calls = [rank_values(world, (12345,), np.float32, salt=salt) for salt in range(100)]
    results = [op(inputs) for inputs in calls]
    world.synchronize()
    for salt, (inputs, result) in enumerate(zip(calls, results)):
        check(world, inputs, result, what=f"call {salt}", op=op)
    op.close()


@pytest.mark.parametrize("layout", ["1x2", "2x3"])
def test_inputs_change_between_calls_and_outputs_follow(make_world, layout):
    """Reusing one output buffer while inputs change: no call sees stale data, and sizes
    that grow the receive buffer between calls work."""
    import mkrt
    world = make_world(layout)
    op = mkrt.AllGather(world, timeout_ms=5000)
    outs = poisoned(world, (4096,), np.float32, world.size)
    for salt in range(12):
        inputs = rank_values(world, (4096,), np.float32, salt=salt)
        op(inputs, out=outs)
        check(world, inputs, outs, what=f"call {salt}", op=op)
    bigger = rank_values(world, (70_000,), np.float32, salt=99)
    check(world, bigger, op(bigger), what="grown")
    op.close()


def test_bad_arguments_raise_before_launch(make_world):
    import cupy
    import mkrt
    world = make_world("2x1")
    op = mkrt.AllGather(world, timeout_ms=2000)
    a = cupy.ones(16, np.float32)
    with pytest.raises(ValueError, match="holds 2 ranks"):
        op(a)
    with pytest.raises(ValueError, match="3 arrays"):
        op([a, a, a])
    with pytest.raises(ValueError, match="differs between ranks"):
        op([a, cupy.ones(8, np.float32)])
    with pytest.raises(ValueError, match="differs between ranks"):
        op([a, cupy.ones(16, np.float16)])
    with pytest.raises(TypeError, match="host numpy"):
        op([np.ones(16, np.float32), a])
    with pytest.raises(ValueError, match="C-contiguous"):
        op([cupy.ones((16, 2), np.float32)[:, 0], a])
    with pytest.raises(ValueError, match=r"out\[0\] is \(2, 15\)"):
        op([a, a], out=[cupy.empty((2, 15), np.float32)] * 2)
    with pytest.raises(ValueError, match=r"group='world'"):     # a node-sized out is too small
        op([a, a], out=[cupy.empty((1, 16), np.float32)] * 2)
    big = cupy.empty((2, 16), np.float32)
    with pytest.raises(ValueError, match="overlaps"):
        op([big[0], a], out=[big, cupy.empty((2, 16), np.float32)])
    with pytest.raises(ValueError, match="mkrt.allgather: group='everyone'"):
        mkrt.AllGather(world, group="everyone")
    with pytest.raises(ValueError, match="mkrt.allgather: muted_rank must be"):
        mkrt.AllGather(world, muted_rank=5)
    with pytest.raises(ValueError, match="mkrt.allgather: ctas"):
        mkrt.AllGather(world, ctas=0)
    # Nothing above launched: the op still works.
    out = op([a, a])
    world.synchronize()
    assert cupy.array_equal(out[1], cupy.ones((2, 16), np.float32))
    op.close()


@pytest.mark.parametrize("layout,muted", [("1x4", 2), ("2x2", 1), ("3x1", 1)])
def test_a_silent_rank_raises_comm_timeout_naming_it(make_world, layout, muted):
    """The muted rank's block is never delivered: inside its node the peers' ready flag for
    it never rises; on other nodes the forwarder's landed flag never does (and so their
    ready flags). Either way the record names the block (tile) and the flag."""
    import mkrt
    from mkrt.kernels.allgather import FlagLayout
    world = make_world(layout)
    timeout_ms = 300
    op = mkrt.AllGather(world, timeout_ms=timeout_ms, muted_rank=muted, ctas=2)
    inputs = rank_values(world, (1000,), np.float32)
    start = time.perf_counter()
    op(inputs)
    with pytest.raises(mkrt.CommTimeout) as info:
        world.synchronize()
    elapsed = time.perf_counter() - start
    record = info.value.record
    flags = FlagLayout(world.ranks_per_node, world.nodes)
    muted_node = world.ranks[muted].node
    assert record.kernel == "allgather" and record.tile == muted, record
    assert (record.role, record.flag) in {("intra", flags.ready(muted)),
                                          ("inter", flags.landed(muted_node))}, record
    assert record.rank in range(world.size) and record.expected == 1 and record.seen == 0
    assert elapsed < timeout_ms / 1e3 + 5.0
    with pytest.raises(mkrt.MkrtError, match="failed earlier"):
        op(inputs)
    # The world is usable again with a fresh op.
    fresh = mkrt.AllGather(world, timeout_ms=5000)
    out = fresh(inputs)
    world.synchronize()
    check(world, inputs, out, what="fresh op")
    fresh.close()


@pytest.mark.parametrize("layout", ["1x2", "2x2"])
def test_captured_in_a_cuda_graph_and_replayed(make_world, layout):
    """Epochs live on the device, so a captured call replays correctly many times (the
    proxy serves the replayed launches' puts like any others)."""
    import cupy
    import mkrt
    world = make_world(layout)
    op = mkrt.AllGather(world, ctas=4, timeout_ms=5000)
    inputs = rank_values(world, (50_000,), np.float32)
    outs = [cupy.empty((world.size, 50_000), np.float32) for _ in world.local]
    op(inputs, out=outs)                     # first call outside: loads, allocates buffers
    world.synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        op(inputs, out=outs)
        graph = stream.end_capture()
    for replay in range(10):
        for out in outs:
            out.fill(-1)
        for x in inputs:
            x += 1                           # new data each replay, same buffers
        cupy.cuda.Device().synchronize()     # the fills ran on the default stream
        graph.launch(stream)
        stream.synchronize()
        world.synchronize()
        check(world, inputs, outs, what=f"replay {replay}")
    op.close()
