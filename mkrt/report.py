"""`python -m mkrt report`: the README's "What works today" table, made from the results.

The table lives in README.md between the two marker comments :data:`BEGIN` and
:data:`END`. It is generated, never edited by hand: each line's numbers come from the
JSON lines under ``experiments/results/*.jsonl`` (the rows ``mkrt.bench.record`` writes),
and each line names the commit its rows were recorded at. ``--check`` exits 1 when the
README differs from what this module generates; tests/test_report.py does the same in CI.

How a line is made (mkrt/DESIGN.md, "Results and the README table"):

* Rows belong to an experiment (their ``experiment`` field, else the file's name) and,
  inside it, to a *family*: a set of cases that one summary covers (one world layout of
  gemm_allreduce, one grid size of gemm, ...). A row may name its line itself with a
  ``report_family`` field; otherwise the experiment's rule below decides, and experiments
  without a rule fall back to (metric, layout, group).
* A *run* is the rows that share (commit, command, date). Each family is summarised over
  its newest run only: the run of its last row in file order (or, for lines marked
  ``same_commit``, every row of its last row's commit: one experiment run as one process
  per world). Older runs stay in the files for the record but no longer move the table.
* The summary is small and fixed per experiment: the range of the run's ratios (ratio > 1
  favours mkrt for every row ``mkrt.bench.record`` writes, except where a line says it is
  a time ratio), the geometric mean when there are several cases, and for a few single
  cases the range over every run recorded (the host side of lent machines varies a lot).
* An experiment this module has no rule for still gets lines (one per family), so new
  result files show up without code changes; give it a :class:`Piece` to word it better.

Reading rows never needs a GPU, CuPy or Numba.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
README = ROOT / "README.md"
BEGIN = "<!-- report:begin -->"
END = "<!-- report:end -->"

Row = dict


# ---- reading rows -----------------------------------------------------------------------

@dataclass
class Results:
    """Rows of every results file, per experiment, in file order."""

    rows: dict[str, list[Row]] = field(default_factory=dict)
    unreadable: dict[str, int] = field(default_factory=dict)     # file name -> bad lines


def load(results_dir: Path = RESULTS) -> Results:
    """Every ``*.jsonl`` under `results_dir`; lines that are not JSON objects are counted
    (a file being appended to may end in half a line), never fatal."""
    out = Results()
    for path in sorted(Path(results_dir).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if not isinstance(row, dict):
                out.unreadable[path.name] = out.unreadable.get(path.name, 0) + 1
                continue
            row.setdefault("_file", path.name)
            out.rows.setdefault(str(row.get("experiment") or path.stem), []).append(row)
    return out


def run_of(row: Row) -> tuple:
    return (str(row.get("commit", "unknown")), str(row.get("command", "")), str(row.get("date", "")))


def newest_run(rows: list[Row]) -> list[Row]:
    """The rows of the run that wrote the last of `rows`."""
    if not rows:
        return []
    last = run_of(rows[-1])
    return [r for r in rows if run_of(r) == last]


def runs(rows: list[Row]) -> list[list[Row]]:
    """Rows grouped by run, in order of each run's first row."""
    grouped: dict[tuple, list[Row]] = {}
    for row in rows:
        grouped.setdefault(run_of(row), []).append(row)
    return list(grouped.values())


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


# ---- formatting -------------------------------------------------------------------------

def fmt(value: float) -> str:
    """Three significant figures, no exponent for the magnitudes results have."""
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 0.01:
        return f"{value:.2f}"
    return f"{value:.2g}"


def span(values: list[float], unit: str = "") -> str:
    low, high = min(values), max(values)
    if fmt(low) == fmt(high):
        return f"{fmt(low)}{unit}"
    return f"{fmt(low)}-{fmt(high)}{unit}"


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def gpu_of(row: Row) -> str:
    """The row's GPU in short ("NVIDIA H100 80GB HBM3" -> "H100"); "" for rows taken
    without one."""
    name = str(row.get("gpu") or "")
    if name.lower() in ("", "none", "cpu"):
        return ""
    words = name.replace("NVIDIA", "").split()
    return words[0] if words else name


def commit_of(rows: list[Row]) -> str:
    """The rows' commits, then the GPUs they ran on."""
    commits = list(dict.fromkeys(str(r.get("commit", "unknown")) for r in rows))
    gpus = list(dict.fromkeys(g for g in map(gpu_of, rows) if g))
    text = ", ".join(f"`{c}`" for c in commits)
    return f"{text} ({', '.join(gpus)})" if gpus else text


# ---- what a line says -------------------------------------------------------------------

@dataclass(frozen=True)
class Line:
    """One table line: a family of rows, summarised over its newest run."""

    label: str                              # what the rows measure, in words
    select: Callable[[Row], bool]           # which rows belong to the line
    show: str = "ratio"                     # "ratio" or "value"
    against: str = ""                       # words after the ratio ("x cuBLAS", ...)
    history: bool = False                   # also: range over every run recorded
    sweep: str = ""                         # a numeric row field: give the ratio at its
                                            # largest and smallest value instead of a range
    sweep_unit: str = ""                    # after the largest value ("MiB per rank")
    sweep_unit_low: str = ""                # after the smallest (default: sweep_unit)
    at_least: float | None = None           # also count the cases whose ratio reaches this
    same_commit: bool = False               # summarise the newest commit's rows (several
                                            # runs, e.g. one process per world), not one run
    describe: Callable[[list[Row]], str] | None = None   # words the run itself, instead
    latest_per_case: bool = False           # the newest row of every case, over all runs
                                            # (an experiment run op by op, world by world)


def summarised_rows(line: Line, rows: list[Row]) -> list[Row]:
    """The rows `line` summarises: the newest row of every case, the newest commit's rows,
    or the newest run's, as the line says."""
    mine = [r for r in rows if line.select(r)]
    if not mine:
        return []
    if line.latest_per_case:
        return list({_case(r): r for r in mine}.values())
    if line.same_commit:
        return [r for r in mine if r.get("commit") == mine[-1].get("commit")]
    return newest_run(mine)


def summarise(line: Line, rows: list[Row]) -> tuple[str, str] | None:
    """(summary text, commit) of `line` over `rows`, or None when no row belongs to it."""
    run = summarised_rows(line, rows)
    if not run:
        return None
    if line.describe is not None:
        return line.describe(run), commit_of(run)
    key = "ratio" if line.show == "ratio" else "value"
    values = [v for v in (_number(r.get(key)) for r in run) if v is not None]
    if not values:
        return f"{line.label}: no {key} recorded", commit_of(run)
    unit = "x" if key == "ratio" else f" {run[-1].get('unit', '')}".rstrip()
    swept = sorted((_number(r.get(line.sweep)), _number(r.get(key))) for r in run
                   if line.sweep and _number(r.get(line.sweep)) is not None
                   and _number(r.get(key)) is not None)
    if len(swept) > 1:
        (low, at_low), (high, at_high) = swept[0], swept[-1]
        text = (f"{line.label}: {fmt(at_high)}{unit}{' ' + line.against if line.against else ''}"
                f" at {high:g}{line.sweep_unit}; {fmt(at_low)}{unit} at {low:g}"
                f"{line.sweep_unit_low or line.sweep_unit}"
                f" ({len(swept)} sizes)")
        return text, commit_of(run)
    text = f"{line.label}: {span(values, unit)}"
    if line.against:
        text += f" {line.against}"
    if len(values) > 1:
        text += f"; {len(values)} cases"
        if key == "ratio" and all(v > 0 for v in values) and span(values) != fmt(values[0]):
            text += f", geomean {fmt(geomean(values))}x"
    if line.at_least is not None and key == "ratio":
        text += f"; {sum(v >= line.at_least for v in values)} of {len(values)} at or above {fmt(line.at_least)}x"
    if line.history:
        per_run = []
        for group in runs([r for r in rows if line.select(r)]):
            got = [v for v in (_number(r.get(key)) for r in group) if v is not None]
            if got:
                per_run.append(geomean(got) if key == "ratio" and all(v > 0 for v in got) else got[-1])
        if len(per_run) > 1:
            text += f"; {len(per_run)} runs recorded: {span(per_run, unit)}"
    return text, commit_of(run)


# ---- families ---------------------------------------------------------------------------

def _case(row: Row) -> str:
    return str(row.get("case", ""))


def family_lines(rows: list[Row], name: Callable[[Row], str | None], *, show: str = "ratio",
                 against: str | Callable[[list[Row]], str] = "") -> list[Line]:
    """One :class:`Line` per family name, in order of each family's first row. A row's own
    ``report_family`` field wins over `name`; rows named None are left out."""
    def family(row: Row) -> str | None:
        return str(row["report_family"]) if row.get("report_family") else name(row)

    labels = list(dict.fromkeys(f for f in map(family, rows) if f is not None))
    lines = []
    for label in labels:
        members = [r for r in rows if family(r) == label]
        words = against(newest_run(members)) if callable(against) else against
        lines.append(Line(label, (lambda r, label=label: family(r) == label), show, words))
    return lines


def generic_family(row: Row) -> str:
    parts = [str(row.get("metric", "value"))]
    for key in ("layout", "group"):
        if row.get(key):
            parts.append(str(row[key]))
    return " ".join(parts)


def versus_baseline(run: list[Row]) -> str:
    names = list(dict.fromkeys(str(r["baseline_name"]) for r in run if r.get("baseline_name")))
    return f"vs {', '.join(names)}" if names else ""


# ---- the pieces of the table -----------------------------------------------------------

@dataclass(frozen=True)
class Piece:
    """A row group of the table: what exists, and (optionally) what its results say."""

    name: str
    state: str
    experiment: str | None = None
    lines: Callable[[list[Row]], list[Line]] | None = None


def _gemm_lines(rows):
    def grid(row):
        sms = row.get("sms")
        if sms is None or row.get("partial_run"):     # a few shapes again, not the suite
            return None
        return "full chip" if int(sms) >= 132 else f"{sms} of 132 SMs"
    return family_lines(rows, grid, against="of torch.matmul (cuBLASLt) on the full chip, same run")


def _allgather_lines(rows):
    def family(row):
        # Rows from before `group` existed gathered inside the node.
        return f"{row.get('layout', '?')} {row.get('group') or 'node'} gather"
    return [dataclasses.replace(line, sweep="mib_per_rank", sweep_unit=" MiB per rank",
                                sweep_unit_low=" MiB", against="of cudaMemcpyAsync (bandwidth)")
            for line in family_lines(rows, family)]


def _gemm_allreduce_lines(rows):
    def family(row):
        if row.get("metric") == "world1_time":
            return "world of 1 (op overhead)"
        layout = row.get("layout") or _case(row).split("_")[0]
        return f"{layout} emulated on one GPU"

    def against(run):
        if run and run[0].get("metric") == "world1_time":
            return "(plain mkrt.gemm's time / the op's)"
        return "cuBLAS + all-reduce (unfused time / fused time)"
    return family_lines(rows, family, against=against)


def _proxy_lines(rows):
    def case(name, metric):
        return lambda r: _case(r) == name and r.get("metric") == metric
    lines = [
        Line("round trip, CTA owns its queue", case("roundtrip_proxy_host_owned_reply_word_demoted", "median_us"),
             against="of a raw pinned-memory ping-pong (time ratio: < 1 is faster)", history=True),
        Line("round trip, shared queue", case("roundtrip_proxy_host_reply_word_demoted", "median_us"),
             against="of the raw ping-pong (time ratio)", history=True),
        Line("commands per second, 1 proxy thread", case("command_rate_1_threads", "Mcommands_per_s"),
             show="value", history=True),
        Line("commands per second, 8 proxy threads", case("command_rate_8_threads", "Mcommands_per_s"),
             show="value", history=True),
    ]
    for size, words in (("1024KiB_x1024", "1 MiB"), ("65536KiB_x16", "64 MiB")):
        lines.append(Line(f"`ce` puts of {words}, one poster",
                          case(f"ce_put_{size}_kernel_1posters", "bandwidth_GBps"),
                          against="back-to-back cudaMemcpyAsync (bandwidth)", history=True))
    return lines


def _runtime_lines(rows):
    def family(row):
        if row.get("metric") != "host_us_per_rank":
            return None                      # graph replays: experiments/notes/runtime.md
        label = str(row.get("label", ""))
        if label.startswith("ab_"):          # an A/B run: old and new code side by side
            return f"{row.get('op', '?')}: host time per call per rank, A/B run, {label[3:]}"
        label = " (code before the prepared path)" if label == "before" else ""
        return f"{row.get('op', '?')}: host time per call per rank{label}"
    lines = family_lines(rows, family, show="value")

    def current_code(line):
        # an A/B run or the code before: its newest commit's rows; the current code's
        # lines: the newest row of every world (runs go world by world)
        label = str(next(r for r in rows if line.select(r)).get("label", ""))
        return not (label.startswith("ab_") or label == "before")

    out = []
    for line in lines:
        current = current_code(line)
        line = dataclasses.replace(line, latest_per_case=current, same_commit=not current)
        found = sorted({str(r.get("layout")) for r in summarised_rows(line, rows)})
        out.append(dataclasses.replace(line, label=f"{line.label}, {'/'.join(found)}"))
    return out


def _planner_lines(rows):
    def family(row):
        if row.get("metric") == "timeout":
            return f"shapes whose fused call ended in CommTimeout (1 per shape), {row.get('layout')}"
        return f"planner's pick, {row.get('set', 'shapes')} shapes, {row.get('layout')}"
    lines = family_lines(rows, family, against="(faster path's time / the pick's)")
    # fuse="measure", timed in the same rounds (rows from 03788a0 on)
    def measured_text(run):
        ratios = [r["measured_vs_best"] for r in run]
        return (f"fuse=\"measure\" pick, {run[0].get('set')} shapes, {run[0].get('layout')}: "
                f"{span(ratios, 'x')} (faster path's time / the pick's); {len(ratios)} cases, "
                f"geomean {fmt(geomean(ratios))}x; {sum(x >= 0.97 for x in ratios)} of "
                f"{len(ratios)} at or above 0.97x")
    groups = dict.fromkeys((r.get("set"), r.get("layout")) for r in rows
                           if _number(r.get("measured_vs_best")))
    lines += [Line(f"fuse=\"measure\" pick, {group[0]} shapes, {group[1]}",
                   lambda r, group=group: (_number(r.get("measured_vs_best")) is not None
                                           and (r.get("set"), r.get("layout")) == group),
                   describe=measured_text)
              for group in groups]
    return [dataclasses.replace(line, at_least=0.97) if line.label.startswith("planner's pick")
            else line if line.describe else dataclasses.replace(line, show="value")
            for line in lines]


def _tp_pair_lines(op: str, name: str, baseline: str):
    """The lines of one op of experiments/tp_pair.py, one per world layout: the fused path,
    then what the op runs by default (fuse=None: it times both paths and keeps the faster),
    both against the unfused path of the same run."""
    def lines(rows):
        def family(row):
            return f"{name} {row.get('layout')} emulated on one GPU" if row.get("op") == op else None
        out = [dataclasses.replace(line, at_least=0.97) for line in family_lines(
            rows, family, against=f"{baseline} (unfused time / fused time)")]

        def measured(run):
            ratios = [r["unfused_us"] / r["measured_us"] for r in run]
            fused = sum(bool(r.get("measured_fused")) for r in run)
            return (f"{name} {run[0].get('layout')}, the default (fuse=None: times both paths, keeps "
                    f"the faster): {span(ratios, 'x')} {baseline} (unfused time / the pick's); "
                    f"{len(ratios)} cases, geomean {fmt(geomean(ratios))}x; "
                    f"{sum(x >= 0.97 for x in ratios)} of {len(ratios)} at or above 0.97x; "
                    f"fused kept on {fused}")

        def timed(r, layout):
            return (r.get("op") == op and r.get("layout") == layout
                    and bool(_number(r.get("measured_us"))) and bool(_number(r.get("unfused_us"))))
        layouts = sorted({str(r.get("layout")) for r in rows if r.get("op") == op})
        out += [Line(f"{name} {layout}, fuse=None", lambda r, layout=layout: timed(r, layout),
                     describe=measured) for layout in layouts
                if any(timed(r, layout) for r in rows)]
        return out
    return lines


def _instance_noise_lines(rows):
    """experiments/instance_noise.py: two op instances timing the same path on the same shape
    (the planner's held-out misses), per layout."""
    def text(run):
        pairs = [r for r in run if r.get("metric") == "b_over_a"]
        ratios = [r["b_us"] / r["a_us"] for r in pairs if _number(r.get("a_us")) and _number(r.get("b_us"))]
        far = sum(abs(v - 1.0) > 0.03 for v in ratios)
        shapes = len({(r.get("m"), r.get("n"), r.get("k")) for r in pairs})
        text = (f"{run[0].get('layout')} emulated, {shapes} shapes x 2 paths: the second instance's "
                f"time / the first's {span(ratios, 'x')}; {far} of {len(ratios)} differ by more "
                "than 3% (the margin the planner's misses are judged by)")
        # rows from 2026-12-04 on: a fuse="measure" op's kept path against the op fixed to it
        kept = [r["measured_us"] / r["fixed_us"] for r in run if r.get("metric") == "measured_over_fixed"
                and _number(r.get("measured_us")) and _number(r.get("fixed_us"))]
        if kept:
            text += (f"; the measuring op's kept path / the fixed op's time {span(kept, 'x')}"
                     f" ({sum(v > 1.03 for v in kept)} of {len(kept)} more than 3% slower)")
        return text
    return _lines_per_layout(rows, "instance noise, {} emulated", text)


def _agg_split_lines(rows):
    """experiments/agg_split.py: per layout, the best static split, the split then fixed,
    and roles="search", each against the unfused path of the same run."""
    def text(run):
        shapes: dict = {}
        for r in run:
            ratio = _number(r.get("ratio"))
            if ratio is not None:
                shapes.setdefault((r.get("m"), r.get("n"), r.get("k")), {})[str(r.get("path"))] = ratio
        best = [max(v for p, v in paths.items() if p.startswith("c")) for paths in shapes.values()]
        parts = [f"{run[0].get('layout')} emulated, {len(shapes)} shapes: best static split {span(best, 'x')} of allgather + cuBLAS "
                 f"(unfused time / fused time; geomean {fmt(geomean(best))}x)"]
        for path, name in (("default", "the default split of that commit"), ("search", 'roles="search"')):
            got = [paths[path] for paths in shapes.values() if path in paths]
            if got:
                parts.append(f"{name} {span(got, 'x')} (geomean {fmt(geomean(got))}x)")
        return "; ".join(parts)
    return _lines_per_layout(rows, "gathering split, {} emulated", text)


def _lines_per_layout(rows, label: str, describe):
    """One described line per world layout of the rows (label: a format with one {})."""
    return [Line(label.format(layout), lambda r, layout=layout: r.get("layout") == layout,
                 describe=describe)
            for layout in sorted({r.get("layout") for r in rows if r.get("layout")})]


def _multi_gpu_lines(rows):
    def family(row):
        kind = "allgather" if "_allgather_" in _case(row) else "gemm_allreduce"
        return f"{row.get('layout') or _case(row).split('_')[0]} {kind}"
    return family_lines(rows, family, against=versus_baseline)


def _faults_text(run):
    cases = [r for r in run if r.get("case") != "summary"]
    handled = sum(_number(r.get("value")) == 1 for r in cases)
    hangs = sum(bool(r.get("problems")) and any("took" in p for p in r["problems"]) for r in cases)
    wrong = len(cases) - handled - hangs
    slowest = max((_number(r.get("seconds")) or 0.0 for r in cases), default=0.0)
    text = (f"{len(cases)} faults tried: {hangs} hangs, {wrong} wrong results; "
            f"{handled} of {len(cases)} ended as promised and a new op was right afterwards; "
            f"slowest end {slowest:.2f} s")
    missed = [str(r.get("case")) for r in cases if _number(r.get("value")) != 1]
    return text + (f"; not handled: {', '.join(missed)}" if missed else "")


def _determinism_text(run):
    same = [r for r in run if r.get("identical")]
    calls = sum(int(_number(r.get("calls")) or 0) for r in same)
    text = (f"{len(same)} of {len(run)} op/mode pairs identical in every hash snapshot "
            f"({', '.join(str(r.get('case')) for r in same) or 'none'}; {calls} calls and "
            "replays, a hash every 100, first output checked against a reference)")
    failed = [r for r in run if not r.get("identical")]
    for r in failed:
        what = "timed out (CommTimeout)" if r.get("metric") == "timeout" else "differed or was wrong"
        text += f"; {r.get('case')} {what}"
    return text


def _sanitize_text(run):
    # the newest row of each (tool, case); "_ce_each" names the same case run with the
    # proxy's cuMemcpyAsync copies, "_processes" run as one process per rank
    newest = {}
    for r in run:
        case = str(r.get("case")).replace("_ce_each", "").replace("_processes", "")
        newest[(str(r.get("tool")), case)] = r
    rows = list(newest.values())
    parts = []
    for tool in dict.fromkeys(str(r.get("tool")) for r in rows if r.get("tool") != "none"):
        mine = [r for r in rows if r.get("tool") == tool]
        key = "hazards" if tool == "racecheck" else "errors"
        counted = [r for r in mine if r.get(key) is not None]
        found = sum(int(_number(r.get(key)) or 0) for r in counted)
        # A case that did not finish under the tool (its own check failed: a timeout,
        # typically) is named: its count covers only what ran.
        unfinished_cases = [str(r.get("case")) for r in mine if not r.get("case_ok")]
        # a case unfinished with every rank under the tool may have finished one rank at a time
        by_rank = [r for r in mine if re.search(r"_rank\d+$", str(r.get("case")))]
        for i, name in enumerate(unfinished_cases):
            stem = name.replace("_ce_each", "").replace("_processes", "")
            ranks = [r for r in by_rank if re.sub(r"_rank\d+$", "", str(r.get("case"))).replace(
                "_ce_each", "").replace("_processes", "") == stem]
            if ranks and all(r.get("case_ok") for r in ranks):
                unfinished_cases[i] = (f"{name}: finished with one rank under the tool at a time, "
                                       f"ranks {sorted(r.get('tool_rank') for r in ranks)}")
        text = f"{tool} {found} {key} in {len(counted)} cases"
        if tool == "initcheck" and found:
            text += (" (reads of what TMA stores wrote, and, one process per rank, of what other "
                     "ranks' processes wrote: initcheck tracks neither; with C stored plainly and "
                     "every writer under the tool, 0)")
        if unfinished_cases:
            text += (f", of which {len(unfinished_cases)} did not finish under the tool "
                     f"({', '.join(unfinished_cases)})")
        parts.append(text)
    return "; ".join(parts) or "no sanitizer rows"


def grouped_tile_cases(rows) -> dict:
    """grouped_gemm_tiles rows by case ((set, label, rows, skew)): the first row's fields as
    "meta" and each tile's time as "ms"[(block_m, block_n)] (also read by
    experiments/grouped_tiles_fit.py)."""
    cases: dict = {}
    for r in rows:
        key = (r.get("set"), r.get("label"), r.get("rows"), r.get("skew"))
        cases.setdefault(key, {"meta": r, "ms": {}})["ms"][(r.get("block_m"), r.get("block_n"))] = r.get("value")
    return cases


def tile_regrets(cases: dict, which: str, choose) -> list[tuple]:
    """(case key, tile, its time / the fastest tile's) for every case of set `which` whose
    sweep timed the tile `choose(rows, groups, n)` picks."""
    out = []
    for key, case in sorted(cases.items()):
        meta, times = case["meta"], case["ms"]
        if key[0] != which:
            continue
        tile = choose(meta["rows"], meta["groups"], meta["n"])
        if tile in times and all(times.values()):
            out.append((key, tile, times[tile] / min(times.values())))
    return out


def _set_regrets_text(regrets_of, what: str, against: str) -> str:
    """Per set (fit, held-out): the geomean and worst of a rule's regrets (its pick's time
    over the best's), `regrets_of(set name)` giving the list."""
    parts = []
    for which in ("fit", "held_out"):
        regrets = regrets_of(which)
        if regrets:
            parts.append(f"{which.replace('_', '-')} set, {len(regrets)} expert GEMMs: the rule's "
                         f"{what} {geomean(regrets):.3f}x {against} (geomean), worst "
                         f"{max(regrets):.3f}x")
    return "; ".join(parts) or "no rows"


def _grouped_tiles_text(run):
    """The grouped GEMM's tile rule against the fastest tile of the same run, per set."""
    from mkrt.kernels.grouped_gemm import choose_tile
    cases = grouped_tile_cases(run)
    return _set_regrets_text(
        lambda which: [x[2] for x in tile_regrets(cases, which, lambda r, g, n: choose_tile(r, g, n, 132))],
        "tile", "the fastest tile's time")


def _grouped_epilogue_text(run):
    """The grouped GEMM's epilogue rule against the faster of TMA and direct stores, per set."""
    from mkrt.kernels.grouped_gemm import choose_epilogue

    def regrets_of(which):
        regrets = []
        for r in run:
            if r.get("set") == which and _number(r.get("value")) and _number(r.get("baseline")):
                tma, direct = r["value"], r["baseline"]
                pick = tma if choose_epilogue(r["rows"], r["groups"], r["n"]) == "tma" else direct
                regrets.append(pick / min(tma, direct))
        return regrets
    return _set_regrets_text(regrets_of, "epilogue", "the faster one's time")


def _proxy_stall_text(run):
    parts = []
    words = {"unsynced": "first calls of each path unsynchronized",
             "synced": "each path synchronized after its first calls",
             "fused": "the fused path alone"}
    for mode in dict.fromkeys(str(r.get("mode")) for r in run):
        mine = [r for r in run if r.get("mode") == mode]
        parts.append(f"{words.get(mode, mode)}: {sum(_number(r.get('value')) == 1 for r in mine)} "
                     f"of {len(mine)} shapes timed out")
    return "; ".join(parts)


def _unordered_replay_text(run):
    words = {"ordered": "synchronized before capture", "unordered": "captured right after the eager call"}
    parts = []
    for r in run:
        mode = str(r.get("case")).rsplit("_", 1)[-1]
        seen = str(r.get("outcome", "")).split(":")[0]
        verdict = "as expected" if seen == r.get("expected") else f"expected {r.get('expected')}"
        parts.append(f"{r.get('case').split('_')[0]} {words.get(mode, mode)}: {seen} ({verdict})")
    return "; ".join(parts)


def _verbs_rate_text(run):
    parts = []
    for r in run:
        kind = "compiled verbs loop" if "compiled" in str(r.get("case")) else "Python verbs proxy"
        parts.append(f"{kind} {_number(r.get('value')) / 1e6:.2f} M commands/s, "
                     f"{_number(r.get('ratio')):.2g}x the host transport")
    where = ("on the GPU machine's CPUs" if run and run[0].get("gpu") not in (None, "none")
             else "CPU only (a 2-core VM, noisy)")
    return f"put+signal of 64 B, {where}: " + "; ".join(parts)


def _attention_lines(rows):
    def family(row):
        case = _case(row)
        d = "head dim 64" if "_d64" in case else "head dim 128"
        return f"{d}, {'causal' if case.endswith('_causal') else 'non-causal'}"
    return family_lines(rows, family, against="of the best torch SDPA backend (cuDNN here), same run")


def _attention_variant_lines(rows):
    turns = ("cyclic", "default")       # the planned deal against the cyclic one, in turns
    lines = family_lines(rows, lambda r: None if r.get("variant") in turns else f"configuration {r.get('variant')}",
                         against="of the default configuration's TFLOP/s, same run")
    return lines + [Line("planned deal", lambda r: r.get("variant") in turns, describe=_planned_deal_text)]


def _planned_deal_text(run):
    """Per causal shape: the planned deal's TFLOP/s over the cyclic deal's, each the mean of
    its turns (the default row taken first is left out: the clocks drift between turns)."""
    ratios = []
    for case in dict.fromkeys(str(r["case"]).rsplit("_", 1)[0] for r in run):
        mean = {}
        for variant in ("cyclic", "default"):
            got = [_number(r["value"]) for r in run if r["case"] == f"{case}_{variant}"]
            mean[variant] = sum(got) / len(got) if got else None
        if mean["cyclic"] and mean["default"]:
            ratios.append(mean["default"] / mean["cyclic"])
    how = "turn by turn"
    if not ratios:
        # timed in rotating rounds beside the default (experiments/attention.py since the
        # eighteenth session): a cyclic row's baseline is the planned default of its rounds
        ratios = [1 / _number(r["ratio"]) for r in run
                  if r.get("variant") == "cyclic" and _number(r.get("ratio"))]
        how = "in rotating rounds"
    if not ratios:
        return "planned deal: no pair of turns recorded"
    return (f"causal tiles dealt by the plan against the cyclic deal, {how}: {span(ratios, 'x')}"
            f" ({len(ratios)} shapes, geomean {fmt(geomean(ratios))}x)")


def _claim_probe_text(run):
    """Per build, its TFLOP/s over the dealt-out build's across the probe's shapes."""
    builds = ("handed_noreset", "handed_dc", "handed", "claimed_pout", "claimed")     # longest suffix first
    ratios: dict = {}
    for r in run:
        build = next((b for b in builds if str(r["case"]).endswith("_" + b)), None)
        if build is not None and _number(r.get("ratio")) is not None:
            ratios.setdefault(build, []).append(_number(r["ratio"]))
    words = {"claimed": "claimed", "handed": "handed (dealt-out tiles, claimed code)",
             "handed_noreset": "handed without the counter reset",
             "handed_dc": "handed by the producer, consumers on the dealt-out list",
             "claimed_pout": "claimed, counted out by the producer without a CTA barrier"}
    parts = [f"{words[b]} {span(ratios[b], 'x')}" for b in reversed(builds) if b in ratios]
    shapes = len({str(r["case"]) for r in run}) // max(1, len(ratios))
    # the probe's fixed-order version recorded each build's turns (a list); the rotating
    # one (interleaved_ms, since 6885d2f) one median
    order = "in turns" if isinstance(run[0].get("ms"), list) else "in rotating rounds"
    return (f"of tiles dealt out (causal: the planned deal; handed builds deal cyclically), "
            f"{shapes} shapes {order}: " + "; ".join(parts))


def _ring_lines(rows):
    return family_lines(rows, lambda r: f"{r.get('layout', '?')} emulated on one GPU",
                        against="of all-gather K/V + SDPA (best backend), same run")


def _gemm_tune_text(run):
    """The sweep's fastest configuration per shape against torch.matmul."""
    best: dict = {}
    for row in run:
        if row.get("metric") == "us" and _number(row.get("value")) is not None:
            if row["case"] not in best or row["value"] < best[row["case"]]["value"]:
                best[row["case"]] = row
    ratios = [r["baseline"] / r["value"] for r in best.values() if _number(r.get("baseline"))]
    if not ratios:
        return "no timed configurations"
    split = sum(int(r.get("split_k") or 1) > 1 and not r.get("split_tail") for r in best.values())
    tail = sum(int(r.get("split_k") or 1) > 1 and bool(r.get("split_tail")) for r in best.values())
    paired = sum(bool(r.get("cluster")) for r in best.values())
    text = (f"fastest of the tiles per shape: {span(ratios, 'x')} of torch.matmul, same run; "
            f"{len(ratios)} shapes, geomean {fmt(geomean(ratios))}x; split-K fastest on "
            f"{split} of {len(best)}")
    if any(r.get("split_tail") for r in run):
        text += f", the last wave's tiles split on {tail}"
    if any(r.get("cluster") for r in run):
        text += f"; clusters of two fastest on {paired} of {len(best)}"
    return text


def _gemm_probe_text(run):
    """The K-offset probe: the rule's tile on rows at each offset from a 32-byte sector."""
    rows = [r for r in run if r.get("probe") == "k_offset" and _number(r.get("ratio"))]
    odd = [r["ratio"] for r in rows if int(r.get("row_offset", 0)) % 32 == 16]
    even = [r["ratio"] for r in rows if int(r.get("row_offset", 0)) % 32 == 0]
    if not odd or not even:
        return "no K-offset rows"
    return (f"K rows an odd 16 bytes off a 32-byte sector: {span(odd, 'x')} of torch.matmul "
            f"({len(odd)} shapes); other offsets: {span(even, 'x')} ({len(even)} shapes)")


def _gemm_odd_rows_text(run):
    """Per shape, the fastest configuration on rows off a sector against torch.matmul."""
    best: dict = {}
    for row in run:
        shape = str(row.get("case", "")).split()[0]
        if _number(row.get("ratio")) and (shape not in best or row["ratio"] > best[shape]["ratio"]):
            best[shape] = row
    return "; ".join(f"{shape}: fastest {str(r['case']).split()[-1]} at {r['ratio']:.3f}x torch.matmul"
                     for shape, r in best.items()) or "no rows"


def _gemm_split_probe_text(run):
    """The tail split and the split kernel running whole tiles, against whole tiles."""
    whole = [r["ratio"] for r in run if r.get("variant") == "split kernel, all whole" and _number(r.get("ratio"))]
    tail = [r["ratio"] for r in run if str(r.get("variant", "")).startswith("tail") and _number(r.get("ratio"))]
    if not whole and not tail:
        return "no rows"
    return (f"the split kernel running every tile whole: {span(whole, 'x')} of the plain kernel's "
            f"speed; the last wave's tiles split: {span(tail, 'x')} ({len(tail)} cases, interleaved)")


def _gemm_l2_text(run):
    """128-byte against 256-byte L2 promotion, per shape and configuration, by row offset."""
    times: dict = {}
    for row in run:
        shape, config = str(row.get("case", "")).split()[:2]
        if _number(row.get("value")) and row.get("l2_promotion") in (2, 3):
            times.setdefault((shape, config.rsplit("_l2p", 1)[0]), {})[row["l2_promotion"]] = row["value"]
    odd, aligned = [], []
    for (shape, _), by in times.items():
        if 2 in by and 3 in by:
            (odd if int(shape.split("x")[2]) % 16 == 8 else aligned).append(by[3] / by[2])
    if not odd and not aligned:
        return "no rows"
    parts = []
    if odd:
        parts.append(f"rows off a sector (K = 8 mod 16): 128-byte promotion {span(odd, 'x')} "
                     f"the speed of 256-byte ({len(odd)} configurations)")
    if aligned:
        parts.append(f"aligned rows: {span(aligned, 'x')} ({len(aligned)})")
    return "; ".join(parts)


def _gemm_small_text(run):
    """Small shapes: GPU time in graphs against torch, and the programmatic launch's gain."""
    by: dict = {}
    for row in run:
        shape, _, what = str(row.get("case", "")).partition(" ")
        if _number(row.get("value")):
            by.setdefault(shape, {})[what] = row
    graph = [r["graph"]["baseline"] / r["graph"]["value"] for r in by.values() if "graph" in r]
    gain = [r["eager_prepared_plain"]["value"] / r["eager_pdl"]["value"] for r in by.values()
            if "eager_pdl" in r and "eager_prepared_plain" in r]
    if not graph:
        return "no rows"
    text = (f"in CUDA graphs (GPU time): {span(graph, 'x')} of torch.matmul ({len(graph)} shapes, "
            f"geomean {fmt(geomean(graph))}x)")
    if gain:
        text += (f"; back to back, the programmatic launch {span(gain, 'x')} the speed of a plain "
                 f"one")
    return text


def _gemm_trim_text(run):
    """Trimmed widths against 128x256 tiles of the same cluster, per shape."""
    by: dict = {}
    for row in run:
        if _number(row.get("value")) and row.get("split_k", 1) == 1 and row.get("block_m") == 128:
            by.setdefault((str(row["case"]).split()[0], row.get("cluster") or ""), {})[row.get("block_n")] = row["value"]
    ratios = [times[256] / us for times in by.values() for width, us in times.items()
              if width not in (128, 192, 256) and 256 in times]
    if not ratios:
        return "no rows"
    return (f"the shape's trimmed width against 128x256 of the same cluster: {span(ratios, 'x')} "
            f"the speed ({len(ratios)} cases)")


def _grouped_cluster_text(run):
    """Grouped GEMM pairs against single CTAs."""
    ratios = [r["m2_ratio_vs_torch"] / r["single_ratio_vs_torch"] for r in run
              if _number(r.get("m2_ratio_vs_torch")) and _number(r.get("single_ratio_vs_torch"))]
    if not ratios:
        return "no rows"
    return (f"pairs {span(ratios, 'x')} the speed of single CTAs ({len(ratios)} cases, "
            f"{sum(x > 1.01 for x in ratios)} faster by more than 1%)")


def _grouped_stream_k_text(run):
    """Grouped stream-K against whole tiles of the same tile, per (case, parts)."""
    ratios = [r["stream_k_ratio_vs_torch"] / r["whole_ratio_vs_torch"] for r in run
              if _number(r.get("stream_k_ratio_vs_torch")) and _number(r.get("whole_ratio_vs_torch"))]
    if not ratios:
        return "no rows"
    checked = all(r.get("correct") and r.get("bit_identical") for r in run)
    return (f"{span(ratios, 'x')} the speed of whole tiles ({len(ratios)} cases x parts, "
            f"{sum(x > 1.01 for x in ratios)} faster by more than 1%; outputs "
            f"{'all' if checked else 'NOT all'} right and repeated bit for bit)")


def _gemm_streamk_text(run):
    """Stream-K against the same tile without it, per case."""
    by: dict = {}
    for row in run:
        if _number(row.get("value")):
            by.setdefault(str(row.get("case", "")).split()[0], {})[row.get("variant")] = row["value"]
    ratios = {case: v["tile"] / v["streamk"] for case, v in by.items() if "tile" in v and "streamk" in v}
    if not ratios:
        return "no rows"
    return (f"against the same tile without it: {span(list(ratios.values()), 'x')} the speed "
            f"({len(ratios)} cases; " + ", ".join(f"{c} {fmt(r)}x" for c, r in ratios.items()) + ")")


def _fused_tile_text(run):
    """The GEMM rule's narrower tile in the fused gemm_allreduce, against the 256 tile."""
    narrower = [r for r in run if r.get("pick") != 256 and _number(r.get("vs_256"))]
    if not narrower:
        return "no shape where the rule picks a narrower tile"
    fastest = [r["times_us"]["256"] / min(r["times_us"].values()) for r in narrower]
    return (f"{run[0].get('layout', '?')} emulated, the rule's narrower tile: "
            f"{span([r['vs_256'] for r in narrower], 'x')} of the 256 tile's speed; "
            f"{len(narrower)} shapes, geomean {fmt(geomean([r['vs_256'] for r in narrower]))}x "
            f"(the fastest width: {fmt(geomean(fastest))}x)")


def _fused_tile_lines(rows):
    return _lines_per_layout(rows, "tile width {}", _fused_tile_text)


def _described(label, text, *, same_commit=False, latest_per_case=False):
    return lambda rows: [Line(label, lambda r: True, describe=text, same_commit=same_commit,
                              latest_per_case=latest_per_case)]


PIECES = [
    Piece("JIT", "CUDA C in Python strings, `#line` back to the Python source, NVRTC for "
          "`sm_90a` (also on machines without a GPU), disk cache, register/spill report"),
    Piece("worlds", "`mkrt.init()` under mpiexec (a node per host, or `MKRT_WORLD_RANKS_PER_NODE` "
          "ranks); emulated `NxG` worlds in one process; worlds across hosts: the `verbs` proxy "
          "service, run with GPU kernels over mkrt's loopback NIC (emulated 2x2, and two "
          "processes under mpiexec), never on RDMA hardware"),
    Piece("memory, waits", "symmetric buffers, peer pointers (CUDA IPC), epoch flags, bounded "
          "waits that end in `mkrt.CommTimeout`"),
    Piece("`mkrt.gemm`", "TMA + wgmma persistent engine, bf16/f16, both B layouts",
          "gemm", _gemm_lines),
    Piece("GEMM tiles", "six tiles (128x256, 128x192, 128x128, 64x256, 64x128, 256x128), clusters "
          "of two CTAs sharing B by TMA multicast, and split-K (of every tile, or of the last "
          "partial wave's tiles only), timed on 30 shapes "
          "(`experiments/gemm_tune.py`); the tile rule's wave model (tiles, clusters, a cost per "
          "row loaded off a 32-byte sector) is fitted on 15 of them "
          "(`mkrt/kernels/gemm_rule_fit.json`) and judged on the other 15", "gemm_tune",
          _described("tiles", _gemm_tune_text)),
    Piece("GEMM probes", "the rule's tile on M x N x K with K stepped by 8 (rows 16 to 128 "
          "bytes off a 128-byte line), torch in the same run (`experiments/gemm_probe.py`)",
          "gemm_probe", _described("K offsets", _gemm_probe_text)),
    Piece("GEMM rows off a sector", "shapes whose rows start 16 bytes off a 32-byte sector: "
          "tiles x clusters x epilogues x raster groups in turns with torch.matmul "
          "(`experiments/gemm_probe.py --probes odd_rows`)", "gemm_odd_rows",
          _described("odd rows", _gemm_odd_rows_text)),
    Piece("GEMM L2 promotion", "the tensor maps' L2 promotion (none, 64, 128, 256 bytes) on rows "
          "off a sector and aligned ones, three configurations each, in turns with torch.matmul "
          "(`experiments/gemm_probe.py --probes l2`); since `6147d83` maps of rows off a sector "
          "promote 128 bytes (`gemm.l2_promotion`)", "gemm_l2_promotion",
          _described("L2 promotion", _gemm_l2_text)),
    Piece("GEMM small shapes", "shapes of a wave or less: mkrt.gemm and torch.matmul eager, in "
          "CUDA graphs, and the host's enqueue time; the prepared launch programmatic (PDL, "
          "mkrt.gemm's default since `295256b`) and plain (`experiments/gemm_probe.py --probes "
          "small`)", "gemm_small", _described("small", _gemm_small_text)),
    Piece("GEMM trimmed widths", "128-row tiles trimmed to the narrowest multiple of 16 that "
          "keeps the waves of 128x256 (B [N, K], direct stores; `gemm_rule.trimmed_width`), in "
          "turns with 128x256 and 128x192 (`experiments/gemm_tune.py --trim`); the rule does not "
          "choose them: a refit rating them lost on the FIT set", "gemm_trim_probe",
          _described("trimmed", _gemm_trim_text)),
    Piece("GEMM stream-K", "`mkrt.gemm(stream_k=True)`: the full waves run whole tiles, the "
          "k-block iterations of the rest are shared out evenly over the grid and the split "
          "tiles added up in CTA order (one CTA per tile), in turns with the same tile without "
          "it and the rule's pick (`experiments/gemm_probe.py --probes streamk`); "
          "the rule takes it for the last wave of 128x256 tiles at "
          "K >= 4096, 4 or more whole waves and a last wave 20-70% full "
          "(`gemm_rule.stream_k_pays`; on by default since the suite run at `6888eda`, "
          "MKRT_GEMM_STREAM_K_RULE=0 turns it off)", "gemm_streamk_probe",
          _described("stream-K", _gemm_streamk_text)),
    Piece("GEMM tail split", "split-K of the last partial wave's tiles only (`split_tail=True`), "
          "against whole tiles of the same tile, in turns (`experiments/gemm_split_probe.py`); "
          "the rule does not choose it", "gemm_split_probe",
          _described("tail split", _gemm_split_probe_text)),
    Piece("`mkrt.allgather`", "world-wide and hierarchical: each block crosses to each other "
          "node once (proxy), then spreads inside the node over peer pointers; `group=\"node\"` "
          "gathers inside the node only", "allgather", _allgather_lines),
    Piece("`mkrt.gemm_allreduce`", "fused, hierarchical (proxy between nodes), graph-capturable; "
          "its CTAs take tiles and reduce tasks from device queues, split by the controller "
          "(below; the figures here predate it); "
          "the planner falls back to the unfused path where it predicts fusion loses. "
          "Emulated worlds share one GPU: ratios measure overlap and protocol cost, not NVLink",
          "gemm_allreduce", _gemm_allreduce_lines),
    Piece("fused tile width", "`GemmAllReduce(block_n=None)` takes the compute tile's width "
          "from the GEMM rule (opt-in: 256 is the default); `experiments/fused_tile.py` times "
          "every width on the shapes where the rule picks a narrower one", "fused_tile",
          _fused_tile_lines),
    Piece("host path", "prepared calls: arguments packed once per signature, launched with one "
          "`cuLaunchKernel`; ops are graph-capturable", "runtime", _runtime_lines),
    Piece("controller", "gemm_allreduce / gemm_reducescatter on a role board: CTAs draw tiles and "
          "reduce tasks from device queues, change role between tasks; the on-GPU controller moves "
          "the split during a launch and the next launch starts from what it learned "
          "(`roles='adaptive'`, default); `experiments/controller.py` sweeps every static split",
          "controller",
          lambda rows: [dataclasses.replace(line, same_commit=True, at_least=1 / 1.03)
                        for line in family_lines(
              [r for r in rows if r.get("metric") in ("controller_vs_best", "controller_vs_default",
                                                      "search_vs_best")],
              lambda r: f"{r['metric'].replace('_', ' ')}, {r.get('layout', '?')} emulated",
              against="time ratio (>1: the controller is faster)")]),
    Piece("planner", "`fuse=None` (the default) times fused and unfused on the first call of "
          "each size class and keeps the faster (`mkrt/controller/fusion.py`); `fuse=\"model\"` "
          "is the cost model's pick (`mkrt/controller/cost.py`; the \"planner's pick\" lines); "
          "`experiments/planner.py` times both against both paths", "planner", _planner_lines),
    Piece("planner: instance noise", "the planner's held-out misses again, each path timed in "
          "two op instances of the same shape, same run (`experiments/instance_noise.py`): how "
          "far two measurements of one path differ", "instance_noise", _instance_noise_lines),
    Piece("proxy", "GPU command queues + Numba proxy threads; `host` and `ce` transports; "
          "`verbs` (RC, EFA SRD): the compiled loop posts through the provider's function pointers; "
          "run over mkrt's loopback NIC with GPU kernels, never on RDMA hardware",
          "proxy", _proxy_lines),
    Piece("`mkrt.allgather_gemm`", "fused: the world-wide allgather's data movement in "
          "communication CTAs (split by `gather_split`), which then join the GEMM engine's CTAs "
          "(tiles claimed from a counter, since `02b9f9b`); tile rows of the rank's own block "
          "read its input, the others wait for the chunks holding their rows; GPU tests, "
          "sanitizers and 10,000-call determinism on emulated worlds (at `46aa52f`, before the "
          "split rule, the own-rows map and the joining CTAs: 0.23-0.87x on 1x2)",
          "tp_pair", _tp_pair_lines("allgather_gemm", "AllGather+GEMM", "allgather + cuBLAS")),
    Piece("AllGather+GEMM split", "the fused op at static splits of 2 to 24 communication CTAs, "
          "with `roles=\"search\"` and the unfused path, same run (`experiments/agg_split.py`); "
          "the split rule is fitted on these rows", "agg_split", _agg_split_lines),
    Piece("`mkrt.gemm_reducescatter`", "fused (the gemm_allreduce kernel, reduce-scatter build): "
          "true W-way, final rows to their keeper only, node sums only to the node that keeps them; "
          "the planner falls back to unfused where it predicts fusion loses "
          "(`experiments/tp_pair.py`)", "tp_pair",
          _tp_pair_lines("gemm_reducescatter", "GEMM+ReduceScatter", "cuBLAS + reduce-scatter")),
    Piece("reliability: faults", "a stalled rank, a proxy killed mid-run, a full queue with a "
          "stalled proxy, commands the transport refuses, NaN/Inf inputs, a timeout shorter than a "
          "tile (`experiments/faults.py`, also `tests/test_faults_gpu.py` with a rank process that "
          "exits under mpiexec)", "faults", _described("fault matrix", _faults_text)),
    Piece("reliability: determinism", "every world op on 2x2 (MoE on 1x4 and 2x2), 10,000 back-to-back calls and "
          "2,000 graph replays, hashed on the GPU every 100 (`experiments/determinism.py`)",
          "determinism", _described("determinism", _determinism_text, latest_per_case=True)),
    Piece("reliability: sanitizers", "compute-sanitizer memcheck, racecheck, synccheck, initcheck "
          "over every kernel at small shapes (`experiments/sanitize.py`)", "sanitize",
          _described("sanitizers", _sanitize_text, latest_per_case=True)),
    Piece("reliability: host stalls", "a host call that waits for the device while fused kernels "
          "wait for the proxy (mkrt/DESIGN.md, \"Runtime hazards\"; `experiments/proxy_stall.py`)",
          "proxy_stall", _described("proxy stall", _proxy_stall_text, same_commit=True)),
    Piece("reliability: unordered replay", "an eager call and a graph replay of the same fused op "
          "on two streams, ordered and not (both read the op's epoch on the device; "
          "`experiments/unordered_replay.py`)", "unordered_replay",
          _described("eager call then replay", _unordered_replay_text, same_commit=True)),
    Piece("verbs: compiled posting", "the proxy loop builds and posts ibv work requests itself "
          "(RC; EFA SRD through the extended QP API), over mkrt's loopback NIC "
          "(`experiments/verbs_rate.py`)", "verbs_rate",
          _described("verbs rate", _verbs_rate_text, same_commit=True)),
    Piece("one multi-GPU host", "mkrt vs NCCL + cuBLAS over NVLink (`experiments/multi_gpu.py`)",
          "multi_gpu", _multi_gpu_lines),
    Piece("`mkrt.attention`", "the Hopper attention engine alone (forward): TMA + wgmma, softmax "
          "probabilities fed to the second MMA from registers, pingpong between the consumer "
          "warpgroups, GQA/MQA, causal, head dim 64/128, [B, S, H, D] strided views "
          "(`experiments/attention.py`)", "attention", _attention_lines),
    Piece("`mkrt.ring_attention`", "the whole ring in one persistent kernel per rank: K/V "
          "gathered hierarchically (each chunk crosses to each node once), the engine visiting "
          "key blocks source by source as they arrive, merged in fp32 registers; zigzag causal "
          "with masked chunk pairs skipped; since `ddbc9bb` blocks are waited for "
          "chunk by chunk and the copying CTAs join the compute (`experiments/ring_attention.py`; "
          "the default split and 2 copying CTAs are both rows)",
          "ring_attention", _ring_lines),
    Piece("attention configurations", "other engine configurations (key block, stages, "
          "pingpong) against the default of the same run", "attention_variants",
          _attention_variant_lines),
    Piece("attention: claimed tiles", "the engine with tiles claimed from a counter, or handed "
          "over as the claimed build does but in the dealt-out order, against tiles dealt out "
          "(`experiments/attention_claim_probe.py`)", "attention_claim_probe",
          _described("claim probe", _claim_probe_text, same_commit=True)),
    Piece("`mkrt.grouped_gemm`", "the GEMM engine over every group's tiles in one launch "
          "(MoE's experts), group offsets from the host or the device; a group's weight too "
          "large for L2 is walked in bands of 8 m-tiles (since `932f011`); the tile by `choose_tile` "
          "(since `5fc7f29`); TMA stores by `choose_epilogue` (since `6b4a793`); timed back to "
          "back, in turns with the baselines (since `a45be3f`), "
          "host time included: the Qwen3 cases' kernels are 0.1-0.2 ms "
          "(`experiments/grouped_gemm.py`; GPU tests pass)", "grouped_gemm",
          lambda rows: family_lines(rows, lambda r: "expert GEMMs",
                                    against="of the best of torch._grouped_mm and a cuBLAS loop")),
    Piece("grouped GEMM tiles", "every tile (64/128 rows x 128/256 columns) on the expert-GEMM "
          "suite and 11 held-out expert GEMMs, same run (`experiments/grouped_gemm.py "
          "--sweep-tiles`); the tile rule (`choose_tile`: whole waves over the grid, an efficiency "
          "per tile) is fitted on the suite (`experiments/grouped_tiles_fit.py`)", "grouped_gemm_tiles",
          _described("tiles", _grouped_tiles_text)),
    Piece("grouped GEMM stores", "the rule's tile with TMA stores (tiles inside one group) "
          "against direct stores, in turns, on the suite and the held-out expert GEMMs; the rule "
          "(`choose_epilogue`: TMA stores where groups average 256 rows or more) is set on the "
          "suite (`experiments/grouped_gemm.py --epilogue-out`)", "grouped_gemm_epilogue",
          _described("stores", _grouped_epilogue_text)),
    Piece("grouped GEMM clusters", "the rule's tile and epilogue in clusters of two CTAs "
          "(pairs of a group's m-tiles sharing each weight load) against single CTAs, in turns, "
          "on the suite and the held-out expert GEMMs (`experiments/grouped_gemm.py "
          "--clusters-out`); `choose_cluster` keeps single CTAs", "grouped_gemm_cluster",
          _described("clusters", _grouped_cluster_text)),
    Piece("grouped GEMM stream-K", "the last wave's k-blocks shared out over the grid "
          "(`grouped_gemm(stream_k=True)`, at most 4, 16 or 132 parts per tile) against whole "
          "tiles of the same tile, in turns, on the suite and the held-out expert GEMMs "
          "(`experiments/grouped_gemm.py --stream-k-out`); the best rule fitted on the suite "
          "lost up to 1.48x on held-out cases (`experiments/grouped_stream_k_fit.py`), so "
          "`choose_stream_k` keeps whole tiles", "grouped_gemm_stream_k",
          _described("stream-K", _grouped_stream_k_text)),
    Piece("grouped GEMM stores, noise", "TMA stores against the rule's own choice, in turns: "
          "where the rule picks TMA both sides are one configuration, so the spread is the "
          "timing's noise", "grouped_gemm_epilogue_rule",
          lambda rows: family_lines(rows, lambda r: f"rule picks {r.get('rule_epilogue')}",
                                    against="of the same tile with the rule's stores")),
    Piece("`mkrt.MoE`", "dispatch in the planned order (across nodes, each token once to each "
          "other node holding one of its experts, placed there by the rank with its local index), "
          "grouped GEMMs, SwiGLU, combine (rows that crossed are summed per token on their node in "
          "fp32, one sum crosses back; a fixed-order fp32 sum at the source), as five launches "
          "(`experiments/moe.py`; GPU tests pass on 1x2, 1x3, 1x4, 2x1, 2x2, 3x1, 2x3)", "moe",
          lambda rows: family_lines(rows, lambda r: f"{r.get('layout', '?')} emulated",
                                    against="of host splits + copies + torch._grouped_mm")),
    Piece("not yet", "MoE in one kernel as the default (moe_fused runs, loses to the five "
          "launches on Qwen3-30B-A3B and fails one 2x2 test), the role queues and controller in the "
          "kernels other than gemm_allreduce / gemm_reducescatter, a run on RDMA hardware "
          "(InfiniBand, RoCE or EFA: worlds have run over mkrt's loopback NIC only, as RC queue "
          "pairs and as an EFA endpoint), a stream-K that pays below 4 waves (split-K pays for "
          "small M only)"),
]


# ---- the table ----------------------------------------------------------------------------

def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(results: Results) -> str:
    """The markdown between the markers (without them)."""
    out = ["| piece | state | measured: newest run of each line | rows from (GPU) |",
           "| --- | --- | --- | --- |"]
    known = {p.experiment for p in PIECES if p.experiment}
    pieces = list(PIECES)
    for name in sorted(set(results.rows) - known):
        pieces.insert(len(pieces) - 1, Piece(
            f"`{name}`", "rows in experiments/results/ without a summary rule in mkrt/report.py",
            name, lambda rows: family_lines(rows, generic_family, against=versus_baseline)))
    for piece in pieces:
        rows = results.rows.get(piece.experiment, []) if piece.experiment else []
        summaries = []
        if rows and piece.lines is not None:
            for line in piece.lines(rows):
                got = summarise(line, rows)
                if got is not None:
                    summaries.append(got)
        if piece.experiment and not summaries:
            summaries.append(("no rows yet", ""))
        if not summaries:
            summaries.append(("", ""))
        for i, (text, commit) in enumerate(summaries):
            name, state = (piece.name, piece.state) if i == 0 else ("", "")
            out.append(f"| {_cell(name)} | {_cell(state)} | {_cell(text)} | {commit} |")
    if results.unreadable:
        skipped = ", ".join(f"{n} ({c})" for n, c in sorted(results.unreadable.items()))
        out.append("")
        out.append(f"Lines that are not JSON objects were skipped: {skipped}.")
    return "\n".join(out)


def render_readme(readme_text: str, results: Results) -> str:
    """`readme_text` with the block between the markers replaced by :func:`table`."""
    start = readme_text.find(BEGIN)
    stop = readme_text.find(END)
    if start < 0 or stop < start:
        raise ValueError("mkrt.report: README.md lacks the report markers "
                         f"{BEGIN!r} ... {END!r}")
    return readme_text[:start + len(BEGIN)] + "\n" + table(results) + "\n" + readme_text[stop:]


def plot(results: Results, path: Path) -> str:
    """One PNG: the newest run's ratio of every case, one panel per experiment. Returns
    what happened (matplotlib is optional: without it nothing is written)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    panels = []
    for piece in PIECES + [Piece(f"`{n}`", "", n, lambda rows: family_lines(rows, generic_family))
                           for n in sorted(set(results.rows) - {p.experiment for p in PIECES})]:
        rows = results.rows.get(piece.experiment, []) if piece.experiment else []
        if not rows or piece.lines is None:
            continue
        points = []
        for line in piece.lines(rows):
            run = newest_run([r for r in rows if line.select(r)])
            ratios = [(_case(r), _number(r.get("ratio"))) for r in run]
            ratios = [(c, v) for c, v in ratios if v is not None]
            if ratios and line.show == "ratio":
                points.append((line.label, ratios))
        if points:
            panels.append((piece.name.strip("`"), points))
    if not panels:
        return "plot skipped: no ratios recorded"
    figure, axes = plt.subplots(len(panels), 1, figsize=(10, 3.2 * len(panels)), squeeze=False)
    for axis, (title, points) in zip(axes[:, 0], panels):
        x = 0
        for label, ratios in points:
            axis.bar([x + i for i in range(len(ratios))], [v for _, v in ratios], label=label)
            x += len(ratios) + 1
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_title(title)
        axis.set_ylabel("ratio (newest run)")
        axis.set_xticks([])
        axis.legend(fontsize=7)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return f"plot: {path}"


def main(args) -> int:
    """``python -m mkrt report [--check] [--print] [--plot PNG]``."""
    results = load(Path(args.results))
    readme = Path(args.readme)
    current = readme.read_text()
    try:
        wanted = render_readme(current, results)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    if args.print:
        print(table(results))
    if args.plot:
        print(plot(results, Path(args.plot)))
    if args.check:
        if current != wanted:
            print(f"mkrt.report: {readme} is out of date with {args.results}; run "
                  "`python -m mkrt report` and commit README.md", file=sys.stderr)
            return 1
        print(f"{readme}: table up to date")
        return 0
    if current != wanted:
        readme.write_text(wanted)
        print(f"{readme}: table rewritten from {sum(len(r) for r in results.rows.values())} rows")
    else:
        print(f"{readme}: table already up to date")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when README.md differs from what the rows give; write nothing")
    parser.add_argument("--print", action="store_true", help="also print the table")
    parser.add_argument("--plot", metavar="PNG", help="also draw the newest ratios (needs matplotlib)")
    parser.add_argument("--results", default=str(RESULTS), help="folder of *.jsonl rows")
    parser.add_argument("--readme", default=str(README), help="the file holding the markers")
