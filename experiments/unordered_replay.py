"""Why tests must order a CUDA graph replay after an eager call of the same op.

Launches of one fused op read their epoch on the device (the launch count + 1) and the last
CTA out publishes it; a launch that starts before the one before it has finished reads the
old count and runs as the same epoch, so the flags its peers wait for never reach the new
value: a CommTimeout ``seen = expected - 1``. On an emulated 2x2 world (one GPU), the eager
call runs on the null stream and the replay on a non-blocking stream, unordered:

    PYTHONPATH=$PWD python3 experiments/unordered_replay.py --rounds 20

Two loops of eager call + replay: first with world.synchronize() between them (must pass),
then without (expected to end in mkrt.CommTimeout within the short timeout). Prints one line
per loop; with --out, one JSON row per loop (value 1 = passed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from mkrt.bench import append_jsonl, capture_graph, record  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="2x2")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--timeout-ms", type=int, default=2000)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    import cupy

    import mkrt
    from mkrt.arrays import bfloat16
    from mkrt.kernels import gemm_allreduce as gar

    world = mkrt.init(emulate=args.layout)
    rng = cupy.random.default_rng(5)
    a_list = [rng.standard_normal((640, 128), dtype=np.float32).astype(bfloat16) for _ in world.local]
    b_list = [rng.standard_normal((512, 128), dtype=np.float32).astype(bfloat16) for _ in world.local]
    outs = [cupy.empty((640, 512), bfloat16) for _ in world.local]
    rows = []
    for ordered in (True, False):
        op = gar.GemmAllReduce(world, b_layout="nk", fuse=True, timeout_ms=args.timeout_ms)
        op(a_list, b_list, out=outs)
        world.synchronize()
        graph, stream = capture_graph(lambda: op(a_list, b_list, out=outs))
        outcome = "passed"
        try:
            for _ in range(args.rounds):
                op(a_list, b_list, out=outs)
                if ordered:
                    world.synchronize()
                graph.launch(stream)
                if ordered:
                    stream.synchronize()
            stream.synchronize()
            world.synchronize()
        except mkrt.CommTimeout as error:
            outcome = f"CommTimeout: {str(error)[:160]}"
            cupy.cuda.Device().synchronize()
        name = "ordered" if ordered else "unordered"
        print(f"{args.layout} {name}: {outcome}", flush=True)
        rows.append(record("unordered_replay", f"{args.layout}_{name}", "passed",
                           float(outcome == "passed"), None, "bool", rounds=args.rounds,
                           expected="passed" if ordered else "CommTimeout", outcome=outcome))
        try:
            op.close()
        except Exception as error:      # the timed-out op may refuse to close cleanly
            print(f"  close: {type(error).__name__}: {str(error)[:120]}")
    world.close()
    if args.out:
        append_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
