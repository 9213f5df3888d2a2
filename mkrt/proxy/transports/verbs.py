"""`verbs` transport: RDMA through pyverbs (InfiniBand / RoCE RC queue pairs; AWS EFA SRD).

Split in two:
  * device-free logic, tested on any CPU: work-request building for a batch of queue
    commands (:class:`WorkRequestBuilder`: RDMA WRITE of the data, then an inline RDMA
    WRITE of the flag — or, on EFA, one RDMA WRITE-with-immediate whose immediate names
    the flag, written by the receiver), selective signalling, send-queue credit
    accounting (:class:`Credits`), the RC connection state machine and its connection
    data (:class:`ConnectionData`, :class:`Connection`), exchanged over MPI;
  * :class:`VerbsTransport`: opens the device with pyverbs (PD, MR registration of GPU
    memory through dma-buf, falling back to peer-memory ``ibv_reg_mr``; one RC QP per
    peer), posts what the builder produced and polls completions to return credits.
    Where pyverbs or an RDMA device is missing, :func:`availability` says why and the
    constructor raises :class:`TransportUnavailable` with that reason.

The compiled proxy loop cannot call pyverbs (Cython objects need the GIL), so a verbs
proxy stages validated commands and posts from Python: see :meth:`VerbsTransport.post_batch`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from mkrt.proxy import queue as Q
from mkrt.proxy.transports.base import TransportUnavailable

# ibv_wr_opcode values (verbs.h)
IBV_WR_RDMA_WRITE = 0
IBV_WR_RDMA_WRITE_WITH_IMM = 1
IBV_SEND_SIGNALED = 2
IBV_SEND_INLINE = 8

MAX_INLINE = 64


@dataclass(frozen=True)
class WorkRequest:
    """One send work request, device-independent."""

    wr_id: int
    opcode: int
    local_address: int
    length: int
    lkey: int
    remote_address: int
    rkey: int
    send_flags: int = 0
    imm_data: int | None = None
    inline_data: bytes | None = None   # for inline flag writes (8 bytes)


@dataclass(frozen=True)
class RemoteRegion:
    address: int
    size: int
    rkey: int


@dataclass(frozen=True)
class LocalRegion:
    address: int
    size: int
    lkey: int


def encode_immediate(flag_index: int, value: int) -> int:
    """EFA: 32-bit immediate = flag index (12 bits) | value low 20 bits."""
    if not (0 <= flag_index < 1 << 12) or not (0 <= value < 1 << 20):
        raise ValueError(f"mkrt.proxy: verbs immediate holds flag_index < 4096 and value < 2**20; "
                         f"got {flag_index=}, {value=}")
    return (flag_index << 20) | value


def decode_immediate(imm: int) -> tuple[int, int]:
    return imm >> 20, imm & ((1 << 20) - 1)


class Credits:
    """Send-queue slots per peer: a post takes one per WR; a signalled completion returns
    every WR up to and including it (unsignalled WRs complete with the next signalled one)."""

    def __init__(self, depth: int, signal_every: int):
        if depth < 2 or not (1 <= signal_every <= depth // 2):
            raise ValueError(f"mkrt.proxy: verbs credits need depth >= 2 and "
                             f"1 <= signal_every <= depth/2; got {depth=}, {signal_every=}")
        self.depth, self.signal_every = depth, signal_every
        self.outstanding = 0
        self.unsignalled = 0
        self._signalled: list[tuple[int, int]] = []   # (wr_id, wrs it covers)

    @property
    def available(self) -> int:
        return self.depth - self.outstanding

    def take(self, wr_id: int, force_signal: bool = False) -> bool:
        """Account one WR; True when it must be posted signalled."""
        if self.available <= 0:
            raise RuntimeError(f"mkrt.proxy: verbs send queue full ({self.depth} outstanding); "
                               "poll completions first")
        self.outstanding += 1
        self.unsignalled += 1
        # signal every N WRs, and always before the queue could fill with unsignalled WRs
        if force_signal or self.unsignalled >= self.signal_every or self.available < self.signal_every:
            self._signalled.append((wr_id, self.unsignalled))
            self.unsignalled = 0
            return True
        return False

    def complete(self, wr_id: int) -> int:
        """A signalled completion for wr_id arrived; returns the credits it gave back."""
        for i, (pending, covered) in enumerate(self._signalled):
            if pending == wr_id:
                if i != 0:
                    raise RuntimeError(f"mkrt.proxy: verbs completion {wr_id} out of order "
                                       f"(expected {self._signalled[0][0]})")
                self._signalled.pop(0)
                self.outstanding -= covered
                return covered
        raise RuntimeError(f"mkrt.proxy: verbs completion for unknown or unsignalled {wr_id=}")


class WorkRequestBuilder:
    """Turns validated put/signal commands into WR chains for one peer.

    RC (ordered): put -> RDMA WRITE; signal -> inline RDMA WRITE of 8 bytes after it.
    EFA SRD (unordered): put+signal -> one RDMA WRITE-with-immediate; the receiver polls
    its CQ and writes the flag itself (:func:`decode_immediate`); a bare signal becomes a
    zero-length write-with-immediate.
    """

    def __init__(self, credits: Credits, *, efa: bool = False):
        self.credits, self.efa = credits, efa
        self.next_id = 1

    def _wr(self, **kw) -> WorkRequest:
        wr_id = self.next_id
        self.next_id += 1
        force = kw.pop("force_signal", False)
        flags = kw.pop("send_flags", 0)
        if self.credits.take(wr_id, force):
            flags |= IBV_SEND_SIGNALED
        return WorkRequest(wr_id=wr_id, send_flags=flags, **kw)

    def put(self, src: LocalRegion, src_offset: int, dst: RemoteRegion, dst_offset: int,
            nbytes: int, *, flag: tuple[RemoteRegion, int, int, int] | None = None) -> list[WorkRequest]:
        """flag: (region, offset, value, flag_index) written after the data."""
        if src_offset + nbytes > src.size or dst_offset + nbytes > dst.size:
            raise ValueError(f"mkrt.proxy: verbs put out of region: {src_offset=}, {dst_offset=}, "
                             f"{nbytes=}, src size {src.size}, dst size {dst.size}")
        if self.efa and flag is not None:
            region, offset, value, index = flag
            return [self._wr(opcode=IBV_WR_RDMA_WRITE_WITH_IMM, local_address=src.address + src_offset,
                             length=nbytes, lkey=src.lkey, remote_address=dst.address + dst_offset,
                             rkey=dst.rkey, imm_data=encode_immediate(index, value))]
        out = [self._wr(opcode=IBV_WR_RDMA_WRITE, local_address=src.address + src_offset,
                        length=nbytes, lkey=src.lkey, remote_address=dst.address + dst_offset,
                        rkey=dst.rkey)]
        if flag is not None:
            out += self.signal(*flag)
        return out

    def signal(self, region: RemoteRegion, offset: int, value: int, index: int = 0) -> list[WorkRequest]:
        if offset % 8 or offset + 8 > region.size:
            raise ValueError(f"mkrt.proxy: verbs flag at {offset=} outside or misaligned in a "
                             f"region of {region.size} bytes")
        if self.efa:
            return [self._wr(opcode=IBV_WR_RDMA_WRITE_WITH_IMM, local_address=0, length=0, lkey=0,
                             remote_address=region.address + offset, rkey=region.rkey,
                             imm_data=encode_immediate(index, value))]
        return [self._wr(opcode=IBV_WR_RDMA_WRITE, local_address=0, length=8, lkey=0,
                         remote_address=region.address + offset, rkey=region.rkey,
                         send_flags=IBV_SEND_INLINE, inline_data=struct.pack("<Q", value))]


@dataclass(frozen=True)
class ConnectionData:
    """What one side of an RC connection tells the other (exchanged with MPI allgather)."""

    rank: int
    qp_num: int
    psn: int
    lid: int
    gid: bytes
    regions: tuple[tuple[int, int, int], ...] = ()   # (address, size, rkey) per region id

    _HEAD = struct.Struct("<IIIH16sH")

    def pack(self) -> bytes:
        if len(self.gid) != 16:
            raise ValueError(f"mkrt.proxy: gid must be 16 bytes; got {len(self.gid)}")
        body = b"".join(struct.pack("<QQI", *r) for r in self.regions)
        return self._HEAD.pack(self.rank, self.qp_num, self.psn, self.lid, self.gid,
                               len(self.regions)) + body

    @classmethod
    def unpack(cls, data: bytes) -> "ConnectionData":
        rank, qp_num, psn, lid, gid, n = cls._HEAD.unpack_from(data)
        off = cls._HEAD.size
        regions = tuple(struct.unpack_from("<QQI", data, off + 20 * i) for i in range(n))
        if len(data) != off + 20 * n:
            raise ValueError(f"mkrt.proxy: connection data of {len(data)} bytes, expected {off + 20 * n}")
        return cls(rank, qp_num, psn, lid, gid, regions)


class Connection:
    """RC queue-pair states: RESET -> INIT -> RTR (needs the peer's data) -> RTS."""

    ORDER = ("RESET", "INIT", "RTR", "RTS")

    def __init__(self, peer: int):
        self.peer = peer
        self.state = "RESET"
        self.remote: ConnectionData | None = None

    def advance(self, to: str, remote: ConnectionData | None = None):
        if to == "ERROR":
            self.state = to
            return
        if self.state not in self.ORDER or to not in self.ORDER:
            raise RuntimeError(f"mkrt.proxy: verbs QP to rank {self.peer}: {self.state} -> {to} is not a transition")
        if self.ORDER.index(to) != self.ORDER.index(self.state) + 1:
            raise RuntimeError(f"mkrt.proxy: verbs QP to rank {self.peer}: cannot go {self.state} -> {to}")
        if to == "RTR":
            if remote is None or remote.rank != self.peer:
                raise ValueError(f"mkrt.proxy: verbs QP to rank {self.peer} needs that rank's "
                                 f"connection data to reach RTR; got {remote}")
            self.remote = remote
        self.state = to

    @property
    def ready(self) -> bool:
        return self.state == "RTS"


def batch_commands(commands, peers: int):
    """Group validated commands (dicts with opcode, dst_rank, ...) by destination peer,
    keeping each peer's order (RC delivers in order per QP)."""
    out: dict[int, list] = {}
    for c in commands:
        rank = int(c["dst_rank"])
        if not 0 <= rank < peers:
            raise ValueError(f"mkrt.proxy: command to rank {rank} outside a world of {peers}")
        if int(c["opcode"]) not in (Q.OP_PUT, Q.OP_PUT_SIGNAL, Q.OP_SIGNAL):
            raise ValueError(f"mkrt.proxy: verbs batches take put/put_signal/signal; "
                             f"got opcode {int(c['opcode'])}")
        out.setdefault(rank, []).append(c)
    return out


def availability() -> str | None:
    """None when pyverbs and an RDMA device are usable here; else the reason they are not."""
    try:
        import pyverbs.device as device  # noqa: F401
    except ImportError as error:
        return (f"pyverbs is not installed ({error}); install rdma-core's python3-pyverbs "
                "(PyPI's 'pyverbs' does not build), FACTS.md")
    try:
        devices = device.get_device_list()
    except Exception as error:  # PyverbsRDMAError errno 38 without a device
        return f"no RDMA device: pyverbs.device.get_device_list() failed: {error}"
    if not devices:
        return "no RDMA device: pyverbs.device.get_device_list() is empty"
    return None


@dataclass
class VerbsTransport:
    """RC (or EFA SRD) connections to every peer, opened with pyverbs."""

    comm: object                                   # mpi4py communicator
    device_name: str | None = None
    sq_depth: int = 256
    signal_every: int = 32
    connections: dict = field(default_factory=dict)

    name = "verbs"

    def __post_init__(self):
        reason = availability()
        if reason is not None:
            raise TransportUnavailable(f"mkrt.proxy: verbs transport unavailable: {reason}")
        from pyverbs.device import Context, get_device_list
        from pyverbs.pd import PD
        names = [d.name.decode() for d in get_device_list()]
        name = self.device_name or names[0]
        self.context = Context(name=name)
        self.pd = PD(self.context)
        self.efa = name.startswith("efa") or name.startswith("rdmap")
        self.memory_regions = []

    def register(self, address: int, size: int, *, dmabuf_fd: int | None = None):
        """Register memory: GPU memory through dma-buf when given its fd, else ibv_reg_mr
        (host memory, or GPU memory through the peer-memory module)."""
        from pyverbs.enums import (IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_READ,
                                   IBV_ACCESS_REMOTE_WRITE)
        access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ
        mr = None
        if dmabuf_fd is not None:
            try:
                from pyverbs.mr import DmaBufMR
                mr = DmaBufMR(self.pd, size, access, fd=dmabuf_fd, offset=0, iova=address)
            except Exception:
                mr = None
        if mr is None:
            from pyverbs.mr import MR
            mr = MR(self.pd, size, access, address=address)
        self.memory_regions.append(mr)
        return mr

    def close(self):
        for mr in self.memory_regions:
            mr.close()
        self.pd.close()
        self.context.close()
