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
     compiled code (no Python in the loop) — target >= 90% from 1 MiB up — for each
     transport mode (one batch copy kernel launch per batch, one cuMemcpyBatchAsync per
     batch with the copy-engine hint, one cuMemcpyAsync per put),
     with one and with 8 CTAs posting (one GPU thread posts a put every few us);
  5. whether a `ce` copy lands while a kernel holds every SM waiting for it.

Launch (GPU machine, checkout in place):
    PYTHONPATH=$PWD python3 experiments/proxy.py --out experiments/results/proxy.jsonl
"""

from __future__ import annotations

import argparse
import ctypes
import threading
import time

import numpy as np


class Recorder:
    """Prints each result and appends it to `path` (records from mkrt.bench: one commit
    stamp, MKRT_BENCH_COMMIT on the device copy)."""

    def __init__(self, path):
        self.path = path

    def add(self, case, metric, value, baseline, unit, **extra):
        from mkrt.bench import append_jsonl, record
        row = record("proxy", case, metric, round(value, 4),
                     None if baseline is None else round(baseline, 4), unit, **extra)
        if row["ratio"] is not None:
            row["ratio"] = round(row["ratio"], 4)
        ratio = row["ratio"] or float("nan")
        print(f"{case:<40} {metric:<22} {value:>12.3f} {unit:<6} | ref "
              f"{(baseline if baseline is not None else float('nan')):>10.3f} | x{ratio:.3f}",
              flush=True)
        append_jsonl(self.path, [row])


# ---------------------------------------------------------------------------- latency
def _responder():
    from numba import njit
    from mkrt.proxy.atomics import demote_line_at, load_acquire, store_release

    @njit(nogil=True)
    def respond(words, iters, max_spins, answer, lines, stride, demote):
        """Answer command i (word stride*(i % lines) of `words`) in answer[0]; `demote`:
        then push the answer's line out of this core's caches, as the host transport does."""
        for i in range(iters):
            want = np.uint64(i + 1)
            spins = 0
            while load_acquire(words, stride * (i % lines)) < want:
                spins += 1
                if spins > max_spins:
                    return i
            store_release(answer, 0, want)
            if demote:
                demote_line_at(answer.ctypes.data)
        return iters
    return respond


def _ring_responder():
    """A bare answerer of ping_pong_proxy's ring (no Proxy): poll the next slot, write the
    flag the signal names, publish the tail every 64 commands (the ring's space). mode 1:
    publish it after every command; mode 2: also decode and check the command with the
    proxy's validate_command. `step` 2: the poster uses every other slot. What the proxy
    loop adds beyond them is its own cost."""
    from numba import njit
    from mkrt.proxy import queue as Q
    from mkrt.proxy.atomics import load_acquire, store_release, store_release_at
    from mkrt.proxy.proxy import V_FLAG, VALIDATED_WORDS, validate_command
    w_value = Q.FIELDS["signal_value"][0]

    @njit(nogil=True)
    def respond(ring, header, slots, iters, max_spins, flag_address, mode, regions, step):
        scratch = np.zeros(VALIDATED_WORDS, dtype=np.uint64)
        mask = slots - np.uint64(1)
        for i in range(iters):
            tail = np.uint64(i * step)
            base = (tail & mask) * np.uint64(8)
            spins = 0
            while load_acquire(ring, base) != tail + np.uint64(1):
                spins += 1
                if spins > max_spins:
                    return i
            address = flag_address
            if mode >= 2:
                err, detail = validate_command(ring, base, regions, np.uint64(0), scratch)
                if err != 0:
                    return -1
                address = scratch[V_FLAG]
            store_release_at(address, ring[base + np.uint64(w_value)])
            if mode >= 1 or (i & 63) == 63:
                store_release(header, Q.H_TAIL, tail + np.uint64(step))
        return iters
    return respond


#: ping_pong_raw variants: name -> (extra, demote). extra: 1 claim atomic, 2 command words,
#: 4 a new line each time (128 B apart; 64 B with 16); where the answer lives (host side):
#: 32 another page of the command words' allocation, 8 an allocation of its own, else the
#: line after the command words'. demote: the responder demotes the answer's line after
#: writing it (demote_line_at). (Staggered polls and poller warps: rows at 2d30710;
#: flushing the line with clflushopt instead: rows up to 4c0dd89, slower.)
RAW_VARIANTS = {
    "raw": (0, 0),
    "raw_plus_claim_atomic": (1, 0),
    "raw_plus_command_words": (2, 0),
    "raw_plus_new_line_each_time": (4, 0),
    "raw_plus_new_64B_line_each_time": (4 | 16, 0),
    "raw_plus_answer_on_another_page": (32, 0),
    "raw_plus_answer_in_its_own_allocation": (8, 0),
    "raw_like_reply_word_ring": (2 | 4 | 16 | 32, 0),
    "raw_like_own_flag_ring": (2 | 4 | 16 | 8, 0),
    "raw_answer_line_demoted": (0, 1),
    "raw_like_reply_word_ring_demoted": (2 | 4 | 16 | 32, 1),
}
#: through the Proxy: name -> (owned, flag in the queue's reply word, demoted flag lines);
#: owned as ping_pong_proxy's (3: shared, descriptor re-read from device memory per post)
PROXY_VARIANTS = {
    "host": (0, False, False),
    "host_owned": (1, False, False),
    "host_reply_word": (0, True, False),
    "host_owned_reply_word": (1, True, False),
    "host_reply_word_descriptor_reread": (3, True, False),
    "host_reply_word_demoted": (0, True, True),
    "host_owned_reply_word_demoted": (1, True, True),
}
#: through the Proxy with its thread and memory placed (latency's `placements`)
PLACED_PROXY_VARIANTS = {k: PROXY_VARIANTS[k] for k in
                         ("host", "host_reply_word", "host_owned_reply_word")}
#: the ring answered by a bare responder: name -> (mode, reply word, step, owned)
RING_VARIANTS = {
    "ring_bare": (0, False, 1, 0),
    "ring_and_tail": (1, False, 1, 0),
    "ring_tail_and_validate": (2, False, 1, 0),
    "ring_bare_reply_word_owned": (0, True, 1, 1),
    "ring_bare_reply_word_owned_128B_slots": (0, True, 2, 2),
}


def _percentiles(cycles, elapsed):
    ns_per_cycle = elapsed[0] / max(1, elapsed[1])
    ns = cycles.astype(np.float64) * ns_per_cycle / 1000.0   # microseconds
    return float(np.median(ns)), float(np.percentile(ns, 99))


class HostFlagQueue:
    """One pinned queue of 256 slots for rank 0 and a region table whose (rank 0, region 1)
    is a host flag: the queue's reply words (`reply`) or a page of its own. Yields
    (queue set, region table, flag address); frees both on exit. `cpus`: the memory comes
    from their NUMA node."""

    def __init__(self, reply: bool, cpus=None):
        self.reply, self.cpus = reply, cpus

    def __enter__(self):
        from mkrt.proxy import QueueSet, REGION_HOST, new_region_table, set_region
        from mkrt.proxy.queue import REPLY_WORDS, PinnedMemory
        self.qs = QueueSet(1, 256, [0], memory="pinned", cpus=self.cpus)
        self.flag = PinnedMemory(4096, cpus=self.cpus)
        regions = new_region_table(1, 2)
        if self.reply:
            address, size = self.qs.reply_address(0), 8 * REPLY_WORDS
        else:
            address, size = self.flag.address, self.flag.nbytes
        set_region(regions, 0, 1, address, size, REGION_HOST)
        return self.qs, regions, address

    def __exit__(self, *exc):
        self.qs.close()
        self.flag.close()


class RawWords:
    """The raw ping-pong's host memory: 8 KiB for the command words and the answer, and a
    page of its own for an answer apart; from the NUMA node of `cpus`."""

    def __init__(self, cpus=None):
        from mkrt.proxy.queue import PinnedMemory
        self.words = PinnedMemory(8192, cpus=cpus)
        self.apart = PinnedMemory(4096, cpus=cpus)
        self.w = self.words.array.view(np.uint64)
        self.a = self.apart.array.view(np.uint64)

    def answer(self, extra):
        """(host view, device address) of the answer word for `extra` (RAW_VARIANTS)."""
        if extra & 8:
            return self.a, self.apart.device_address
        # the next line, past the 16 command lines (2 KiB), or on the next page
        offset = 4096 if extra & 32 else (2112 if extra & 4 else 64)
        return self.w[offset // 8:], self.words.device_address + offset

    def close(self):
        self.words.close()
        self.apart.close()


def _pinned(target, cpus):
    """`target` run on a thread pinned to `cpus` (unpinned when empty)."""
    from mkrt.proxy.affinity import pin_current_thread

    def run(*args):
        pin_current_thread(cpus)
        target(*args)
    return run


def latency(rec, args, fn_raw, fn_pp):
    import cupy
    from mkrt.proxy import Proxy, QueueSet, HostTransport, new_region_table, set_region, REGION_DEVICE
    from mkrt.proxy.affinity import allowed_cpus, gpu_local_cpus, gpu_remote_cpus
    from mkrt.proxy.kernels import raise_status, status_words
    iters = args.iters
    respond = _responder()
    ring_respond = _ring_responder()
    warm = RawWords()
    respond(warm.w, 1, 1, warm.w[8:], 1, 16, True)  # compile
    warm.close()
    results = {}
    counter = cupy.zeros(2, dtype=np.uint64)
    cycles = cupy.zeros(iters, dtype=np.int64)
    elapsed = cupy.zeros(2, dtype=np.uint64)
    status = status_words()
    # where the host thread and its memory are: the OS's choice, or pinned to the GPU's
    # NUMA node ("near") or to another node ("far", on hosts with more than one)
    placements = {"near": gpu_local_cpus(0), "far": gpu_remote_cpus(0)}
    print(f"allowed CPUs {allowed_cpus()}; GPU 0 local {placements['near']}; "
          f"far {placements['far']}", flush=True)

    def measured(skip=100):
        return _percentiles(cycles.get()[skip:], elapsed.get())

    def raw_trial(extra, demote=False, place=None):
        """One run of the reference on fresh memory (pages differ from trial to trial,
        like the proxy's queues: where the answer lands moves the result by +-0.2 us)."""
        mem = RawWords(placements.get(place))
        answer, answer_address = mem.answer(extra)
        lines, stride = (16 if extra & 4 else 1), (8 if extra & 16 else 16)
        th = threading.Thread(target=_pinned(respond, placements.get(place)), daemon=True,
                              args=(mem.w, iters, 10**10, answer, lines, stride, bool(demote)))
        th.start()
        fn_raw((1,), (32,),
               (np.uint64(mem.words.device_address), np.uint64(answer_address), np.int32(iters),
                cycles, elapsed, np.int32(extra & 23), counter))
        cupy.cuda.Device(0).synchronize()
        th.join(30)
        if th.is_alive():
            raise RuntimeError(f"raw ping-pong ({extra=}, {demote=}) did not finish")
        mem.close()
        return measured()

    def ping_pong(qs, flag_address, n, owned=0):
        """ping_pong_proxy: `n` signals to the u64 at `flag_address` (registered as rank 0,
        region 1, offset 0), each waited for."""
        fn_pp((1,), (32,), (qs.device_descriptors(), np.uint32(0), np.uint32(1), np.uint64(0),
                            np.uint64(flag_address), np.int32(n), *status.args, np.uint64(10**10),
                            cycles, elapsed, np.int32(owned)))
        cupy.cuda.Device(0).synchronize()
        raise_status(status)

    for trial in range(args.trials):
        for name, variant in RAW_VARIANTS.items():
            results.setdefault(name, []).append(raw_trial(*variant))

        # through the proxy, host transport, flag in mapped host memory
        for name, (owned, reply, demote) in PROXY_VARIANTS.items():
            with HostFlagQueue(reply) as (qs, regions, flag_address):
                with Proxy(qs, regions, HostTransport(demote_signals=demote), threads=1, batch=64):
                    ping_pong(qs, flag_address, iters, owned)
                results.setdefault(name, []).append(measured())
                if int(qs.device_heads()[0]) != iters:
                    raise RuntimeError(f"owned queue gave back head {qs.device_heads()[0]}, "
                                       f"expected {iters}")

        # the ring answered by a bare responder (no Proxy), growing towards the proxy's work
        for name, (mode, reply, step, owned) in RING_VARIANTS.items():
            with HostFlagQueue(reply) as (qs, regions, flag_address):
                responder_args = (qs.ring, qs.header, np.uint64(qs.slots))
                ring_respond(*responder_args, 0, 1, np.uint64(flag_address), mode, regions, 1)
                th = threading.Thread(target=ring_respond, daemon=True,
                                      args=(*responder_args, iters, 10**10, np.uint64(flag_address),
                                            mode, regions, step))
                th.start()
                ping_pong(qs, flag_address, iters, owned)
                th.join(30)
                results.setdefault(name, []).append(measured())

        # placements: the reference and the proxy with the host thread and its memory on
        # the GPU's NUMA node or on another one
        for place, cpus in placements.items():
            if not cpus:
                continue
            results.setdefault(f"raw_{place}", []).append(raw_trial(0, 0, place))
            for name, (owned, reply, demote) in PLACED_PROXY_VARIANTS.items():
                with HostFlagQueue(reply, cpus) as (qs, regions, flag_address):
                    with Proxy(qs, regions, HostTransport(demote_signals=demote), threads=1,
                               batch=64, cpus=cpus):
                        ping_pong(qs, flag_address, iters, owned)
                    results.setdefault(f"{name}_{place}", []).append(measured())

        # through the proxy, ce transport, flag in device memory (cuStreamWriteValue64)
        from mkrt.proxy.transports.ce import CopyEngineTransport
        qs = QueueSet(1, 256, [0], memory="pinned")
        dflag = cupy.zeros(8, dtype=np.uint64)
        regions = new_region_table(1, 2)
        set_region(regions, 0, 1, dflag.data.ptr, dflag.nbytes, REGION_DEVICE)
        with Proxy(qs, regions, CopyEngineTransport(0), threads=1, batch=64):
            ping_pong(qs, dflag.data.ptr, iters // 4)
        results.setdefault("ce", []).append(_percentiles(cycles.get()[50:iters // 4], elapsed.get()))
        qs.close()
    # each case: the median over trials of each trial's median (and of its p99); the
    # trials' spread is kept with it
    best = {name: (float(np.median([r[0] for r in runs])), float(np.median([r[1] for r in runs])))
            for name, runs in results.items()}
    spread = {name: [round(r[0], 3) for r in runs] for name, runs in results.items()}
    from mkrt.proxy.atomics import HAS_CLDEMOTE

    def report(case, name, ref, p99=False, **extra):
        """median (and p99) row of `name` against the reference row `ref` (None: none)."""
        got, base = best[name], best[ref] if ref else (None, None)
        rec.add(case, "median_us", got[0], base[0], "us", p99_us=got[1], trials=len(spread[name]),
                trial_medians_us=spread[name], aggregate="median over trials", **extra)
        if p99:
            rec.add(case, "p99_us", got[1], base[1], "us", aggregate="median over trials")

    report("roundtrip_raw_pinned_pingpong", "raw", None, p99=True)
    for name, (extra, demote) in RAW_VARIANTS.items():   # what each part adds
        if name != "raw":
            report(f"roundtrip_{name}", name, "raw", extra_bits=extra, demoted=bool(demote),
                   cldemote_on_this_cpu=HAS_CLDEMOTE)
    for name, (owned, reply, demote) in PROXY_VARIANTS.items():
        report("roundtrip_proxy_host_flag_pinned" if name == "host" else f"roundtrip_proxy_{name}",
               name, "raw", p99=True, target="ratio <= 1.10", owned_queue=owned in (1, 2),
               demoted_flag_lines=demote, cldemote_on_this_cpu=HAS_CLDEMOTE,
               descriptor="re-read per post" if owned == 3 else "in registers",
               flag="the queue's reply word (ring's allocation)" if reply else "its own allocation")
    for name, (mode, reply, step, owned) in RING_VARIANTS.items():
        report(f"roundtrip_{name}", name, "raw", slot_step=step, owned_queue=bool(owned),
               flag="reply word" if reply else "its own allocation")
    for place, cpus in placements.items():
        if not cpus:
            continue
        report(f"roundtrip_raw_pinned_pingpong_{place}", f"raw_{place}", None, cpus=cpus,
               note="responder thread and memory pinned to these CPUs")
        for name, (owned, reply, demote) in PLACED_PROXY_VARIANTS.items():
            report(f"roundtrip_proxy_{name}_{place}", f"{name}_{place}", f"raw_{place}", p99=True,
                   target="ratio <= 1.10", owned_queue=bool(owned), cpus=cpus,
                   reference=f"roundtrip_raw_pinned_pingpong_{place} (same placement, same run)")
    report("roundtrip_proxy_ce_flag_device", "ce", "raw", p99=True,
           note="flag written by cuStreamWriteValue64 on the proxy's stream")


# ---------------------------------------------------------------------------- command rate
def _busy_python(stop):
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i * i
    return x


def command_rate(rec, args, fn_sig, threads, *, busy=False, batch=256, demote=True):
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
    with Proxy(qs, regions, HostTransport(demote_signals=demote), threads=threads,
               batch=batch) as proxy:
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
            time.sleep(0.0002)     # reading the stats line nonstop would slow its writer
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


CE_MODES = {   # CopyEngineTransport options per mode
    "kernel": dict(copy_method="kernel"),                              # the default
    "batch_ce": dict(copy_method="batch", prefer_copy_engines=True),
    "per_put": dict(copy_method="each"),
}


def ce_bandwidth(rec, args, fn_puts):
    import cupy
    from mkrt.proxy import Proxy, QueueSet, new_region_table, set_region, REGION_DEVICE
    from mkrt.proxy.kernels import raise_status, status_words
    from mkrt.proxy.transports.ce import CopyEngineTransport
    region = 1 << 30
    src = cupy.random.randint(0, 256, region, dtype=np.uint8)
    dst = cupy.zeros(region, dtype=np.uint8)
    flags = cupy.zeros(max(8, max(args.posters)), dtype=np.uint64)
    regions = new_region_table(2, 2)
    set_region(regions, 0, 0, src.data.ptr, region, REGION_DEVICE)
    set_region(regions, 1, 0, dst.data.ptr, region, REGION_DEVICE)
    set_region(regions, 1, 1, flags.data.ptr, flags.nbytes, REGION_DEVICE)
    status = status_words()
    result = cupy.zeros(max(args.posters), dtype=np.uint64)
    copies = _copier()
    stream = cupy.cuda.Stream(non_blocking=True)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    for mode in args.ce_modes:
        qs = QueueSet(1, 4096, [0], memory="pinned")
        transport = CopyEngineTransport(0, **CE_MODES[mode])
        with Proxy(qs, regions, transport, threads=1, batch=64):
            desc = qs.device_descriptors()
            for posters in args.posters:
                for size_kib in args.sizes_kib:
                    chunk = size_kib << 10
                    count = min(4096, region // chunk) // posters * posters
                    per_poster = count // posters
                    proxy_ms, ref_ms = [], []
                    calls_before = transport.copy_calls()
                    for rep in range(args.reps + 1):
                        dst[:] = 0
                        flags[:] = 0
                        cupy.cuda.Device(0).synchronize()
                        start.record(stream)
                        # CTA b: chunks [b * per_poster, (b + 1) * per_poster), its flag b
                        fn_puts((posters,), (32,), (desc, np.int32(1), np.uint32(1), np.uint32(1), flags,
                                                    np.uint64(chunk), np.int32(per_poster),
                                                    np.int32(per_poster), *status.args,
                                                    np.uint64(10**10), result), stream=stream)
                        end.record(stream)
                        end.synchronize()
                        raise_status(status)
                        if rep == 0:
                            if not bool((dst[: chunk * count] == src[: chunk * count]).all()):
                                raise RuntimeError(f"ce data mismatch at {chunk=} ({mode=}, {posters=})")
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
                    calls = (transport.copy_calls() - calls_before) / (args.reps + 1)
                    nbytes = chunk * count
                    bw = nbytes / (np.median(proxy_ms) * 1e-3) / 1e9
                    ref = nbytes / (np.median(ref_ms) * 1e-3) / 1e9
                    rec.add(f"ce_put_{size_kib}KiB_x{count}_{mode}_{posters}posters", "bandwidth_GBps",
                            bw, ref, "GB/s", target="ratio >= 0.90 from 1 MiB",
                            transport_options=CE_MODES[mode], posting_threads=posters,
                            driver_copy_calls_per_run=round(calls, 1),
                            reference="back-to-back cuMemcpyAsync D2D from compiled code, same sizes",
                            bytes_counted="copied bytes (not read+write)")
        qs.close()


def ce_with_every_sm_held(rec, args, fn_hold):
    """Can a proxy copy land while persistent CTAs hold every SM and wait for it?

    A kernel of 2 CTAs x 1024 threads per SM holds every thread slot until a flag in
    device memory is set; the host then posts one 64 MiB put + signal (host producer, the
    same ring protocol) and the proxy's `ce` copies it. If the copy needs an SM kernel it
    cannot run until the holder gives up (timeout, result 2 per CTA). The reference: the
    same copy + flag write issued directly (cuMemcpyAsync + cuStreamWriteValue64).
    """
    import cupy
    from mkrt.proxy import Proxy, QueueSet, new_region_table, set_region, REGION_DEVICE
    from mkrt.proxy import OP_PUT_SIGNAL
    from mkrt.proxy import producer as P
    from mkrt.proxy.transports.ce import CopyEngineTransport, _function, _libcuda
    nbytes = 64 << 20
    sms = cupy.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    src = cupy.random.randint(0, 256, nbytes, dtype=np.uint8)
    dst = cupy.zeros(nbytes, dtype=np.uint8)
    flag = cupy.zeros(8, dtype=np.uint64)
    result = cupy.zeros(2 * sms, dtype=np.uint64)
    regions = new_region_table(2, 2)
    set_region(regions, 0, 0, src.data.ptr, nbytes, REGION_DEVICE)
    set_region(regions, 1, 0, dst.data.ptr, nbytes, REGION_DEVICE)
    set_region(regions, 1, 1, flag.data.ptr, flag.nbytes, REGION_DEVICE)
    hold_stream = cupy.cuda.Stream(non_blocking=True)
    copy_stream = cupy.cuda.Stream(non_blocking=True)
    lib = _libcuda()
    u64 = ctypes.c_uint64
    memcpy_async = _function(lib, ["cuMemcpyAsync"], [u64, u64, u64, u64])
    write_value = _function(lib, ["cuStreamWriteValue64_v2", "cuStreamWriteValue64"],
                            [u64, u64, u64, ctypes.c_uint32])
    timeout_ns = 1_000_000_000
    put_signal = P.command(OP_PUT_SIGNAL, dst_rank=1, src_region=0, dst_region=0, nbytes=nbytes,
                           signal_region=1, signal_offset=0, signal_value=1)

    def trial(issue):
        dst[:] = 0
        flag[:] = 0
        result[:] = 7
        cupy.cuda.Device(0).synchronize()
        fn_hold((2 * sms,), (1024,), (flag, np.uint64(1), np.uint64(timeout_ns), result),
                stream=hold_stream)
        time.sleep(0.002)                       # the holder is resident
        t0 = time.perf_counter()
        issue()
        hold_stream.synchronize()
        held_us = (time.perf_counter() - t0) * 1e6
        cupy.cuda.Device(0).synchronize()
        landed = bool((dst == src).all())
        timed_out = int((result == 2).sum().get())
        return held_us, timed_out, landed

    def direct():
        memcpy_async(dst.data.ptr, src.data.ptr, nbytes, copy_stream.ptr)
        write_value(copy_stream.ptr, flag.data.ptr, 1, 0)

    outcomes = {"direct_cuMemcpyAsync": [trial(direct) for _ in range(2)]}
    for mode in args.ce_modes:
        qs = QueueSet(1, 64, [0], memory="pinned")
        with Proxy(qs, regions, CopyEngineTransport(0, **CE_MODES[mode]), threads=1):
            def via_proxy():
                P.post(qs.ring, qs.header, np.uint64(qs.slots), 0, put_signal, np.int64(10**9))
            outcomes[mode] = [trial(via_proxy) for _ in range(2)]
        qs.close()
    for name, runs in outcomes.items():
        held_us, timed_out, landed = min(runs)
        if not all(r[2] for r in runs):
            raise RuntimeError(f"every-SM-held probe: data did not land ({name})")
        rec.add(f"ce_64MiB_every_sm_held_{name}", "flag_seen_us", held_us, None, "us",
                holder_ctas_timed_out=timed_out, holder_ctas=2 * sms,
                holder_timeout_us=timeout_ns / 1e3,
                note="0 CTAs timed out: the copy ran while every thread slot was held")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="experiments/results/proxy.jsonl")
    parser.add_argument("--iters", type=int, default=20000)
    parser.add_argument("--commands", type=int, default=4_000_000)
    parser.add_argument("--threads", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--rate-reps", type=int, default=5, help="command-rate runs (median)")
    parser.add_argument("--sizes-kib", type=int, nargs="*", default=[64, 256, 1024, 4096, 16384, 65536])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--posters", type=int, nargs="*", default=[1, 8],
                        help="CTAs posting the ce puts (one thread each)")
    parser.add_argument("--ce-modes", nargs="*", default=list(CE_MODES), choices=list(CE_MODES))
    parser.add_argument("--trials", type=int, default=7,
                        help="round-trip trials, each on fresh memory (median of their medians)")
    parser.add_argument("--parts", nargs="*", default=["latency", "rate", "ce", "held"],
                        choices=["latency", "rate", "ce", "held"])
    args = parser.parse_args()
    from mkrt.proxy.kernels import ProxyKernelsSpec
    rec = Recorder(args.out)
    spec = ProxyKernelsSpec()
    fn_raw = spec.function("ping_pong_raw", 0)
    fn_pp = spec.function("ping_pong_proxy", 0)
    fn_sig = spec.function("post_signals", 0)
    fn_puts = spec.function("post_puts", 0)
    if "latency" in args.parts:
        latency(rec, args, fn_raw, fn_pp)
    if "rate" in args.parts:
        def rates(threads, busy=False, demote=True):
            """median of args.rate_reps runs (the host side of a lent machine is noisy)"""
            runs = [command_rate(rec, args, fn_sig, threads, busy=busy, demote=demote)
                    for _ in range(args.rate_reps)]
            runs.sort(key=lambda run: run[0])
            return runs[len(runs) // 2], [round(run[0], 2) for run in runs]
        base = None
        for threads in args.threads:
            (rate, stats), each = rates(threads)
            if threads == 1:
                base = rate
            rec.add(f"command_rate_{threads}_threads", "Mcommands_per_s", rate,
                    5.0 if threads == 1 else base, "M/s",
                    target="1 thread >= 5 M/s; others vs 1 thread", runs_Mcommands_per_s=each,
                    mean_batch=round(stats["commands"] / max(1, stats["batches"]), 1))
        (plain, _), each = rates(1, demote=False)
        rec.add("command_rate_1_thread_flags_not_demoted", "Mcommands_per_s", plain, base, "M/s",
                runs_Mcommands_per_s=each,
                note="HostTransport(demote_signals=False): no cldemote after each batch")
        (busy, _), each = rates(1, busy=True)
        rec.add("command_rate_1_thread_python_busy", "Mcommands_per_s", busy, base, "M/s",
                runs_Mcommands_per_s=each,
                note="another Python thread runs pure-Python arithmetic throughout")
    if "ce" in args.parts:
        ce_bandwidth(rec, args, fn_puts)
    if "held" in args.parts:
        ce_with_every_sm_held(rec, args, spec.function("hold_sms_until", 0))


if __name__ == "__main__":
    main()
