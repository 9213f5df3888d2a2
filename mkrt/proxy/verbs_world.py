"""The proxy service of a world whose nodes talk through verbs (``MKRT_TRANSPORT=verbs``).

Per local rank: a :class:`~mkrt.proxy.transports.verbs.VerbsTransport` (an RC queue pair
to every rank, the rank's staging memory registered), one queue its kernels post to, and
a :class:`~mkrt.proxy.verbs_loop.CompiledVerbsProxy` thread serving it. Every symmetric
buffer is registered with the NIC when it is made, as each rank's region, and its (base,
size, rkey) told to every rank, so kernels name memory as (rank, region, offset) exactly
as with the `ce` transport.

``MKRT_VERBS_PROVIDER=loopback`` puts mkrt's stand-in NIC behind the same ABI
(:mod:`mkrt.proxy.transports.loopback_nic`): its queue pairs copy with ``cuMemcpy``, so
an emulated world (every rank in this process) runs the whole verbs path, from the GPU's
commands through work requests and completions, without RDMA hardware;
``loopback_efa`` makes it an EFA SRD endpoint. On EFA (a device or that stand-in) the
sender writes every flag as a WRITE of its own once the data before it has completed
(``efa_flags="direct"``): a world's flags are GPU memory in many regions.
``MKRT_VERBS_PROVIDER=device`` opens an RDMA device through pyverbs.

Connection data is exchanged in the process when it holds every rank, else over the
world's MPI communicator (one rank per process).
"""

from __future__ import annotations

from mkrt import envs
from mkrt.errors import MkrtError
from mkrt.proxy import queue as Q
from mkrt.proxy.world import ProxyService, close_proxies

MAX_REGIONS = 4096


def nic_for_gpu(device: int) -> str | None:
    """The RDMA device ``MKRT_VERBS_DEVICES`` names for GPU `device` (None: the first)."""
    names = [n.strip() for n in envs.get("MKRT_VERBS_DEVICES").split(",") if n.strip()]
    if not names:
        return None
    return names[0] if len(names) == 1 else names[device % len(names)]


class VerbsWorldProxy(ProxyService):
    def __init__(self, world, *, slots: int = 1024, sq_depth: int = 256, signal_every: int = 32,
                 timeout: float = 30.0):
        from mkrt.proxy.affinity import gpu_local_cpus
        from mkrt.proxy.transports.verbs import PyverbsBackend, VerbsTransport
        from mkrt.proxy.verbs_loop import CompiledVerbsProxy
        self.world = world
        self.provider = envs.get("MKRT_VERBS_PROVIDER")
        everyone_here = len(world.local) == world.size
        if not everyone_here and len(world.local) != 1:
            raise MkrtError("mkrt.proxy: verbs across processes needs one rank per process")
        loopback = self.provider in ("loopback", "loopback_efa")
        if loopback and not everyone_here:
            me = world.local[0].rank
            others = [r.rank for r in world.ranks if not world.same_host(me, r.rank)]
            if others:
                raise MkrtError("mkrt.proxy: MKRT_VERBS_PROVIDER=loopback reaches ranks of this "
                                f"host only; ranks {others} are on other hosts")
        self.transports = {}
        self.queue_sets: dict[int, Q.QueueSet] = {}
        self.proxies = {}
        fabric = None
        if loopback:
            from mkrt.proxy.transports.loopback_nic import LoopbackFabric
            # one process: every rank shares owner 0; processes: each registers as its
            # rank and aliases its peers' registrations onto its IPC mappings of them
            fabric = LoopbackFabric(owners=1 if everyone_here else world.size,
                                    per_owner=16384 if everyone_here else 4096)
        self.fabric = fabric
        try:
            for info in world.local:
                if fabric is not None:
                    from mkrt.proxy.transports.loopback_nic import LoopbackBackend
                    backend = LoopbackBackend(fabric, info.rank, device=info.device,
                                              efa=self.provider == "loopback_efa")
                else:
                    backend = PyverbsBackend()
                self.transports[info.rank] = VerbsTransport(
                    info.rank, world.size, MAX_REGIONS, backend=backend, sq_depth=sq_depth,
                    signal_every=signal_every, timeout=timeout, efa_flags="direct",
                    device_name=None if fabric is not None else nic_for_gpu(info.device))
            self._connect()
            for info in world.local:
                transport = self.transports[info.rank]
                cpus = gpu_local_cpus(info.device)
                queue_set = Q.QueueSet(1, slots, [info.rank], memory="pinned", cpus=cpus)
                self.queue_sets[info.rank] = queue_set
                self.proxies[info.rank] = CompiledVerbsProxy(queue_set, transport.regions, transport)
            self.register_existing()
        except BaseException:
            self.close()
            raise

    def _connect(self) -> None:
        if len(self.transports) == self.world.size:
            sent = {rank: t.connection_data() for rank, t in self.transports.items()}
            for rank, t in self.transports.items():
                t.complete([sent[peer][rank] for peer in range(self.world.size)])
        else:
            (transport,) = self.transports.values()
            transport.connect(self.world.comm)

    def __repr__(self) -> str:
        return f"VerbsWorldProxy(provider={self.provider}, ranks={sorted(self.transports)})"

    @property
    def transport_name(self) -> str:
        """What ``repr(world)`` says: verbs, over which provider."""
        return "verbs" if self.provider == "device" else f"verbs ({self.provider} NIC)"

    def register(self, buffer) -> None:
        """Register `buffer`'s copy of every local rank with its NIC and tell every rank
        (collective where ranks live in several processes, as buffer creation is)."""
        if buffer.region >= MAX_REGIONS:
            raise ValueError(f"mkrt.proxy: region {buffer.region} exceeds the table's {MAX_REGIONS}")
        pointers = buffer.host_pointers()
        mine = []
        for rank, transport in self.transports.items():
            dmabuf = {}
            if self.provider == "device":
                from mkrt.proxy.transports.base import TransportUnavailable
                from mkrt.proxy.transports.verbs import cuda_dmabuf_fd
                try:
                    fd, offset = cuda_dmabuf_fd(pointers[rank], buffer.nbytes)
                    dmabuf = dict(dmabuf_fd=fd, dmabuf_offset=offset)
                except TransportUnavailable:
                    pass                   # plain ibv_reg_mr: needs the peer-memory module
            reg = transport.register_region(buffer.region, pointers[rank], buffer.nbytes,
                                            late=True, **dmabuf)
            mine.append((rank, reg.base, buffer.nbytes, reg.rkey))
        every = mine
        if len(self.transports) != self.world.size:
            every = [row for rows in self.world.comm.allgather(mine) for row in rows]
            if self.fabric is not None:
                for rank, base, size, rkey in every:
                    if rank not in self.transports:        # a peer process's copy, as mapped here
                        self.fabric.alias(rkey, base, pointers[rank], size)
        for transport in self.transports.values():
            for rank, base, size, rkey in every:
                transport.set_remote_region(rank, buffer.region, base, size, rkey)

    def unregister(self, buffer) -> None:
        if buffer.region >= MAX_REGIONS:
            return
        if self.fabric is not None and len(self.transports) != self.world.size:
            (transport,) = self.transports.values()
            for rank in range(self.world.size):
                key = int(transport.rkeys[rank, buffer.region])
                if rank not in self.transports and key:
                    self.fabric.deregister(key)          # the alias of a peer's copy
        for transport in self.transports.values():
            transport.unregister_region(buffer.region)

    def queue_pointer(self, rank: int) -> int:
        """Device address of `rank`'s ``mkrt::Queue`` descriptor."""
        return self.queue_sets[rank].device_descriptors().data.ptr

    def close(self) -> None:
        errors = close_proxies(self.proxies, self.queue_sets)
        for transport in self.transports.values():
            transport.close()
        self.transports.clear()
        if errors:
            raise errors[0]
