"""A host proxy for the `verbs` transport: a Python thread (pyverbs needs the GIL).

The compiled loop of :class:`mkrt.proxy.Proxy` cannot call pyverbs (Cython objects,
Python calls), so this proxy is a plain Python thread. It **holds the GIL while it
posts and polls**: Python code on other threads slows it and it slows them. What it
shares with the compiled loop (so GPU producers cannot tell them apart):

  * the rings and headers of a :class:`~mkrt.proxy.queue.QueueSet` — a slot is taken
    only once its ``valid`` word, read with an acquire load (a Numba helper, callable
    from Python), equals ticket + 1; the tail is published with a release store;
  * validation: :func:`mkrt.proxy.proxy.validate_command`, the very function the
    compiled loop uses, so the same commands fail with the same error codes, written
    into the queue's error word (what the GPU's waits check) and raised on check/close;
  * lifecycle, errors and statistics: this class is a :class:`~mkrt.proxy.Proxy`
    (start/stop/kill/close/context manager; no thread left after close or an exception).

Per poll it takes up to ``batch`` commands from each queue, groups puts and signals by
destination (:func:`~mkrt.proxy.transports.verbs.batch_commands`, per-peer order kept),
posts one WR chain per peer, and reaps completions; a queue's ``done`` word advances once
every WR posted for its commands has completed. Fence and barrier post what is pending,
wait for all of it to complete, then write their flags.
"""

from __future__ import annotations

import threading
import time

import numpy as np
from numba import njit

from mkrt.errors import MkrtError
from mkrt.proxy import proxy as P
from mkrt.proxy import queue as Q
from mkrt.proxy.atomics import load_acquire, store_release
from mkrt.proxy.transports.verbs import batch_commands

_HW = Q.HEADER_WORDS


@njit(nogil=True, cache=False)
def take_commands(ring, header, regions, q, my_rank, slots, tail, max_n, decoded, errors):
    """Acquire up to `max_n` ready commands of queue `q` from ticket `tail`; validate each
    into decoded[i] / errors[i] = (code, detail). Returns how many were taken."""
    mask = slots - np.uint64(1)
    n = 0
    while n < max_n:
        ticket = tail + np.uint64(n)
        base = (np.uint64(q) * slots + (ticket & mask)) * np.uint64(8)
        if load_acquire(ring, base) != ticket + np.uint64(1):
            break
        err, detail = P.validate_command(ring, base, regions, my_rank, decoded[n])
        errors[n, 0] = np.uint64(err)
        errors[n, 1] = detail
        n += 1
    return n


@njit(nogil=True, cache=False)
def publish(words, index, value):
    store_release(words, index, value)


@njit(nogil=True, cache=False)
def read_acquire(words, index):
    return load_acquire(words, index)


def check_arguments(kind: str, queue_set: Q.QueueSet, transport) -> None:
    """What every verbs proxy needs: a connected transport, and queues of its rank only."""
    if not getattr(transport, "connected", False):
        raise MkrtError(f"mkrt.proxy: {kind} needs a connected verbs transport "
                        "(transport.connect(comm) first)")
    if not (queue_set.ranks == transport.rank).all():
        raise ValueError(f"mkrt.proxy: every queue of a verbs proxy must belong to rank "
                         f"{transport.rank}; got ranks {queue_set.ranks.tolist()}")


class VerbsProxy(P.Proxy):
    """One Python proxy thread serving every queue of `queue_set` through a connected
    :class:`~mkrt.proxy.transports.verbs.VerbsTransport`. ``regions`` must be the
    transport's table (``transport.regions``: bases are the addresses WRs use)."""

    def __init__(self, queue_set: Q.QueueSet, regions: np.ndarray, transport, *,
                 batch: int = 64, start: bool = True, idle_sleep: float = 20e-6):
        check_arguments("VerbsProxy", queue_set, transport)
        self.idle_sleep = idle_sleep
        super().__init__(queue_set, regions, transport, threads=1, batch=batch, start=start)

    def start(self):
        if self.closed:
            raise MkrtError("mkrt.proxy: start() after close()")
        if self._threads:
            raise MkrtError("mkrt.proxy: already started")
        # compile the helpers here, not in the thread
        qs = self.queue_set
        take_commands(qs.ring, qs.header, self.regions, 0, np.int64(0), np.uint64(qs.slots),
                      np.uint64(1 << 62), 0, np.zeros((1, P.VALIDATED_WORDS), np.uint64),
                      np.zeros((1, 2), np.uint64))
        read_acquire(self.controls[0], P.C_STOP)
        self.controls[:] = 0
        thread = threading.Thread(target=self._run_verbs, name="mkrt-proxy-verbs", daemon=True)
        self._threads.append(thread)
        thread.start()
        return self

    def _run_verbs(self):
        control, stats = self.controls[0], self.stats_by_thread[0]
        try:
            self._loop_verbs(control, stats)
        except BaseException as error:   # reported by check()/close()
            self._failures.append(error)
        finally:
            publish(control, P.C_RUNNING, np.uint64(0))

    def _fail(self, q, i, code, detail, ticket, failed, control, stats):
        failed[i] = True
        P._error(self.queue_set.header, np.int64(q), control, stats, np.int64(code),
                 np.uint64(detail), np.uint64(ticket), np.int64(i))

    def _loop_verbs(self, control, stats):
        qs, transport = self.queue_set, self.transport
        header, slots = qs.header, np.uint64(qs.slots)
        queues = list(range(qs.queues))
        my_rank = np.int64(transport.rank)
        tails = [int(read_acquire(header, q * _HW + Q.H_TAIL)) for q in queues]
        done = list(tails)
        failed = [False] * len(queues)
        marks: list[list] = [[] for _ in queues]       # (tail, transport mark) not yet complete
        decoded = np.zeros((self.batch, P.VALIDATED_WORDS), dtype=np.uint64)
        errors = np.zeros((self.batch, 2), dtype=np.uint64)
        publish(control, P.C_RUNNING, np.uint64(1))
        while True:
            stop = int(read_acquire(control, P.C_STOP))
            if stop == P.STOP_NOW:
                break
            worked = False
            for i, q in enumerate(queues):
                n = int(take_commands(qs.ring, header, self.regions, q, my_rank, slots,
                                      np.uint64(tails[i]), self.batch, decoded, errors))
                if n == 0:
                    continue
                worked = True
                try:
                    self._execute(q, i, n, tails[i], decoded, errors, failed, control, stats)
                except P.ProxyError as error:      # transport failure: every queue fails
                    for j, qj in enumerate(queues):
                        if not failed[j]:
                            self._fail(qj, j, Q.E_TRANSPORT, error.detail, tails[j], failed,
                                       control, stats)
                tails[i] += n
                publish(header, q * _HW + Q.H_TAIL, np.uint64(tails[i]))
                marks[i].append((tails[i], transport.mark()))
                stats[P.S_COMMANDS] += np.uint64(n)
                stats[P.S_BATCHES] += np.uint64(1)
                stats[P.S_MAX_BATCH] = max(int(stats[P.S_MAX_BATCH]), n)
            if not all(failed):
                try:
                    transport.poll()
                except P.ProxyError as error:
                    for j, qj in enumerate(queues):
                        if not failed[j]:
                            self._fail(qj, j, Q.E_TRANSPORT, error.detail, tails[j], failed,
                                       control, stats)
            for i, q in enumerate(queues):
                while marks[i] and (failed[i] or transport.completed(marks[i][0][1])):
                    tail, _ = marks[i].pop(0)
                    if not failed[i] and tail != done[i]:
                        done[i] = tail
                        publish(header, q * _HW + Q.H_DONE, np.uint64(tail))
            if not worked:
                stats[P.S_IDLE] += np.uint64(1)
                settled = all(failed) or transport.idle
                if stop == P.STOP_DRAIN and settled and not any(marks):
                    break
                time.sleep(self.idle_sleep)

    def _execute(self, q, i, n, tail, decoded, errors, failed, control, stats):
        transport = self.transport
        pending = []        # (position, decoded row) of puts/signals not yet posted

        def flush():
            if pending:
                rows = [dict(opcode=int(v[P.V_OPCODE]), dst_rank=int(v[P.V_RANK]), row=v)
                        for v in pending]
                for peer, cmds in batch_commands(rows, transport.ranks).items():
                    transport.post_commands(peer, [c["row"] for c in cmds])
                    stats[P.S_TRANSPORT] += np.uint64(1)
                pending.clear()

        for k in range(n):
            ticket = tail + k
            if failed[i]:
                stats[P.S_DROPPED] += np.uint64(1)
                continue
            v = decoded[k].copy()
            code, detail = int(errors[k, 0]), int(errors[k, 1])
            if code == 0:
                code, detail = transport.refusal(v)
            opcode = int(v[P.V_OPCODE])
            if opcode in (Q.OP_FENCE, Q.OP_BARRIER):
                flush()
                transport.quiesce()
                if opcode == Q.OP_FENCE:
                    stats[P.S_FENCES] += np.uint64(1)
            if code != 0:
                flush()
                self._fail(q, i, code, detail, ticket, failed, control, stats)
                continue
            if opcode in (Q.OP_PUT, Q.OP_PUT_SIGNAL):
                stats[P.S_PUTS] += np.uint64(1)
                stats[P.S_BYTES] += v[P.V_BYTES]
                if opcode == Q.OP_PUT_SIGNAL:
                    stats[P.S_SIGNALS] += np.uint64(1)
                pending.append(v)
            elif opcode == Q.OP_SIGNAL:
                stats[P.S_SIGNALS] += np.uint64(1)
                pending.append(v)
            elif opcode == Q.OP_FENCE and v[P.V_SIGNAL]:
                transport.post_commands(int(v[P.V_RANK]), [v])
                stats[P.S_SIGNALS] += np.uint64(1)
            elif opcode == Q.OP_BARRIER:
                region = int(v[P.V_GREGION])
                for r in range(self.regions.shape[0]):
                    if self.regions[r, region, 3]:
                        transport.post_commands(r, [v])
                stats[P.S_BARRIERS] += np.uint64(1)
        flush()
