"""The README's results table is what `python -m mkrt report` makes from the result rows,
and the report copes with rows it has never seen (CPU only)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from mkrt import report

ROOT = Path(__file__).resolve().parents[1]


def test_readme_table_is_generated_from_the_results():
    readme = (ROOT / "README.md").read_text()
    wanted = report.render_readme(readme, report.load(ROOT / "experiments" / "results"))
    if readme != wanted:
        import difflib
        diff = "\n".join(difflib.unified_diff(readme.splitlines(), wanted.splitlines(),
                                              "README.md", "generated", lineterm="", n=0))
        pytest.fail("README.md's results table differs from the result rows: run "
                    f"`python -m mkrt report` and commit README.md\n{diff[:4000]}")


def test_every_kept_log_names_its_commit_and_command():
    for path in sorted((ROOT / "experiments" / "results").glob("*.log")):
        head = path.read_text().splitlines()[:6]
        assert any(re.match(r"# commit: \S+", line) for line in head), f"{path.name}: no '# commit:' line"
        assert any(line.startswith("# command: ") for line in head), f"{path.name}: no '# command:' line"


def row(experiment, case, ratio, commit, *, metric="time", command="run", **extra):
    return {"experiment": experiment, "case": case, "metric": metric, "value": 1.0,
            "baseline": ratio, "ratio": ratio, "unit": "us", "commit": commit,
            "command": command, "date": "2026-12-02", **extra}


def write_rows(folder: Path, name: str, rows, *, extra_lines=()):
    lines = [json.dumps(r) for r in rows] + list(extra_lines)
    (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")


def test_each_family_is_summarised_over_its_newest_run_only(tmp_path):
    rows = [row("gemm_allreduce", "1x2_a", 2.0, "old", layout="1x2"),
            row("gemm_allreduce", "1x2_b", 3.0, "old", layout="1x2"),
            row("gemm_allreduce", "2x2_a", 1.1, "old", layout="2x2"),
            row("gemm_allreduce", "1x2_a", 1.2, "new", layout="1x2"),
            row("gemm_allreduce", "1x2_b", 1.4, "new", layout="1x2")]
    write_rows(tmp_path, "gemm_allreduce", rows)
    text = report.table(report.load(tmp_path))
    one_node = next(line for line in text.splitlines() if "1x2 emulated" in line)
    assert "1.20-1.40x" in one_node and "`new`" in one_node and "3.00" not in one_node
    two_nodes = next(line for line in text.splitlines() if "2x2 emulated" in line)
    assert "1.10x" in two_nodes and "`old`" in two_nodes      # its newest run is still old


def test_new_experiments_and_bad_lines_do_not_break_the_report(tmp_path):
    write_rows(tmp_path, "gemm", [row("gemm", "bf16 8192", 1.05, "c1", metric="tflops", sms=132)])
    write_rows(tmp_path, "brand_new", [
        row("brand_new", "x_1", 0.9, "c2", metric="latency", layout="1x2", baseline_name="NCCL"),
        row("brand_new", "x_2", 1.3, "c2", metric="latency", layout="1x2", baseline_name="NCCL"),
        row("brand_new", "y", 2.0, "c2", metric="other", report_family="my own line")],
        extra_lines=['{"experiment": "brand_new", "half a li', "[1, 2]"])
    text = report.table(report.load(tmp_path))
    assert "| `brand_new` |" in text
    assert "latency 1x2: 0.90-1.30x vs NCCL; 2 cases" in text
    assert "my own line: 2.00x" in text
    assert "brand_new.jsonl (2)" in text                        # the skipped lines are said
    assert "| `mkrt.allgather` |" in text and "no rows yet" in text
    # The generic piece goes before "not yet", the last row group.
    assert text.index("`brand_new`") < text.index("| not yet |")


def test_sweeps_give_both_ends_and_proxy_lines_give_every_run(tmp_path):
    write_rows(tmp_path, "allgather", [
        row("allgather", f"1x2_{mib}MiB", ratio, "c3", metric="bandwidth_written", layout="1x2",
            group="world", mib_per_rank=mib) for mib, ratio in ((1, 0.1), (16, 0.5), (256, 0.9))])
    rate = "command_rate_1_threads"
    write_rows(tmp_path, "proxy", [row("proxy", rate, 1.0, c, metric="Mcommands_per_s") | {"value": v, "unit": "M/s"}
                                   for c, v in (("r1", 13.0), ("r2", 5.0), ("r3", 6.0))])
    text = report.table(report.load(tmp_path))
    assert "1x2 world gather: 0.90x of cudaMemcpyAsync (bandwidth) at 256 MiB per rank; 0.10x at 1 MiB (3 sizes)" in text
    assert "commands per second, 1 proxy thread: 6.00 M/s; 3 runs recorded: 5.00-13.0 M/s" in text


def test_check_fails_on_a_stale_readme_and_writing_fixes_it(tmp_path, capsys):
    write_rows(tmp_path, "gemm", [row("gemm", "bf16 8192", 1.05, "c1", metric="tflops", sms=132)])
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n\n{report.BEGIN}\nold table\n{report.END}\n\nrest\n")

    def run(*flags):
        parser = argparse.ArgumentParser()
        report.add_arguments(parser)
        return report.main(parser.parse_args([*flags, "--results", str(tmp_path), "--readme", str(readme)]))
    assert run("--check") == 1
    assert run() == 0
    assert run("--check") == 0
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("\n\nrest\n") and "old table" not in text
    assert "full chip: 1.05x" in text
    readme.write_text("no markers here\n")
    assert run("--check") == 2
    assert "lacks the report markers" in capsys.readouterr().err


def test_each_line_says_which_gpu_its_rows_ran_on():
    from mkrt import report
    rows = [{"commit": "abc1234", "gpu": "NVIDIA H100 80GB HBM3"}, {"commit": "abc1234", "gpu": "NVIDIA H200"},
            {"commit": "def5678", "gpu": "none"}]
    assert report.gpu_of(rows[0]) == "H100" and report.gpu_of(rows[1]) == "H200"
    assert report.gpu_of(rows[2]) == "" and report.gpu_of({}) == ""
    assert report.commit_of(rows) == "`abc1234`, `def5678` (H100, H200)"
    assert report.commit_of(rows[2:]) == "`def5678`"
