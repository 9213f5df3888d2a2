"""Ranks, nodes and GPUs: the real world under mpiexec, or an emulated one in one process.

A *rank* is one participant of a fused op; a *node* is a set of ranks that reach each
other's memory directly (peer pointers); ranks on different nodes talk only through the
proxy. Under ``mpiexec`` each process holds one rank and a node is a host (or every
``MKRT_WORLD_RANKS_PER_NODE`` ranks of it). ``mkrt.init(emulate="2x4")`` builds 2 nodes x
4 ranks inside this process on the visible GPUs, several ranks per GPU allowed, each with
its own stream and share of the SMs.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from dataclasses import dataclass, field

from mkrt import checks, envs
from mkrt.cuda import device_sm_count
from mkrt.errors import CommTimeout

log = logging.getLogger("mkrt.world")

_MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "PMI_RANK")


#: Appended to a CommTimeout when the proxy had issued every command (mkrt/DESIGN.md,
#: "Runtime hazards").
PROXY_STALL_HINT = (
    "; the proxy had issued every command posted to it, so if this flag is one the proxy "
    "writes, its GPU work (copy, flag write on the proxy's stream) did not run in time: "
    "where nodes share a host, a CUDA call of this process that waits for the device (a "
    "first cuBLAS call of a new shape, a memory allocation or free), or many CUDA graph "
    "replays queued ahead of the GPU, while a fused call is in flight hold that work back; "
    "call world.synchronize() before such calls and every few dozen replays. If the wait saw "
    "the launch before's value (seen = expected - 1), two launches of one op may also have "
    "overlapped: a CUDA graph replayed on a stream not ordered after an eager call of the "
    "same op, or replays on two unordered streams; order them (world.synchronize()) first")

@dataclass(frozen=True)
class RankInfo:
    rank: int
    node: int
    local_rank: int          # index inside its node
    device: int | None       # CUDA device ordinal in the process that holds the rank


@dataclass(eq=False)
class World:
    """Who is where. Ops take per-rank arguments in the order of ``world.local``."""

    ranks: tuple[RankInfo, ...]
    local: tuple[RankInfo, ...]            # the ranks this process holds
    emulated: bool
    comm: object = None                    # mpi4py communicator (None when emulated)
    node_comm: object = None               # ranks of this process's node
    host_comm: object = None               # ranks on this host (CUDA IPC reaches them all)
    hosts: tuple = ()                      # host index of every rank
    _streams: dict = field(default_factory=dict, repr=False)
    _services: dict = field(default_factory=dict, repr=False)   # (name, key) -> service
    _status_cache: list | None = field(default=None, repr=False)
    _regions: list = field(default_factory=list, repr=False)     # symmetric buffers (mkrt.memory)
    _closed: bool = False
    failures: int = 0                      # device-side failures raised so far

    # ---- layout ---------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def nodes(self) -> int:
        return 1 + max(r.node for r in self.ranks)

    def node_ranks(self, node: int) -> list[int]:
        return [r.rank for r in self.ranks if r.node == node]

    @property
    def ranks_per_node(self) -> int:
        sizes = {len(self.node_ranks(n)) for n in range(self.nodes)}
        if len(sizes) != 1:
            raise ValueError(f"mkrt.world: nodes have different sizes {sorted(sizes)}")
        return sizes.pop()

    def same_node(self, a: int, b: int) -> bool:
        return self.ranks[a].node == self.ranks[b].node

    def same_host(self, a: int, b: int) -> bool:
        """Whether this process can map `b`'s memory directly (emulated: always)."""
        return self.emulated or self.hosts[a] == self.hosts[b]

    @property
    def layout(self) -> str:
        try:
            return f"{self.nodes}x{self.ranks_per_node}"
        except ValueError:
            return "+".join(str(len(self.node_ranks(n))) for n in range(self.nodes))

    def ranks_on_device(self, device: int) -> list[RankInfo]:
        """Local ranks sharing `device` (they split its SMs)."""
        return [r for r in self.local if r.device == device]

    def device_slot(self, rank: int) -> int:
        """Index of `rank` among the local ranks on its device (its status-block slot)."""
        info = self.ranks[rank]
        return [r.rank for r in self.ranks_on_device(info.device)].index(rank)

    # ---- per-rank resources ---------------------------------------------------
    def _require_device(self, rank: int) -> int:
        device = self.ranks[rank].device
        if device is None:
            raise RuntimeError(f"mkrt.world: rank {rank} has no GPU (this machine has none); "
                               "only planning and compile-only work here")
        if self._closed:
            raise RuntimeError("mkrt.world: the world is closed")
        return device

    def stream(self, rank: int):
        """The CUDA stream every op of `rank` runs on (one per rank)."""
        import cupy
        if rank not in self._streams:
            with cupy.cuda.Device(self._require_device(rank)):
                self._streams[rank] = cupy.cuda.Stream(non_blocking=True)
        return self._streams[rank]

    def sm_count(self, rank: int) -> int:
        """SMs this rank may fill: the device's, split evenly among the ranks sharing it
        (in this process, or, under mpiexec, in other processes on the same host), less
        :data:`CE_COPY_SMS` when nodes share this host (their traffic is `ce` copies)."""
        device = self._require_device(rank)
        usable = device_sm_count(device) - (CE_COPY_SMS if self.copies_need_sms(rank) else 0)
        return max(1, usable // self.device_sharing(rank))

    def device_sharing(self, rank: int) -> int:
        """Ranks (`rank` included) that run on `rank`'s GPU: they split its SMs and its L2."""
        device = self.ranks[rank].device
        return max(1, sum(1 for r in self.ranks if r.device == device and self.same_host(rank, r.rank)))

    def copies_need_sms(self, rank: int) -> bool:
        """Whether `rank`'s traffic to other nodes is `ce` copies on this host: a
        device-to-device copy runs as an SM kernel, even with the driver's copy-engine
        hint, and cannot start while waiting CTAs hold every SM (measured:
        experiments/results/proxy.jsonl, case ce_64MiB_every_sm_held_*)."""
        return self.nodes > 1 and any(self.same_host(rank, r.rank) and r.node != self.ranks[rank].node
                                      for r in self.ranks)

    # ---- services the layers above provide (status blocks, the proxy) --------------
    def service(self, name: str, key=None):
        """The world's `name` service for `key`, made on first use by the factory that its
        module registered (:func:`register_service`): the world imports none of them."""
        found = self._services.get((name, key))
        if found is None:
            if name not in _SERVICE_FACTORIES:
                raise RuntimeError(f"mkrt.world: no {name!r} service is registered (import "
                                   f"{_SERVICE_MODULES.get(name, 'its module')} first)")
            found = self._services[(name, key)] = _SERVICE_FACTORIES[name](self, key)
            self._status_cache = None
            if name == "proxy":
                import atexit
                # Proxy threads must stop before CUDA and the interpreter go away.
                atexit.register(self._close_proxy)
        return found

    def _status_blocks(self) -> list:
        if self._status_cache is None:
            self._status_cache = [s for (name, _), s in self._services.items() if name == "status"]
        return self._status_cache

    def running_service(self, name: str, key=None):
        """The service if it has been started, else None (starts nothing)."""
        return self._services.get((name, key))

    def status(self, device: int):
        """The status block of `device` that bounded waits report into (mkrt/status.py)."""
        return self.service("status", device)

    def proxy(self):
        """The world's proxy service (queues, proxy threads, region table), started on
        first use; kernels that send between nodes post to it (mkrt/proxy/world.py)."""
        return self.service("proxy")

    def _close_proxy(self) -> None:
        proxy = self._services.pop(("proxy", None), None)
        if proxy is not None:
            proxy.close()

    def check(self, *, synchronize: bool = False) -> None:
        """Raise mkrt.CommTimeout if any device-side wait of this process's ranks gave up,
        or the proxy's error if one of its threads failed."""
        if synchronize:
            import cupy
            for device in sorted({r.device for r in self.local if r.device is not None}):
                cupy.cuda.Device(device).synchronize()
        proxy = self.running_service("proxy")
        if not synchronize:
            # The fast path of every call: one pinned word per GPU, then the proxy's words.
            for block in self._status_blocks():
                if block.host_word[0]:
                    break
            else:
                if proxy is not None:
                    self._check_proxy(proxy)
                return
        for block in list(self._status_blocks()):
            try:
                block.raise_if_failed(blocking=synchronize)
            except Exception as error:
                self.failures += 1
                if proxy is not None:
                    self._check_proxy(proxy)     # a proxy failure is the root cause: say so
                    if isinstance(error, CommTimeout) and self._proxy_stream_stalled(proxy):
                        error.args = (error.args[0] + PROXY_STALL_HINT,)
                    self._retire_proxy(proxy)
                raise
        if proxy is not None:
            self._check_proxy(proxy)

    def _check_proxy(self, proxy) -> None:
        """Raise the proxy's error, once, and retire the proxy that reported it."""
        try:
            proxy.check()
        except Exception as error:
            self.failures += 1
            self._retire_proxy(proxy)
            # The kernels that were waiting on the failed proxy gave up too, and wrote their
            # records: they belong to this failure, not to the next op's first check.
            drained = self._drain_status_blocks()
            if drained and not hasattr(error, "records"):
                error.records = tuple(drained)
            raise

    def _retire_proxy(self, proxy) -> None:
        """After a failure: stop the proxy (it may have lost commands, or its threads may be
        dead) once the GPUs are idle; the next op that needs one starts a new one, with every
        buffer registered again. Ops that used the old one refuse further calls (their
        epochs are out of step anyway)."""
        if self._services.get(("proxy", None)) is not proxy:
            return
        del self._services[("proxy", None)]
        self._status_cache = None
        try:
            import cupy
            for device in sorted({r.device for r in self.local if r.device is not None}):
                cupy.cuda.Device(device).synchronize()
            proxy.close()
        except Exception as error:     # noqa: BLE001 - the failure being raised says more
            log.warning("mkrt.world: while retiring the proxy after a failure: %s", error)

    def _drain_status_blocks(self) -> list:
        """Read and clear every status block (after the GPUs went idle); the records."""
        drained = []
        for block in list(self._status_blocks()):
            try:
                words = block.read()
                if words[0] or block.failed():
                    drained.extend(block.records())
                    block.reset()
            except Exception as error:     # noqa: BLE001 - the failure being raised says more
                log.warning("mkrt.world: while clearing a status block after a failure: %s", error)
        return drained

    @staticmethod
    def _proxy_stream_stalled(proxy) -> bool:
        """After a timeout: whether the proxy had issued every command (then what did not
        arrive was its GPU work, held back, not a command never posted or never taken)."""
        try:
            return proxy.caught_up()
        except Exception:          # noqa: BLE001 - only a hint; the timeout is the error
            return False

    def synchronize(self) -> None:
        """Wait for every local rank's stream, then raise device-side errors, if any."""
        self.check(synchronize=True)

    def barrier(self) -> None:
        """Host barrier across processes (a no-op in an emulated world)."""
        if self.comm is not None:
            self.comm.Barrier()

    def close(self) -> None:
        """Release streams and status blocks; the world cannot be used afterwards."""
        if self._closed:
            return
        for rank in list(self._streams):
            self._streams[rank].synchronize()
        self._streams.clear()
        self._close_proxy()
        for service in self._services.values():
            service.close()
        self._services.clear()
        self._status_cache = None
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        kind = "emulated" if self.emulated else "mpi"
        held = [r.rank for r in self.local]
        devices = sorted({r.device for r in self.local if r.device is not None})
        proxy = self._services.get(("proxy", None))
        transport = proxy.transport_name if proxy is not None else self.transport
        return (f"World({kind} {self.layout}, size={self.size}, local ranks={held}, "
                f"GPUs={devices}, proxy={transport})")

    @property
    def transport(self) -> str:
        """How nodes of this world talk ("ce" or "verbs"): ``MKRT_TRANSPORT``, where
        "auto" means verbs when nodes are on different hosts (mkrt/proxy/world.py)."""
        choice = envs.get("MKRT_TRANSPORT")
        if choice == "auto":
            choice = "verbs" if not self.emulated and len(set(self.hosts)) > 1 else "ce"
        return choice


#: name -> factory(world, key) of the services above this layer; registered on import
_SERVICE_FACTORIES: dict = {}
_SERVICE_MODULES = {"status": "mkrt.status", "proxy": "mkrt.proxy.world"}


def register_service(name: str, factory) -> None:
    """Let worlds make `name` services with `factory(world, key)` (called by mkrt.status,
    mkrt.pacing and mkrt.proxy.world when they are imported). A service must have
    ``close()``: ``world.close()`` calls it."""
    _SERVICE_FACTORIES[name] = factory


#: SMs per GPU that ranks leave free for the proxy's copy kernels when nodes share a host
CE_COPY_SMS = 4


#: the most ranks a world may have: a proxy command names its destination in 16 bits
MAX_WORLD_SIZE = 65535


def parse_layout(text: str) -> tuple[int, int]:
    if not isinstance(text, str):
        raise TypeError(f"mkrt.world: a layout is a str 'NxG', got {text!r} ({type(text).__name__})")
    match = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", text)
    if not match or int(match.group(1)) < 1 or int(match.group(2)) < 1:
        raise ValueError(f"mkrt.world: layout {text!r} is not 'NxG' (N nodes x G ranks per node, "
                         "both >= 1), e.g. '2x4'")
    nodes, per_node = int(match.group(1)), int(match.group(2))
    if nodes * per_node > MAX_WORLD_SIZE:
        raise ValueError(f"mkrt.world: layout {text!r} has {nodes * per_node} ranks; at most "
                         f"{MAX_WORLD_SIZE} (proxy commands address ranks in 16 bits)")
    return nodes, per_node


def _gpus_option(gpus) -> int:
    """``gpus=``: how many GPUs the world spreads its ranks over (0: none, planning only;
    at most the visible ones where there are any)."""
    return checks.integer(gpus, "gpus", "world", low=0, high=visible_gpus() or None)


def visible_gpus() -> int:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() if cupy.cuda.is_available() else 0
    except Exception:
        return 0


def emulated_world(layout: str, *, gpus: int | None = None) -> World:
    """N nodes x G ranks in this process; rank r runs on GPU r*gpus//size (blocks of ranks)."""
    nodes, per_node = parse_layout(layout)
    gpus = visible_gpus() if gpus is None else _gpus_option(gpus)
    size = nodes * per_node
    ranks = tuple(RankInfo(rank=r, node=r // per_node, local_rank=r % per_node,
                           device=(r * gpus // size) if gpus else None) for r in range(size))
    world = World(ranks=ranks, local=ranks, emulated=True)
    if gpus > 1:
        _enable_peer_access(sorted({r.device for r in ranks}))
    return world


def _enable_peer_access(devices: list[int]) -> None:
    import cupy
    for device in devices:
        with cupy.cuda.Device(device):
            for peer in devices:
                if peer == device:
                    continue
                if not cupy.cuda.runtime.deviceCanAccessPeer(device, peer):
                    raise RuntimeError(f"mkrt.world: GPU {device} cannot access GPU {peer} "
                                       "directly; ranks on them cannot share a node")
                try:
                    cupy.cuda.runtime.deviceEnablePeerAccess(peer)
                except cupy.cuda.runtime.CUDARuntimeError as error:
                    if "AlreadyEnabled" not in str(error) and "already" not in str(error).lower():
                        raise


def mpi_world(comm=None, *, ranks_per_node: int | None = None, gpus: int | None = None) -> World:
    """The real world: one rank per process, nodes from host names (or fixed-size groups)."""
    from mpi4py import MPI
    comm = comm if comm is not None else MPI.COMM_WORLD
    if not all(hasattr(comm, name) for name in ("Get_rank", "Get_size", "allgather", "Barrier")):
        raise TypeError(f"mkrt.world: comm= must be an MPI communicator (mpi4py), got "
                        f"{type(comm).__name__}")
    gpus = None if gpus is None else _gpus_option(gpus)
    rank, size = comm.Get_rank(), comm.Get_size()
    hosts = comm.allgather(socket.gethostname())
    # A node is a host, in order of first appearance; its ranks keep world order.
    host_order = list(dict.fromkeys(hosts))
    host_local = [hosts[:r].count(hosts[r]) for r in range(size)]
    ranks_per_node = envs.get("MKRT_WORLD_RANKS_PER_NODE") if ranks_per_node is None else ranks_per_node
    gpus = visible_gpus() if gpus is None else gpus
    infos = []
    node_of_group: dict[tuple[int, int], int] = {}
    for r in range(size):
        host = host_order.index(hosts[r])
        group = host_local[r] // ranks_per_node if ranks_per_node else 0
        node = node_of_group.setdefault((host, group), len(node_of_group))
        infos.append((r, node, host_local[r]))
    ranks = []
    for r, node, on_host in infos:
        local_rank = sum(1 for q, n, _ in infos[:r] if n == node)
        # Every process sees all GPUs of its host: the host-local index picks one.
        device = (on_host % gpus) if gpus else None
        ranks.append(RankInfo(rank=r, node=node, local_rank=local_rank, device=device))
    node_comm = comm.Split(color=ranks[rank].node, key=rank)
    host_comm = comm.Split(color=host_order.index(hosts[rank]), key=rank)
    world = World(ranks=tuple(ranks), local=(ranks[rank],), emulated=False, comm=comm,
                  node_comm=node_comm, host_comm=host_comm,
                  hosts=tuple(host_order.index(h) for h in hosts))
    if gpus and visible_gpus():
        import cupy
        cupy.cuda.Device(ranks[rank].device).use()
    return world


def under_mpiexec() -> bool:
    return any(name in os.environ for name in _MPI_ENV)


_WORLD: World | None = None


def init(emulate: str | None = None, *, comm=None, gpus: int | None = None) -> World:
    """Build the world and make it the default for ops called without ``world=``.

    - ``init(emulate="NxG")``: N nodes x G ranks in this process.
    - ``init()`` under mpiexec (or with ``comm=``): one rank per process.
    - ``init()`` otherwise: ``MKRT_EMULATE`` or 1 node x every visible GPU (at least 1 rank).
    """
    global _WORLD
    if emulate is not None and comm is not None:
        raise ValueError("mkrt.world: give emulate= or comm=, not both")
    if emulate is None and (comm is not None or under_mpiexec()):
        world = mpi_world(comm, gpus=gpus)
    else:
        layout = emulate or envs.get("MKRT_EMULATE") or f"1x{max(1, visible_gpus())}"
        world = emulated_world(layout, gpus=gpus)
    _WORLD = world
    log.info("%s", world)
    return world


def current_world() -> World:
    if _WORLD is None:
        raise RuntimeError("mkrt.world: no world yet; call mkrt.init() (or pass world=)")
    return _WORLD
