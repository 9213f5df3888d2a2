"""Symmetric memory: the same-size allocation on every rank, and pointers to peers' copies.

Inside a node a rank reaches its peers' copies directly: in an emulated world through
plain device pointers (peer access enabled between GPUs), under mpiexec through CUDA IPC
handles exchanged over the node's communicator. Every buffer is also a *region* with a
world-wide id, so transports address memory as (rank, region, offset).

Flags are symmetric buffers of u64 that only ever grow (epochs): they are zeroed once at
allocation and never reset between calls.
"""

from __future__ import annotations

import numpy as np

from mkrt.world import World


class SymmetricBuffer:
    """`nbytes` bytes on every rank of `world`; this process owns its local ranks' copies."""

    def __init__(self, world: World, nbytes: int, *, name: str = "buffer", zero: bool = True):
        import cupy
        if nbytes <= 0:
            raise ValueError(f"mkrt.memory: symmetric buffer {name!r} needs nbytes > 0, got {nbytes}")
        self.world, self.nbytes, self.name = world, int(nbytes), name
        runtime = cupy.cuda.runtime
        self._own: dict[int, int] = {}        # rank -> pointer this process allocated
        self._opened: dict[tuple[int, int], int] = {}   # (holder device, peer) -> IPC pointer
        for info in world.local:
            with cupy.cuda.Device(world._require_device(info.rank)):
                ptr = runtime.malloc(self.nbytes)
                if zero:
                    runtime.memset(ptr, 0, self.nbytes)
                self._own[info.rank] = ptr
        if not world.emulated:
            self._exchange_handles()
        regions = world._regions
        self.region = len(regions)
        regions.append(self)
        proxy = world.running_service("proxy")
        if proxy is not None:
            proxy.register(self)
        self._tables: dict[int, object] = {}
        self._closed = False

    def _exchange_handles(self) -> None:
        """Open every copy on this host: node peers for kernels, the rest for the proxy
        (nodes split out of one host talk through the `ce` transport)."""
        import cupy
        runtime = cupy.cuda.runtime
        (me,) = self.world.local
        handle = runtime.ipcGetMemHandle(self._own[me.rank])
        handles = self.world.host_comm.allgather((me.rank, handle))
        with cupy.cuda.Device(me.device):
            for peer, peer_handle in handles:
                if peer != me.rank:
                    self._opened[(me.device, peer)] = runtime.ipcOpenMemHandle(
                        peer_handle, runtime.cudaIpcMemLazyEnablePeerAccess)

    # ---- addressing -----------------------------------------------------------
    def local_ptr(self, rank: int) -> int:
        try:
            return self._own[rank]
        except KeyError:
            raise ValueError(f"mkrt.memory: rank {rank} is not held by this process "
                             f"(local ranks: {sorted(self._own)})") from None

    def peer_ptr(self, rank: int, peer: int) -> int:
        """Pointer, valid on `rank`'s device, to `peer`'s copy; both in one node."""
        self.local_ptr(rank)
        if not self.world.same_node(rank, peer):
            raise ValueError(f"mkrt.memory: rank {peer} is on node {self.world.ranks[peer].node}, "
                             f"not on rank {rank}'s node {self.world.ranks[rank].node}; "
                             "reach it through the proxy")
        if peer in self._own:
            return self._own[peer]
        return self._opened[(self.world.ranks[rank].device, peer)]

    def peer_table(self, rank: int):
        """Device array (u64) on `rank`'s GPU: pointer to each node peer's copy, by local rank."""
        import cupy
        if rank not in self._tables:
            node = self.world.ranks[rank].node
            pointers = [self.peer_ptr(rank, peer) for peer in self.world.node_ranks(node)]
            with cupy.cuda.Device(self.world.ranks[rank].device):
                self._tables[rank] = cupy.asarray(np.array(pointers, dtype=np.uint64))
        return self._tables[rank]

    def view(self, rank: int, dtype, shape, offset: int = 0):
        """A CuPy array over `rank`'s copy (no copy made)."""
        import cupy
        dtype = np.dtype(dtype)
        count = int(np.prod(shape))
        if offset < 0 or offset + count * dtype.itemsize > self.nbytes:
            raise ValueError(f"mkrt.memory: view {shape} {dtype} at {offset=} exceeds "
                             f"{self.name!r} of {self.nbytes} bytes")
        memory = cupy.cuda.UnownedMemory(self.local_ptr(rank), self.nbytes, self,
                                         device_id=self.world.ranks[rank].device)
        return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, offset))

    def host_pointers(self) -> dict[int, int]:
        """rank -> pointer valid in this process, for every copy this process can map."""
        out = dict(self._own)
        for (device, peer), pointer in self._opened.items():
            out[peer] = pointer
        return out

    def address(self, rank: int, offset: int) -> tuple[int, int, int]:
        """(rank, region, offset) as transports name it, checked against the size."""
        if not 0 <= offset < self.nbytes:
            raise ValueError(f"mkrt.memory: {offset=} outside {self.name!r} ({self.nbytes} bytes)")
        return rank, self.region, offset

    # ---- lifetime -------------------------------------------------------------
    def close(self) -> None:
        """Free this process's copies (collective under mpiexec: peers stop using them first)."""
        import cupy
        if self._closed:
            return
        self._closed = True
        runtime = cupy.cuda.runtime
        for info in self.world.local:
            if info.device is not None:
                cupy.cuda.Device(info.device).synchronize()
        self.world.barrier()
        for (device, _), ptr in self._opened.items():
            with cupy.cuda.Device(device):
                runtime.ipcCloseMemHandle(ptr)
        self.world.barrier()
        for rank, ptr in self._own.items():
            with cupy.cuda.Device(self.world.ranks[rank].device):
                runtime.free(ptr)
        self._own.clear()
        self._opened.clear()
        self._tables.clear()
        regions = self.world._regions
        if self.region < len(regions):
            regions[self.region] = None
        proxy = self.world.running_service("proxy")
        if proxy is not None:
            proxy.unregister(self)


def flags(world: World, count: int, *, name: str = "flags") -> SymmetricBuffer:
    """`count` u64 epoch flags per rank, zeroed once."""
    return SymmetricBuffer(world, 8 * count, name=name, zero=True)


def region_table(world: World) -> np.ndarray:
    """(rank, region) -> (pointer, size) for the proxy; pointer 0 where this process has none."""
    regions = world._regions
    table = np.zeros((world.size, max(1, len(regions)), 2), dtype=np.uint64)
    for region, buffer in enumerate(regions):
        if buffer is None:
            continue
        for rank, ptr in buffer._own.items():
            table[rank, region] = (ptr, buffer.nbytes)
    return table
