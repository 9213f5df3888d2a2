"""allgather between processes under mpiexec (both ranks may share one GPU)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from mkrt.launch import child_env, mpiexec_command

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("ranks", [2, 4])
def test_allgather_across_processes(ranks):
    script = str(Path(__file__).with_name("mpi_allgather.py"))
    result = subprocess.run(mpiexec_command(ranks, script), env=child_env(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"MPI_ALLGATHER ranks={ranks} layout=1x{ranks} failures=0" in result.stdout
