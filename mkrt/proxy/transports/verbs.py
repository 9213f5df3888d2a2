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

The compiled proxy loop cannot call pyverbs (Cython objects need the GIL), so
:class:`mkrt.proxy.verbs_proxy.VerbsProxy` (a Python thread) drives this transport.

Everything the transport does to the device goes through a *backend* object
(:class:`PyverbsBackend` on a real device; tests inject an in-process fake with the same
methods), so connection set-up, region exchange, posting, credits and completion
handling are exercised without an RDMA device. Backend methods:

  open(device_name) -> DeviceInfo
  create_cq(cqe) -> cq                     cq.poll(n) -> list[Completion]
  create_qp(cq, sq_depth, recv_depth, max_inline, efa) -> qp   (qp.qp_num)
  connect(qp, local: ConnectionData, remote: ConnectionData) -> None   RC: INIT->RTR->RTS
  connect_srd(qp) -> None; address(remote: ConnectionData) -> ah   (EFA SRD)
  register(address, size, dmabuf_fd, dmabuf_offset) -> Registration
  post_send(qp, wrs: list[WorkRequest], ah, remote: ConnectionData) -> None   one chain
  post_recv(qp, wr_ids) -> None
  close() -> None
"""

from __future__ import annotations

import ctypes
import logging
import random
import struct
import time
from dataclasses import dataclass

import numpy as np
from numba import njit

from mkrt.errors import MkrtError
from mkrt.proxy import queue as Q
from mkrt.proxy.atomics import load_acquire_at, store_release_at
from mkrt.proxy.transports.base import TransportUnavailable

log = logging.getLogger("mkrt.proxy")

# ibv_wr_opcode values (verbs.h)
IBV_WR_RDMA_WRITE = 0
IBV_WR_RDMA_WRITE_WITH_IMM = 1
IBV_SEND_SIGNALED = 2
IBV_SEND_INLINE = 8
IBV_WC_SUCCESS = 0
IBV_WC_RDMA_WRITE = 1
IBV_WC_RECV_RDMA_WITH_IMM = 129   # ibv_wc_opcode
IBV_ACCESS_LOCAL_WRITE = 1
IBV_ACCESS_REMOTE_WRITE = 2
IBV_ACCESS_REMOTE_READ = 4
PEER_SHIFT = 40                   # wr_id = peer << PEER_SHIFT | sequence
QKEY = 0x11111111                 # SRD queue key (both sides use the same)

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

    def __init__(self, depth: int, signal_every: int, *, ordered: bool = True):
        if depth < 2 or not (1 <= signal_every <= depth // 2):
            raise ValueError(f"mkrt.proxy: verbs credits need depth >= 2 and "
                             f"1 <= signal_every <= depth/2; got {depth=}, {signal_every=}")
        if not ordered and signal_every != 1:
            # completions of an unordered QP (EFA SRD) may arrive in any order: an
            # unsignalled WR could not be known complete, so every WR is signalled
            raise ValueError(f"mkrt.proxy: unordered verbs credits need signal_every=1; "
                             f"got {signal_every=}")
        self.depth, self.signal_every, self.ordered = depth, signal_every, ordered
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
                if i != 0 and self.ordered:
                    raise RuntimeError(f"mkrt.proxy: verbs completion {wr_id} out of order "
                                       f"(expected {self._signalled[0][0]})")
                self._signalled.pop(i)
                self.outstanding -= covered
                return covered
        raise RuntimeError(f"mkrt.proxy: verbs completion for unknown or unsignalled {wr_id=}")

    @property
    def idle(self) -> bool:
        return self.outstanding == 0


class WorkRequestBuilder:
    """Turns validated put/signal commands into WR chains for one peer.

    RC (ordered): put -> RDMA WRITE; signal -> RDMA WRITE of 8 bytes after it, inline
    where the device allows (``inline=True``), else from a registered host staging slot
    (``staging``: one 8-byte slot per send-queue entry, reused only after its WR has
    completed, which the credits guarantee). Inline WRs also point their SGE at the slot:
    ibv_post_send copies inline data from the SGE address.
    EFA SRD (unordered): put+signal -> one RDMA WRITE-with-immediate; the receiver polls
    its CQ and writes the flag itself (:func:`decode_immediate`); a bare signal becomes a
    zero-length write-with-immediate.
    ``id_base``: high bits of every wr_id (the peer), so one CQ serves every peer.
    """

    def __init__(self, credits: Credits, *, efa: bool = False, id_base: int = 0,
                 staging: LocalRegion | None = None, inline: bool = True):
        if not inline and staging is None and not efa:
            raise ValueError("mkrt.proxy: verbs flag writes without inline data need a staging region")
        self.credits, self.efa, self.id_base = credits, efa, id_base
        self.staging, self.inline = staging, inline
        self.next_id = 1

    def _wr(self, **kw) -> WorkRequest:
        wr_id = self.id_base | self.next_id
        self.next_id += 1
        force = kw.pop("force_signal", False)
        flags = kw.pop("send_flags", 0)
        if self.credits.take(wr_id, force):
            flags |= IBV_SEND_SIGNALED
        return WorkRequest(wr_id=wr_id, send_flags=flags, **kw)

    def wrs_needed(self, opcode: int) -> int:
        if opcode == Q.OP_PUT_SIGNAL and not self.efa:
            return 2
        return 1

    def staging_slot(self, wr_id: int) -> int:
        """Byte offset in the staging region of the slot of WR `wr_id`."""
        slots = self.staging.size // 8
        return 8 * ((wr_id & ((1 << PEER_SHIFT) - 1)) % slots)

    def put(self, src: LocalRegion, src_offset: int, dst: RemoteRegion, dst_offset: int,
            nbytes: int, *, flag: tuple[RemoteRegion, int, int, int] | None = None,
            force_signal: bool = False) -> list[WorkRequest]:
        """flag: (region, offset, value, flag_index) written after the data."""
        if src_offset + nbytes > src.size or dst_offset + nbytes > dst.size:
            raise ValueError(f"mkrt.proxy: verbs put out of region: {src_offset=}, {dst_offset=}, "
                             f"{nbytes=}, src size {src.size}, dst size {dst.size}")
        if self.efa and flag is not None:
            region, offset, value, index = flag
            return [self._wr(opcode=IBV_WR_RDMA_WRITE_WITH_IMM, local_address=src.address + src_offset,
                             length=nbytes, lkey=src.lkey, remote_address=dst.address + dst_offset,
                             rkey=dst.rkey, imm_data=encode_immediate(index, value),
                             force_signal=force_signal)]
        out = [self._wr(opcode=IBV_WR_RDMA_WRITE, local_address=src.address + src_offset,
                        length=nbytes, lkey=src.lkey, remote_address=dst.address + dst_offset,
                        rkey=dst.rkey, force_signal=force_signal and flag is None)]
        if flag is not None:
            out += self.signal(*flag, force_signal=force_signal)
        return out

    def signal(self, region: RemoteRegion, offset: int, value: int, index: int = 0, *,
               force_signal: bool = False) -> list[WorkRequest]:
        if offset % 8 or offset + 8 > region.size:
            raise ValueError(f"mkrt.proxy: verbs flag at {offset=} outside or misaligned in a "
                             f"region of {region.size} bytes")
        if self.efa:
            address, lkey = (self.staging.address, self.staging.lkey) if self.staging else (0, 0)
            return [self._wr(opcode=IBV_WR_RDMA_WRITE_WITH_IMM, local_address=address, length=0,
                             lkey=lkey, remote_address=region.address + offset, rkey=region.rkey,
                             imm_data=encode_immediate(index, value), force_signal=force_signal)]
        wr_id = self.id_base | self.next_id
        address, lkey = 0, 0
        if self.staging is not None:
            address, lkey = self.staging.address + self.staging_slot(wr_id), self.staging.lkey
        return [self._wr(opcode=IBV_WR_RDMA_WRITE, local_address=address, length=8, lkey=lkey,
                         remote_address=region.address + offset, rkey=region.rkey,
                         send_flags=IBV_SEND_INLINE if self.inline else 0,
                         inline_data=struct.pack("<Q", value), force_signal=force_signal)]


@dataclass(frozen=True)
class ConnectionData:
    """What one side of a connection tells the other (exchanged over MPI).

    ``regions[i]``: (remote base address, size, rkey) of region id ``i`` — (0, 0, 0) when
    not registered. The base is the address the peer must use in RDMA WRITEs: the
    virtual address for ``ibv_reg_mr``, the iova for a dma-buf MR.
    ``mtu``: ibv_mtu enum (1..5 = 256..4096 bytes); the connection uses the smaller side's.
    """

    rank: int
    qp_num: int
    psn: int
    lid: int
    gid: bytes
    regions: tuple[tuple[int, int, int], ...] = ()   # (address, size, rkey) per region id
    mtu: int = 5

    _HEAD = struct.Struct("<IIIH16sHB")

    def pack(self) -> bytes:
        if len(self.gid) != 16:
            raise ValueError(f"mkrt.proxy: gid must be 16 bytes; got {len(self.gid)}")
        if not 1 <= self.mtu <= 5:
            raise ValueError(f"mkrt.proxy: mtu is an ibv_mtu value 1..5; got {self.mtu}")
        body = b"".join(struct.pack("<QQI", *r) for r in self.regions)
        return self._HEAD.pack(self.rank, self.qp_num, self.psn, self.lid, self.gid,
                               len(self.regions), self.mtu) + body

    @classmethod
    def unpack(cls, data: bytes) -> "ConnectionData":
        if len(data) < cls._HEAD.size:
            raise ValueError(f"mkrt.proxy: connection data of {len(data)} bytes, expected at "
                             f"least {cls._HEAD.size}")
        rank, qp_num, psn, lid, gid, n, mtu = cls._HEAD.unpack_from(data)
        off = cls._HEAD.size
        if len(data) != off + 20 * n:
            raise ValueError(f"mkrt.proxy: connection data of {len(data)} bytes, expected {off + 20 * n}")
        regions = tuple(struct.unpack_from("<QQI", data, off + 20 * i) for i in range(n))
        return cls(rank, qp_num, psn, lid, gid, regions, mtu)


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
                "(PyPI's 'pyverbs' does not build; mkrt/DESIGN.md, \"Machine facts\")")
    try:
        devices = device.get_device_list()
    except Exception as error:  # PyverbsRDMAError errno 38 without a device
        return f"no RDMA device: pyverbs.device.get_device_list() failed: {error}"
    if not devices:
        return "no RDMA device: pyverbs.device.get_device_list() is empty"
    return None


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    efa: bool
    lid: int
    gid: bytes
    mtu: int            # ibv_mtu of the port
    max_inline: int     # inline bytes the device takes (0: none)


@dataclass(frozen=True)
class Completion:
    wr_id: int
    status: int
    opcode: int
    imm_data: int = 0
    qp_num: int = 0


@dataclass(frozen=True)
class Registration:
    handle: object
    lkey: int
    rkey: int
    base: int           # address WRs use for byte 0 of the region (VA, or iova of a dma-buf MR)


def cuda_dmabuf_fd(address: int, size: int) -> tuple[int, int]:
    """(dma-buf fd, offset of `address` in it) for GPU memory, through libcuda's
    cuMemGetHandleForAddressRange (the range is widened to whole host pages)."""
    page = 4096
    start = address - address % page
    length = (address + size - start + page - 1) // page * page
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        raise TransportUnavailable(f"mkrt.proxy: no libcuda for dma-buf export: {error}") from None
    fd = ctypes.c_int(-1)
    rc = cuda.cuMemGetHandleForAddressRange(ctypes.byref(fd), ctypes.c_uint64(start),
                                            ctypes.c_size_t(length), ctypes.c_int(1),  # DMA_BUF_FD
                                            ctypes.c_ulonglong(0))
    if rc != 0 or fd.value < 0:
        raise TransportUnavailable(f"mkrt.proxy: cuMemGetHandleForAddressRange({address=:#x}, "
                                   f"{size=}) failed: CUresult {rc}")
    return fd.value, address - start


class PyverbsBackend:
    """The backend on a real device: every call here is pyverbs (rdma-core's Cython)."""

    def __init__(self):
        reason = availability()
        if reason is not None:
            raise TransportUnavailable(f"mkrt.proxy: verbs transport unavailable: {reason}")
        self.port = 1
        self.gid_index = 0
        self._objects = []

    def open(self, device_name):
        from pyverbs.device import Context, get_device_list
        from pyverbs.pd import PD
        names = [d.name.decode() for d in get_device_list()]
        name = device_name or names[0]
        if name not in names:
            raise TransportUnavailable(f"mkrt.proxy: no RDMA device {name!r}; have {names}")
        self.efa = name.startswith("efa") or name.startswith("rdmap")
        if self.efa:
            from pyverbs.providers.efa import efadv, efa_enums
            if not hasattr(efa_enums, "EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE"):
                raise TransportUnavailable("mkrt.proxy: this rdma-core's EFA provider has no "
                                           "RDMA write (needs rdma-core >= 45)")
            self.context = efadv.EfaContext(name=name)
            caps = self.context.query_efa_device()
            if not caps.device_caps & efa_enums.EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE:
                raise TransportUnavailable(f"mkrt.proxy: EFA device {name} has no RDMA write")
            max_inline = caps.inline_buf_size
        else:
            self.context = Context(name=name)
            max_inline = MAX_INLINE
        self.pd = PD(self.context)
        port = self.context.query_port(self.port)
        gid = self.context.query_gid(self.port, self.gid_index)
        gid_bytes = bytes.fromhex(str(gid.gid).replace(":", ""))
        return DeviceInfo(name, self.efa, int(port.lid), gid_bytes, int(port.active_mtu), max_inline)

    def create_cq(self, cqe):
        from pyverbs.cq import CQ
        cq = CQ(self.context, cqe)
        self._objects.append(cq)
        return _PyverbsCQ(cq)

    def create_qp(self, cq, sq_depth, recv_depth, max_inline, efa):
        from pyverbs.enums import IBV_QPT_DRIVER, IBV_QPT_RC
        from pyverbs.qp import QPCap, QPInitAttr, QPInitAttrEx
        cap = QPCap(max_send_wr=sq_depth, max_recv_wr=max(1, recv_depth), max_send_sge=1,
                    max_recv_sge=1, max_inline_data=max_inline)
        if efa:
            from pyverbs.enums import (IBV_QP_EX_WITH_RDMA_WRITE, IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM,
                                       IBV_QP_INIT_ATTR_PD, IBV_QP_INIT_ATTR_SEND_OPS_FLAGS)
            from pyverbs.providers.efa import efa_enums, efadv
            attr = QPInitAttrEx(qp_type=IBV_QPT_DRIVER, scq=cq.cq, rcq=cq.cq, cap=cap, pd=self.pd,
                                comp_mask=IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
                                send_ops_flags=IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM)
            efa_attr = efadv.EfaQPInitAttr()
            efa_attr.driver_qp_type = efa_enums.EFADV_QP_DRIVER_TYPE_SRD
            qp = efadv.SRDQPEx(self.context, attr, efa_attr)
        else:
            qp = _qp(self.pd, QPInitAttr(qp_type=IBV_QPT_RC, scq=cq.cq, rcq=cq.cq, cap=cap, sq_sig_all=0))
        self._objects.append(qp)
        return qp

    def connect(self, qp, local, remote):
        """RC: RESET -> INIT -> RTR (peer's qpn, psn, lid/gid, mtu) -> RTS."""
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.enums import IBV_QPS_INIT
        from pyverbs.qp import QPAttr
        attr = QPAttr(qp_state=IBV_QPS_INIT)
        attr.port_num = self.port
        attr.pkey_index = 0
        attr.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ
        qp.to_init(attr)
        attr.path_mtu = min(local.mtu, remote.mtu)
        attr.dest_qp_num = remote.qp_num
        attr.rq_psn = remote.psn
        attr.max_dest_rd_atomic = 1
        attr.min_rnr_timer = 12
        gid = GID(":".join(remote.gid.hex()[i:i + 4] for i in range(0, 32, 4)))
        route = GlobalRoute(dgid=gid, sgid_index=self.gid_index)
        attr.ah_attr = AHAttr(gr=route, is_global=1, dlid=remote.lid, port_num=self.port)
        qp.to_rtr(attr)
        attr.sq_psn = local.psn
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        attr.max_rd_atomic = 1
        qp.to_rts(attr)

    def connect_srd(self, qp):
        from pyverbs.enums import IBV_QPS_INIT
        from pyverbs.qp import QPAttr
        self._srd_qp = qp                     # its protection domain makes the address handles
        attr = QPAttr(qp_state=IBV_QPS_INIT)
        attr.port_num = self.port
        attr.pkey_index = 0
        attr.qkey = QKEY
        qp.to_init(attr)
        qp.to_rtr(attr)
        attr.sq_psn = 0
        qp.to_rts(attr)

    def address(self, remote):
        """An address handle to `remote`: pyverbs' AH for the Python posting path, and the
        same route made with ``ibv_create_ah`` for the compiled loop (pyverbs keeps an AH's
        pointer private; verbs_abi.RawAddressHandle)."""
        from pyverbs.addr import AH, GID, AHAttr, GlobalRoute

        from mkrt.proxy.transports.verbs_abi import RawAddressHandle
        gid = GID(":".join(remote.gid.hex()[i:i + 4] for i in range(0, 32, 4)))
        ah = AH(self.pd, attr=AHAttr(gr=GlobalRoute(dgid=gid, sgid_index=self.gid_index),
                                     is_global=1, port_num=self.port))
        self._objects.append(ah)
        raw = RawAddressHandle(int(self._srd_qp.qp), bytes(remote.gid), self.gid_index,
                               self.port, ah)
        self._objects.append(raw)          # closed before the AHs and QPs made before it
        return raw

    def register(self, address, size, dmabuf_fd=None, dmabuf_offset=0):
        access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ
        if dmabuf_fd is not None:
            try:
                from pyverbs.mr import DmaBufMR
                # pyverbs registers a dma-buf MR with iova == offset: WRs address it from there
                mr = DmaBufMR(self.pd, size, access, dmabuf=dmabuf_fd, offset=dmabuf_offset)
                return Registration(mr, mr.lkey, mr.rkey, dmabuf_offset)
            except Exception as error:  # no dma-buf support in kernel/driver: peer-memory
                log.info("mkrt.proxy: dma-buf registration failed (%s); trying ibv_reg_mr", error)
        from pyverbs.mr import MR
        mr = MR(self.pd, size, access, address=address)
        return Registration(mr, mr.lkey, mr.rkey, address)

    def post_send(self, qp, wrs, ah=None, remote=None):
        if isinstance(ah, int) or ah is None:
            qp.post_send(pyverbs_chain(wrs))
            return
        # EFA SRD: extended QP, one wr_start/wr_complete batch
        ah = getattr(ah, "pyverbs", ah)
        qp.wr_start()
        for w in wrs:
            qp.wr_id = w.wr_id
            qp.wr_flags = w.send_flags
            qp.wr_rdma_write_imm(w.rkey, w.remote_address, w.imm_data)
            qp.wr_set_sge(w.lkey, w.local_address, w.length)
            qp.wr_set_ud_addr(ah, remote.qp_num, QKEY)
        qp.wr_complete()

    def post_recv(self, qp, wr_ids):
        from pyverbs.wr import SGE, RecvWR
        for wr_id in wr_ids:
            qp.post_recv(RecvWR(wr_id=wr_id, num_sge=1, sg=[SGE(0, 0, 0)]))

    def close(self):
        for obj in reversed(self._objects):
            obj.close()
        self._objects = []
        if getattr(self, "pd", None) is not None:
            self.pd.close()
            self.context.close()
            self.pd = None


def _qp(pd, init_attr):
    from pyverbs.qp import QP
    return QP(pd, init_attr)


class _PyverbsCQ:
    def __init__(self, cq):
        self.cq = cq

    def poll(self, n):
        count, wcs = self.cq.poll(n)
        return [Completion(wc.wr_id, wc.status, wc.opcode, wc.imm_data, wc.qp_num)
                for wc in wcs[:count]]


def pyverbs_chain(wrs):
    """One pyverbs SendWR chain (next_wr links) for WorkRequests, first WR returned."""
    from pyverbs.wr import SGE, SendWR
    head = None
    for w in reversed(wrs):
        sge = SGE(w.local_address, w.length, w.lkey)
        kw = dict(wr_id=w.wr_id, opcode=w.opcode, num_sge=1, sg=[sge], send_flags=w.send_flags)
        if w.imm_data is not None:
            kw["imm_data"] = w.imm_data
        if head is not None:
            kw["next_wr"] = head
        wr = SendWR(**kw)
        wr.set_wr_rdma(w.rkey, w.remote_address)
        head = wr
    return head


@njit(nogil=True, cache=False)
def _flag_max(address, value):
    """Receiver-side flag write (EFA): never move a flag backwards (completions are unordered)."""
    if load_acquire_at(address) < value:
        store_release_at(address, value)


class VerbsTransport:
    """Connections from rank `rank` to every rank of a world of `ranks` (itself included, a
    loopback QP), with `regions` region ids per rank.

    Use: ``register_region(...)`` for every local region, then ``connect(comm)``
    (collective; or ``connection_data()`` + ``complete(remote_data)`` where no MPI is
    used), then hand ``transport.regions`` to :class:`mkrt.proxy.verbs_proxy.VerbsProxy`.

    RC: one QP per peer, each with ``sq_depth`` send slots and its own :class:`Credits`
    (signalled every ``signal_every`` WRs and at the end of every posted chain).
    EFA (SRD): one QP, an address handle per peer. ``efa_flags="immediate"``: a flag rides
    on its put as write-with-immediate; flags must live in region ``efa_flag_region`` (host
    memory) of the destination at index < 4096 with value < 2**20; the receiver posts
    ``recv_depth`` receives and writes flags from their completions. ``efa_flags="direct"``
    (worlds: flags in GPU memory, any region, any value): the sender writes each flag as an
    8-byte WRITE of its own, posted once every WR before it has completed; only the compiled
    loop (:class:`mkrt.proxy.verbs_loop.CompiledVerbsProxy`) posts in this mode.
    """

    name = "verbs"

    def __init__(self, rank: int, ranks: int, regions: int, *, backend=None,
                 device_name: str | None = None, sq_depth: int = 256, signal_every: int = 32,
                 recv_depth: int = 256, efa_flag_region: int = 1, efa_flags: str = "immediate",
                 timeout: float = 30.0):
        if not (0 <= rank < ranks):
            raise ValueError(f"mkrt.proxy: verbs transport needs 0 <= rank < ranks; got {rank=}, {ranks=}")
        if sq_depth < 4 or recv_depth < 1 or timeout <= 0:
            raise ValueError(f"mkrt.proxy: verbs transport needs sq_depth >= 4, recv_depth >= 1, "
                             f"timeout > 0; got {sq_depth=}, {recv_depth=}, {timeout=}")
        Credits(sq_depth, signal_every)             # validates the pair
        if efa_flags not in ("immediate", "direct"):
            raise ValueError(f"mkrt.proxy: efa_flags={efa_flags!r}; expected 'immediate' or 'direct'")
        self.rank, self.ranks, self.timeout = rank, ranks, timeout
        self.backend = backend if backend is not None else PyverbsBackend()
        self.info = self.backend.open(device_name)
        self.efa = self.info.efa
        #: EFA flags written by the sender as WRITEs of their own (see the class docstring)
        self.efa_direct = self.efa and efa_flags == "direct"
        self.sq_depth, self.signal_every, self.recv_depth = sq_depth, signal_every, recv_depth
        self.efa_flag_region = efa_flag_region
        self.regions = Q.new_region_table(ranks, regions)   # bases are what WRs use (iova)
        self.rkeys = np.zeros((ranks, regions), dtype=np.uint64)
        self.lkeys = np.zeros(regions, dtype=np.uint64)        # this rank's, per region id
        self.local: dict[int, tuple[LocalRegion, int, int]] = {}   # region -> (LocalRegion, VA, kind)
        self._registrations = []
        self.connected = False
        self.closed = False
        self.stats = {"posts": 0, "wrs": 0, "signalled": 0, "completions": 0,
                      "recv_completions": 0, "credit_waits": 0}
        self.cq = self.backend.create_cq(ranks * sq_depth + recv_depth)
        # staging: one 8-byte slot per send slot per peer (flag values of non-inline writes)
        self._staging = np.zeros(ranks * sq_depth, dtype=np.uint64)
        reg = self.backend.register(self._staging.ctypes.data, self._staging.nbytes)
        self._registrations.append(reg)
        self._staging_reg = reg
        inline = self.info.max_inline >= 8
        self.connections = {p: Connection(p) for p in range(ranks)}
        if self.efa:
            self.credits = {p: Credits(sq_depth, 1, ordered=False) for p in range(ranks)}
            shared = self.credits[0]
            self.credits = {p: shared for p in range(ranks)}   # one SRD QP, one send queue
            qp = self.backend.create_qp(self.cq, sq_depth, recv_depth, self.info.max_inline, True)
            self.qps = {p: qp for p in range(ranks)}
            builder = WorkRequestBuilder(shared, efa=True,
                                         staging=LocalRegion(reg.base, 8, reg.lkey))
            self.builders = {p: builder for p in range(ranks)}
        else:
            self.credits = {p: Credits(sq_depth, signal_every) for p in range(ranks)}
            self.qps = {p: self.backend.create_qp(self.cq, sq_depth, 0, self.info.max_inline
                                                  if inline else 0, False) for p in range(ranks)}
            self.builders = {p: WorkRequestBuilder(
                self.credits[p], id_base=p << PEER_SHIFT, inline=inline,
                staging=LocalRegion(reg.base + 8 * sq_depth * p, 8 * sq_depth, reg.lkey))
                for p in range(ranks)}
        self._ah = {}
        self._psn = random.Random(rank * 7919 + 1).randrange(1 << 24)
        self._recv_id = 0

    # -- memory --
    def register_region(self, region: int, address: int, size: int, *, kind: int = Q.REGION_DEVICE,
                        dmabuf_fd: int | None = None, dmabuf_offset: int = 0, late: bool = False):
        """Register local region `region` (before connect, or ``late=True`` after it: then
        the caller tells every peer with :meth:`set_remote_region`). GPU memory: pass its
        dma-buf fd (:func:`cuda_dmabuf_fd`); without one, plain ibv_reg_mr (host memory,
        or GPU memory through the peer-memory module)."""
        if self.connected and not late:
            raise RuntimeError(f"mkrt.proxy: verbs region {region} registered after connect()")
        if not 0 <= region < self.regions.shape[1] or region in self.local:
            raise ValueError(f"mkrt.proxy: verbs region {region} outside 0..{self.regions.shape[1] - 1} "
                             f"or registered twice")
        if address <= 0 or size <= 0:
            raise ValueError(f"mkrt.proxy: verbs region {region} needs address > 0 and size > 0; "
                             f"got {address=:#x}, {size=}")
        if self.efa and not self.efa_direct and region == self.efa_flag_region \
                and kind != Q.REGION_HOST:
            raise ValueError(f"mkrt.proxy: EFA flags are written by the receiving CPU: region "
                             f"{region} must be host memory; got {kind=}")
        reg = self.backend.register(address, size, dmabuf_fd, dmabuf_offset)
        self._registrations.append(reg)
        self.local[region] = (LocalRegion(reg.base, size, reg.lkey), address, kind)
        self.regions[self.rank, region] = (reg.base, size, kind, 1)
        self.rkeys[self.rank, region] = reg.rkey
        self.lkeys[region] = reg.lkey
        return reg

    def set_remote_region(self, peer: int, region: int, base: int, size: int, rkey: int,
                          kind: int = Q.REGION_DEVICE) -> None:
        """What `peer` registered late as `region` (its base, size and rkey)."""
        if peer == self.rank:
            return
        self.regions[peer, region] = (base, size, kind, 1)
        self.rkeys[peer, region] = rkey

    def unregister_region(self, region: int) -> None:
        """Forget `region` on every rank and deregister this rank's (the GPUs and the proxy
        must be done with it)."""
        self.regions[:, region] = 0
        self.rkeys[:, region] = 0
        self.lkeys[region] = 0
        entry = self.local.pop(region, None)
        if entry is not None:
            for reg in list(self._registrations):
                if reg.base == entry[0].address and reg.lkey == entry[0].lkey:
                    self._registrations.remove(reg)
                    deregister = getattr(self.backend, "deregister", None)
                    if deregister is not None:
                        deregister(reg)
                    else:
                        close = getattr(reg.handle, "close", None)
                        if close is not None:
                            close()

    def thread_setup(self) -> None:
        """Runs in the posting thread before its loop (the backend's, if it has one)."""
        setup = getattr(self.backend, "thread_setup", None)
        if setup is not None:
            setup()

    # -- connection --
    def _region_list(self):
        out = []
        for region in range(self.regions.shape[1]):
            if region in self.local:
                local = self.local[region][0]
                out.append((local.address, local.size, int(self.rkeys[self.rank, region])))
            else:
                out.append((0, 0, 0))
        return tuple(out)

    def connection_data(self) -> list[bytes]:
        """Packed ConnectionData for each peer (index = peer): what alltoall sends."""
        regions = self._region_list()
        out = []
        for p in range(self.ranks):
            if self.connections[p].state == "RESET":
                self.connections[p].advance("INIT")
            out.append(ConnectionData(self.rank, self.qps[p].qp_num, self._psn, self.info.lid,
                                      self.info.gid, regions, self.info.mtu).pack())
        return out

    def complete(self, received: list[bytes]):
        """Connect every QP with what each peer sent us (index = peer)."""
        if len(received) != self.ranks:
            raise ValueError(f"mkrt.proxy: verbs connect got {len(received)} connection data, "
                             f"expected {self.ranks}")
        mine = ConnectionData(self.rank, 0, self._psn, self.info.lid, self.info.gid, (), self.info.mtu)
        if self.efa:
            self.backend.connect_srd(self.qps[0])
        for p, packed in enumerate(received):
            remote = ConnectionData.unpack(packed)
            if remote.rank != p:
                raise ValueError(f"mkrt.proxy: connection data from rank {p} names rank {remote.rank}")
            if len(remote.regions) != self.regions.shape[1]:
                raise ValueError(f"mkrt.proxy: rank {p} has {len(remote.regions)} region ids, "
                                 f"this rank {self.regions.shape[1]}")
            if self.efa:
                self._ah[p] = self.backend.address(remote)
            else:
                self.backend.connect(self.qps[p], ConnectionData(
                    self.rank, self.qps[p].qp_num, self._psn, self.info.lid, self.info.gid, (),
                    self.info.mtu), remote)
            conn = self.connections[p]
            conn.advance("RTR", remote)
            conn.advance("RTS")
            for region, (base, size, rkey) in enumerate(remote.regions):
                if size:
                    if p != self.rank:
                        self.regions[p, region] = (base, size, Q.REGION_DEVICE, 1)
                    self.rkeys[p, region] = rkey
        del mine
        if self.efa:
            ids = list(range(self.recv_depth))
            self._recv_id = self.recv_depth
            self.backend.post_recv(self.qps[0], ids)
        self.connected = True
        return self

    def connect(self, comm):
        """Collective over the mpi4py communicator `comm` (rank and size must match)."""
        if comm.Get_rank() != self.rank or comm.Get_size() != self.ranks:
            raise ValueError(f"mkrt.proxy: communicator is rank {comm.Get_rank()} of "
                             f"{comm.Get_size()}; the transport rank {self.rank} of {self.ranks}")
        return self.complete(comm.alltoall(self.connection_data()))

    # -- posting --
    def _check_ready(self, peer):
        if not self.connected or not self.connections[peer].ready:
            raise RuntimeError(f"mkrt.proxy: verbs QP to rank {peer} is not connected "
                               f"({self.connections[peer].state})")

    def post_commands(self, peer: int, commands) -> int:
        """Post validated commands (rows of ``validate_command`` output) to `peer` as one or
        more WR chains; waits (polling completions, bounded by ``timeout``) for credits.
        Returns the number of WRs posted."""
        from mkrt.proxy import proxy as P
        self._check_ready(peer)
        self._python_posting()
        builder, credits = self.builders[peer], self.credits[peer]
        chain: list[WorkRequest] = []
        posted = 0
        for i, v in enumerate(commands):
            opcode = int(v[P.V_OPCODE])
            need = builder.wrs_needed(opcode)
            if self.efa and opcode == Q.OP_SIGNAL:
                # unordered delivery: a bare flag may not pass earlier puts of this queue
                posted += self._post(peer, chain)
                chain = []
                self.quiesce()
            if credits.available < need:
                posted += self._post(peer, chain)
                chain = []
                self._wait_credits(credits, need)
            last = i == len(commands) - 1
            chain += self._build(peer, builder, v, opcode, last)
        return posted + self._post(peer, chain)

    def refusal(self, v) -> tuple[int, int]:
        """(error code, detail) for a validated command this transport cannot carry, else
        (0, 0): on EFA, a flag outside what write-with-immediate encodes. Checked before
        anything of the command is posted, so it is refused like a malformed command."""
        from mkrt.proxy import proxy as P
        opcode = int(v[P.V_OPCODE])
        if not self.efa or self.efa_direct or not (opcode in (Q.OP_PUT_SIGNAL, Q.OP_SIGNAL, Q.OP_BARRIER)
                                or (opcode == Q.OP_FENCE and v[P.V_SIGNAL])):
            return 0, 0
        return self._efa_flag_refusal(int(v[P.V_GREGION]), int(v[P.V_GOFFSET]), int(v[P.V_VALUE]))

    def _efa_flag_refusal(self, region: int, offset: int, value: int) -> tuple[int, int]:
        """(error code, detail) when write-with-immediate cannot carry this flag, else (0, 0):
        flags live in region ``efa_flag_region`` at index < 4096 with value < 2**20."""
        if region != self.efa_flag_region:
            return Q.E_REGION, region
        if offset // 8 >= 1 << 12 or value >= 1 << 20:
            return Q.E_BOUNDS, offset if offset // 8 >= 1 << 12 else value
        return 0, 0

    def _python_posting(self) -> None:
        if self.efa_direct:
            raise MkrtError("mkrt.proxy: EFA with efa_flags='direct' is posted by the compiled "
                            "loop only (CompiledVerbsProxy), not by the Python proxy")

    def _flag(self, peer, region, offset, value):
        """(RemoteRegion, offset, value, index) of a flag write."""
        self._python_posting()
        remote = RemoteRegion(int(self.regions[peer, region, 0]), int(self.regions[peer, region, 1]),
                              int(self.rkeys[peer, region]))
        index = 0
        if self.efa:
            if self._efa_flag_refusal(region, offset, value)[0]:
                raise ValueError(f"mkrt.proxy: EFA flags live in region {self.efa_flag_region} at "
                                 f"index < 4096 with value < 2**20; got {region=}, {offset=}, {value=}")
            index = offset // 8
        return remote, offset, value, index

    def _build(self, peer, builder, v, opcode, last):
        from mkrt.proxy import proxy as P
        if opcode in (Q.OP_PUT, Q.OP_PUT_SIGNAL):
            sregion, dregion = int(v[P.V_SREGION]), int(v[P.V_DREGION])
            if sregion not in self.local:
                raise ValueError(f"mkrt.proxy: verbs source region {sregion} not registered here")
            src = self.local[sregion][0]
            dst = RemoteRegion(int(self.regions[peer, dregion, 0]), int(self.regions[peer, dregion, 1]),
                               int(self.rkeys[peer, dregion]))
            flag = None
            if opcode == Q.OP_PUT_SIGNAL:
                flag = self._flag(peer, int(v[P.V_GREGION]), int(v[P.V_GOFFSET]), int(v[P.V_VALUE]))
            return builder.put(src, int(v[P.V_SOFFSET]), dst, int(v[P.V_DOFFSET]), int(v[P.V_BYTES]),
                               flag=flag, force_signal=last)
        if opcode in (Q.OP_SIGNAL, Q.OP_FENCE, Q.OP_BARRIER):
            flag = self._flag(peer, int(v[P.V_GREGION]), int(v[P.V_GOFFSET]), int(v[P.V_VALUE]))
            return builder.signal(*flag, force_signal=last)
        raise ValueError(f"mkrt.proxy: verbs cannot post opcode {opcode}")

    def _post(self, peer, chain) -> int:
        if not chain:
            return 0
        for w in chain:
            if w.inline_data is not None and w.local_address:
                # the flag value: inline posts copy it now, others read it when the WR runs
                slot = (w.local_address - self._staging_reg.base) // 8
                self._staging[slot] = struct.unpack("<Q", w.inline_data)[0]
        try:
            if self.efa:
                self.backend.post_send(self.qps[peer], chain, self._ah[peer], self.connections[peer].remote)
            else:
                self.backend.post_send(self.qps[peer], chain)
        except Exception as error:
            self.connections[peer].advance("ERROR")
            raise _transport_error(f"post_send to rank {peer} failed: {error}", 1) from error
        self.stats["posts"] += 1
        self.stats["wrs"] += len(chain)
        self.stats["signalled"] += sum(1 for w in chain if w.send_flags & IBV_SEND_SIGNALED)
        return len(chain)

    # -- completions --
    def poll(self, max_completions: int = 64) -> int:
        """Reap completions: return credits; on EFA write flags of received immediates and
        repost receives. A failed completion raises ProxyError (E_TRANSPORT, detail = status)."""
        completions = self.cq.poll(max_completions)
        reposts = []
        for c in completions:
            if c.status != IBV_WC_SUCCESS:
                peer = c.wr_id >> PEER_SHIFT
                if peer in self.connections:
                    self.connections[peer].advance("ERROR")
                raise _transport_error(f"completion of wr_id {c.wr_id:#x} (rank {peer}) failed "
                                       f"with status {c.status}", c.status)
            if c.opcode & 0x80:                      # IBV_WC_RECV*: an incoming immediate
                index, value = decode_immediate(c.imm_data)
                _, va, _ = self.local[self.efa_flag_region]
                _flag_max(np.uint64(va + 8 * index), np.uint64(value))
                self.stats["recv_completions"] += 1
                reposts.append(self._recv_id)
                self._recv_id += 1
                continue
            peer = c.wr_id >> PEER_SHIFT
            self.credits[peer].complete(c.wr_id)
            self.stats["completions"] += 1
        if reposts:
            self.backend.post_recv(self.qps[0], reposts)
        return len(completions)

    @property
    def idle(self) -> bool:
        return all(c.idle for c in self.credits.values())

    def mark(self) -> tuple:
        """Per peer, the last wr_id posted so far (for :meth:`completed`)."""
        return tuple(b.id_base | (b.next_id - 1) for b in self.builders.values())

    def completed(self, mark: tuple) -> bool:
        """Has every WR posted before `mark` was taken completed?"""
        for credits, last in zip(self.credits.values(), mark):
            if credits.idle:
                continue
            if not credits._signalled:
                return False
            if credits.ordered:
                # the oldest pending signalled WR covers `covered` WRs ending at its id
                first_pending = credits._signalled[0][0] - credits._signalled[0][1] + 1
                if first_pending <= last:
                    return False
            else:
                if min(w for w, _ in credits._signalled) <= last:
                    return False
        return True

    def _wait_credits(self, credits, need):
        self.stats["credit_waits"] += 1
        deadline = time.monotonic() + self.timeout
        while credits.available < need:
            if self.poll() == 0:
                if time.monotonic() > deadline:
                    raise _transport_error(f"no send completion within {self.timeout} s "
                                           f"({credits.outstanding} WRs outstanding)", 2)
                time.sleep(0)

    def quiesce(self):
        """Poll until every posted WR has completed (bounded by ``timeout``)."""
        deadline = time.monotonic() + self.timeout
        while not self.idle:
            if self.poll() == 0:
                if time.monotonic() > deadline:
                    raise _transport_error(f"work outstanding after {self.timeout} s", 2)
                time.sleep(0)

    def close(self):
        if self.closed:
            return
        self.closed = True
        for reg in self._registrations:
            close = getattr(reg.handle, "close", None)
            if close is not None:
                close()
        self._registrations = []
        self.backend.close()


def _transport_error(message, detail):
    from mkrt.proxy.proxy import ProxyError
    return ProxyError(f"mkrt.proxy: verbs: {message}", code=Q.E_TRANSPORT, detail=int(detail),
                      queue=-1, ticket=-1)
