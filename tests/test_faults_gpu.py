"""Fault injection on the GPU: each fault of experiments/faults.py ends in the exception it
promises within its bound, and a new op on the same world is right afterwards. Also: a
rank whose process exits under mpiexec (tests/mpi_faults.py)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mkrt.launch import child_env, mpiexec_command

pytestmark = pytest.mark.gpu

_spec = importlib.util.spec_from_file_location(
    "mkrt_experiment_faults", Path(__file__).resolve().parents[1] / "experiments" / "faults.py")
faults = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(faults)


@pytest.mark.parametrize("name", sorted(faults.FAULTS))
def test_fault_is_handled(make_world, name):
    outcome = faults.FAULTS[name](make_world)
    assert faults.judge(name, outcome) == [], outcome


def test_a_rank_whose_process_exits_ends_in_comm_timeout_on_the_survivor():
    """Two processes on one node (CUDA IPC); rank 1 exits after building the op. Rank 0's
    call ends in CommTimeout within its bound and says which wait gave up."""
    script = str(Path(__file__).with_name("mpi_faults.py"))
    result = subprocess.run(mpiexec_command(2, script), env=child_env(), capture_output=True,
                            text=True, timeout=180)
    output = result.stdout + result.stderr
    match = re.search(r"MPI_FAULT survivor=0 raised=(\w+) seconds=(\S+) bound=(\S+) waiters=(\d+)",
                      output)
    assert match, output[-3000:]
    assert match.group(1) == "CommTimeout", output[-2000:]
    assert float(match.group(2)) < float(match.group(3)) + faults.SLACK_S
