"""AllGather bandwidth on emulated worlds vs a device-to-device cudaMemcpy of the same bytes.

Launch (one GPU is enough):
    PYTHONPATH=$PWD python3 experiments/allgather.py --layouts 2x2 2x4 --mib 1 16 64 256

For each layout N x G and per-rank size n: each rank receives R*n bytes (R = N*G ranks
with the default group="world"; G with --group node), so one call delivers
S = R * R*n bytes over all ranks. The world-wide gather is hierarchical: a rank's block
goes through the proxy (`ce` copies in an emulated world) to the same local rank of each
other node, which spreads it inside its node with peer stores.

Baseline: one cudaMemcpyAsync device-to-device of S bytes (the bytes every rank receives,
together) on the same GPU, timed in the same run; ratio = memcpy time / allgather time
(> 1: the gather delivers its bytes faster than a plain copy of them). An emulated world
runs every rank on ONE GPU: all ranks share its HBM, so this measures protocol overhead
and copy efficiency, not NVLink or a network; rows say so (emulated=true, gpus=1).
HBM traffic: the memcpy of a rank's share reads and writes R*n bytes each (2*N*G*n). The
gather reads each source block once for all of a node's destinations, but with several
nodes also stages each block in a registered receive buffer and crosses nodes as a proxy
copy: about N*n*(G+3) bytes per rank ((G+1)*n with one node). The row's `hbm_bound_ratio`
is the ratio that traffic alone allows (2x2: 0.80, 2x4: 1.14).

Correctness is checked against the stacked inputs before timing. Results: JSON lines
(--out) and a table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["2x2", "2x4"])
    parser.add_argument("--mib", nargs="+", type=float, default=[1, 16, 64, 256])
    parser.add_argument("--group", choices=["world", "node"], default="world")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "allgather.jsonl"))
    args = parser.parse_args()

    import cupy
    import numpy as np

    import mkrt
    from mkrt.bench import append_jsonl, interleaved_ms, record

    records = []
    print(f"{'layout':>6} {'group':>5} {'MiB/rank':>9} {'allgather us':>13} {'GB/s':>8} "
          f"{'memcpy us':>10} {'GB/s':>8} {'ratio':>6} {'bound':>6} {'host us':>8} ok")
    for layout in args.layouts:
        world = mkrt.init(emulate=layout)
        op = mkrt.AllGather(world, group=args.group, timeout_ms=20000)
        G = world.ranks_per_node
        N = world.nodes if args.group == "world" else 1
        for mib in args.mib:
            count = int(mib * 2**20) // 4
            inputs = [cupy.random.standard_normal(count, dtype=np.float32) + info.rank
                      for info in world.local]
            outputs = [cupy.full((op.ranks, count), np.nan, np.float32) for _ in world.local]
            op(inputs, out=outputs)
            world.synchronize()
            ok = True
            for info, out in zip(world.local, outputs):
                ranks = range(world.size) if args.group == "world" else world.node_ranks(info.node)
                ok &= all(bool(cupy.array_equal(out[i], inputs[r])) for i, r in enumerate(ranks))
            received = outputs[0].nbytes                 # what each rank receives
            written = received * len(outputs)            # what every rank receives, together
            source = cupy.empty(written, np.uint8)
            target = cupy.empty_like(source)
            kind = cupy.cuda.runtime.memcpyDeviceToDevice

            def memcpy():
                cupy.cuda.runtime.memcpyAsync(target.data.ptr, source.data.ptr, written, kind,
                                              cupy.cuda.get_current_stream().ptr)
            # rotating rounds (interleaved_ms): clocks drift under load, and until
            # 6885d2f-era commits the op was always timed before the copy
            ms_of = interleaved_ms({"op": lambda: op(inputs, out=outputs), "memcpy": memcpy},
                                   iterations=max(1, args.iters // 5), rounds=5, warmup=5)
            ms, base_ms = ms_of["op"], ms_of["memcpy"]
            world.synchronize()
            start = time.perf_counter()
            for _ in range(args.iters):
                op(inputs, out=outputs)
            host_us = (time.perf_counter() - start) / args.iters * 1e6
            world.synchronize()
            del source, target
            gbps, base_gbps = written / ms / 1e6, written / base_ms / 1e6
            bound = 2 * N * G / (N * (G + 3) if N > 1 else G + 1)
            print(f"{layout:>6} {args.group:>5} {mib:>9g} {ms * 1e3:>13.1f} {gbps:>8.1f} "
                  f"{base_ms * 1e3:>10.1f} {base_gbps:>8.1f} {base_ms / ms:>6.2f} {bound:>6.2f} "
                  f"{host_us:>8.1f} {ok}")
            case = f"{layout}_{mib:g}MiB" if args.group == "world" else f"{layout}_node_{mib:g}MiB"
            records.append(record(
                "allgather", case, "bandwidth_written", gbps, base_gbps, "GB/s",
                layout=layout, group=args.group, emulated=True, gpus=1,
                setup=f"emulated {layout} world on one GPU: all ranks share its HBM; nodes talk "
                      "through the proxy's ce copies",
                mib_per_rank=mib, bytes_received_per_rank=received, bytes_received_all_ranks=written,
                timing="interleaved_ms medians",
                time_us=ms * 1e3, host_us_per_call=host_us, baseline_time_us=base_ms * 1e3,
                hbm_bound_ratio=bound, correct=ok,
                baseline_name="cudaMemcpyAsync D2D of the bytes every rank receives (same GPU, same run)"))
            del inputs, outputs
        op.close()
        world.close()
        cupy.get_default_memory_pool().free_all_blocks()
    append_jsonl(args.out, records)
    print(f"wrote {len(records)} records to {args.out}")
    return 0 if all(r["correct"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
