"""Proxy command rate: the compiled verbs loop over the loopback NIC against the `host`
transport (and the Python verbs proxy), in the same run, CPU only.

A producer thread (the GPU's posting protocol, compiled: mkrt/proxy/producer.py) posts
--commands put-with-signal commands of --bytes bytes from rank 0 to rank 1; the rate is
commands / (time from the first post until the last flag landed), median of --trials.
The `host` transport copies with memmove and stores the flag; the verbs paths build
ibv_send_wr chains and post them to the loopback NIC, which copies with memmove too, so
the difference is the posting path: WR building, credits, completions.

    PYTHONPATH=$PWD python3 experiments/verbs_rate.py --out experiments/results/verbs_rate.jsonl
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SPINS = np.int64(4_000_000_000)


def commands(n, nbytes):
    from mkrt.proxy import OP_PUT_SIGNAL
    from mkrt.proxy import producer as PR
    return PR.commands([dict(opcode=OP_PUT_SIGNAL, dst_rank=1, src_offset=(i % 64) * nbytes,
                             dst_offset=(i % 64) * nbytes, nbytes=nbytes, signal_region=1,
                             signal_offset=0, signal_value=i + 1) for i in range(n)])


def run_once(kind, cmds, nbytes):
    """Seconds from the first post until the last flag landed."""
    from mkrt.proxy import REGION_HOST, Proxy, QueueSet, new_region_table, set_region
    from mkrt.proxy import producer as PR
    from mkrt.proxy.transports.host import HostTransport
    from test_proxy_verbs_compiled import Ranks
    size = 64 * nbytes
    if kind == "host":
        data = [np.zeros(size, np.uint8) for _ in range(2)]
        flags = [np.zeros(8, np.uint64) for _ in range(2)]
        regions = new_region_table(2, 2)
        for r in range(2):
            set_region(regions, r, 0, data[r].ctypes.data, size, REGION_HOST)
            set_region(regions, r, 1, flags[r].ctypes.data, flags[r].nbytes, REGION_HOST)
        queues = QueueSet(1, 1024, [0])
        proxy = Proxy(queues, regions, HostTransport())
        target, close = flags[1], lambda: (proxy.close(), queues.close())
    else:
        from mkrt.proxy.verbs_loop import CompiledVerbsProxy
        from mkrt.proxy.verbs_proxy import VerbsProxy
        ranks = Ranks(2, sq_depth=256, signal_every=32)
        ranks.queues = [QueueSet(1, 1024, [r]) for r in range(2)]
        # only rank 0 posts: one proxy thread, as for the host transport (the loopback
        # NIC writes at post time, so rank 1 needs none; a 2-core machine has no spare)
        kind_class = CompiledVerbsProxy if kind == "verbs_compiled" else VerbsProxy
        transport = ranks.transports[0]
        ranks.proxies = [kind_class(ranks.queues[0], transport.regions, transport)]
        queues, target, close = ranks.queues[0], ranks.flags[1], ranks.close
    try:
        done = threading.Event()
        start = time.perf_counter()
        producer = threading.Thread(target=lambda: (PR.post_many(
            queues.ring, queues.header, np.uint64(queues.slots), 0, cmds, SPINS), done.set()))
        producer.start()
        # This thread sleeps between looks: on a 2-core machine a third spinning thread
        # (next to the producer and the proxy) would decide the result.
        deadline = start + 120
        while int(target[0]) < len(cmds) and time.perf_counter() < deadline:
            time.sleep(20e-6)
        seconds = time.perf_counter() - start
        producer.join()
        if int(target[0]) < len(cmds):
            raise RuntimeError(f"{kind}: the last flag never landed")
        return seconds
    finally:
        close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commands", type=int, default=200_000)
    parser.add_argument("--bytes", type=int, default=64)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--kinds", nargs="+", default=["host", "verbs_compiled", "verbs_python"])
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    from mkrt.bench import append_jsonl, record
    cmds = commands(args.commands, args.bytes)
    counts = {kind: args.commands if kind != "verbs_python" else min(args.commands, 20_000)
              for kind in args.kinds}
    for kind in args.kinds:
        run_once(kind, cmds[:1000], args.bytes)                      # compile, warm up
    times = {kind: [] for kind in args.kinds}
    for _ in range(args.trials):                                     # interleaved
        for kind in args.kinds:
            times[kind].append(run_once(kind, cmds[:counts[kind]], args.bytes))
    rates = {}
    for kind in args.kinds:
        rates[kind] = counts[kind] / statistics.median(times[kind])
        spread = [counts[kind] / t / 1e6 for t in times[kind]]
        print(f"{kind:15s} {rates[kind] / 1e6:7.3f} M commands/s (median of {args.trials}, "
              f"{min(spread):.3f}-{max(spread):.3f}; {counts[kind]} commands of {args.bytes} B)",
              flush=True)
    rows = []
    for kind, rate in rates.items():
        if kind == "host":
            continue
        rows.append(record("verbs_rate", f"{kind}_{args.bytes}B", "commands_per_s", rate,
                           rates.get("host"), "1/s", baseline_name="host transport",
                           commands=counts[kind], trials=args.trials,
                           samples=[counts[kind] / t for t in times[kind]],
                           host_samples=[counts["host"] / t for t in times["host"]]))
        print(f"{kind}: {rate / rates['host']:.2f}x the host transport's rate")
    if args.out:
        append_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
