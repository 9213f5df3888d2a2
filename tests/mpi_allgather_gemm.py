"""Run under mpiexec by tests/test_allgather_gemm_gpu.py: AllGather+GEMM between processes
(CUDA IPC inside a node; with MKRT_WORLD_RANKS_PER_NODE=1 the host is split into nodes
that talk through the `ce` proxy), every rank checked against float64, A returned too."""

import sys

import cupy
import numpy as np

import mkrt
from mkrt.arrays import bfloat16
from mkrt.kernels.gemm import to_float32

ROWS, N, K = 200, 384, 64


def rows_of(rank, call):
    rng = np.random.default_rng(1000 * call + rank)
    return (rng.standard_normal((ROWS, K), dtype=np.float32) + 0.25 * rank).astype(bfloat16)


def shard_of(rank, call):
    rng = np.random.default_rng(7000 * call + rank)
    return (rng.standard_normal((K, N), dtype=np.float32) / 4).astype(bfloat16)


world = mkrt.init()
(me,) = world.local
op = mkrt.AllGatherGemm(world, fuse=True, timeout_ms=20000, ctas=8)
worst, gathered_exact = 0.0, True
for call in range(3):
    a, b = rows_of(me.rank, call), shard_of(me.rank, call)
    gathered = cupy.empty((ROWS * world.size, K), a.dtype)
    out = op(cupy.asarray(a), cupy.asarray(b), gathered_out=gathered)
    world.synchronize()
    whole = np.concatenate([rows_of(r, call) for r in range(world.size)])
    expected = to_float32(whole).astype(np.float64) @ to_float32(b).astype(np.float64)
    error = float(np.linalg.norm(to_float32(out.get()) - expected) / np.linalg.norm(expected))
    worst = max(worst, error)
    gathered_exact &= bool(np.array_equal(gathered.get().view(np.uint16), whole.view(np.uint16)))
worst = world.comm.allreduce(worst, op=__import__("mpi4py").MPI.MAX)
gathered_exact = world.comm.allreduce(int(gathered_exact), op=__import__("mpi4py").MPI.MIN)
op.close()
world.close()
if me.rank == 0:
    print(f"MPI_ALLGATHER_GEMM ranks={world.size} layout={world.layout} worst_error={worst:.2e} "
          f"gathered_exact={gathered_exact}")
sys.exit(0 if worst < 1e-2 and gathered_exact else 1)
