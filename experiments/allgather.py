"""AllGather bandwidth on emulated worlds vs a device-to-device cudaMemcpy of the same bytes.

Launch (one GPU is enough):
    PYTHONPATH=$PWD python3 experiments/allgather.py --layouts 1x2 1x4 2x2 --mib 1 16 64 256

For each layout and per-rank size n: every rank's output is W*n bytes (W ranks per node),
so one call writes S = ranks * W * n bytes. The baseline is one cudaMemcpyAsync of S bytes
on the same GPU, timed in the same run; ratio = memcpy time / allgather time (> 1: the
allgather moves its bytes faster than a plain copy would). On one GPU all ranks share one
HBM, so this measures protocol overhead and copy efficiency, not NVLink. Correctness is
checked against the stacked inputs before timing. Results: JSON lines (--out) and a table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["1x2", "1x4", "2x2"])
    parser.add_argument("--mib", nargs="+", type=float, default=[1, 4, 16, 64, 256])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "allgather.jsonl"))
    args = parser.parse_args()

    import cupy
    import numpy as np

    import mkrt
    from mkrt.bench import append_jsonl, median_ms, record

    records = []
    print(f"{'layout':>6} {'MiB/rank':>9} {'allgather us':>13} {'GB/s':>8} {'memcpy us':>10} "
          f"{'GB/s':>8} {'ratio':>6} {'host us':>8} ok")
    for layout in args.layouts:
        world = mkrt.init(emulate=layout)
        op = mkrt.AllGather(world, timeout_ms=20000)
        for mib in args.mib:
            count = int(mib * 2**20) // 4
            inputs = [cupy.random.standard_normal(count, dtype=np.float32) + info.rank
                      for info in world.local]
            outputs = [cupy.full((world.ranks_per_node, count), np.nan, np.float32)
                       for _ in world.local]
            op(inputs, out=outputs)
            world.synchronize()
            ok = all(bool(cupy.array_equal(out, cupy.stack([inputs[r] for r in world.node_ranks(info.node)])))
                     for info, out in zip(world.local, outputs))
            ms = median_ms(lambda: op(inputs, out=outputs), iters=args.iters)
            world.synchronize()
            start = time.perf_counter()
            for _ in range(args.iters):
                op(inputs, out=outputs)
            host_us = (time.perf_counter() - start) / args.iters * 1e6
            world.synchronize()
            written = sum(o.nbytes for o in outputs)
            source = cupy.empty(written, np.uint8)
            target = cupy.empty_like(source)
            kind = cupy.cuda.runtime.memcpyDeviceToDevice

            def memcpy():
                cupy.cuda.runtime.memcpyAsync(target.data.ptr, source.data.ptr, written, kind,
                                              cupy.cuda.get_current_stream().ptr)
            base_ms = median_ms(memcpy, iters=args.iters)
            del source, target
            gbps, base_gbps = written / ms / 1e6, written / base_ms / 1e6
            print(f"{layout:>6} {mib:>9g} {ms * 1e3:>13.1f} {gbps:>8.1f} {base_ms * 1e3:>10.1f} "
                  f"{base_gbps:>8.1f} {base_ms / ms:>6.2f} {host_us:>8.1f} {ok}")
            records.append(record("allgather", f"{layout}_{mib:g}MiB", "bandwidth_written", gbps,
                                  base_gbps, "GB/s", layout=layout, mib_per_rank=mib,
                                  time_us=ms * 1e3, host_us_per_call=host_us, baseline_time_us=base_ms * 1e3, correct=ok,
                                  baseline_name="cudaMemcpyAsync D2D of the same bytes"))
        op.close()
        world.close()
    append_jsonl(args.out, records)
    print(f"wrote {len(records)} records to {args.out}")
    return 0 if all(r["correct"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
