"""The security boundary of the proxy: a command from a (buggy) kernel that names a rank,
region or offset outside what was registered is refused and reported, never written;
tested for every transport.

One table (:data:`CASES`) of malformed commands, each with the error code the proxy
must answer (``mkrt/proxy/queue.py``, ``E_*``), run against

* the ``host`` transport (compiled proxy loop, CPU),
* the ``verbs`` transport driven by :class:`~mkrt.proxy.verbs_proxy.VerbsProxy` on the
  in-process fake device (tests/test_proxy_verbs_fake.py, CPU; RC and EFA SRD),
* the ``verbs`` transport driven by the compiled loop (:class:`~mkrt.proxy.verbs_loop.CompiledVerbsProxy`)
  on the loopback NIC (CPU; RC and EFA SRD),
* the ``ce`` transport (compiled loop, device memory; ``gpu``, skipped without one).

For every case: the command is refused (drained, tail advanced), the queue's error word
(what the GPU's waits check) holds the code and the failed ticket, the host raises a
ProxyError with the expected text once, no byte of any registered region or flag changed
(not even the in-range part of a put), later commands of that queue are drained without
executing, and the proxy closes cleanly. The GPU posts through the same ring protocol
as the host producer used here (mkrt/proxy/producer.py), so the proxy cannot tell them
apart.

Every wait is bounded (seconds), so a proxy that never answers fails the test, never
hangs it.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

from mkrt.proxy import (NO_REGION, OP_BARRIER, OP_FENCE, OP_NOP, OP_PUT, OP_PUT_SIGNAL,
                        OP_SIGNAL, REGION_DEVICE, REGION_HOST, HostTransport, Proxy,
                        ProxyError, QueueSet, new_region_table, set_region)
from mkrt.proxy import producer as P
from mkrt.proxy import queue as Q

RANKS = 2
REGIONS = 4               # 0: data, 1: flags (every rank); 2: never registered; 3: rank 0 only
DATA = 1 << 12
FLAG_WORDS = 64
FLAG_BYTES = 8 * FLAG_WORDS
SCRATCH = 256             # region 3 (rank 0 only)
U64 = 2**64
WAIT_S = 10.0             # bound of every host-side wait


@dataclasses.dataclass(frozen=True)
class Case:
    command: dict          # keywords of mkrt.proxy.producer.command
    code: int              # E_* the proxy must answer
    poster: int = 0        # rank whose queue carries the command

    @property
    def text(self) -> str:
        return Q.ERROR_NAMES[self.code]


def put(**kw):
    """A put of 8 in-range bytes from rank 0's data to rank 1's data, with `kw` spoiled."""
    return dict(dict(opcode=OP_PUT, dst_rank=1, src_region=0, dst_region=0, src_offset=0,
                     dst_offset=64, nbytes=8), **kw)


def put_signal(**kw):
    return put(**dict(dict(opcode=OP_PUT_SIGNAL, signal_region=1, signal_offset=8 * 5,
                           signal_value=0xBAD), **kw))


def signal(**kw):
    return dict(dict(opcode=OP_SIGNAL, dst_rank=1, signal_region=1, signal_offset=8 * 5,
                     signal_value=0xBAD), **kw)


def fence(**kw):
    return signal(**dict(dict(opcode=OP_FENCE), **kw))


def barrier(**kw):
    return dict(dict(opcode=OP_BARRIER, signal_region=1, signal_offset=8 * 8,
                     signal_value=0xBAD), **kw)


#: id -> Case: every check validate_command (mkrt/proxy/proxy.py) makes, and its edges
CASES = {
    # opcodes
    "opcode-unknown": Case(dict(opcode=77), Q.E_OPCODE),
    "opcode-max-u16": Case(dict(opcode=0xFFFF), Q.E_OPCODE),
    "opcode-just-past-barrier": Case(dict(opcode=OP_BARRIER + 1), Q.E_OPCODE),
    # destination rank
    "put-rank-out-of-range": Case(put(dst_rank=RANKS), Q.E_RANK),
    "put-rank-huge": Case(put(dst_rank=1000), Q.E_RANK),
    "put-rank-negative(0xFFFF)": Case(put(dst_rank=0xFFFF), Q.E_RANK),
    "signal-rank-out-of-range": Case(signal(dst_rank=RANKS), Q.E_RANK),
    "put_signal-rank-out-of-range": Case(put_signal(dst_rank=RANKS), Q.E_RANK),
    "fence-signal-rank-out-of-range": Case(fence(dst_rank=0xFFFF), Q.E_RANK),
    # regions
    "put-dst-region-unregistered": Case(put(dst_region=2), Q.E_REGION),
    "put-dst-region-registered-only-at-source": Case(put(dst_region=3), Q.E_REGION),
    "put-dst-region-beyond-table": Case(put(dst_region=REGIONS), Q.E_REGION),
    "put-dst-region-no-region": Case(put(dst_region=NO_REGION), Q.E_REGION),
    "put-src-region-unregistered": Case(put(src_region=2), Q.E_REGION),
    "put-src-region-beyond-table": Case(put(src_region=REGIONS + 5), Q.E_REGION),
    "put-src-region-registered-only-at-peer": Case(put(src_region=3, dst_region=0), Q.E_REGION,
                                                   poster=1),
    "put_signal-no-signal-region": Case(put_signal(signal_region=NO_REGION), Q.E_REGION),
    "put_signal-signal-region-unregistered": Case(put_signal(signal_region=2), Q.E_REGION),
    "signal-region-unregistered": Case(signal(signal_region=2), Q.E_REGION),
    "signal-region-only-at-another-rank": Case(signal(signal_region=3), Q.E_REGION),
    "signal-no-region": Case(signal(signal_region=NO_REGION), Q.E_REGION),
    "fence-signal-region-beyond-table": Case(fence(signal_region=REGIONS), Q.E_REGION),
    "barrier-region-beyond-table": Case(barrier(signal_region=REGIONS), Q.E_REGION),
    "barrier-no-region": Case(barrier(signal_region=NO_REGION), Q.E_REGION),
    "barrier-region-registered-nowhere": Case(barrier(signal_region=2), Q.E_REGION),
    # destination bounds
    "put-dst-straddles-end": Case(put(dst_offset=DATA - 4, nbytes=8), Q.E_BOUNDS),
    "put-dst-offset-past-end": Case(put(dst_offset=DATA + 8, nbytes=0), Q.E_BOUNDS),
    "put-dst-offset+nbytes-wraps-2**64": Case(put(dst_offset=U64 - 4, nbytes=8), Q.E_BOUNDS),
    "put-nbytes-wraps-2**64": Case(put(dst_offset=8, nbytes=U64 - 4), Q.E_BOUNDS),
    "put-nbytes-past-end": Case(put(src_offset=0, dst_offset=0, nbytes=DATA + 1), Q.E_BOUNDS),
    "put-nbytes-max-u64": Case(put(nbytes=U64 - 1), Q.E_BOUNDS),
    # source bounds
    "put-src-offset-max-u64": Case(put(src_offset=U64 - 1, nbytes=2), Q.E_BOUNDS),
    "put-src-straddles-end": Case(put(src_offset=DATA - 8, nbytes=16), Q.E_BOUNDS),
    "put-src-offset-past-end": Case(put(src_offset=DATA + 1, nbytes=0), Q.E_BOUNDS),
    # signals: alignment first, then bounds
    "put_signal-misaligned": Case(put_signal(signal_offset=4), Q.E_ALIGN),
    "put_signal-signal-past-end": Case(put_signal(signal_offset=FLAG_BYTES), Q.E_BOUNDS),
    "signal-misaligned": Case(signal(signal_offset=8 * 3 + 1), Q.E_ALIGN),
    "signal-misaligned-near-end": Case(signal(signal_offset=FLAG_BYTES - 4), Q.E_ALIGN),
    "signal-past-end": Case(signal(signal_offset=FLAG_BYTES), Q.E_BOUNDS),
    "signal-offset-max-aligned-u64": Case(signal(signal_offset=U64 - 8), Q.E_BOUNDS),
    "signal-into-data-region-past-end": Case(signal(signal_region=0, signal_offset=DATA), Q.E_BOUNDS),
    "fence-signal-misaligned": Case(fence(signal_offset=12), Q.E_ALIGN),
    "fence-signal-past-end": Case(fence(signal_offset=FLAG_BYTES + 64), Q.E_BOUNDS),
    "barrier-misaligned": Case(barrier(signal_offset=4), Q.E_ALIGN),
    "barrier-past-end": Case(barrier(signal_offset=FLAG_BYTES), Q.E_BOUNDS),
    "barrier-last-slot-past-end": Case(barrier(signal_offset=FLAG_BYTES - 8), Q.E_BOUNDS,
                                       poster=1),
    "barrier-offset-wraps-2**64": Case(barrier(signal_offset=U64 - 8), Q.E_BOUNDS, poster=1),
}


def case_params():
    out = []
    for name, case in CASES.items():
        if isinstance(case, Case):
            out.append(pytest.param(case, id=name))
        else:                         # already a pytest.param with marks
            out.append(pytest.param(*case.values, id=name, marks=case.marks))
    return out


#: valid commands posted after the refused one: a failed queue must drop them unexecuted
LATER = [signal(signal_offset=8 * 1, signal_value=2),
         put(dst_offset=128, nbytes=64),
         put_signal(dst_offset=256, nbytes=32, signal_offset=8 * 2, signal_value=3),
         fence(signal_offset=8 * 3, signal_value=4),
         barrier(signal_offset=8 * 8, signal_value=5),
         dict(opcode=OP_NOP)]


def wait_word(words, index, value, seconds=WAIT_S) -> bool:
    """Bounded wait (time-bounded, in short compiled spins) until words[index] >= value."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if P.wait_at_least(words, index, np.uint64(value), np.int64(20_000)):
            return True
        time.sleep(0.0005)
    return bool(words[index] >= np.uint64(value))


def post(bench, words) -> int:
    qs = bench.queue
    return P.post(qs.ring, qs.header, np.uint64(qs.slots), 0, words, np.int64(10**7))


# ---- benches: one per transport -------------------------------------------------------

class _HostMemoryBench:
    """Regions in host numpy arrays (data with random bytes, zeroed flags)."""

    def _host_arrays(self, seed=0):
        rng = np.random.default_rng(seed)
        self.data = [rng.integers(0, 256, DATA, dtype=np.uint8) for _ in range(RANKS)]
        self.flags = [np.zeros(FLAG_WORDS, dtype=np.uint64) for _ in range(RANKS)]
        self.scratch = rng.integers(0, 256, SCRATCH, dtype=np.uint8)

    def memory(self) -> list[np.ndarray]:
        return [a.copy() for a in (*self.data, *self.flags, self.scratch)]

    def wait_flag(self, rank, word, value) -> bool:
        return wait_word(self.flags[rank], word, value)

    def settle(self):
        pass


class HostBench(_HostMemoryBench):
    name = "host"

    def __init__(self, poster):
        self._host_arrays()
        self.regions = new_region_table(RANKS, REGIONS)
        for r in range(RANKS):
            set_region(self.regions, r, 0, self.data[r].ctypes.data, DATA, REGION_HOST)
            set_region(self.regions, r, 1, self.flags[r].ctypes.data, FLAG_BYTES, REGION_HOST)
        set_region(self.regions, 0, 3, self.scratch.ctypes.data, SCRATCH, REGION_HOST)
        self.queue = QueueSet(1, 8, [poster])
        self.proxy = Proxy(self.queue, self.regions, HostTransport(), threads=1)
        self.others = []

    def close(self):
        self.queue.close()


class VerbsBench(_HostMemoryBench):
    """Both ranks' verbs transports and VerbsProxies on the fake fabric; the poster's queue."""

    def __init__(self, poster, efa=False):
        from test_proxy_verbs_fake import FakeBackend, Fabric, connect_all
        from mkrt.proxy.transports import verbs as V
        from mkrt.proxy.verbs_proxy import VerbsProxy
        self.name = "verbs-efa" if efa else "verbs-rc"
        self._host_arrays()
        fabric = Fabric(efa=efa, seed=0)
        self.transports = []
        for r in range(RANKS):
            t = V.VerbsTransport(r, RANKS, REGIONS, backend=FakeBackend(fabric, r),
                                 sq_depth=16, signal_every=1 if efa else 4, recv_depth=64,
                                 timeout=5.0)
            t.register_region(0, self.data[r].ctypes.data, DATA)
            t.register_region(1, self.flags[r].ctypes.data, FLAG_BYTES, kind=REGION_HOST)
            if r == 0:
                t.register_region(3, self.scratch.ctypes.data, SCRATCH)
            self.transports.append(t)
        connect_all(self.transports)
        self.queues = [QueueSet(1, 8, [r]) for r in range(RANKS)]
        proxies = [VerbsProxy(self.queues[r], t.regions, t) for r, t in enumerate(self.transports)]
        self.queue, self.proxy = self.queues[poster], proxies[poster]
        self.others = [p for r, p in enumerate(proxies) if r != poster]
        self.efa = efa

    def settle(self):
        if self.efa:
            # SRD flags are written by the receiver's proxy from its receive completions:
            # give a wrongly accepted signal time to land before memory is compared
            time.sleep(0.05)

    def close(self):
        for q in self.queues:
            q.close()


class CompiledVerbsBench(_HostMemoryBench):
    """Both ranks' verbs transports on the loopback NIC, each served by the compiled verbs
    loop (CompiledVerbsProxy); RC queue pairs or EFA SRD endpoints."""

    def __init__(self, poster, efa=False):
        from mkrt.proxy.transports import loopback_nic as L
        from mkrt.proxy.transports import verbs as V
        from mkrt.proxy.verbs_loop import CompiledVerbsProxy
        self.name = "compiled-verbs-efa" if efa else "compiled-verbs-rc"
        self._host_arrays()
        fabric = L.LoopbackFabric()
        self.transports = []
        for r in range(RANKS):
            backend = L.LoopbackBackend(fabric, r)
            if efa:
                backend.open = lambda name, r=r: V.DeviceInfo("efa_loopback", True, r + 1,
                                                              bytes([r]) * 16, 5, 32)
            t = V.VerbsTransport(r, RANKS, REGIONS, backend=backend, sq_depth=16,
                                 signal_every=1 if efa else 4, recv_depth=64, timeout=5.0)
            t.register_region(0, self.data[r].ctypes.data, DATA)
            t.register_region(1, self.flags[r].ctypes.data, FLAG_BYTES, kind=REGION_HOST)
            if r == 0:
                t.register_region(3, self.scratch.ctypes.data, SCRATCH)
            self.transports.append(t)
        sent = [t.connection_data() for t in self.transports]
        for r, t in enumerate(self.transports):
            t.complete([sent[p][r] for p in range(RANKS)])
        self.queues = [QueueSet(1, 8, [r]) for r in range(RANKS)]
        proxies = [CompiledVerbsProxy(self.queues[r], t.regions, t)
                   for r, t in enumerate(self.transports)]
        self.queue, self.proxy = self.queues[poster], proxies[poster]
        self.others = [p for r, p in enumerate(proxies) if r != poster]
        self.efa = efa

    def settle(self):
        if self.efa:
            time.sleep(0.05)            # SRD flags are written by the receiver's proxy

    def close(self):
        for q in self.queues:
            q.close()
        for t in self.transports:
            t.close()


class CopyEngineBench:
    """Regions in device memory of GPU 0 (both ranks), the `ce` transport's proxy."""

    name = "ce"

    def __init__(self, poster):
        import cupy
        from mkrt.proxy.transports.ce import CopyEngineTransport
        rng = np.random.default_rng(0)
        with cupy.cuda.Device(0):
            self.data = [cupy.asarray(rng.integers(0, 256, DATA, dtype=np.uint8))
                         for _ in range(RANKS)]
            self.flags = [cupy.zeros(FLAG_WORDS, dtype=np.uint64) for _ in range(RANKS)]
            self.scratch = cupy.asarray(rng.integers(0, 256, SCRATCH, dtype=np.uint8))
            cupy.cuda.Device(0).synchronize()
        self.regions = new_region_table(RANKS, REGIONS)
        for r in range(RANKS):
            set_region(self.regions, r, 0, self.data[r].data.ptr, DATA, REGION_DEVICE)
            set_region(self.regions, r, 1, self.flags[r].data.ptr, FLAG_BYTES, REGION_DEVICE)
        set_region(self.regions, 0, 3, self.scratch.data.ptr, SCRATCH, REGION_DEVICE)
        self.queue = QueueSet(1, 8, [poster])
        self.proxy = Proxy(self.queue, self.regions, CopyEngineTransport(0), threads=1)
        self.others = []

    def settle(self):
        import cupy
        cupy.cuda.Device(0).synchronize()

    def memory(self) -> list[np.ndarray]:
        self.settle()
        return [a.get() for a in (*self.data, *self.flags, self.scratch)]

    def wait_flag(self, rank, word, value) -> bool:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if int(self.flags[rank][word].get()) >= value:
                return True
            time.sleep(0.001)
        return False

    def close(self):
        self.queue.close()


# ---- the one check every transport runs ---------------------------------------------------

def run_case(bench, case: Case):
    header = bench.queue.header
    try:
        # the proxy works: a good signal from the poster lands
        assert post(bench, P.command(**signal(signal_offset=0, signal_value=1))) == P.POST_OK
        assert bench.wait_flag(1, 0, 1), f"{bench.name}: a good command never landed"
        before = bench.memory()

        # the malformed command: taken (tail moves on), refused with its code, ticket 1
        assert post(bench, P.command(**case.command)) == P.POST_OK
        assert wait_word(header, Q.H_TAIL, 2), f"{bench.name}: the command was never taken"
        error = int(header[Q.H_ERROR])
        assert error & 0xFF == case.code, (
            f"{bench.name}: error word {error:#x} (code {error & 0xFF}); expected "
            f"{case.code} ({case.text})")
        assert int(header[Q.H_ERROR_TICKET]) == 1

        # later commands are drained without executing, so producers never block
        for words in P.commands(LATER):
            assert post(bench, words) in (P.POST_OK, P.POST_ERROR)
        assert wait_word(header, Q.H_TAIL, 2 + len(LATER)), f"{bench.name}: not drained"
        bench.settle()

        # never written: no byte of any region or flag, not even the in-range part of a put
        after = bench.memory()
        changed = [i for i, (x, y) in enumerate(zip(before, after)) if not np.array_equal(x, y)]
        assert changed == [], f"{bench.name}: regions {changed} changed (data 0..{RANKS - 1}, " \
                              f"flags {RANKS}..{2 * RANKS - 1}, scratch {2 * RANKS})"

        # the host raises it, once, with the expected text
        with pytest.raises(ProxyError, match=f"queue 0 command 1: {case.text}") as raised:
            bench.proxy.check()
        assert (raised.value.code, raised.value.ticket) == (case.code, 1)
        bench.proxy.check()                                  # raised once only
        stats = bench.proxy.stats
        assert stats["errors"] == 1 and stats["dropped"] == len(LATER)
    finally:
        try:
            bench.proxy.close(timeout=10)                    # already raised: closes quietly
        finally:
            for other in bench.others:
                other.close(timeout=10)                      # its queue saw no error
            bench.close()
    assert not bench.proxy.running


@pytest.mark.parametrize("case", case_params())
def test_host_transport_refuses_and_reports(case):
    run_case(HostBench(case.poster), case)


@pytest.mark.parametrize("efa", [False, True], ids=["rc", "efa"])
@pytest.mark.parametrize("case", case_params())
def test_verbs_proxy_refuses_and_reports(case, efa):
    run_case(VerbsBench(case.poster, efa=efa), case)


@pytest.mark.parametrize("efa", [False, True], ids=["rc", "efa"])
@pytest.mark.parametrize("case", case_params())
def test_compiled_verbs_loop_refuses_and_reports(case, efa):
    run_case(CompiledVerbsBench(case.poster, efa=efa), case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", case_params())
def test_ce_transport_refuses_and_reports(case):
    run_case(CopyEngineBench(case.poster), case)


def test_efa_unencodable_signal_is_refused_and_reported():
    bench = VerbsBench(0, efa=True)
    header = bench.queue.header
    try:
        assert post(bench, P.command(**signal(signal_offset=0, signal_value=1))) == P.POST_OK
        assert bench.wait_flag(1, 0, 1)
        assert post(bench, P.command(**signal(signal_value=1 << 20))) == P.POST_OK
        assert wait_word(header, Q.H_TAIL, 2, seconds=3.0), "never taken: the proxy thread died"
        assert int(header[Q.H_ERROR]) != 0, "the GPU would not see the refusal"
    finally:
        try:
            bench.proxy.close(timeout=10)
        except ProxyError:
            pass
        for other in bench.others:
            other.close(timeout=10)
        bench.close()
    assert not bench.proxy.running


def test_table_covers_every_error_code_the_validation_returns():
    """E_TRANSPORT and E_STOPPED come from transports and shutdown, not from a command."""
    codes = {(c if isinstance(c, Case) else c.values[0]).code for c in CASES.values()}
    assert codes == set(Q.ERROR_NAMES) - {Q.E_TRANSPORT, Q.E_STOPPED}
    opcodes = {(c if isinstance(c, Case) else c.values[0]).command["opcode"]
               for c in CASES.values()}
    assert {OP_PUT, OP_PUT_SIGNAL, OP_SIGNAL, OP_FENCE, OP_BARRIER} <= opcodes
    assert not [t for t in threading.enumerate() if t.name.startswith("mkrt-proxy")]
