"""CPU tests: host producers drive the real compiled proxy loop through the `host` transport.

Every test that starts proxy threads bounds them: producers and waits spin a bounded
number of times, and Proxy.close() joins with a timeout.
"""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest

from mkrt.proxy import (OP_BARRIER, OP_FENCE, OP_NOP, OP_PUT, OP_PUT_SIGNAL, OP_SIGNAL,
                        REGION_HOST, HostTransport, Proxy, ProxyError, QueueSet,
                        new_region_table, set_region)
from mkrt.proxy import producer as P
from mkrt.proxy import layout
from mkrt.proxy import queue as Q

SPINS = np.int64(2_000_000_000)   # bound of every host-side wait (a few seconds at most)


class World:
    """`ranks` ranks in one process: data region 0, flag region 1 per rank."""

    def __init__(self, ranks=2, data_bytes=1 << 16, flag_words=256):
        self.regions = new_region_table(ranks, 4)
        rng = np.random.default_rng()
        self.data = [rng.integers(0, 256, data_bytes, dtype=np.uint8) for _ in range(ranks)]
        self.flags = [np.zeros(flag_words, dtype=np.uint64) for _ in range(ranks)]
        for r in range(ranks):
            set_region(self.regions, r, 0, self.data[r].ctypes.data, data_bytes, REGION_HOST)
            set_region(self.regions, r, 1, self.flags[r].ctypes.data, 8 * flag_words, REGION_HOST)


def post(qs, q, words):
    return P.post(qs.ring, qs.header, np.uint64(qs.slots), q, words, SPINS)


def post_many(qs, q, commands):
    return P.post_many(qs.ring, qs.header, np.uint64(qs.slots), q, commands, SPINS)


def wait_flag(flags, index, value):
    return P.wait_at_least(flags, index, np.uint64(value), SPINS)


def test_layout_is_one_definition():
    assert Q.COMMAND_DTYPE.itemsize == 64
    for name, (word, shift, mask) in Q.FIELDS.items():
        record = np.zeros(1, Q.COMMAND_DTYPE)
        record[name] = 1
        words = record.view(np.uint64)
        assert words[word] == np.uint64(1) << np.uint64(shift), name
    with pytest.raises(ImportError, match="padding"):
        layout._check_packed(np.dtype([("valid", "<u8"), ("opcode", "<u2"), ("bytes", "<u8")], align=True))


def test_queue_kernel_compiles_without_spills_and_asserts_layout():
    from mkrt.proxy.kernels import ProxyKernelsSpec
    build = ProxyKernelsSpec().build(check_spills=True)
    for name in ProxyKernelsSpec.entry_points:
        assert build.resources[name].spills == 0
    # the C struct's size assert comes from the dtype: a drifted size fails to compile
    from mkrt.jit import compile_cuda, cuda_source, render
    from mkrt.errors import CompileError
    bad = "namespace mkrt {\n" + Q.command_struct_source().replace("u;\n", "u;\n", 1).replace(
        "sizeof(Command) == 64", "sizeof(Command) == 72") + "\n}\n"
    piece = cuda_source("layout_drift", bad, requires=("base",), register=False)
    with pytest.raises(CompileError):
        compile_cuda("layout_drift_test", render(piece, {}))


@pytest.mark.parametrize("demote", [False, True])
def test_ordering_and_wraparound_puts_land_before_flags(demote):
    """demote: flags written then pushed out of the proxy core's caches (cldemote where
    the CPU has it): the same values land."""
    w = World()
    qs = QueueSet(1, 8, [0])                     # 8 slots: 512 commands wrap 64 times
    chunk, n = 128, 512
    cmds = P.commands([dict(opcode=OP_PUT_SIGNAL, dst_rank=1, src_region=0, dst_region=0,
                            src_offset=(i * chunk) % (1 << 16), dst_offset=(i * chunk) % (1 << 16),
                            nbytes=chunk, signal_region=1, signal_offset=0, signal_value=i + 1)
                       for i in range(n)])
    with Proxy(qs, w.regions, HostTransport(demote_signals=demote), batch=4) as proxy:
        assert post_many(qs, 0, cmds) == n
        assert wait_flag(w.flags[1], 0, n)
    assert (w.data[1] == w.data[0]).all()
    s = proxy.stats
    assert s["commands"] == n and s["puts"] == n and s["signals"] == n and s["errors"] == 0
    assert s["max_batch"] <= 4
    assert qs.tail(0) == n and qs.done(0) == n
    qs.close()


def test_full_ring_backpressure_then_release():
    w = World()
    qs = QueueSet(1, 4, [0])
    proxy = Proxy(qs, w.regions, HostTransport(), start=False)
    sig = P.command(OP_SIGNAL, dst_rank=0, signal_region=1, signal_offset=8, signal_value=1)
    for i in range(4):                              # fills the ring; nobody consumes
        assert post(qs, 0, sig) == P.POST_OK
    assert P.post(qs.ring, qs.header, np.uint64(qs.slots), 0, sig, np.int64(100000)) == P.POST_TIMEOUT
    # the timed-out producer holds ticket 4; a started proxy frees space for the next ones
    proxy.start()
    assert wait_flag(qs.header, Q.H_TAIL, 4)
    assert post(qs, 0, sig) == P.POST_OK           # ticket 5; ticket 4 never published
    time.sleep(0.05)
    assert qs.tail(0) == 4                          # the proxy waits for ticket 4, in order
    proxy.kill()
    proxy.close()
    qs.close()


def test_many_producers_many_queues_two_threads():
    w = World(ranks=2, flag_words=64)
    producers, per = 8, 2000
    qs = QueueSet(4, 16, [0, 0, 1, 1])
    results = [None] * producers

    def produce(p):
        q = p % 4
        src_rank = qs.ranks[q]
        cmds = P.commands([dict(opcode=OP_SIGNAL, dst_rank=1 - src_rank, signal_region=1,
                                signal_offset=8 * p, signal_value=i + 1) for i in range(per)])
        results[p] = post_many(qs, q, cmds)

    with Proxy(qs, w.regions, HostTransport(), threads=2, batch=8) as proxy:
        threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        for p in range(producers):
            rank = 1 - qs.ranks[p % 4]
            assert wait_flag(w.flags[rank], p, per)
    assert results == [per] * producers
    assert proxy.stats["signals"] == producers * per
    qs.close()


@pytest.mark.parametrize("bad,code", [
    (dict(opcode=77), "unknown opcode"),
    (dict(opcode=OP_PUT, dst_rank=9, nbytes=8), "destination rank out of range"),
    (dict(opcode=OP_PUT, dst_rank=1, dst_region=3, nbytes=8), "region not registered"),
    (dict(opcode=OP_PUT, dst_rank=1, dst_offset=(1 << 16) - 4, nbytes=8), "offset out of the region"),
    (dict(opcode=OP_PUT, dst_rank=1, src_offset=2**64 - 1, nbytes=2), "offset out of the region"),
    (dict(opcode=OP_SIGNAL, dst_rank=1, signal_region=1, signal_offset=4), "not 8-byte aligned"),
])
def test_malformed_commands_error_on_both_sides(bad, code):
    w = World()
    qs = QueueSet(1, 8, [0])
    good = P.command(OP_SIGNAL, dst_rank=1, signal_region=1, signal_offset=0, signal_value=1)
    proxy = Proxy(qs, w.regions, HostTransport())
    try:
        assert post(qs, 0, good) == P.POST_OK
        assert wait_flag(w.flags[1], 0, 1)
        before = [d.copy() for d in w.data] + [f.copy() for f in w.flags]
        assert post(qs, 0, P.command(**bad)) == P.POST_OK
        assert wait_flag(qs.header, Q.H_ERROR, 1)                    # what the GPU's waits see
        # refused, never written: not even the part of a put that lies inside the region
        after = [d.copy() for d in w.data] + [f.copy() for f in w.flags]
        assert all(np.array_equal(x, y) for x, y in zip(before, after))
        assert qs.error(0) & 0xFF != 0
        # later commands are drained, not executed, so producers never block
        for _ in range(20):
            assert post(qs, 0, good) in (P.POST_OK, P.POST_ERROR)
        with pytest.raises(ProxyError, match=code):
            proxy.check()
    finally:
        proxy.close()                 # already raised once; threads joined
    assert not proxy.running
    assert proxy.stats["errors"] == 1
    qs.close()


def test_error_raised_on_close():
    w = World()
    qs = QueueSet(1, 8, [0])
    with pytest.raises(ProxyError, match="queue 0 command 0"):
        with Proxy(qs, w.regions, HostTransport()):
            post(qs, 0, P.command(77))
    qs.close()


def test_fence_nop_barrier():
    w = World(ranks=3)
    qs = QueueSet(3, 8, [0, 1, 2])
    with Proxy(qs, w.regions, HostTransport(), threads=3):
        for r in range(3):
            post(qs, r, P.command(OP_NOP))
            post(qs, r, P.command(OP_PUT, dst_rank=(r + 1) % 3, src_region=0, dst_region=0,
                                  src_offset=0, dst_offset=1024 * (r + 1), nbytes=512))
            post(qs, r, P.command(OP_FENCE, dst_rank=r, signal_region=1, signal_offset=8 * 100,
                                  signal_value=5))
            post(qs, r, P.command(OP_BARRIER, signal_region=1, signal_offset=8 * 10, signal_value=3))
        for r in range(3):
            assert wait_flag(w.flags[r], 100, 5)
            for peer in range(3):
                assert wait_flag(w.flags[r], 10 + peer, 3)
    for r in range(3):
        dst = (r + 1) % 3
        assert (w.data[dst][1024 * (r + 1): 1024 * (r + 1) + 512] == w.data[r][:512]).all()
    qs.close()


def test_close_while_busy_joins_every_thread():
    w = World()
    qs = QueueSet(2, 64, [0, 0])
    stop = threading.Event()
    sig = P.command(OP_SIGNAL, dst_rank=1, signal_region=1, signal_offset=0, signal_value=1)

    def produce(q):
        while not stop.is_set():
            if P.post(qs.ring, qs.header, np.uint64(qs.slots), q, sig, np.int64(10**6)) != P.POST_OK:
                break

    proxy = Proxy(qs, w.regions, HostTransport(), threads=2)
    producers = [threading.Thread(target=produce, args=(q,), daemon=True) for q in range(2)]
    for t in producers:
        t.start()
    time.sleep(0.2)
    proxy.close(timeout=2.0)          # producers still posting: close must not hang
    assert not proxy.running
    assert not [t for t in threading.enumerate() if t.name.startswith("mkrt-proxy")]
    stop.set()
    for t in producers:
        t.join(10)
    assert proxy.stats["commands"] > 0
    qs.close()


def test_exception_inside_with_stops_threads():
    w = World()
    qs = QueueSet(1, 8, [0])
    with pytest.raises(KeyError):
        with Proxy(qs, w.regions, HostTransport()) as proxy:
            raise KeyError("boom")
    assert not proxy.running
    qs.close()


def test_bad_arguments_raise():
    w = World()
    with pytest.raises(ValueError, match="slots"):
        QueueSet(1, 6, [0])
    with pytest.raises(ValueError, match="ranks"):
        QueueSet(2, 8, [0])
    qs = QueueSet(2, 8, [0, 5])
    with pytest.raises(ValueError, match="exceed"):
        Proxy(qs, w.regions, HostTransport(), start=False)
    with pytest.raises(ValueError, match="threads"):
        Proxy(QueueSet(1, 8, [0]), w.regions, HostTransport(), threads=2, start=False)
    with pytest.raises(ValueError, match="region"):
        set_region(w.regions, 0, 9, 4096, 8)
    with pytest.raises(TypeError):
        Proxy(QueueSet(1, 8, [0]), np.zeros((2, 2, 4), np.int64), HostTransport(), start=False)


def test_shared_memory_queue_across_processes():
    """Two processes (mpiexec -n 2): each one's host producer puts into the other's segment."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    mpiexec = Path(sys.executable).with_name("mpiexec")
    if not mpiexec.exists():
        pytest.skip(f"no mpiexec beside {sys.executable}")
    script = Path(__file__).with_name("proxy_mpi_script.py")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run([str(mpiexec), "-n", "2", sys.executable, "-m", "mpi4py", str(script)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # two processes share the pipe: their lines can interleave, so match, don't split
    reports = sorted(re.findall(r"rank (\d+) ok (\d+)", proc.stdout))
    assert reports == [("0", "1000"), ("1", "1000")], proc.stdout + proc.stderr


def test_reply_words_take_flags_the_proxy_writes_back():
    w = World(ranks=1)
    qs = QueueSet(2, 8, [0, 0])
    with pytest.raises(ValueError, match="reply word"):
        qs.reply_address(0, Q.REPLY_WORDS)
    set_region(w.regions, 0, 2, qs.reply_address(1), 8 * Q.REPLY_WORDS, REGION_HOST)
    sig = P.command(OP_SIGNAL, dst_rank=0, signal_region=2, signal_offset=8 * 3, signal_value=42)
    with Proxy(qs, w.regions, HostTransport()):
        assert post(qs, 1, sig) == P.POST_OK
        assert wait_flag(qs.header, 1 * Q.HEADER_WORDS + Q.H_REPLY + 3, 42)
    # its own line: the queue's tail, done and error words are untouched by replies
    assert qs.tail(1) == 1 and qs.done(1) == 1 and qs.error(1) == 0 and qs.tail(0) == 0
    qs.close()
