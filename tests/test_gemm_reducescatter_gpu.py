"""GEMM+ReduceScatter on emulated worlds on one GPU: each rank's rows against a float64
reference, the unfused baseline, 100 calls identical, graph replay, bad inputs, a silent
rank; and two processes under mpiexec (CUDA IPC, and a host split into two nodes)."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import mkrt
from mkrt.kernels import gemm_reducescatter as grs
from mkrt.launch import child_env, mpiexec_command
from tp_pair_checks import (REL_ERROR_BOUND, graph_replays_follow_new_inputs,
                            hundred_calls_are_identical)

pytestmark = pytest.mark.gpu


def operands(world, m, n, k, b_layout, dtype, seed=0):
    import cupy

    from mkrt.arrays import bfloat16
    np_dtype = bfloat16 if dtype == "bf16" else np.float16
    rng = cupy.random.default_rng(seed)
    a = [rng.standard_normal((m, k), dtype=np.float32).astype(np_dtype) for _ in world.local]
    shape = (k, n) if b_layout == "kn" else (n, k)
    b = [(rng.standard_normal(shape, dtype=np.float32) / 4).astype(np_dtype) for _ in world.local]
    return a, b


def worst_error(outs, a, b, b_layout):
    import cupy

    from mkrt.kernels.gemm import to_float32
    worst = 0.0
    for rank, out in enumerate(outs):
        expected = grs.reference(a, b, rank, b_layout=b_layout)
        got = to_float32(out).astype(cupy.float64)
        worst = max(worst, float(cupy.linalg.norm(got - expected) / cupy.linalg.norm(expected)))
    return worst


@pytest.mark.parametrize("case", grs.test_cases(), ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("fuse", [True, False])
def test_rows_match_float64_reference(make_world, case, fuse):
    import cupy

    from mkrt.kernels.gemm import poison
    layout, m, n, k, b_layout, dtype = case
    world = make_world(layout)
    op = mkrt.GemmReduceScatter(world, b_layout=b_layout, fuse=fuse, timeout_ms=10000)
    a, b = operands(world, m, n, k, b_layout, dtype, seed=m + n)
    outs = [poison(cupy.empty((m // world.size, n), a[0].dtype)) for _ in world.local]
    if fuse:
        op(a, b, out=outs)
    else:
        op.unfused(a, b, out=outs)
    world.synchronize()
    assert worst_error(outs, a, b, b_layout) < REL_ERROR_BOUND
    if fuse:
        assert op.last_plan.fused and op.last_plan.collective == "reducescatter"


@pytest.mark.parametrize("layout", ["1x2", "2x2"])
def test_hundred_calls_without_sync_are_identical(make_world, layout):
    world = make_world(layout)
    op = mkrt.GemmReduceScatter(world, fuse=True, timeout_ms=10000)
    a, b = operands(world, 512, 768, 64, "kn", "bf16", seed=3)
    hundred_calls_are_identical(world, op, a, b, worst_error)


def test_graph_capture_and_replay(make_world):
    import cupy
    world = make_world("2x2")
    op = mkrt.GemmReduceScatter(world, fuse=True, timeout_ms=10000)
    a, b = operands(world, 512, 512, 64, "kn", "bf16", seed=11)
    outs = [cupy.empty((128, 512), a[0].dtype) for _ in world.local]
    graph_replays_follow_new_inputs(world, op, a, b, outs, 512, operands, worst_error)


def test_bad_inputs_raise_before_launch(make_world):
    import cupy
    world = make_world("1x2")
    op = mkrt.GemmReduceScatter(world, timeout_ms=2000)
    a, b = operands(world, 301, 256, 64, "kn", "bf16")
    with pytest.raises(ValueError, match="mkrt.gemm_reducescatter: m=301 must be a multiple"):
        op(a, b)
    a, b = operands(world, 300, 256, 64, "kn", "bf16")
    with pytest.raises(ValueError, match="out"):
        op(a, b, out=[cupy.empty((300, 256), a[0].dtype) for _ in world.local])
    world2 = make_world("2x2")
    a2, b2 = operands(world2, 200, 256, 64, "kn", "bf16")       # 100 rows per node: not tiles
    with pytest.raises(ValueError, match="multiple of 128"):
        mkrt.GemmReduceScatter(world2, fuse=True)(a2, b2)
    outs = mkrt.GemmReduceScatter(world2, timeout_ms=10000)(a2, b2)   # unfused path instead
    world2.synchronize()
    assert worst_error(outs, a2, b2, "kn") < REL_ERROR_BOUND


@pytest.mark.parametrize("layout,muted", [("1x2", 1), ("2x2", 3)])
def test_a_rank_that_never_signals_raises_comm_timeout(make_world, layout, muted):
    world = make_world(layout)
    op = mkrt.GemmReduceScatter(world, fuse=True, timeout_ms=300, muted_rank=muted)
    a, b = operands(world, 512, 256, 64, "kn", "bf16")
    start = time.perf_counter()
    with pytest.raises(mkrt.CommTimeout):
        op(a, b)
        world.synchronize()
    assert time.perf_counter() - start < 10


@pytest.mark.parametrize("ranks_per_node,layout", [(0, "1x2"), (1, "2x1")])
def test_reducescatter_across_processes(ranks_per_node, layout):
    script = str(Path(__file__).with_name("mpi_gemm_allreduce.py"))
    env = child_env(MKRT_WORLD_RANKS_PER_NODE=str(ranks_per_node), MKRT_TEST_COLLECTIVE="reducescatter")
    result = subprocess.run(mpiexec_command(2, script), env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    match = re.search(rf"MPI_GEMM_REDUCESCATTER ranks=2 layout={layout} worst_error=(\S+)", result.stdout)
    assert match and float(match.group(1)) < 1e-2, result.stdout[-2000:]
