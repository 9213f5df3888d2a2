"""Ring buffers of the command queue, shared by the GPU (producer) and the host proxy.

The command layout, header words and region table are in :mod:`mkrt.proxy.layout`
(re-exported here).
"""

from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass

import numpy as np

from mkrt.proxy.layout import (  # noqa: F401  (the wire format, re-exported for the proxy side)
    OP_NOP, OP_PUT, OP_PUT_SIGNAL, OP_SIGNAL, OP_FENCE, OP_BARRIER, OPCODE_NAMES, NO_REGION,
    COMMAND_DTYPE, COMMAND_BYTES, COMMAND_WORDS, FIELDS, HEADER_WORDS, H_TAIL, H_DONE,
    H_ERROR, H_ERROR_TICKET, H_HOST_HEAD, H_REPLY, REPLY_WORDS, E_OPCODE, E_RANK, E_REGION,
    E_BOUNDS, E_ALIGN, E_TRANSPORT, E_STOPPED, ERROR_NAMES, REGION_DEVICE, REGION_HOST,
    REGION_WORDS, new_region_table, set_region, command_struct_source, QUEUE_DESC_DTYPE,
)


# ---- memory ----------------------------------------------------------------------------
class HostMemory:
    """Page-aligned, zeroed host memory: anonymous mmap, or a named shared segment."""

    def __init__(self, nbytes: int, *, shared_name: str | None = None, create: bool = True):
        if nbytes <= 0:
            raise ValueError(f"mkrt.proxy: host memory needs nbytes > 0; got {nbytes=}")
        self.nbytes = nbytes
        self._shm = None
        if shared_name is not None:
            from multiprocessing import shared_memory
            self._shm = shared_memory.SharedMemory(name=shared_name, create=create, size=nbytes)
            if create:
                # the creator unlinks; keep the resource tracker from doing it twice
                _untrack(self._shm)
            else:
                _untrack(self._shm)
            buffer = self._shm.buf
        else:
            self._map = mmap.mmap(-1, nbytes)
            buffer = self._map
        self.array = np.frombuffer(buffer, dtype=np.uint8, count=nbytes)
        self.address = self.array.ctypes.data
        self.name = shared_name

    def close(self, unlink: bool = False):
        self.array = None
        if self._shm is not None:
            try:
                self._shm.close()
            except BufferError:
                pass    # numpy views still alive: the mapping goes with them
            if unlink:
                self._shm.unlink()
            self._shm = None


def _untrack(shm):
    try:
        from multiprocessing import resource_tracker
        resource_tracker.unregister(shm._name, "shared_memory")
    except Exception:  # pragma: no cover - tracker internals differ across versions
        pass


class PinnedMemory:
    """cudaHostAlloc(mapped | portable) memory; under UVA its device address is its host address.

    ``cpus``: allocate while running on these CPUs, so the pages come from their NUMA node
    (:func:`mkrt.proxy.affinity.gpu_local_cpus`: the node of the GPU that polls them)."""

    def __init__(self, nbytes: int, cpus=None):
        import cupy
        from mkrt.proxy.affinity import running_on
        if nbytes <= 0:
            raise ValueError(f"mkrt.proxy: pinned memory needs nbytes > 0; got {nbytes=}")
        runtime = cupy.cuda.runtime
        self.nbytes = nbytes
        with running_on(cpus):
            self.address = runtime.hostAlloc(nbytes, runtime.hostAllocMapped | runtime.hostAllocPortable)
        # Under UVA (every 64-bit platform CUDA 12 supports) cudaHostAlloc memory has one
        # address on host and device.
        self.device_address = self.address
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(self.address))
        self.array[:] = 0

    def close(self, unlink: bool = False):
        if self.address:
            import cupy
            self.array = None
            cupy.cuda.runtime.freeHost(self.address)
            self.address = 0


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


@dataclass
class QueueViews:
    ring: np.ndarray       # flat u64: queues * slots * 8 words
    header: np.ndarray     # flat u64: queues * HEADER_WORDS
    commands: np.ndarray   # structured view (queues, slots) of COMMAND_DTYPE


class QueueSet:
    """`queues` rings of `slots` commands each, plus their headers, in one allocation.

    ``memory``: "host" (anonymous mmap, CPU tests), "shared" (a named shared segment other
    processes attach with ``attach=True``), or "pinned" (mapped pinned memory for GPUs).
    ``ranks[q]`` is the rank whose regions queue ``q``'s sources are (its producer).
    ``cpus`` (pinned): the CPUs whose NUMA node the memory comes from (see PinnedMemory).
    """

    def __init__(self, queues: int, slots: int, ranks, *, memory: str = "host",
                 shared_name: str | None = None, attach: bool = False, cpus=None):
        if queues < 1:
            raise ValueError(f"mkrt.proxy: a queue set needs queues >= 1; got {queues=}")
        if slots < 2 or slots & (slots - 1):
            raise ValueError(f"mkrt.proxy: slots must be a power of two >= 2; got {slots=}")
        ranks = np.asarray(list(ranks) if not np.isscalar(ranks) else [ranks] * queues,
                           dtype=np.int64)
        if ranks.shape != (queues,) or (ranks < 0).any():
            raise ValueError(f"mkrt.proxy: ranks must give one rank >= 0 per queue; "
                             f"got {ranks.tolist()} for {queues=}")
        self.queues, self.slots, self.ranks, self.memory_kind = queues, slots, ranks, memory
        header_bytes = _round_up(queues * HEADER_WORDS * 8, 4096)
        ring_bytes = queues * slots * COMMAND_BYTES
        total = header_bytes + ring_bytes
        if memory == "host":
            self.memory = HostMemory(total)
        elif memory == "shared":
            if not shared_name:
                raise ValueError("mkrt.proxy: memory='shared' needs shared_name")
            self.memory = HostMemory(total, shared_name=shared_name, create=not attach)
        elif memory == "pinned":
            self.memory = PinnedMemory(total, cpus=cpus)
        else:
            raise ValueError(f"mkrt.proxy: memory must be 'host', 'shared' or 'pinned'; got {memory=}")
        self.attached = attach
        words = self.memory.array.view(np.uint64)
        self.header = words[: queues * HEADER_WORDS]
        self.ring = words[header_bytes // 8: header_bytes // 8 + queues * slots * COMMAND_WORDS]
        self.commands = self.ring.view(COMMAND_DTYPE).reshape(queues, slots)
        self.header_address = self.memory.address
        self.ring_address = self.memory.address + header_bytes
        self._device = None

    # -- device descriptors (GPU producers) --
    def device_descriptors(self):
        """Per-queue ``mkrt::Queue`` descriptors in device memory (cupy u8 array), built once."""
        if self._device is None:
            import cupy
            if self.memory_kind != "pinned":
                raise ValueError(f"mkrt.proxy: GPU producers need memory='pinned'; "
                                 f"this set has memory={self.memory_kind!r}")
            counters = cupy.zeros(self.queues * 16, dtype=np.uint64)   # head, tail_cache on own lines
            desc = np.zeros(self.queues, dtype=QUEUE_DESC_DTYPE)
            base = self.memory.device_address
            header_off = 0
            ring_off = self.ring_address - self.memory.address
            for q in range(self.queues):
                desc[q]["ring"] = base + ring_off + q * self.slots * COMMAND_BYTES
                desc[q]["header"] = base + header_off + q * HEADER_WORDS * 8
                desc[q]["head"] = counters.data.ptr + q * 128
                desc[q]["tail_cache"] = counters.data.ptr + q * 128 + 64
                desc[q]["slots"] = self.slots
                desc[q]["rank"] = self.ranks[q]
            self._device = (counters, cupy.asarray(desc.view(np.uint8)))
        return self._device[1]

    def device_heads(self):
        """How many commands each queue's GPU producers have claimed.

        Read whole (no strided copy kernel) on a non-blocking stream of its own: after a
        timeout this diagnosis must not wait behind work still queued on the caller's or
        the proxy's streams (on the legacy stream it added 0.16 s to a 0.3 s timeout)."""
        import cupy
        self.device_descriptors()
        counters = self._device[0]
        with counters.device:
            stream = cupy.cuda.Stream(non_blocking=True)
            words = counters.get(stream=stream)
        return words.reshape(self.queues, 16)[:, 0]

    def reply_address(self, queue: int, index: int = 0) -> int:
        """Address (host = device under UVA) of reply word `index` of `queue`: register
        it as a host region for flags the proxy writes back to that queue's poster."""
        if not (0 <= queue < self.queues and 0 <= index < REPLY_WORDS):
            raise ValueError(f"mkrt.proxy: reply word ({queue=}, {index=}) outside "
                             f"{self.queues} queues x {REPLY_WORDS} words")
        return self.header_address + 8 * (queue * HEADER_WORDS + H_REPLY + index)

    def tail(self, queue: int) -> int:
        return int(self.header[queue * HEADER_WORDS + H_TAIL])

    def done(self, queue: int) -> int:
        return int(self.header[queue * HEADER_WORDS + H_DONE])

    def error(self, queue: int) -> int:
        return int(self.header[queue * HEADER_WORDS + H_ERROR])

    def close(self):
        self._device = None
        if self.memory is not None:
            self.memory.close(unlink=self.memory_kind == "shared" and not self.attached)
            self.memory = None
            self.ring = self.header = self.commands = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
