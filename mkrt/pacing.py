"""How far the host may run ahead of the GPU where the proxy's traffic is GPU work.

Where nodes share a host (emulated worlds, or several nodes on one machine), what the proxy
sends between nodes is GPU work that its thread submits (a copy kernel, then a flag write
on its stream). When the host has queued many calls ahead of the GPU, the proxy's
submissions are held back (our reading: the driver makes submissions wait for queue
space, the proxy's too) while the queued kernels wait for the proxy, and nothing moves
until their bounded waits give up (measured on the emulated 2x2 world: the unfused ``gemm_allreduce``, back to back without
synchronisation, stalled after 118 to 545 calls; with the host waiting every 50 calls, it
did not: experiments/results/unfused_stall.jsonl).

So every op on such a world keeps at most :data:`IN_FLIGHT_CALLS` calls per GPU in flight:
every :data:`PACE_STRIDE` calls an event on the caller's stream, and before it the host
waits for the event recorded :data:`IN_FLIGHT_CALLS` calls earlier (normally long
complete). The other calls pay one counter increment. Calls captured into a CUDA graph
are not paced; replays of such graphs are the caller's to pace.
"""

from __future__ import annotations

from cupy_backends.cuda.api import runtime as _runtime

from mkrt.world import register_service

#: calls per GPU that may be queued and unfinished (the host then waits for the oldest)
IN_FLIGHT_CALLS = 32
#: calls between two pacing events (the others cost no runtime call)
PACE_STRIDE = 8


class HostPacer:
    """A ring of events on one GPU, one every `stride` calls: the host waits for the
    oldest before reusing it."""

    def __init__(self, device: int, depth: int = IN_FLIGHT_CALLS, stride: int = PACE_STRIDE):
        import cupy
        self.device, self.stride = device, stride
        slots = max(1, depth // stride)
        with cupy.cuda.Device(device):
            self._events = [cupy.cuda.Event(disable_timing=True) for _ in range(slots)]
        self._pointers = [event.ptr for event in self._events]
        self.calls = 0          # calls seen
        self.recorded = 0       # events recorded

    def after_call(self, stream_ptr: int) -> None:
        """Count a call; every `stride` calls, record an event on `stream_ptr` (the
        caller's stream, after the call's launches), first waiting for the event recorded
        `depth` calls earlier."""
        self.calls += 1
        if self.calls % self.stride:
            return
        if _runtime.streamIsCapturing(stream_ptr):    # not "none": a graph is being built
            return
        slot = self.recorded % len(self._pointers)
        if self.recorded >= len(self._pointers):
            _runtime.eventSynchronize(self._pointers[slot])    # returns at once when done
        _runtime.eventRecord(self._pointers[slot], stream_ptr)
        self.recorded += 1

    def close(self) -> None:
        """Called by ``world.close()`` (every world service has one)."""
        self._events, self._pointers = [], []


register_service("pacer", lambda world, device: HostPacer(device))
