"""The one interface every transport gives the compiled proxy loop.

A transport hands the loop four ``@njit(nogil=True)`` functions over its own state (a
u64 numpy array the loop passes back on every call):

  put(state, dst_address, src_address, nbytes, dst_kind) -> int   0 or an error code
  signal(state, address, value, kind) -> int                      ordered after earlier puts
  progress(state, idle) -> int        1: all issued work complete, 0: not yet, < 0: -error
  quiesce(state) -> int               wait until all issued work is complete; 0 or error

Delivery must be in order per proxy thread: a signal lands after every put issued before
it (the destination reads data once it sees the flag). ``kind`` is the region kind
(0 device, 1 host) of the address.
"""

from __future__ import annotations


class TransportUnavailable(RuntimeError):
    """A transport cannot run here (no GPU driver, no RDMA device, no pyverbs); says why."""


class Transport:
    name = "?"

    def ops(self):
        raise NotImplementedError

    def thread_state(self, thread: int):
        """The u64 state array of proxy thread `thread` (each thread has its own)."""
        import numpy as np
        return np.zeros(8, dtype=np.uint64)

    def thread_setup(self):
        """Runs in each proxy thread before its loop (e.g. make a CUDA context current)."""

    def close(self):
        """Release resources; the proxy threads have ended."""
