"""Starting mpiexec jobs from Python (tests, experiments): the right binary and flags."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path


@functools.cache
def mpiexec_path() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if not found:
        raise FileNotFoundError("mkrt.launch: no mpiexec beside the interpreter or on PATH "
                                "(pip install mpich, or install an MPI)")
    return found


@functools.cache
def _is_open_mpi() -> bool:
    try:
        out = subprocess.run([mpiexec_path(), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in out.stdout + out.stderr or "OpenRTE" in out.stdout + out.stderr


def mpiexec_command(ranks: int, script: str, *args: str) -> list[str]:
    """`mpiexec -n ranks python -m mpi4py script args` (an uncaught error aborts every rank)."""
    command = [mpiexec_path(), "-n", str(ranks)]
    if _is_open_mpi():
        command += ["--oversubscribe"]
        if os.geteuid() == 0:
            command += ["--allow-run-as-root"]
    return command + [sys.executable, "-m", "mpi4py", script, *args]


def child_env(**overrides: str) -> dict[str, str]:
    """Environment for child processes: this checkout importable even when not installed."""
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, **overrides)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env
