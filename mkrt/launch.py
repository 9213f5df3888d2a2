"""Starting mpiexec jobs from Python (tests, experiments): the right binary and flags, and
a private CUDA MPS daemon for processes that share a GPU."""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def private_mps():
    """A private CUDA MPS control daemon for child processes that share one GPU.

    Yields the environment entries that point children at it, or None when the machine
    has no ``nvidia-cuda-mps-control`` or the daemon does not start; stops it afterwards.
    Without MPS, processes on one GPU get separate contexts that take turns on it, and
    persistent kernels waiting for each other across processes progress only as the turns
    alternate: the two-process verbs test failed that way in most of its runs on one
    H200 and passed under MPS (experiments/notes/verbs.md).
    """
    import tempfile
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="mkrt-mps-") as folder:
        env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(folder, "pipe"),
               "CUDA_MPS_LOG_DIRECTORY": os.path.join(folder, "log")}
        for path in env.values():
            os.mkdir(path)
        daemon_env = dict(os.environ, **env)
        try:
            started = subprocess.run([control, "-d"], env=daemon_env, capture_output=True,
                                     timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            started = False
        try:
            yield env if started else None
        finally:
            if started:
                subprocess.run([control], input=b"quit\n", env=daemon_env, capture_output=True,
                               timeout=30)
