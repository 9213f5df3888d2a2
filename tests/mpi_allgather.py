"""Run under mpiexec by tests/test_allgather_mpi_gpu.py: allgather across processes
(CUDA IPC peer pointers, staged receive buffers), checked on every rank."""

import sys

import cupy
import numpy as np

import mkrt

world = mkrt.init()
(me,) = world.local
op = mkrt.AllGather(world, timeout_ms=10000)
failures = 0
for call in range(20):
    count = 1000 + 17 * call
    x = ((me.rank + 1) * 100_000 + cupy.arange(count) + call).astype(np.float32)
    out = op(x)
    world.synchronize()
    expected = [((r + 1) * 100_000 + np.arange(count) + call).astype(np.float32)
                for r in world.node_ranks(me.node)]
    failures += int(not np.array_equal(out.get(), np.stack(expected)))
total = world.comm.allreduce(failures)
op.close()
if me.rank == 0:
    print(f"MPI_ALLGATHER ranks={world.size} layout={world.layout} failures={total}")
sys.exit(1 if total else 0)
