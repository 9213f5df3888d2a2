"""A host-side producer: the GPU's posting protocol, compiled with Numba, for CPU tests.

Same protocol as ``mkrt/kernels/device/queue.py``: claim a ticket with an atomic add on
the queue's head, wait (bounded) until ``ticket < tail + slots`` or the queue's error word
is set, write words 1..7, release-store ``valid = ticket + 1``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from mkrt.proxy import queue as Q
from mkrt.proxy.atomics import fetch_add, load_acquire, spin_pause, store_release

_HW = Q.HEADER_WORDS
POST_OK = 0
POST_TIMEOUT = 1      # the ring stayed full for max_spins polls (dead proxy)
POST_ERROR = 2        # the proxy set the queue's error word


@njit(nogil=True, cache=False)
def post(ring, header, slots, q, words, max_spins):
    """Post one command (`words`: 8 u64, word 0 ignored) to queue `q`; POST_* code."""
    ticket = fetch_add(header, q * _HW + Q.H_HOST_HEAD, np.uint64(1))
    spins = 0
    while ticket - load_acquire(header, q * _HW + Q.H_TAIL) >= slots:
        if load_acquire(header, q * _HW + Q.H_ERROR) != np.uint64(0):
            return POST_ERROR
        spins += 1
        if spins > max_spins:
            return POST_TIMEOUT
        spin_pause()
    base = (np.uint64(q) * slots + (ticket & (slots - np.uint64(1)))) * np.uint64(8)
    for w in range(1, 8):
        ring[base + np.uint64(w)] = words[w]
    store_release(ring, base, ticket + np.uint64(1))
    return POST_OK


@njit(nogil=True, cache=False)
def post_many(ring, header, slots, q, commands, max_spins):
    """Post every row of `commands` ((n, 8) u64); returns how many were posted."""
    for i in range(commands.shape[0]):
        if post(ring, header, slots, q, commands[i], max_spins) != POST_OK:
            return i
    return commands.shape[0]


@njit(nogil=True, cache=False)
def wait_at_least(flags, index, expected, max_spins):
    """Spin (bounded) until flags[index] >= expected; True when it got there."""
    spins = 0
    while load_acquire(flags, index) < expected:
        spins += 1
        if spins > max_spins:
            return False
        spin_pause()
    return True


def command(opcode: int, *, dst_rank: int = 0, src_region: int = 0, dst_region: int = 0,
            src_offset: int = 0, dst_offset: int = 0, nbytes: int = 0, signal_region: int = Q.NO_REGION,
            signal_offset: int = 0, signal_value: int = 0) -> np.ndarray:
    """One command as 8 u64 words (word 0 left 0), through the structured dtype."""
    record = np.zeros(1, dtype=Q.COMMAND_DTYPE)
    record["opcode"] = opcode
    record["dst_rank"] = dst_rank
    record["src_region"] = src_region
    record["dst_region"] = dst_region
    record["src_offset"] = src_offset
    record["dst_offset"] = dst_offset
    record["bytes"] = nbytes
    record["signal_region"] = signal_region
    record["signal_offset"] = signal_offset
    record["signal_value"] = signal_value
    return record.view(np.uint64).copy()


def commands(records) -> np.ndarray:
    """An (n, 8) u64 array of commands from dicts of :func:`command` keywords."""
    return np.stack([command(**r) for r in records]) if records else np.zeros((0, 8), np.uint64)
