"""The host proxy: threads whose polling loop is compiled with Numba (nogil).

Each proxy thread serves a fixed set of queues. Per queue it looks at the slot of the
next ticket, takes the command once its ``valid`` word (acquire load) equals ticket + 1,
checks it against the region table, hands it to the transport, and after a batch of up
to ``batch`` commands release-stores the new tail (the producers' space bound). Errors —
unknown opcode, bad rank or region, offsets out of the region, a transport failure — are
written into the queue's error word (which the GPU's waits check, so kernels leave
instead of hanging) and into the thread's control block (which :meth:`Proxy.check` and
:meth:`Proxy.close` raise as :class:`ProxyError`). A failed queue keeps being drained
(commands dropped and counted) so producers are never stuck behind it.

The loop never prints and never takes the GIL: it counts into a stats array
(:data:`STAT_NAMES`).

Lifecycle::

    with Proxy(queue_set, regions, HostTransport(), threads=2) as proxy:
        ...                        # producers post
    # close(): drain what was posted, stop and join every thread, raise errors
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
from numba import njit

from mkrt.errors import MkrtError
from mkrt.proxy import queue as Q
from mkrt.proxy.affinity import pin_current_thread
from mkrt.proxy.atomics import load_acquire, spin_pause, store_release

log = logging.getLogger("mkrt.proxy")

STAT_NAMES = ("commands", "batches", "puts", "signals", "bytes", "fences", "barriers",
              "errors", "dropped", "idle_polls", "max_batch", "transport_calls")
S_COMMANDS, S_BATCHES, S_PUTS, S_SIGNALS, S_BYTES, S_FENCES, S_BARRIERS, S_ERRORS, \
    S_DROPPED, S_IDLE, S_MAX_BATCH, S_TRANSPORT = range(len(STAT_NAMES))
STATS_WORDS = 16

# control block of one thread (u64 words)
C_STOP = 0          # 0 run, 1 drain then stop, 2 stop now (no drain)
C_ERROR = 1         # first error of the thread: code | detail << 8
C_ERROR_QUEUE = 2
C_ERROR_TICKET = 3
C_RUNNING = 4       # 1 while the compiled loop runs
CONTROL_WORDS = 8
STOP_DRAIN = 1
STOP_NOW = 2
HOT_POLLS = 4096    # idle polls without a CPU pause after the last command (tens of us)

# decoding constants, from the one command dtype
_W_OP, _S_OP, _M_OP = Q.FIELDS["opcode"]
_W_RANK, _S_RANK, _M_RANK = Q.FIELDS["dst_rank"]
_W_SREG, _S_SREG, _M_SREG = Q.FIELDS["src_region"]
_W_DREG, _S_DREG, _M_DREG = Q.FIELDS["dst_region"]
_W_SOFF = Q.FIELDS["src_offset"][0]
_W_DOFF = Q.FIELDS["dst_offset"][0]
_W_BYTES = Q.FIELDS["bytes"][0]
_W_GOFF = Q.FIELDS["signal_offset"][0]
_W_GVAL = Q.FIELDS["signal_value"][0]
_W_GREG, _S_GREG, _M_GREG = Q.FIELDS["signal_region"]
for _name in ("src_offset", "dst_offset", "bytes", "signal_offset", "signal_value"):
    if Q.FIELDS[_name][1:] != (0, (1 << 64) - 1):
        raise ImportError(f"mkrt.proxy: field {_name} must fill a whole u64 word")
_HW = Q.HEADER_WORDS
_NO_REGION = Q.NO_REGION


class ProxyError(MkrtError):
    """The proxy rejected a command or its transport failed."""

    def __init__(self, message: str, *, code: int, detail: int, queue: int, ticket: int):
        super().__init__(message)
        self.code, self.detail, self.queue, self.ticket = code, detail, queue, ticket


def describe_error(word: int, queue: int, ticket: int) -> str:
    code, detail = word & 0xFF, word >> 8
    what = Q.ERROR_NAMES.get(code, f"error {code}")
    return f"mkrt.proxy: queue {queue} command {ticket}: {what} (code={code}, detail={detail})"


@njit(nogil=True, cache=False)
def _error(header, q, control, stats, code, detail, ticket, qi):
    word = np.uint64(code) | (np.uint64(detail) << np.uint64(8))
    if load_acquire(header, q * _HW + Q.H_ERROR) == np.uint64(0):
        header[q * _HW + Q.H_ERROR_TICKET] = ticket
        store_release(header, q * _HW + Q.H_ERROR, word)
    if control[C_ERROR] == np.uint64(0):
        control[C_ERROR_QUEUE] = np.uint64(q)
        control[C_ERROR_TICKET] = ticket
        store_release(control, C_ERROR, word)
    stats[S_ERRORS] += np.uint64(1)


@njit(nogil=True, cache=False)
def _address(regions, rank, region, offset, nbytes):
    """(address, kind, error code, detail) of [offset, offset + nbytes) in (rank, region)."""
    if rank >= regions.shape[0]:
        return np.uint64(0), np.uint64(0), Q.E_RANK, rank
    if region >= regions.shape[1] or regions[rank, region, 3] == np.uint64(0):
        return np.uint64(0), np.uint64(0), Q.E_REGION, region
    size = regions[rank, region, 1]
    if offset > size or nbytes > size - offset:
        return np.uint64(0), np.uint64(0), Q.E_BOUNDS, offset
    return regions[rank, region, 0] + offset, regions[rank, region, 2], 0, np.uint64(0)


# decoded command (what validate_command fills; the compiled loop and the verbs proxy read it)
V_OPCODE, V_RANK, V_SRC, V_SRC_KIND, V_DST, V_DST_KIND, V_BYTES, V_FLAG, V_FLAG_KIND, \
    V_VALUE, V_SIGNAL, V_SREGION, V_DREGION, V_GREGION, V_SOFFSET, V_DOFFSET, V_GOFFSET = range(17)
VALIDATED_WORDS = 17


@njit(nogil=True, cache=False)
def _signal_target(regions, rank, region, offset, out):
    """Check the u64 flag a command signals (aligned, inside a registered region) and
    record where it is in `out`; (error code, detail)."""
    if offset & np.uint64(7):
        return Q.E_ALIGN, offset
    flag, kind, err, detail = _address(regions, rank, region, offset, np.uint64(8))
    if err != 0:
        return err, detail
    out[V_FLAG] = flag
    out[V_FLAG_KIND] = kind
    out[V_SIGNAL] = np.uint64(1)
    return 0, np.uint64(0)


@njit(nogil=True, cache=False)
def validate_command(ring, base, regions, my_rank, out):
    """Decode the command at ring[base:base+8] and check it against the region table.

    Shared by the compiled loop and :class:`mkrt.proxy.verbs_proxy.VerbsProxy`, so both
    reject exactly the same commands with the same (error code, detail). Fills `out`
    (``VALIDATED_WORDS`` u64, ``V_*`` indices); ``out[V_SIGNAL]`` is 1 when a flag write
    at ``out[V_FLAG]`` follows (a barrier's per-rank flags: ``V_GREGION``/``V_GOFFSET``,
    the offset already advanced by 8 * my_rank, every rank checked here).
    """
    w1 = ring[base + _W_OP]
    opcode = (w1 >> np.uint64(_S_OP)) & np.uint64(_M_OP)
    out[V_OPCODE] = opcode
    out[V_SIGNAL] = np.uint64(0)
    out[V_BYTES] = np.uint64(0)
    if opcode == np.uint64(Q.OP_NOP):
        return 0, np.uint64(0)
    rank = (ring[base + _W_RANK] >> np.uint64(_S_RANK)) & np.uint64(_M_RANK)
    gregion = (ring[base + _W_GREG] >> np.uint64(_S_GREG)) & np.uint64(_M_GREG)
    goffset = ring[base + _W_GOFF]
    out[V_RANK] = rank
    out[V_GREGION] = gregion
    out[V_GOFFSET] = goffset
    out[V_VALUE] = ring[base + _W_GVAL]
    if opcode == np.uint64(Q.OP_PUT) or opcode == np.uint64(Q.OP_PUT_SIGNAL):
        sregion = (ring[base + _W_SREG] >> np.uint64(_S_SREG)) & np.uint64(_M_SREG)
        dregion = (ring[base + _W_DREG] >> np.uint64(_S_DREG)) & np.uint64(_M_DREG)
        nbytes = ring[base + _W_BYTES]
        out[V_SREGION] = sregion
        out[V_DREGION] = dregion
        out[V_SOFFSET] = ring[base + _W_SOFF]
        out[V_DOFFSET] = ring[base + _W_DOFF]
        out[V_BYTES] = nbytes
        src, skind, err, detail = _address(regions, my_rank, sregion, ring[base + _W_SOFF], nbytes)
        if err != 0:
            return err, detail
        dst, dkind, err, detail = _address(regions, rank, dregion, ring[base + _W_DOFF], nbytes)
        if err != 0:
            return err, detail
        out[V_SRC] = src
        out[V_SRC_KIND] = skind
        out[V_DST] = dst
        out[V_DST_KIND] = dkind
        if opcode == np.uint64(Q.OP_PUT_SIGNAL):
            return _signal_target(regions, rank, gregion, goffset, out)
        return 0, np.uint64(0)
    if opcode == np.uint64(Q.OP_SIGNAL) or opcode == np.uint64(Q.OP_FENCE):
        if opcode == np.uint64(Q.OP_FENCE) and gregion == np.uint64(_NO_REGION):
            return 0, np.uint64(0)
        return _signal_target(regions, rank, gregion, goffset, out)
    if opcode == np.uint64(Q.OP_BARRIER):
        if goffset & np.uint64(7):
            return Q.E_ALIGN, goffset
        # this rank's slot: the offset must not wrap past 2**64 on the way there
        if goffset > np.uint64(0xFFFFFFFFFFFFFFFF) - np.uint64(8) * np.uint64(my_rank):
            return Q.E_BOUNDS, goffset
        slot_offset = goffset + np.uint64(8) * np.uint64(my_rank)
        out[V_GOFFSET] = slot_offset
        if gregion >= np.uint64(regions.shape[1]):
            return Q.E_REGION, gregion
        # every rank that registered the region takes part; validate all before writing
        takers = 0
        for r in range(regions.shape[0]):
            if regions[r, gregion, 3] != np.uint64(0):
                takers += 1
                flag, fkind, err, detail = _address(regions, np.uint64(r), gregion,
                                                    slot_offset, np.uint64(8))
                if err != 0:
                    return err, detail
        if takers == 0:                 # a barrier nobody can see would never complete
            return Q.E_REGION, gregion
        out[V_SIGNAL] = np.uint64(1)
        return 0, np.uint64(0)
    return Q.E_OPCODE, opcode


def _build_loop(put, signal, progress, quiesce):
    """The polling loop specialised for one transport's functions."""

    @njit(nogil=True, cache=False)
    def execute(ring, base, regions, my_rank, tstate, stats, v):
        """Run one command; (error code, detail). Code 0: fine. `v`: scratch for the decode."""
        err, detail = validate_command(ring, base, regions, my_rank, v)
        opcode = v[V_OPCODE]
        if opcode == np.uint64(Q.OP_FENCE) or opcode == np.uint64(Q.OP_BARRIER):
            # earlier work completes first (also when this command is malformed, as before)
            rc = quiesce(tstate)
            if opcode == np.uint64(Q.OP_FENCE):
                stats[S_FENCES] += np.uint64(1)
            if rc != 0:
                return Q.E_TRANSPORT, np.uint64(rc)
        if err != 0:
            return err, detail
        if opcode == np.uint64(Q.OP_NOP):
            return 0, np.uint64(0)
        if opcode == np.uint64(Q.OP_PUT) or opcode == np.uint64(Q.OP_PUT_SIGNAL):
            nbytes = v[V_BYTES]
            if nbytes > np.uint64(0):
                rc = put(tstate, v[V_DST], v[V_SRC], nbytes, v[V_DST_KIND])
                stats[S_TRANSPORT] += np.uint64(1)
                if rc != 0:
                    return Q.E_TRANSPORT, np.uint64(rc)
            stats[S_PUTS] += np.uint64(1)
            stats[S_BYTES] += nbytes
        if opcode == np.uint64(Q.OP_BARRIER):
            gregion = v[V_GREGION]
            for r in range(regions.shape[0]):
                if regions[r, gregion, 3] != np.uint64(0):
                    flag, fkind, err, detail = _address(regions, np.uint64(r), gregion,
                                                        v[V_GOFFSET], np.uint64(8))
                    rc = signal(tstate, flag, v[V_VALUE], fkind)
                    stats[S_TRANSPORT] += np.uint64(1)
                    if rc != 0:
                        return Q.E_TRANSPORT, np.uint64(rc)
            stats[S_BARRIERS] += np.uint64(1)
            return 0, np.uint64(0)
        if v[V_SIGNAL] != np.uint64(0):
            rc = signal(tstate, v[V_FLAG], v[V_VALUE], v[V_FLAG_KIND])
            stats[S_TRANSPORT] += np.uint64(1)
            if rc != 0:
                return Q.E_TRANSPORT, np.uint64(rc)
            stats[S_SIGNALS] += np.uint64(1)
        return 0, np.uint64(0)

    @njit(nogil=True, cache=False)
    def loop(ring, header, regions, queue_ids, queue_ranks, slots, control, stats, tstate,
             batch_max):
        nq = queue_ids.shape[0]
        tails = np.zeros(nq, dtype=np.uint64)
        done = np.zeros(nq, dtype=np.uint64)
        failed = np.zeros(nq, dtype=np.uint8)
        for i in range(nq):
            q = queue_ids[i]
            tails[i] = load_acquire(header, q * _HW + Q.H_TAIL)
            done[i] = tails[i]
        mask = slots - np.uint64(1)
        scratch = np.zeros(VALIDATED_WORDS, dtype=np.uint64)
        pending = False
        idle_streak = 0
        store_release(control, C_RUNNING, np.uint64(1))
        while True:
            stop = load_acquire(control, C_STOP)
            if stop == np.uint64(STOP_NOW):
                break
            worked = False
            for i in range(nq):
                q = queue_ids[i]
                tail = tails[i]
                n = 0
                while n < batch_max:
                    base = (np.uint64(q) * slots + (tail & mask)) * np.uint64(8)
                    if load_acquire(ring, base) != tail + np.uint64(1):
                        break
                    if failed[i] != 0:
                        stats[S_DROPPED] += np.uint64(1)
                    else:
                        err, detail = execute(ring, base, regions, queue_ranks[i], tstate, stats, scratch)
                        if err != 0:
                            failed[i] = 1
                            _error(header, q, control, stats, err, detail, tail, i)
                    tail += np.uint64(1)
                    n += 1
                if n > 0:
                    worked = True
                    pending = True
                    tails[i] = tail
                    store_release(header, q * _HW + Q.H_TAIL, tail)
                    stats[S_COMMANDS] += np.uint64(n)
                    stats[S_BATCHES] += np.uint64(1)
                    if np.uint64(n) > stats[S_MAX_BATCH]:
                        stats[S_MAX_BATCH] = np.uint64(n)
            if pending:
                state = progress(tstate, not worked)
                if state == 1:
                    pending = False
                    for i in range(nq):
                        if done[i] != tails[i]:
                            done[i] = tails[i]
                            store_release(header, queue_ids[i] * _HW + Q.H_DONE, tails[i])
                elif state < 0:
                    pending = False
                    for i in range(nq):
                        if failed[i] == 0:
                            failed[i] = 1
                            _error(header, queue_ids[i], control, stats, Q.E_TRANSPORT,
                                   np.uint64(-state), tails[i], i)
            if not worked:
                stats[S_IDLE] += np.uint64(1)
                if stop == np.uint64(STOP_DRAIN) and not pending:
                    break
                idle_streak += 1
                if idle_streak > HOT_POLLS:    # a command just after the last one is seen
                    spin_pause()               # without a pause's delay; then be polite
            else:
                idle_streak = 0
        if load_acquire(control, C_STOP) != np.uint64(STOP_NOW):
            quiesce(tstate)
        store_release(control, C_RUNNING, np.uint64(0))
        return 0

    return loop


_LOOPS: dict[tuple, object] = {}


def compiled_loop(transport):
    ops = transport.ops()
    key = tuple(id(f) for f in ops)
    if key not in _LOOPS:
        _LOOPS[key] = _build_loop(*ops)
    return _LOOPS[key]


class Proxy:
    """Proxy threads serving the queues of `queue_set`, writing through `transport`.

    ``regions``: the region table (:func:`mkrt.proxy.queue.new_region_table`), read by
    the compiled loop on every command, so it can be filled (not reshaped) while running.
    Queue ``q`` is served by thread ``q % threads``. ``batch``: most commands taken from one
    queue before the tail is published. ``cpus``: CPUs every proxy thread pins itself to
    (:func:`mkrt.proxy.affinity.gpu_local_cpus` of the GPU it serves); None or empty:
    wherever the OS puts them.
    """

    def __init__(self, queue_set: Q.QueueSet, regions: np.ndarray, transport, *,
                 threads: int = 1, batch: int = 64, start: bool = True, cpus=None):
        if threads < 1 or threads > queue_set.queues:
            raise ValueError(f"mkrt.proxy: need 1 <= threads <= queues; got {threads=}, "
                             f"queues={queue_set.queues}")
        if batch < 1:
            raise ValueError(f"mkrt.proxy: batch must be >= 1; got {batch=}")
        if not (isinstance(regions, np.ndarray) and regions.dtype == np.uint64
                and regions.ndim == 3 and regions.shape[2] == Q.REGION_WORDS):
            raise TypeError(f"mkrt.proxy: regions must be a (ranks, regions, {Q.REGION_WORDS}) "
                            f"uint64 array from new_region_table")
        if int(queue_set.ranks.max()) >= regions.shape[0]:
            raise ValueError(f"mkrt.proxy: queue ranks {queue_set.ranks.tolist()} exceed the "
                             f"region table's {regions.shape[0]} ranks")
        self.queue_set, self.regions, self.transport = queue_set, regions, transport
        self.threads, self.batch = threads, batch
        self.cpus = sorted(set(cpus)) if cpus else []
        self.controls = np.zeros((threads, CONTROL_WORDS), dtype=np.uint64)
        self.stats_by_thread = np.zeros((threads, STATS_WORDS), dtype=np.uint64)
        self._threads: list[threading.Thread] = []
        self._failures: list[BaseException] = []
        self._raised = False
        self._loop = None
        self.closed = False
        if start:
            self.start()

    # -- lifecycle --
    def start(self):
        if self.closed:
            raise MkrtError("mkrt.proxy: start() after close()")
        if self._threads:
            raise MkrtError("mkrt.proxy: already started")
        self._loop = compiled_loop(self.transport)
        qs = self.queue_set
        states = [self.transport.thread_state(t) for t in range(self.threads)]
        self._states = states
        # compile on this thread (no thread to clean up if Numba fails)
        warm = np.zeros(CONTROL_WORDS, dtype=np.uint64)
        warm[C_STOP] = STOP_NOW
        self._loop(qs.ring, qs.header, self.regions, np.zeros(1, np.int64), np.zeros(1, np.int64),
                   np.uint64(qs.slots), warm, np.zeros(STATS_WORDS, np.uint64), states[0],
                   np.int64(self.batch))
        self.controls[:] = 0
        for t in range(self.threads):
            ids = np.arange(t, qs.queues, self.threads, dtype=np.int64)
            thread = threading.Thread(target=self._run, name=f"mkrt-proxy-{t}", daemon=True,
                                      args=(t, ids, qs.ranks[ids].astype(np.int64), states[t]))
            self._threads.append(thread)
            thread.start()
        return self

    def _run(self, t, ids, ranks, state):
        try:
            pin_current_thread(self.cpus)
            self.transport.thread_setup()
            qs = self.queue_set
            self._loop(qs.ring, qs.header, self.regions, ids, ranks, np.uint64(qs.slots),
                       self.controls[t], self.stats_by_thread[t], state, np.int64(self.batch))
        except BaseException as error:  # reported by check()/close()
            self._failures.append(error)

    @property
    def running(self) -> bool:
        return any(th.is_alive() for th in self._threads)

    def stop(self, *, drain: bool = True, timeout: float = 30.0):
        """Stop every thread (after draining what is posted, unless drain=False) and join."""
        self.controls[:, C_STOP] = STOP_DRAIN if drain else STOP_NOW
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if self.running and drain:
            # producers keep posting: stop without draining
            self.controls[:, C_STOP] = STOP_NOW
            for thread in self._threads:
                thread.join(5.0)
        if self.running:
            raise MkrtError(f"mkrt.proxy: proxy threads did not stop within {timeout=} s")
        self._threads = []

    def kill(self):
        """Stop at once without draining (a dead proxy, for tests of the GPU's bounded waits)."""
        self.stop(drain=False)

    def close(self, *, timeout: float = 30.0):
        """Drain, stop, join, release the transport; raise the first proxy error if any."""
        if self.closed:
            return
        try:
            if self._threads:
                self.stop(drain=True, timeout=timeout)
        finally:
            self.closed = True
            self.transport.close()
        self.check()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except MkrtError as error:
                log.warning("mkrt.proxy: while closing after %s: %s", exc_type.__name__, error)

    # -- errors and statistics --
    def error(self) -> ProxyError | None:
        if self._failures:
            error = self._failures[0]
            return ProxyError(f"mkrt.proxy: proxy thread failed: {error!r}", code=-1, detail=0,
                              queue=-1, ticket=-1)
        for t in range(self.threads):
            word = int(self.controls[t, C_ERROR])
            if word:
                q, ticket = int(self.controls[t, C_ERROR_QUEUE]), int(self.controls[t, C_ERROR_TICKET])
                return ProxyError(describe_error(word, q, ticket), code=word & 0xFF,
                                  detail=word >> 8, queue=q, ticket=ticket)
        return None

    def check(self):
        """Raise the first error any proxy thread saw (once)."""
        error = self.error()
        if error is not None and not self._raised:
            self._raised = True
            if self._failures:
                raise error from self._failures[0]
            raise error

    @property
    def stats(self) -> dict[str, int]:
        total = self.stats_by_thread.sum(axis=0)
        out = {name: int(total[i]) for i, name in enumerate(STAT_NAMES)}
        out["max_batch"] = int(self.stats_by_thread[:, S_MAX_BATCH].max())
        return out
