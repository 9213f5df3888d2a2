"""Run under mpiexec by tests/test_faults_gpu.py: rank 1 exits after the op is built (and
one call ran on both); rank 0's next call must end in mkrt.CommTimeout within its bound."""

import os
import sys
import time

import cupy
import numpy as np

import mkrt
from mkrt.arrays import bfloat16

world = mkrt.init()
(me,) = world.local
op = mkrt.GemmAllReduce(world, fuse=True, timeout_ms=500, ctas=8)
a = cupy.asarray(np.ones((256, 64), np.float32)).astype(bfloat16)
b = cupy.asarray(np.ones((64, 256), np.float32)).astype(bfloat16)
op(a, b)
world.synchronize()
world.barrier()
if me.rank == 1:
    sys.stdout.flush()
    os._exit(0)                       # gone: no finalize, no goodbye
time.sleep(0.5)
start = time.perf_counter()
raised, waiters = "nothing", 0
try:
    op(a, b)
    world.synchronize()
except mkrt.CommTimeout as error:
    raised, waiters = type(error).__name__, len(error.records)
except Exception as error:           # noqa: BLE001 - reported, the test judges it
    raised = type(error).__name__
print(f"MPI_FAULT survivor={me.rank} raised={raised} seconds={time.perf_counter() - start:.3f} "
      f"bound=0.5 waiters={waiters}", flush=True)
os._exit(0)
