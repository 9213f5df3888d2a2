"""AllGather+GEMM on emulated worlds on one GPU: every rank's C against a float64
reference (rank-encoded rows of A), the unfused baseline, gathered A returned, 100 calls
identical, graph replay, bad inputs, a silent rank; two processes under mpiexec."""

from __future__ import annotations

import time

import numpy as np
import pytest

import mkrt
from mkrt.kernels import allgather_gemm as agg
from tp_pair_checks import (REL_ERROR_BOUND, graph_replays_follow_new_inputs,
                            hundred_calls_are_identical)

pytestmark = pytest.mark.gpu


def operands(world, rows, n, k, b_layout, dtype, seed=0):
    """A's rows carry their rank (an offset of 0.25 * rank), so a block landing in the
    wrong place shows; B is each rank's own random shard."""
    import cupy

    from mkrt.arrays import bfloat16
    np_dtype = bfloat16 if dtype == "bf16" else np.float16
    rng = cupy.random.default_rng(seed)
    a = [(rng.standard_normal((rows, k), dtype=np.float32) + 0.25 * info.rank).astype(np_dtype)
         for info in world.local]
    shape = (k, n) if b_layout == "kn" else (n, k)
    b = [(rng.standard_normal(shape, dtype=np.float32) / 4).astype(np_dtype) for _ in world.local]
    return a, b


def worst_error(outs, a, b, b_layout):
    import cupy

    from mkrt.kernels.gemm import to_float32
    worst = 0.0
    for out, b_r in zip(outs, b):
        expected = agg.reference(a, b_r, b_layout=b_layout)
        got = to_float32(out).astype(cupy.float64)
        worst = max(worst, float(cupy.linalg.norm(got - expected) / cupy.linalg.norm(expected)))
    return worst


@pytest.mark.parametrize("case", agg.test_cases(), ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("fuse", [True, False])
def test_matches_float64_reference(make_world, case, fuse):
    import cupy

    from mkrt.kernels.gemm import poison
    layout, rows, n, k, b_layout, dtype = case
    world = make_world(layout)
    op = mkrt.AllGatherGemm(world, b_layout=b_layout, fuse=fuse, timeout_ms=10000)
    a, b = operands(world, rows, n, k, b_layout, dtype, seed=rows + n)
    m = rows * world.size
    outs = [poison(cupy.empty((m, n), a[0].dtype)) for _ in world.local]
    gathered = [poison(cupy.empty((m, k), a[0].dtype)) for _ in world.local]
    op(a, b, out=outs, gathered_out=gathered)
    world.synchronize()
    assert op.last_plan.fused == fuse
    assert worst_error(outs, a, b, b_layout) < REL_ERROR_BOUND
    whole = cupy.concatenate(a)
    for g in gathered:
        assert cupy.array_equal(g.view(cupy.uint16), whole.view(cupy.uint16))


@pytest.mark.parametrize("layout", ["1x2", "2x2"])
def test_hundred_calls_without_sync_are_identical(make_world, layout):
    world = make_world(layout)
    op = mkrt.AllGatherGemm(world, fuse=True, timeout_ms=10000)
    a, b = operands(world, 256, 512, 64, "kn", "bf16", seed=3)
    hundred_calls_are_identical(world, op, a, b, worst_error)


def test_graph_capture_and_replay(make_world):
    import cupy
    world = make_world("2x2")
    op = mkrt.AllGatherGemm(world, fuse=True, timeout_ms=10000)
    a, b = operands(world, 256, 512, 64, "kn", "bf16", seed=11)
    outs = [cupy.empty((1024, 512), a[0].dtype) for _ in world.local]
    graph_replays_follow_new_inputs(world, op, a, b, outs, 256, operands, worst_error)


def test_bad_inputs_raise_before_launch(make_world):
    import cupy
    world = make_world("1x2")
    op = mkrt.AllGatherGemm(world, timeout_ms=2000)
    a, b = operands(world, 128, 256, 64, "kn", "bf16")
    with pytest.raises(ValueError, match="out"):
        op(a, b, out=[cupy.empty((128, 256), a[0].dtype) for _ in world.local])
    with pytest.raises(ValueError):
        op([a[0], a[1][:64]], b)                           # ranks disagree on rows
    with pytest.raises(ValueError, match="n % 8"):
        op(a, [cupy.ascontiguousarray(x[:, :100]) for x in b])


@pytest.mark.parametrize("layout,muted", [("1x2", 1), ("2x2", 3)])
def test_a_rank_that_never_signals_raises_comm_timeout(make_world, layout, muted):
    world = make_world(layout)
    op = mkrt.AllGatherGemm(world, fuse=True, timeout_ms=300, muted_rank=muted)
    a, b = operands(world, 256, 256, 64, "kn", "bf16")
    start = time.perf_counter()
    with pytest.raises(mkrt.CommTimeout):
        op(a, b)
        world.synchronize()
    assert time.perf_counter() - start < 10


@pytest.mark.parametrize("ranks_per_node,layout", [(0, "1x2"), (1, "2x1")])
def test_across_processes(ranks_per_node, layout):
    import re
    import subprocess
    from pathlib import Path

    from mkrt.launch import child_env, mpiexec_command
    script = str(Path(__file__).with_name("mpi_allgather_gemm.py"))
    env = child_env(MKRT_WORLD_RANKS_PER_NODE=str(ranks_per_node))
    result = subprocess.run(mpiexec_command(2, script), env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    match = re.search(rf"MPI_ALLGATHER_GEMM ranks=2 layout={layout} worst_error=(\S+) "
                      r"gathered_exact=1", result.stdout)
    assert match and float(match.group(1)) < 1e-2, result.stdout[-2000:]


@pytest.mark.parametrize("layout", ["1x2", "2x2"])
def test_measured_fusion_settles_on_the_path_it_timed(make_world, layout):
    """fuse="measure": the first call times both paths and settles; its output and the
    gathered A it returns are the settled path's bits (a forced op of that path)."""
    import cupy

    from graph_checks import assert_same_bits
    world = make_world(layout)
    op = mkrt.AllGatherGemm(world, b_layout="nk", fuse="measure", timeout_ms=10000)
    a, b = operands(world, 256, 384, 128, "nk", "bf16", seed=31)
    m = 256 * world.size
    gathered = [cupy.empty((m, 128), a[0].dtype) for _ in world.local]
    first = op(a, b, gathered_out=gathered)
    world.synchronize()
    plan = op.last_plan
    assert plan.reason.startswith("measured") and len(op.measured.times) == 1
    forced = mkrt.AllGatherGemm(world, b_layout="nk", fuse=plan.fused, timeout_ms=10000)
    reference = forced(a, b)
    again = op(a, b)
    world.synchronize()
    assert_same_bits(first, reference)
    assert_same_bits(again, reference)
    full = cupy.concatenate(a, axis=0)
    for g in gathered:
        assert cupy.array_equal(g.view(cupy.uint16), full.view(cupy.uint16))
    assert worst_error(first, a, b, "nk") < REL_ERROR_BOUND
    op.close()
    forced.close()
