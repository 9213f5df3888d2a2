"""What the ops share whose kernels gather one block per rank with the shared gathering
role (kernels/device/gather.py, ``gather_role``): AllGather+GEMM gathers A, ring
attention K and V. The flag layout, the checks of the world and the role split, the
gathered buffer and flags, and the kernel arguments the role reads."""

from __future__ import annotations

import dataclasses

from mkrt import checks
from mkrt.controller.board import Board
from mkrt.kernels.op import Op
from mkrt.memory import SymmetricBuffer, flags as flag_buffer

#: most ranks per node (the role keeps peer targets in shared memory)
MAX_NODE_RANKS = 32
#: chunk flags per block (the device's GATHER_MAX_CHUNKS): blocks are spread in chunks so
#: the compute role can start on a block's first rows before its last have arrived
GATHER_MAX_CHUNKS = 64


@dataclasses.dataclass(frozen=True)
class FlagLayout:
    """Index of every flag word of a rank (mirrors the device's struct GatheredFlags)."""

    G: int
    N: int

    def arrive(self, p): return p
    def node_arrive(self, n): return self.G + n
    def ready(self, b): return self.G + self.N + b
    def pushed(self): return self.G + self.N + self.N * self.G
    def forwarded(self, n): return self.pushed() + 1 + n
    def comm_before(self): return self.pushed() + 1 + self.N
    def finished(self): return self.comm_before() + 1
    def chunk(self, b, c): return self.finished() + 3 + b * GATHER_MAX_CHUNKS + c
    def claims(self): return self.chunk(self.N * self.G, 0)
    def credit(self, n): return self.claims() + 1 + n
    def forwarded_step(self, s): return self.credit(self.N) + s

    @property
    def words(self) -> int:
        return self.forwarded_step(self.N * self.G)


# ---- the device's chunk arithmetic (kernels/device/gather.py), for CPU checks -----------

def gather_chunks(comm_ctas: int, want: int = 16) -> int:
    """Chunks per block of a launch with `comm_ctas` communication CTAs."""
    return min(comm_ctas * -(-want // comm_ctas), GATHER_MAX_CHUNKS)


def chunk_begin(nbytes: int, c: int, chunks: int) -> int:
    """First byte of chunk c of an nbytes block (16-byte aligned)."""
    return nbytes if c >= chunks else (nbytes * c // chunks) & ~15


def chunk_holding(nbytes: int, x: int, chunks: int) -> int:
    """The chunk holding byte x < nbytes."""
    c = min(x * chunks // nbytes, chunks - 1)
    while c + 1 < chunks and chunk_begin(nbytes, c + 1, chunks) <= x:
        c += 1
    return c


def chunk_at(k: int, chunks: int, pairs: bool) -> int:
    """The k-th chunk a launch copies (two equal spans: their chunks alternating)."""
    return (k & 1) * (chunks // 2) + (k >> 1) if pairs else k


def default_comm_ctas(ctas: int, nodes: int, ranks_per_node: int) -> int:
    """CTAs of the communication role (AllGather+GEMM, ring attention): a few (copies are
    bandwidth-bound and short next to the compute), more when there are more peers to store
    into."""
    want = 2 + (ranks_per_node > 2) * 2 + (nodes > 1) * 2
    return max(1, min(want, ctas // 4))


class GatheringOp(Op):
    """An op whose persistent kernel has a communication role (gathering) and a compute
    role. Subclasses call :meth:`_ensure_gathered` before building launches (a new
    ``_generation`` means the buffer moved) and :meth:`_gather_args` for the role's
    kernel arguments."""

    def __init__(self, world=None, *, ctas=None, comm_ctas=None, timeout_ms=None,
                 muted_rank=None, roles="static"):
        super().__init__(world, timeout_ms=timeout_ms)
        area = self.name
        if not isinstance(roles, str) or roles not in ("static", "search"):
            raise ValueError(f"mkrt.{area}: roles={roles!r}; expected 'static' or 'search'")
        self.roles = roles
        self.ctas = checks.integer(ctas, "ctas", area, low=2, high=checks.MAX_GRID, optional=True)
        self.comm_ctas = checks.integer(comm_ctas, "comm_ctas", area, low=1, optional=True)
        muted = checks.integer(muted_rank, "muted_rank", area, low=0, high=self.world.size - 1,
                               optional=True)
        self.muted_rank = -1 if muted is None else muted
        sizes = {len(self.world.node_ranks(n)) for n in range(self.world.nodes)}
        if len(sizes) != 1:
            raise ValueError(f"mkrt.{area}: nodes of different sizes ({self.world.layout}) "
                             "are not supported")
        if self.world.ranks_per_node > MAX_NODE_RANKS:
            raise ValueError(f"mkrt.{area}: at most {MAX_NODE_RANKS} ranks per node")
        devices = [info for info in self.world.local if info.device is not None]
        if self.ctas is not None and devices:
            share = min(self.world.sm_count(info.rank) for info in devices)
            if self.ctas > share:
                raise ValueError(f"mkrt.{area}: ctas={self.ctas} exceeds this rank's "
                                 f"share of {share} SMs (every CTA must be resident)")
        self.layout = FlagLayout(self.world.ranks_per_node, self.world.nodes)
        self._flags = None
        self._gathered: SymmetricBuffer | None = None
        self._generation = 0
        self._prepared: dict = {}

    def _ensure_gathered(self, need: int) -> None:
        """Flags, and a gathered buffer of at least `need` bytes on every rank."""
        grow = self._gathered is None or self._gathered.nbytes < need
        if grow or self._flags is None:
            # Allocations wait for the device: never while other calls' kernels may wait
            # for the proxy (mkrt/DESIGN.md, "Runtime hazards").
            self.world.synchronize()
        if self._flags is None:
            self._flags = flag_buffer(self.world, self.layout.words, name=f"{self.name}.flags")
        if grow:
            if self._gathered is not None:
                self._gathered.close()
            self._gathered = SymmetricBuffer(self.world, need, name=f"{self.name}.gathered",
                                             zero=False)
            self._generation += 1
        if self.world.nodes > 1:
            self.world.proxy()

    def _gather_args(self, args, info) -> None:
        """The gathering role's fields of a kernel's Args record (gathered, flags, peer
        tables, queue, me, node, G, N, regions)."""
        rank = info.rank
        args["gathered"] = self._gathered.local_ptr(rank)
        args["flags"] = self._flags.local_ptr(rank)
        args["peer_flags"] = self._flags.peer_table(rank).data.ptr
        args["peer_gathered"] = self._gathered.peer_table(rank).data.ptr
        if self.world.nodes > 1:
            args["queue"] = self.world.proxy().queue_pointer(rank)
        args["me"], args["node"] = info.local_rank, info.node
        args["G"], args["N"] = self.world.ranks_per_node, self.world.nodes
        args["gathered_region"] = self._gathered.region
        args["flags_region"] = self._flags.region

    def _board_pointer(self, call, i: int, ctas: int, comm_ctas: int) -> int:
        """Local rank `i`'s role board of a prepared call (roles="search"; made once per
        call, kept across re-allocations: the search is per shape), or 0 (static)."""
        if self.roles != "search":
            return 0
        if call.boards is None:
            call.boards = []
            for device in self._local_devices:
                with self.on_device(device):
                    call.boards.append(Board(ctas, comm_ctas, static=False, search=True))
        return call.boards[i].ptr

    def _call_shape(self, call) -> tuple:
        """How :meth:`controller_state` names a prepared call's shape."""
        raise NotImplementedError

    def controller_state(self) -> list[dict]:
        """roles="search": per prepared shape and local rank, the board (synchronizes): the
        split the next launch runs (``learned`` communication CTAs), the search's best
        (``s_best``, ``s_best_ns``), whether it settled, the last launch's time."""
        self.world.synchronize()
        return [dict(board.state(), rank=info.rank, ctas=board.ctas, shape=self._call_shape(call))
                for call in self._prepared.values()
                for info, board in zip(self.world.local, call.boards or [])]

    def close(self) -> None:
        for buffer in (self._flags, self._gathered):
            if buffer is not None:
                buffer.close()
        self._flags = self._gathered = None
        # prepared launches point into the freed buffers: a later call rebuilds them
        self._prepared.clear()
        self._generation += 1
