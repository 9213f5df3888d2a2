"""`host` transport: the proxy copies with memmove and signals with a release store.

Every address in the region table is a host address: numpy/mmap memory for threads,
a shared-memory segment mapped into this process for other processes (the region table
of a process holds the addresses at which *it* maps each peer's segment), or pinned
mapped memory (whose host and device addresses agree under UVA). Work is synchronous,
so a command is complete when the call returns.
"""

from __future__ import annotations

from numba import njit

from mkrt.proxy.atomics import copy_bytes, demote_line_at, store_release_at
from mkrt.proxy.transports.base import Transport


@njit(nogil=True, cache=False)
def _put(state, dst, src, nbytes, dst_kind):
    copy_bytes(dst, src, nbytes)
    return 0


@njit(nogil=True, cache=False)
def _signal(state, address, value, kind):
    store_release_at(address, value)
    return 0


@njit(nogil=True, cache=False)
def _signal_demoted(state, address, value, kind):
    store_release_at(address, value)
    state[0] = address          # demoted once the batch is done (_progress_demoting)
    return 0


@njit(nogil=True, cache=False)
def _progress(state, idle):
    return 1


@njit(nogil=True, cache=False)
def _progress_demoting(state, idle):
    """After a batch: demote the line of its last signal (the one a poster is most likely
    waiting for); one cldemote per batch, so a stream of signals to the same lines keeps
    them in this core's cache."""
    if state[0] != 0:
        demote_line_at(state[0])
        state[0] = 0
    return 1


@njit(nogil=True, cache=False)
def _quiesce(state):
    return 0


class HostTransport(Transport):
    """``demote_signals``: after a batch, push the line of its last flag out of the proxy
    core's caches (``cldemote`` where the CPU has it), so the GPU's read of that flag need
    not snoop the core: about 0.1 us off a 3.2 us round trip on the H200 machines
    (experiments/notes/proxy.md)."""
    name = "host"

    def __init__(self, demote_signals: bool = True):
        self.demote_signals = demote_signals

    def ops(self):
        if self.demote_signals:
            return _put, _signal_demoted, _progress_demoting, _quiesce
        return _put, _signal, _progress, _quiesce
