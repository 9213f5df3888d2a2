"""The verbs transport driven by the real VerbsProxy, over an in-process fake device
(tests/test_proxy_verbs_fake.py), with the host-side producer in place of the GPU."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from mkrt.proxy import (OP_BARRIER, OP_FENCE, OP_PUT, OP_PUT_SIGNAL, OP_SIGNAL, REGION_HOST,
                        ProxyError, QueueSet)
from mkrt.proxy import producer as P
from mkrt.proxy import queue as Q
from mkrt.proxy.transports import verbs as V
from mkrt.proxy.verbs_proxy import VerbsProxy
from test_proxy_verbs_fake import FakeBackend, Fabric, connect_all, WC_REM_ACCESS_ERR

SPINS = np.int64(2_000_000_000)
DATA = 1 << 16


class Ranks:
    """`n` ranks in one process, each: data region 0, flag region 1 (host), a transport."""

    def __init__(self, n=2, *, efa=False, sq_depth=16, signal_every=4, max_inline=64, seed=0,
                 dmabuf=False):
        self.fabric = Fabric(efa=efa, seed=seed)
        rng = np.random.default_rng(seed)
        self.data = [rng.integers(0, 256, DATA, dtype=np.uint8) for _ in range(n)]
        self.flags = [np.zeros(512, dtype=np.uint64) for _ in range(n)]
        self.transports = []
        for r in range(n):
            t = V.VerbsTransport(r, n, 2, backend=FakeBackend(self.fabric, r, max_inline=max_inline),
                                 sq_depth=sq_depth, signal_every=1 if efa else signal_every,
                                 recv_depth=64, timeout=5.0)
            # dma-buf registration: WRs address the region from its iova (= offset 4096 here)
            t.register_region(0, self.data[r].ctypes.data, DATA,
                              dmabuf_fd=99 if dmabuf else None, dmabuf_offset=4096)
            t.register_region(1, self.flags[r].ctypes.data, self.flags[r].nbytes, kind=REGION_HOST)
            self.transports.append(t)
        connect_all(self.transports)
        self.queues = [QueueSet(1, 8, [r]) for r in range(n)]
        self.proxies = []

    def start(self, **kw):
        self.proxies = [VerbsProxy(self.queues[r], t.regions, t, **kw)
                        for r, t in enumerate(self.transports)]
        return self.proxies

    def close(self):
        errors = []
        for p in self.proxies:
            try:
                p.close(timeout=10)
            except ProxyError as error:
                errors.append(error)
        for q in self.queues:
            q.close()
        return errors


def post_many(qs, commands, spins=SPINS):
    return P.post_many(qs.ring, qs.header, np.uint64(qs.slots), 0, commands, spins)


def puts(n, *, chunk=128, dst_rank=1, signal=True, flag_word=0):
    return P.commands([dict(opcode=OP_PUT_SIGNAL if signal else OP_PUT, dst_rank=dst_rank,
                            src_region=0, dst_region=0, src_offset=(i * chunk) % DATA,
                            dst_offset=(i * chunk) % DATA, nbytes=chunk, signal_region=1,
                            signal_offset=8 * flag_word, signal_value=i + 1) for i in range(n)])


@pytest.mark.parametrize("efa,max_inline,dmabuf", [(False, 64, False), (False, 0, True), (True, 32, False)],
                         ids=["rc-inline", "rc-staged-dmabuf", "efa-srd"])
def test_puts_land_before_flags_with_wraparound(efa, max_inline, dmabuf):
    w = Ranks(efa=efa, max_inline=max_inline, dmabuf=dmabuf, seed=3)
    n = 400                                 # 8-slot ring: wraps 50 times; 16-deep SQ refills 50 times
    w.start(batch=8)
    try:
        assert post_many(w.queues[0], puts(n)) == n
        assert P.wait_at_least(w.flags[1], 0, np.uint64(n), SPINS)
        deadline = time.monotonic() + 10
        while w.queues[0].done(0) != n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.queues[0].tail(0) == n and w.queues[0].done(0) == n
        # RC: the flag alone vouches for every earlier put; SRD: a flag vouches only for its
        # own put, so all data is checked once `done` says every WR completed
        assert (w.data[1][: n * 128 % DATA] == w.data[0][: n * 128 % DATA]).all()
    finally:
        assert w.close() == []
    # flag ordering: for every command, its flag write landed after its data write
    flag_addr = w.flags[1].ctypes.data
    log = w.fabric.log
    data_positions = [i for i, (kind, dst, length) in enumerate(log) if kind == "data" and length == 128]
    assert len(data_positions) == n
    if efa:
        imm = [(i, V.decode_immediate(length)) for i, (kind, dst, length) in enumerate(log) if kind == "imm"]
        assert len(imm) == n
        order = [value for _, (index, value) in imm]
        assert sorted(order) == list(range(1, n + 1))
        assert order != list(range(1, n + 1))          # SRD really reordered them
        for i, _ in imm:                               # immediate follows its own data write
            assert log[i - 1][0] == "data"
        assert w.transports[1].stats["recv_completions"] == n
    else:
        flag_positions = [i for i, (kind, dst, length) in enumerate(log) if dst == flag_addr]
        assert len(flag_positions) == n
        assert all(d < f for d, f in zip(data_positions, flag_positions))
    s = w.proxies[0].stats
    assert s["commands"] == n and s["puts"] == n and s["errors"] == 0


def test_selective_signalling_and_credit_backpressure():
    w = Ranks(sq_depth=16, signal_every=4)
    w.fabric.stall = True                       # nothing completes: credits run out
    w.start(batch=8)
    posted = []
    producer = threading.Thread(target=lambda: posted.append(post_many(w.queues[0], puts(40, signal=False))),
                                daemon=True)
    try:
        producer.start()
        time.sleep(0.3)
        assert w.queues[0].tail(0) < 40          # the ring backs up behind the full send queue
        t = w.transports[0]
        assert t.credits[1].outstanding == 16 and t.stats["credit_waits"] >= 1
        assert w.flags[1][0] == 0
        assert w.queues[0].done(0) == 0
        w.fabric.stall = False                  # completions flow again: the rest goes out
        deadline = time.monotonic() + 10
        while w.queues[0].done(0) != 40 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.queues[0].done(0) == 40
        producer.join(10)
        assert posted == [40]
    finally:
        assert w.close() == []
    t = w.transports[0]
    assert t.stats["wrs"] == 40
    # every 4th WR, the last of every chain, and every WR once fewer than 4 slots are left
    assert 10 <= t.stats["signalled"] < 40
    assert t.stats["completions"] == t.stats["signalled"]
    assert max(w.fabric.posted_chains) <= 16


def test_completion_error_reaches_gpu_word_and_host():
    w = Ranks()
    w.start(batch=4)
    try:
        assert post_many(w.queues[0], puts(4)) == 4
        assert P.wait_at_least(w.flags[1], 0, np.uint64(4), SPINS)
        w.fabric.fail_next = WC_REM_ACCESS_ERR
        post_many(w.queues[0], puts(4), spins=np.int64(10**7))
        assert P.wait_at_least(w.queues[0].header, Q.H_ERROR, np.uint64(1), SPINS)
        word = w.queues[0].error(0)
        assert word & 0xFF == Q.E_TRANSPORT and word >> 8 == WC_REM_ACCESS_ERR
        # producers are never stuck behind the failed queue
        for _ in range(20):
            assert P.post(w.queues[0].ring, w.queues[0].header, np.uint64(8), 0, puts(1)[0],
                          np.int64(10**7)) in (P.POST_OK, P.POST_ERROR)
        with pytest.raises(ProxyError, match="transport failure"):
            w.proxies[0].check()
    finally:
        w.close()
    assert not any(p.running for p in w.proxies)


def test_malformed_commands_same_codes_as_compiled_loop():
    w = Ranks()
    w.start()
    try:
        post_many(w.queues[0], P.commands([dict(opcode=OP_SIGNAL, dst_rank=1, signal_region=1,
                                                signal_offset=4, signal_value=1)]))
        assert P.wait_at_least(w.queues[0].header, Q.H_ERROR, np.uint64(1), SPINS)
        assert w.queues[0].error(0) & 0xFF == Q.E_ALIGN
    finally:
        errors = w.close()
    assert len(errors) == 1 and "not 8-byte aligned" in str(errors[0])


def test_fence_and_barrier_across_three_ranks():
    w = Ranks(3)
    w.start()
    try:
        for r in range(3):
            post_many(w.queues[r], P.commands([
                dict(opcode=OP_PUT, dst_rank=(r + 1) % 3, src_region=0, dst_region=0,
                     src_offset=0, dst_offset=1024 * (r + 1), nbytes=512),
                dict(opcode=OP_FENCE, dst_rank=r, signal_region=1, signal_offset=8 * 100, signal_value=5),
                dict(opcode=OP_BARRIER, signal_region=1, signal_offset=8 * 10, signal_value=3)]))
        for r in range(3):
            assert P.wait_at_least(w.flags[r], 100, np.uint64(5), SPINS)
            for peer in range(3):
                assert P.wait_at_least(w.flags[r], 10 + peer, np.uint64(3), SPINS)
    finally:
        assert w.close() == []
    for r in range(3):
        dst = (r + 1) % 3
        assert (w.data[dst][1024 * (r + 1): 1024 * (r + 1) + 512] == w.data[r][:512]).all()
    assert sum(p.stats["barriers"] for p in w.proxies) == 3


def test_close_while_busy_and_exception_leave_no_thread():
    w = Ranks()
    stop = threading.Event()
    one = puts(1)[0]

    def produce():
        while not stop.is_set():
            if P.post(w.queues[0].ring, w.queues[0].header, np.uint64(8), 0, one,
                      np.int64(10**6)) != P.POST_OK:
                break

    w.start()
    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    time.sleep(0.2)
    w.proxies[0].close(timeout=2.0)
    assert not w.proxies[0].running
    stop.set()
    producer.join(10)
    assert not producer.is_alive()
    assert w.proxies[0].stats["commands"] > 0
    with pytest.raises(KeyError):
        with VerbsProxy(QueueSet(1, 8, [1]), w.transports[1].regions, w.transports[1]):
            raise KeyError("boom")
    w.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("mkrt-proxy")]


def test_verbs_proxy_refuses_bad_setup():
    fabric = Fabric()
    t = V.VerbsTransport(0, 2, 2, backend=FakeBackend(fabric, 0))
    with pytest.raises(Exception, match="connected"):
        VerbsProxy(QueueSet(1, 8, [0]), t.regions, t, start=False)
    with pytest.raises(ValueError, match="rank"):
        V.VerbsTransport(2, 2, 2, backend=FakeBackend(fabric, 2))
    with pytest.raises(ValueError, match="address"):
        t.register_region(0, 0, 8)
    efa = V.VerbsTransport(0, 2, 2, backend=FakeBackend(Fabric(efa=True), 0), signal_every=1)
    with pytest.raises(ValueError, match="host memory"):
        efa.register_region(1, 4096, 8)
