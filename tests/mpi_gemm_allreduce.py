"""Run under mpiexec by tests/test_gemm_allreduce_mpi_gpu.py: GEMM+AllReduce between
processes (CUDA IPC peer pointers, staged results), checked on every rank. With
MKRT_TEST_COLLECTIVE=reducescatter (tests/test_gemm_reducescatter_gpu.py): GEMM+ReduceScatter,
each rank checking its rows."""

import os
import sys

import cupy
import numpy as np

import mkrt
from mkrt.arrays import bfloat16
from mkrt.kernels import gemm_allreduce as gar
from mkrt.kernels.gemm import to_float32

SCATTER = os.environ.get("MKRT_TEST_COLLECTIVE") == "reducescatter"
# Reduce-scatter on two nodes: each node's rows (M / 2) whole 128-row tiles.
M, N, K = (512 if SCATTER else 320), 512, 64


def operands(rank, call):
    rng = np.random.default_rng(1000 * call + rank)
    a = rng.standard_normal((M, K), dtype=np.float32).astype(bfloat16)
    b = (rng.standard_normal((K, N), dtype=np.float32) / 4).astype(bfloat16)
    return a, b


world = mkrt.init()
(me,) = world.local
op = (mkrt.GemmReduceScatter if SCATTER else gar.GemmAllReduce)(world, fuse=True, timeout_ms=20000,
                                                                ctas=8)
worst = 0.0
for call in range(3):
    a, b = operands(me.rank, call)
    out = op(cupy.asarray(a), cupy.asarray(b))
    world.synchronize()
    expected = sum(to_float32(x) @ to_float32(y) for x, y in map(lambda r: operands(r, call), range(world.size)))
    if SCATTER:
        rows = M // world.size
        expected = expected[me.rank * rows:(me.rank + 1) * rows]
    error = float(np.linalg.norm(to_float32(out.get()) - expected) / np.linalg.norm(expected))
    worst = max(worst, error)
worst = world.comm.allreduce(worst, op=__import__("mpi4py").MPI.MAX)
op.close()
world.close()
if me.rank == 0:
    name = "MPI_GEMM_REDUCESCATTER" if SCATTER else "MPI_GEMM_ALLREDUCE"
    print(f"{name} ranks={world.size} layout={world.layout} worst_error={worst:.2e}")
sys.exit(0 if worst < 1e-2 else 1)
