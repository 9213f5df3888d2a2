"""GEMM+AllReduce between processes under mpiexec (the ranks may share one GPU)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from mkrt.launch import child_env, mpiexec_command

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("ranks_per_node,layout", [(0, "1x2"), (1, "2x1")])
def test_gemm_allreduce_across_processes(ranks_per_node, layout):
    """1x2: one node, CUDA IPC peer pointers. 2x1: the host split into two nodes, whose
    traffic goes through each process's proxy and the `ce` transport (IPC-mapped)."""
    script = str(Path(__file__).with_name("mpi_gemm_allreduce.py"))
    env = child_env(MKRT_WORLD_RANKS_PER_NODE=str(ranks_per_node))
    result = subprocess.run(mpiexec_command(2, script), env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    match = re.search(rf"MPI_GEMM_ALLREDUCE ranks=2 layout={layout} worst_error=(\S+)", result.stdout)
    assert match and float(match.group(1)) < 1e-2, result.stdout[-2000:]
