"""experiments/sanitize.py's parts that run without a GPU: which cases run as one process
per rank, the mpiexec command that does it, and reading the tool's counts back."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sanitize():
    spec = importlib.util.spec_from_file_location("sanitize", ROOT / "experiments" / "sanitize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_world_cases_run_as_one_process_per_rank_under_the_tool(sanitize):
    assert {"gemm_allreduce_fused_2x2", "gemm_allreduce_unfused_2x2",
            "gemm_reducescatter_fused_2x2", "allgather_gemm_fused_1x2",
            "allgather_2x2"} <= sanitize.PROCESS_CASES
    assert not {"gemm_300x520x64_kn", "attention_d128", "ring_attention_2x2",
                "moe_1x2"} & sanitize.PROCESS_CASES
    command, env = sanitize.process_command("gemm_reducescatter_fused_2x2", "racecheck", "each")
    assert command[command.index("-n") + 1] == "4"
    tool = command.index("--tool")
    # the tool wraps each rank's Python, inside mpiexec
    assert command[tool + 1] == "racecheck" and tool < command.index(sys.executable)
    assert command[-4:] == ["--inner", "gemm_reducescatter_fused_2x2", "--ce-copy-method", "each"]
    assert env["MKRT_WORLD_RANKS_PER_NODE"] == "2" and env["MKRT_SANITIZE_PROCESSES"] == "1"
    plain, _ = sanitize.process_command("allgather_gemm_fused_1x2", None, "kernel")
    assert "--tool" not in plain and plain[plain.index("-n") + 1] == "2"


def test_counts_are_summed_over_the_processes_and_every_check_must_pass(sanitize):
    one = "========= ERROR SUMMARY: 3 errors\nSANITIZE_CASE c ok=True\n"
    two = "========= ERROR SUMMARY: 4 errors\nSANITIZE_CASE c ok=True\n"
    parsed = sanitize.parse_output(one + two, "c", ranks=2)
    assert parsed == {"errors": 7, "hazards": None, "case_ok": True}
    assert not sanitize.parse_output(one + two, "c", ranks=4)["case_ok"]
    races = "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
    assert sanitize.parse_output(races * 2, "c", ranks=2)["hazards"] == 0


def test_one_rank_under_the_tool(sanitize, monkeypatch):
    """--tool-ranks: mpiexec runs every rank plainly and tells them which one re-runs itself
    under the tool; only the process of that rank does, once."""
    command, _ = sanitize.process_command("gemm_reducescatter_fused_2x2", "racecheck", "each", tool_rank=2)
    assert "--tool" not in command[:command.index(sys.executable)]      # no tool around mpiexec's ranks
    assert command[-4:] == ["--inner-tool", "racecheck", "--inner-tool-rank", "2"]
    execs = []
    monkeypatch.setattr(sanitize.os, "execvp", lambda path, argv: execs.append(argv))
    monkeypatch.setattr(sanitize, "use_ce_copy_method", lambda method: None)
    monkeypatch.setitem(sanitize.CASES, "probe_case", lambda: True)
    monkeypatch.delenv("MKRT_SANITIZE_WATCHED", raising=False)
    for variable in ("PMIX_RANK", "PMI_RANK"):
        monkeypatch.delenv(variable, raising=False)
    for rank, watched in ((1, False), (2, True)):
        monkeypatch.setenv("OMPI_COMM_WORLD_RANK", str(rank))
        execs.clear()
        # a plain rank runs the case and exits; the watched one execs (mocked here, so it
        # then runs the case too)
        with pytest.raises(SystemExit):
            sanitize.inner("probe_case", "each", "racecheck", 2)
        assert bool(execs) == watched
        if watched:
            prefix = sanitize.tool_prefix("racecheck")
            assert execs[0][:len(prefix) + 1] == [*prefix, sys.executable]
            assert execs[0][len(prefix) + 1:] == sys.orig_argv[1:]      # the same command line
            assert sanitize.os.environ["MKRT_SANITIZE_WATCHED"] == "1"
            monkeypatch.delenv("MKRT_SANITIZE_WATCHED")


def test_a_timeout_ends_the_whole_process_tree(sanitize, tmp_path):
    """A run that outlives its time is killed with everything it started (mpiexec's ranks
    under the tool): a grandchild left running held the GPU for the next case."""
    marker = tmp_path / "grandchild.pid"
    script = f"sleep 60 & echo $! > {marker}; echo started; wait"
    result = []
    # in a thread: with the grandchild alive, reading the pipe to its end would block
    runner = threading.Thread(target=lambda: result.append(
        sanitize.run_tree(["bash", "-c", script], None, 2.0)), daemon=True)
    runner.start()
    runner.join(20)
    assert result, "run_tree did not return: something it started still holds its output"
    output, code, timed_out = result[0]
    assert timed_out and code is None and "started" in output
    pid = int(marker.read_text())
    for _ in range(50):                  # the kill is delivered at once; reaping may lag
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
        if state == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the grandchild {pid} outlived the timeout")
    output, code, timed_out = sanitize.run_tree([sys.executable, "-c", "import sys; print('x', file=sys.stderr)"],
                                                None, 30.0)
    assert (output, code, timed_out) == ("x\n", 0, False)      # stderr comes back too


def test_the_not_printed_line_is_not_a_count(sanitize):
    """'ERROR SUMMARY: 81900 errors were not printed' follows the count when the print limit
    is reached; counting it too doubled three initcheck rows."""
    output = ("========= ERROR SUMMARY: 81920 errors\n"
              "========= ERROR SUMMARY: 81900 errors were not printed. Use --print-limit option\n"
              "SANITIZE_CASE c ok=True\n")
    assert sanitize.parse_output(output, "c")["errors"] == 81920
    assert sanitize.parse_output("========= ERROR SUMMARY: 1 error\n", "c")["errors"] == 1
