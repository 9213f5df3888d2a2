"""Command queue + host proxy: latency, command rate, `ce` bandwidth, each against its reference.

Measures, in one run on one GPU:
  1. round trip GPU -> proxy -> GPU (one thread posts a signal to itself and waits for it),
     median and p99, against the raw pinned-memory ping-pong (GPU release-stores a word in
     mapped host memory, a Numba nogil host thread answers) — target: within 10%;
     plus the same through `ce` with the flag in device memory (cuStreamWriteValue64).
  2. commands/s through 1, 2, 4, 8 proxy threads (host transport, signals into mapped
     host memory, many CTAs posting) — target >= 5 M/s for one thread;
  3. the one-thread rate again while another Python thread runs pure-Python code (GIL busy);
  4. `ce` bandwidth vs message size against back-to-back cuMemcpyAsync D2D issued from
     compiled code (no Python in the loop) — target >= 90% from 1 MiB up.

Launch (GPU machine, checkout in place):
    PYTHONPATH=$PWD python3 experiments/proxy.py --out experiments/results/proxy.jsonl
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np


def _commit() -> str:
    if os.environ.get("MKRT_COMMIT"):
        return os.environ["MKRT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


class Recorder:
    def __init__(self, path, gpu):
        self.path, self.gpu = path, gpu
        self.common = {"gpu": gpu, "date": datetime.date.today().isoformat(), "commit": _commit(),
                       "command": " ".join([os.path.basename(sys.executable), *sys.argv])}
        self.rows = []

    def add(self, case, metric, value, baseline, unit, **extra):
        ratio = (value / baseline) if baseline else None
        row = {"experiment": "proxy", "case": case, "metric": metric, "value": round(value, 4),
               "baseline": None if baseline is None else round(baseline, 4),
               "ratio": None if ratio is None else round(ratio, 4), "unit": unit,
               **self.common, **extra}
        self.rows.append(row)
        print(f"{case:<40} {metric:<22} {value:>12.3f} {unit:<6} | ref "
              f"{(baseline if baseline is not None else float('nan')):>10.3f} | x{(ratio or float('nan')):.3f}",
              flush=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


# ---------------------------------------------------------------------------- latency
def _responder():
    from numba import njit
    from mkrt.proxy.atomics import load_acquire, store_release

    @njit(nogil=True)
    def respond(words, iters, max_spins):
        for i in range(iters):
            want = np.uint64(i + 1)
            spins = 0
            while load_acquire(words, 0) < want:
                spins += 1
                if spins > max_spins:
                    return i
            store_release(words, 8, want)
        return iters
    return respond


def _percentiles(cycles, elapsed):
    ns_per_cycle = elapsed[0] / max(1, elapsed[1])
    ns = cycles.astype(np.float64) * ns_per_cycle / 1000.0   # microseconds
    return float(np.median(ns)), float(np.percentile(ns, 99))


def latency(rec, args, fn_raw, fn_pp):
    import cupy
    from mkrt.proxy import (Proxy, QueueSet, HostTransport, new_region_table, set_region,
                            REGION_HOST, REGION_DEVICE)
    from mkrt.proxy.kernels import raise_status, status_words
    from mkrt.proxy.queue import PinnedMemory
    iters = args.iters
    respond = _responder()
    words = PinnedMemory(4096)
    w = words.array.view(np.uint64)
    respond(w, 0, 1)  # compile
    results = {}
    for trial in range(2):
        w[:] = 0
        cycles = cupy.zeros(iters, dtype=np.int64)
        elapsed = cupy.zeros(2, dtype=np.uint64)
        out = []
        th = threading.Thread(target=lambda: out.append(respond(w, iters, 10**10)), daemon=True)
        th.start()
        fn_raw((1,), (32,), (np.uint64(words.device_address), np.uint64(words.device_address + 64),
                             np.int32(iters), cycles, elapsed))
        cupy.cuda.Device(0).synchronize()
        th.join(30)
        results.setdefault("raw", []).append(_percentiles(cycles.get()[100:], elapsed.get()))

        # through the proxy, host transport, flag in mapped host memory
        qs = QueueSet(1, 256, [0], memory="pinned")
        regions = new_region_table(1, 2)
        flag = PinnedMemory(4096)
        set_region(regions, 0, 1, flag.address, flag.nbytes, REGION_HOST)
        status = status_words()
        with Proxy(qs, regions, HostTransport(), threads=1, batch=64):
            fn_pp((1,), (32,), (qs.device_descriptors(), np.uint32(0), np.uint32(1), np.uint64(0),
                                np.uint64(flag.device_address), np.int32(iters), *status.args,
                                np.uint64(10**10), cycles, elapsed))
            cupy.cuda.Device(0).synchronize()
        raise_status(status)
        results.setdefault("host", []).append(_percentiles(cycles.get()[100:], elapsed.get()))
        qs.close()

        # through the proxy, ce transport, flag in device memory (cuStreamWriteValue64)
        from mkrt.proxy.transports.ce import CopyEngineTransport
        qs = QueueSet(1, 256, [0], memory="pinned")
        dflag = cupy.zeros(8, dtype=np.uint64)
        regions = new_region_table(1, 2)
        set_region(regions, 0, 1, dflag.data.ptr, dflag.nbytes, REGION_DEVICE)
        with Proxy(qs, regions, CopyEngineTransport(0), threads=1, batch=64):
            fn_pp((1,), (32,), (qs.device_descriptors(), np.uint32(0), np.uint32(1), np.uint64(0),
                                dflag, np.int32(iters // 4), *status.args, np.uint64(10**10), cycles,
                                elapsed))
            cupy.cuda.Device(0).synchronize()
        raise_status(status)
        results.setdefault("ce", []).append(_percentiles(cycles.get()[50:iters // 4], elapsed.get()))
        qs.close()
        flag.close()
    words.close()
    raw = min(results["raw"])           # best of two trials for each, same treatment
    host = min(results["host"])
    ce = min(results["ce"])
    rec.add("roundtrip_raw_pinned_pingpong", "median_us", raw[0], None, "us", p99_us=raw[1])
    rec.add("roundtrip_proxy_host_flag_pinned", "median_us", host[0], raw[0], "us",
            target="ratio <= 1.10")
    rec.add("roundtrip_proxy_host_flag_pinned", "p99_us", host[1], raw[1], "us")
    rec.add("roundtrip_proxy_ce_flag_device", "median_us", ce[0], raw[0], "us",
            note="flag written by cuStreamWriteValue64 on the proxy's stream")
    rec.add("roundtrip_proxy_ce_flag_device", "p99_us", ce[1], raw[1], "us")


# ---------------------------------------------------------------------------- command rate
def _busy_python(stop):
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i * i
    return x


def command_rate(rec, args, fn_sig, threads, *, busy=False, batch=256):
    import cupy
    from mkrt.proxy import Proxy, QueueSet, HostTransport, new_region_table, set_region, REGION_HOST
    from mkrt.proxy.kernels import raise_status, status_words
    from mkrt.proxy.queue import PinnedMemory
    queues = threads
    ctas = 32 * queues
    total = args.commands
    count = total // ctas
    qs = QueueSet(queues, 4096, [0] * queues, memory="pinned")
    flags = PinnedMemory(8 * ctas + 4096)
    regions = new_region_table(1, 2)
    set_region(regions, 0, 1, flags.address, flags.nbytes, REGION_HOST)
    status = status_words()
    result = cupy.zeros(ctas, dtype=np.uint64)
    stop = threading.Event()
    busy_thread = threading.Thread(target=_busy_python, args=(stop,), daemon=True) if busy else None
    with Proxy(qs, regions, HostTransport(), threads=threads, batch=batch) as proxy:
        desc = qs.device_descriptors()
        cupy.cuda.Device(0).synchronize()
        if busy_thread:
            busy_thread.start()
        t0 = time.perf_counter()
        fn_sig((ctas,), (32,), (desc, np.int32(queues), np.uint32(0), np.uint32(1), np.int32(count),
                                *status.args, np.uint64(10**10), result))
        cupy.cuda.Device(0).synchronize()
        target = count * ctas
        deadline = time.monotonic() + 60
        while proxy.stats["commands"] < target and time.monotonic() < deadline:
            pass
        seconds = time.perf_counter() - t0
        stats = proxy.stats
    stop.set()
    if busy_thread:
        busy_thread.join(10)
    raise_status(status)
    flag_values = flags.array.view(np.uint64)[:ctas]
    if not (flag_values == count).all() or stats["commands"] != target:
        raise RuntimeError(f"command rate check failed: {stats}, flags {flag_values[:8]}")
    qs.close()
    flags.close()
    rate = target / seconds / 1e6
    return rate, stats


# ---------------------------------------------------------------------------- ce bandwidth
def _copier():
    from numba import njit
    from mkrt.proxy.transports.ce import _libcuda, _function
    lib = _libcuda()
    u64 = ctypes.c_uint64
    memcpy_async = _function(lib, ["cuMemcpyAsync"], [u64, u64, u64, u64])

    @njit(nogil=True)
    def copies(dst, src, chunk, count, stream):
        for i in range(count):
            off = np.uint64(i) * chunk
            rc = memcpy_async(dst + off, src + off, chunk, stream)
            if rc != 0:
                return rc
        return 0
    return copies


def ce_bandwidth(rec, args, fn_puts):
    import cupy
    from mkrt.proxy import Proxy, QueueSet, new_region_table, set_region, REGION_DEVICE
    from mkrt.proxy.kernels import raise_status, status_words
    from mkrt.proxy.transports.ce import CopyEngineTransport
    region = 1 << 30
    src = cupy.random.randint(0, 256, region, dtype=np.uint8)
    dst = cupy.zeros(region, dtype=np.uint8)
    flags = cupy.zeros(8, dtype=np.uint64)
    regions = new_region_table(2, 2)
    set_region(regions, 0, 0, src.data.ptr, region, REGION_DEVICE)
    set_region(regions, 1, 0, dst.data.ptr, region, REGION_DEVICE)
    set_region(regions, 1, 1, flags.data.ptr, flags.nbytes, REGION_DEVICE)
    qs = QueueSet(1, 4096, [0], memory="pinned")
    status = status_words()
    result = cupy.zeros(1, dtype=np.uint64)
    copies = _copier()
    stream = cupy.cuda.Stream(non_blocking=True)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    with Proxy(qs, regions, CopyEngineTransport(0), threads=1, batch=64):
        desc = qs.device_descriptors()
        for size_kib in args.sizes_kib:
            chunk = size_kib << 10
            count = min(4096, region // chunk)
            proxy_ms, ref_ms = [], []
            for rep in range(args.reps + 1):
                dst[:] = 0
                flags[:] = 0
                cupy.cuda.Device(0).synchronize()
                start.record(stream)
                fn_puts((1,), (32,), (desc, np.int32(1), np.uint32(1), np.uint32(1), flags,
                                      np.uint64(chunk), np.int32(count), np.int32(count), *status.args,
                                      np.uint64(10**10), result), stream=stream)
                end.record(stream)
                end.synchronize()
                raise_status(status)
                if rep == 0:
                    if not bool((dst[: chunk * count] == src[: chunk * count]).all()):
                        raise RuntimeError(f"ce data mismatch at {chunk=}")
                    continue
                proxy_ms.append(cupy.cuda.get_elapsed_time(start, end))
                start.record(stream)
                rc = copies(np.uint64(dst.data.ptr), np.uint64(src.data.ptr), np.uint64(chunk),
                            count, np.uint64(stream.ptr))
                end.record(stream)
                end.synchronize()
                if rc:
                    raise RuntimeError(f"cuMemcpyAsync failed: {rc}")
                ref_ms.append(cupy.cuda.get_elapsed_time(start, end))
            nbytes = chunk * count
            bw = nbytes / (np.median(proxy_ms) * 1e-3) / 1e9
            ref = nbytes / (np.median(ref_ms) * 1e-3) / 1e9
            rec.add(f"ce_put_{size_kib}KiB_x{count}", "bandwidth_GBps", bw, ref, "GB/s",
                    target="ratio >= 0.90 from 1 MiB", bytes_counted="copied bytes (not read+write)")
    qs.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="experiments/results/proxy.jsonl")
    parser.add_argument("--iters", type=int, default=20000)
    parser.add_argument("--commands", type=int, default=4_000_000)
    parser.add_argument("--threads", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--sizes-kib", type=int, nargs="*", default=[64, 256, 1024, 4096, 16384, 65536])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    import cupy
    from mkrt.proxy.kernels import ProxyKernelsSpec
    gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    rec = Recorder(args.out, gpu)
    spec = ProxyKernelsSpec()
    fn_raw = spec.function("ping_pong_raw", 0)
    fn_pp = spec.function("ping_pong_proxy", 0)
    fn_sig = spec.function("post_signals", 0)
    fn_puts = spec.function("post_puts", 0)
    latency(rec, args, fn_raw, fn_pp)
    base = None
    for threads in args.threads:
        rate, stats = command_rate(rec, args, fn_sig, threads)
        if threads == 1:
            base = rate
        rec.add(f"command_rate_{threads}_threads", "Mcommands_per_s", rate,
                5.0 if threads == 1 else base, "M/s",
                target="1 thread >= 5 M/s; others vs 1 thread",
                mean_batch=round(stats["commands"] / max(1, stats["batches"]), 1))
    busy, _ = command_rate(rec, args, fn_sig, 1, busy=True)
    rec.add("command_rate_1_thread_python_busy", "Mcommands_per_s", busy, base, "M/s",
            note="another Python thread runs pure-Python arithmetic throughout")
    ce_bandwidth(rec, args, fn_puts)


if __name__ == "__main__":
    main()
