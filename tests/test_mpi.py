"""mpiexec bootstrap: mkrt.init() in 4 processes builds the same world everywhere (CPU)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path


from mkrt.launch import child_env, mpiexec_command

SCRIPT = str(Path(__file__).with_name("mpi_bootstrap.py"))


def run_bootstrap(tmp_path, ranks: int, gpus: int, ranks_per_node: int = 0) -> list[dict]:
    out = tmp_path / "world.json"
    env = child_env(MKRT_WORLD_RANKS_PER_NODE=str(ranks_per_node))
    result = subprocess.run(mpiexec_command(ranks, SCRIPT, str(out), str(gpus)), env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(out.read_text())


def test_four_ranks_on_one_host_form_one_node(tmp_path):
    table = run_bootstrap(tmp_path, 4, gpus=2)
    assert [r["rank"] for r in table] == [0, 1, 2, 3]
    assert {r["nodes"] for r in table} == {1} and {r["size"] for r in table} == {4}
    assert [r["local_rank"] for r in table] == [0, 1, 2, 3]
    assert [r["device"] for r in table] == [0, 1, 0, 1]     # host-local index modulo GPUs
    assert {r["node_comm_size"] for r in table} == {4}


def test_ranks_per_node_splits_the_host(tmp_path):
    table = run_bootstrap(tmp_path, 4, gpus=4, ranks_per_node=2)
    assert [r["node"] for r in table] == [0, 0, 1, 1]
    assert [r["local_rank"] for r in table] == [0, 1, 0, 1]
    assert [r["device"] for r in table] == [0, 1, 2, 3]
    assert [r["node_ranks"] for r in table] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert {r["node_comm_size"] for r in table} == {2}


def test_without_gpus_ranks_have_no_device(tmp_path):
    table = run_bootstrap(tmp_path, 2, gpus=0)
    assert [r["device"] for r in table] == [None, None]
