"""The examples' CPU parts (plans, compile-only builds, the tensor-parallel split in NumPy,
under mpiexec too) and the demo without a GPU: what CI can run of them."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from mkrt.launch import child_env, mpiexec_command

EXAMPLES = Path(__file__).resolve().parents[1] / "experiments" / "examples"


def run_example(*args: str, timeout: int = 300) -> str:
    result = subprocess.run([sys.executable, *args], env=child_env(), capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_walkthrough_cpu_part():
    out = run_example(str(EXAMPLES / "walkthrough.py"), "--cpu")
    assert "World(emulated 1x2" in out
    assert out.count("schedule check: every tile once, no wait cycle") == 4
    assert "compiled gemm_allreduce_bf16_kn_" in out and "compiled allgather_" in out
    assert "walkthrough --cpu: ok" in out


def test_tp_mlp_cpu_part_in_one_process():
    out = run_example(str(EXAMPLES / "tp_mlp.py"), "--cpu")
    assert "world 1x2 (one process)" in out
    assert "row-parallel: gemm_allreduce 4096x4096x8192 per rank" in out
    assert "tp_mlp --cpu: ok" in out


def test_tp_mlp_cpu_part_under_mpiexec():
    """Two processes: mkrt.init() builds the MPI world without GPUs and the shards' sum,
    reduced over MPI, equals the unsplit block."""
    try:
        command = mpiexec_command(2, str(EXAMPLES / "tp_mlp.py"), "--cpu")
    except FileNotFoundError as error:
        pytest.skip(f"no mpiexec: {error}")
    result = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "world 1x2 (mpiexec)" in result.stdout
    assert result.stdout.count("tp_mlp --cpu: ok") == 1          # rank 0 reports


def test_sweep_cpu_part_writes_the_planner_table(tmp_path):
    out = run_example(str(EXAMPLES / "sweep.py"), "--cpu", "--out", str(tmp_path),
                      "--m", "2048", "8192")
    assert f"csv: {tmp_path / 'sweep.csv'}" in out
    assert "plot: " in out or "plot skipped: matplotlib is not installed" in out
    rows = list(csv.DictReader((tmp_path / "sweep.csv").open()))
    assert [(r["layout"], r["m"]) for r in rows] == [("1x2", "2048"), ("1x2", "8192"),
                                                     ("2x2", "2048"), ("2x2", "8192")]
    assert all(r["source"] == "planner model" and float(r["fused_us"]) > 0 for r in rows)


def test_demo_without_a_gpu_says_what_it_ran(capsys):
    from mkrt.__main__ import main
    from mkrt.world import visible_gpus
    if visible_gpus():
        pytest.skip("a GPU is present: the demo runs the showcase op instead")
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mkrt demo: no usable CUDA GPU: ")
    assert "specs, 0 failed" in out
    assert "Ran: compile-only builds (above) and 5 CPU checks (5 passed)" in out
    assert "no kernel was launched and nothing was timed" in out
    assert "FAILED" not in out
