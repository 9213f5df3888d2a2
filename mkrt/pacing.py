"""How far the host may run ahead of the GPU where the proxy's traffic is GPU work.

Where nodes share a host (emulated worlds, or several nodes on one machine), what the proxy
sends between nodes is GPU work that its thread submits (a copy kernel, then a flag write
on its stream). When the host has queued many calls ahead of the GPU, the driver makes the
next submission wait for queue space, and the proxy's submissions wait too, while the
queued kernels wait for the proxy: nothing moves until their bounded waits give up
(measured on the emulated 2x2 world: the unfused ``gemm_allreduce``, back to back without
synchronisation, stalled after 118 to 545 calls; with the host waiting every 50 calls, it
did not: experiments/results/unfused_stall.jsonl).

So every op on such a world keeps at most :data:`IN_FLIGHT_CALLS` calls per GPU in flight:
after each call an event on the caller's stream, and before it the host waits for the
event recorded that many calls earlier (normally long complete: one query's cost). Calls
captured into a CUDA graph are not paced; replays of such graphs are the caller's to pace.
"""

from __future__ import annotations

from cupy_backends.cuda.api import runtime as _runtime

from mkrt.world import register_service

#: calls per GPU that may be queued and unfinished (the host then waits for the oldest)
IN_FLIGHT_CALLS = 16


class HostPacer:
    """A ring of events on one GPU: the host waits for the oldest before reusing it."""

    def __init__(self, device: int, depth: int = IN_FLIGHT_CALLS):
        import cupy
        with cupy.cuda.Device(device):
            self._events = [cupy.cuda.Event(disable_timing=True) for _ in range(depth)]
        self._pointers = [event.ptr for event in self._events]
        self.device, self.depth = device, depth
        self.calls = 0          # calls paced so far

    def after_call(self, stream_ptr: int) -> None:
        """Record this call's event on `stream_ptr` (the caller's stream, after the
        call's launches), first waiting for the one `depth` calls older."""
        if _runtime.streamIsCapturing(stream_ptr):    # not "none": a graph is being built
            return
        slot = self.calls % self.depth
        if self.calls >= self.depth:
            _runtime.eventSynchronize(self._pointers[slot])    # returns at once when done
        _runtime.eventRecord(self._pointers[slot], stream_ptr)
        self.calls += 1

    def close(self) -> None:
        """Called by ``world.close()`` (every world service has one)."""
        self._events, self._pointers = [], []


register_service("pacer", lambda world, device: HostPacer(device))
