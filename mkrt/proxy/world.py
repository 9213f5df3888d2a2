"""The proxy service of a world: queues, proxy threads and the region table, per GPU.

``MKRT_TRANSPORT`` chooses the service (:func:`new_world_proxy`). The `ce` transport
copies between any two pieces of memory this process can address:
in an emulated world every rank's (one process), under mpiexec every rank's on this
host (CUDA IPC). That is how emulated nodes, and nodes split out of one host with
MKRT_WORLD_RANKS_PER_NODE, talk. Each local rank gets its own queue (its kernels post
there); every symmetric buffer of the world is registered as a region
(``buffer.region``) as soon as it exists. Nodes on other hosts need `verbs`
(mkrt/proxy/verbs_world.py).
"""

from __future__ import annotations

from mkrt.errors import MkrtError
from mkrt.proxy import queue as Q
from mkrt.world import register_service

MAX_REGIONS = 4096


class ProxyService:
    """What every world proxy service shares: ``proxies`` and ``queue_sets`` (dicts) and
    the checks over them."""

    proxies: dict
    queue_sets: dict

    def caught_up(self) -> bool:
        """Whether every command the kernels claimed was taken and issued by the proxy
        (reads the queues' device heads: call it when the GPU is idle)."""
        for queue_set in self.queue_sets.values():
            heads = queue_set.device_heads()
            for q in range(queue_set.queues):
                if not int(heads[q]) == queue_set.tail(q) == queue_set.done(q):
                    return False
        return True

    def register_existing(self) -> None:
        """Register the world's symmetric buffers made before this service."""
        for buffer in self.world._regions:
            if buffer is not None:
                self.register(buffer)

    def check(self) -> None:
        """Raise the first error a proxy thread reported (mkrt.proxy.ProxyError)."""
        for proxy in self.proxies.values():
            proxy.check()


class WorldProxy(ProxyService):
    transport_name = "ce"

    def __init__(self, world, *, slots: int = 1024, threads_per_gpu: int = 1):
        """``threads_per_gpu``: proxy threads per GPU. One is the default: with one per
        rank (4 on one H200, 2 MiB puts) a 2x2 gemm_allreduce run ended in CommTimeout
        (experiments/results/gemm_allreduce_v5_timeout.log). Likely cause, since measured:
        device-to-device copies are SM kernels, and its 4 x 33 CTAs held all 132 SMs;
        worlds like it now leave mkrt.world.CE_COPY_SMS free (experiments/notes/proxy.md).
        Not yet re-run with more threads."""
        from mkrt.proxy.affinity import gpu_local_cpus
        from mkrt.proxy.proxy import Proxy
        from mkrt.proxy.transports.ce import CopyEngineTransport
        if not world.emulated and len(set(world.hosts)) > 1:
            raise MkrtError("mkrt.proxy: the `ce` transport copies between GPUs of one host; "
                            "nodes on different hosts need MKRT_TRANSPORT=verbs (or auto)")
        self.world = world
        _check_connections(world, threads_per_gpu)
        self.regions = Q.new_region_table(world.size, MAX_REGIONS)
        self.queue_sets: dict[int, Q.QueueSet] = {}
        self.proxies = {}
        self._queue_index: dict[int, tuple[int, int]] = {}
        try:
            for device in sorted({r.device for r in world.local}):
                ranks = [r.rank for r in world.ranks_on_device(device)]
                cpus = gpu_local_cpus(device)    # the proxy's PCIe traffic stays on one node
                queue_set = Q.QueueSet(len(ranks), slots, ranks, memory="pinned", cpus=cpus)
                self.queue_sets[device] = queue_set
                for index, rank in enumerate(ranks):
                    self._queue_index[rank] = (device, index)
                threads = min(threads_per_gpu, len(ranks))
                self.proxies[device] = Proxy(queue_set, self.regions, CopyEngineTransport(device),
                                             threads=threads, cpus=cpus)
            self.register_existing()
        except BaseException:
            self.close()
            raise

    def register(self, buffer) -> None:
        """Make `buffer`'s copies addressable as (rank, buffer.region, offset)."""
        if buffer.region >= MAX_REGIONS:
            raise ValueError(f"mkrt.proxy: region {buffer.region} exceeds the table's {MAX_REGIONS}")
        for rank, pointer in buffer.host_pointers().items():
            Q.set_region(self.regions, rank, buffer.region, pointer, buffer.nbytes)

    def unregister(self, buffer) -> None:
        if buffer.region < MAX_REGIONS:
            self.regions[:, buffer.region] = 0

    def queue_pointer(self, rank: int) -> int:
        """Device address of `rank`'s ``mkrt::Queue`` descriptor."""
        device, index = self._queue_index[rank]
        descriptors = self.queue_sets[device].device_descriptors()
        return descriptors.data.ptr + index * Q.QUEUE_DESC_DTYPE.itemsize

    def close(self) -> None:
        errors = close_proxies(self.proxies, self.queue_sets)
        if errors:
            raise errors[0]


def close_proxies(proxies: dict, queue_sets: dict) -> list:
    """Close every proxy, then every queue set (both dicts emptied); the errors raised."""
    errors = []
    for proxy in proxies.values():
        try:
            proxy.close()
        except Exception as error:   # close every proxy, then report
            errors.append(error)
    proxies.clear()
    for queue_set in queue_sets.values():
        queue_set.close()
    queue_sets.clear()
    return errors



def _check_connections(world, threads_per_gpu: int) -> None:
    """Refuse a hardware-queue setting under which proxy copies can queue behind kernels."""
    import os
    value = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if value is None:
        return
    busiest = max(len(world.ranks_on_device(r.device)) for r in world.local)
    needed = busiest + min(threads_per_gpu, busiest) + 2     # ranks, proxies, caller, reader
    if int(value) < needed:
        raise ValueError(
            f"mkrt.proxy: CUDA_DEVICE_MAX_CONNECTIONS={value} but this world needs {needed} "
            "hardware queues per GPU (rank streams, proxy streams, the caller's); with fewer, "
            "a proxy's copy can wait behind a kernel that waits for it. Unset it (mkrt sets "
            "32 when imported before CUDA starts) or raise it")


def new_world_proxy(world):
    """The proxy service ``MKRT_TRANSPORT`` asks for: `ce` (:class:`WorldProxy`), `verbs`
    (:class:`mkrt.proxy.verbs_world.VerbsWorldProxy`), or `auto`: verbs when nodes are on
    different hosts, else ce."""
    if world.transport == "verbs":
        from mkrt.proxy.verbs_world import VerbsWorldProxy
        return VerbsWorldProxy(world)
    return WorldProxy(world)


register_service("proxy", lambda world, key: new_world_proxy(world))
