"""allgather between processes whose host is split into nodes (MKRT_WORLD_RANKS_PER_NODE):
node peers through CUDA IPC into staged receive buffers, other nodes through each
process's proxy (`ce` over IPC-mapped memory). The ranks may share one GPU."""

from __future__ import annotations

import re
import subprocess

import pytest

from mkrt.launch import child_env, mpiexec_command

pytestmark = pytest.mark.gpu

SCRIPT = r'''
import sys

import cupy
import numpy as np

import mkrt

world = mkrt.init()
(me,) = world.local
failures = 0
for group in ("world", "node"):
    op = mkrt.AllGather(world, group=group, timeout_ms=10000)
    ranks = range(world.size) if group == "world" else world.node_ranks(me.node)
    for call in range(12):
        count = 1000 + 4099 * call          # grows: the staged buffer is re-made on the way
        x = ((me.rank + 1) * 1_000_000 + cupy.arange(count) + call).astype(np.float32)
        out = op(x)
        world.synchronize()
        expected = np.stack([((r + 1) * 1_000_000 + np.arange(count) + call).astype(np.float32)
                             for r in ranks])
        failures += int(out.shape != expected.shape or not np.array_equal(out.get(), expected))
    op.close()
total = world.comm.allreduce(failures)
if me.rank == 0:
    print(f"MPI_ALLGATHER_WORLD ranks={world.size} layout={world.layout} failures={total}")
sys.exit(1 if total else 0)
'''


@pytest.mark.parametrize("ranks,ranks_per_node,layout", [(2, 1, "2x1"), (4, 2, "2x2")])
def test_allgather_across_processes_and_nodes(tmp_path, ranks, ranks_per_node, layout):
    script = tmp_path / "mpi_allgather_world.py"
    script.write_text(SCRIPT)
    try:
        command = mpiexec_command(ranks, str(script))
    except FileNotFoundError as error:
        pytest.skip(str(error))
    env = child_env(MKRT_WORLD_RANKS_PER_NODE=str(ranks_per_node))
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    match = re.search(rf"MPI_ALLGATHER_WORLD ranks={ranks} layout={layout} failures=(\d+)",
                      result.stdout)
    assert match and match.group(1) == "0", result.stdout[-2000:]
