"""GEMM+AllReduce between processes under mpiexec (the ranks may share one GPU)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from mkrt.launch import child_env, mpiexec_command

pytestmark = pytest.mark.gpu


def test_gemm_allreduce_across_processes():
    script = str(Path(__file__).with_name("mpi_gemm_allreduce.py"))
    result = subprocess.run(mpiexec_command(2, script), env=child_env(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    match = re.search(r"MPI_GEMM_ALLREDUCE ranks=2 worst_error=(\S+)", result.stdout)
    assert match and float(match.group(1)) < 1e-2, result.stdout[-2000:]
