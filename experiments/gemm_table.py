"""Per-shape table of a GEMM suite run (experiments/gemm.py rows): the full-chip ratio to
torch.matmul and the reduced grids' scaling (time over 132/SMs x the full-chip time; the
issue's target is <= 1.05 on shapes of >= 4 waves), one column pair per run.

    python experiments/gemm_table.py [--commit HASH] [--file experiments/results/gemm.jsonl]
"""

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

FULL = 132                  # the H200's SMs
RESULTS = Path(__file__).resolve().parent / "results" / "gemm.jsonl"


def split_runs(rows):
    """Rows of one commit cut into runs: a run ends where a case repeats."""
    runs, seen = [[]], set()
    for row in rows:
        if row["case"] in seen:
            runs.append([])
            seen = set()
        seen.add(row["case"])
        runs[-1].append(row)
    return [run for run in runs if run]


def table(rows):
    by_run = [{r["case"]: r for r in run} for run in split_runs(rows)]
    shapes = list(dict.fromkeys(r["case"].split(" sms=")[0] for r in rows))
    lines = ["| shape | waves | " + " | ".join(f"run {i + 1}: full, 116, 100" for i in range(len(by_run))) + " |",
             "| --- | --- |" + " --- |" * len(by_run)]
    summary = []
    for i, run in enumerate(by_run):
        full = [r["ratio"] for r in run.values() if r["sms"] == FULL]
        pairs = [r["scaling"] for r in run.values() if r.get("scaling") is not None
                 and r.get("waves_full", 0) >= 4]
        low = sorted((r["ratio"], c.split(" sms=")[0]) for c, r in run.items()
                     if r["sms"] == FULL and r["ratio"] < 0.90)
        summary.append(f"run {i + 1}: full-chip geomean {math.exp(sum(map(math.log, full)) / len(full)):.3f}"
                       f" over {len(full)} shapes; below 0.90: {low or 'none'}; scaling pairs of >= 4 waves:"
                       f" {len(pairs)}, worst {max(pairs, default=float('nan')):.3f},"
                       f" above 1.05: {sum(p > 1.05 for p in pairs)}")
    for shape in shapes:
        cells, waves = [], ""
        for run in by_run:
            full = run.get(f"{shape} sms={FULL}")
            cut = [run.get(f"{shape} sms={s}") for s in (116, 100)]
            waves = waves or (cut[0] or {}).get("waves_full", "")
            text = f"{full['ratio']:.3f}" if full else "-"
            for r in cut:
                mark = ""
                if r and r.get("scaling") is not None:
                    mark = f"{r['scaling']:.3f}" + ("*" if r["scaling"] > 1.05 and r.get("waves_full", 0) >= 4 else "")
                    mark += "sk" if r.get("config", {}).get("stream_k") else ""
                text += ", " + (mark or "-")
            cells.append(text)
        lines.append(f"| {shape} | {waves} | " + " | ".join(cells) + " |")
    return "\n".join(lines + [""] + summary)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", type=Path, default=RESULTS)
    parser.add_argument("--commit", help="default: the file's last commit")
    args = parser.parse_args()
    rows = [json.loads(line) for line in args.file.read_text().splitlines() if line.strip()]
    commit = args.commit or rows[-1]["commit"]
    print(f"commit {commit}; ratio = torch time / mkrt time at full chip; scaling = time / "
          "(132 / SMs x full-chip time); * above 1.05 at >= 4 waves; sk: stream-K\n")
    print(table([r for r in rows if r["commit"] == commit]))


if __name__ == "__main__":
    main()
