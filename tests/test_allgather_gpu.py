"""allgather on emulated worlds (one GPU is enough): values that name their source rank,
odd sizes, back-to-back calls without host sync, input checks, a silent rank."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def rank_values(world, shape, dtype=np.float32, salt=0):
    """x[r][i] encodes (rank, i): every receiver can tell where each element came from."""
    import cupy
    count = int(np.prod(shape))
    out = []
    for info in world.local:
        with cupy.cuda.Device(info.device):
            if np.dtype(dtype) == np.float16:     # exact integers only up to 2048
                values = info.rank * 512 + (cupy.arange(count) * 7 + salt) % 512
            else:
                values = (info.rank + 1) * 1_000_000 + (cupy.arange(count) * 7 + salt) % 1_000_000
            out.append(values.astype(dtype).reshape(shape))
    return out


def expected_for(world, inputs, info):
    import cupy
    return cupy.stack([inputs[r] for r in world.node_ranks(info.node)])


@pytest.mark.parametrize("layout", ["1x1", "1x2", "1x4", "2x2"])
@pytest.mark.parametrize("shape,dtype", [((1 << 20,), np.float32), ((333, 7), np.float32),
                                          ((5,), np.int32), ((4096, 128), np.float16)])
def test_allgather_matches_reference(make_world, layout, shape, dtype):
    import cupy
    import mkrt
    world = make_world(layout)
    op = mkrt.AllGather(world, timeout_ms=5000)
    inputs = rank_values(world, shape, dtype)
    outs = []
    for info in world.local:    # poison: every element must be written
        with cupy.cuda.Device(info.device):
            outs.append(cupy.full((world.ranks_per_node, *shape), 77, dtype))
    result = op(inputs, out=outs)
    world.synchronize()
    assert result is outs
    for info, out in zip(world.local, outs):
        assert cupy.array_equal(out, expected_for(world, inputs, info)), f"rank {info.rank}"
    op.close()


def test_hundred_calls_without_host_sync_are_identical(make_world):
    import cupy
    import mkrt
    world = make_world("2x2")
    op = mkrt.AllGather(world, ctas=8, timeout_ms=5000)
    inputs = rank_values(world, (12345,), np.float32, salt=3)
    results = [op(inputs) for _ in range(100)]
    world.synchronize()
    for info, out in zip(world.local, results[0]):
        assert cupy.array_equal(out, expected_for(world, inputs, info))
    for call in results[1:]:
        for first, again in zip(results[0], call):
            assert cupy.array_equal(first, again)
    op.close()


def test_inputs_change_between_calls_and_outputs_follow(make_world):
    """Reusing one output buffer while inputs change: no call sees stale data."""
    import cupy
    import mkrt
    world = make_world("1x4")
    op = mkrt.AllGather(world, timeout_ms=5000)
    outs = [cupy.empty((4, 4096), np.float32) for _ in world.local]
    for salt in range(20):
        inputs = rank_values(world, (4096,), np.float32, salt=salt)
        op(inputs, out=outs)
        for info, out in zip(world.local, outs):
            assert cupy.array_equal(out, expected_for(world, inputs, info)), f"call {salt}"
    op.close()


def test_bad_arguments_raise_before_launch(make_world):
    import cupy
    import mkrt
    world = make_world("1x2")
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
    with pytest.raises(ValueError, match="out"):
        op([a, a], out=[cupy.empty((2, 15), np.float32)] * 2)
    # Nothing above launched: the op still works.
    out = op([a, a])
    world.synchronize()
    assert cupy.array_equal(out[1], cupy.ones((2, 16), np.float32))
    op.close()


def test_a_silent_rank_raises_comm_timeout_naming_it(make_world):
    import cupy
    import mkrt
    world = make_world("1x4")
    timeout_ms = 300
    op = mkrt.AllGather(world, timeout_ms=timeout_ms, muted_rank=2, ctas=2)
    inputs = rank_values(world, (1000,), np.float32)
    start = time.perf_counter()
    op(inputs)
    with pytest.raises(mkrt.CommTimeout) as info:
        world.synchronize()
    elapsed = time.perf_counter() - start
    record = info.value.record
    assert record.role == "intra" and record.kernel == "allgather"
    # whichever rank gives up first (the muted one waits for its own ready[2] too), the
    # record names the silent rank's flag: ready[2] of a 4-rank node, never set
    assert record.tile == 2 and record.flag == 4 + 2
    assert record.rank in range(4) and record.expected == 1 and record.seen == 0
    assert elapsed < timeout_ms / 1e3 + 5.0
    with pytest.raises(mkrt.MkrtError, match="failed earlier"):
        op(inputs)
    # The world is usable again with a fresh op.
    fresh = mkrt.AllGather(world, timeout_ms=5000)
    out = fresh(inputs)
    world.synchronize()
    assert cupy.array_equal(out[0], expected_for(world, inputs, world.local[0]))


def test_captured_in_a_cuda_graph_and_replayed(make_world):
    """Epochs live on the device, so a captured call replays correctly many times."""
    import cupy
    import mkrt
    world = make_world("1x2")
    op = mkrt.AllGather(world, ctas=4, timeout_ms=5000)
    inputs = rank_values(world, (50_000,), np.float32)
    outs = [cupy.empty((2, 50_000), np.float32) for _ in world.local]
    op(inputs, out=outs)                     # first call outside: loads, allocates flags
    world.synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        op(inputs, out=outs)
        graph = stream.end_capture()
    for replay in range(10):
        for out in outs:
            out.fill(-1)
        for info, x in zip(world.local, inputs):
            x += 1                           # new data each replay, same buffers
        stream.synchronize()
        graph.launch(stream)
        stream.synchronize()
        world.synchronize()
        for info, out in zip(world.local, outs):
            assert cupy.array_equal(out, expected_for(world, inputs, info)), f"replay {replay}"
