"""The libibverbs ABI the compiled proxy loop posts through (x86-64, little endian).

``ibv_post_send`` and ``ibv_poll_cq`` are inline functions of verbs.h: they call through
the device context's ops table, ``qp->context->ops.post_send(qp, wr, bad_wr)`` and
``cq->context->ops.poll_cq(cq, n, wc)``. The compiled loop does the same: it reads the two
function pointers once, from the ``ibv_qp`` and ``ibv_cq`` that pyverbs created (pyverbs
gives their addresses: ``QP.qp``, ``CQ.cq``), and calls them on work requests it writes
into preallocated arrays. No Python runs per command, and the GIL is not held.

Layouts (rdma-core, libibverbs/verbs.h; the ABI is stable across releases):

* ``struct ibv_context``: ``device`` pointer, then ``struct ibv_context_ops``: 8-byte
  function pointers, ``poll_cq`` the 12th (index 11), ``post_send`` the 26th (index 25);
* ``struct ibv_qp`` and ``struct ibv_cq`` begin with their ``ibv_context *``;
* ``struct ibv_send_wr`` (128 bytes): wr_id, next, sg_list, num_sge (i32), opcode (i32),
  send_flags (u32), imm_data (u32, network byte order), then ``wr.rdma``: remote_addr
  (u64), rkey (u32); the rest (atomic, ud, xrc, bind_mw, tso) stays zero;
* ``struct ibv_sge`` (16 bytes): addr (u64), length (u32), lkey (u32);
* ``struct ibv_wc`` (48 bytes): wr_id (u64), status (u32), opcode (u32), vendor_err,
  byte_len, imm_data (network order), qp_num, src_qp, wc_flags (u32 each), then pkey
  index, slid (u16), sl, dlid_path_bits (u8).

Arrays here hold those structs as rows of u64 words (``SEND_WR_WORDS``, ``SGE_WORDS``,
``WC_WORDS`` per struct); the ``W_*``, ``G_*`` and ``C_*`` constants name the words.
"""

from __future__ import annotations

import ctypes

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

#: byte offsets in struct ibv_context of the ops the loop calls
CONTEXT_POLL_CQ = 8 + 8 * 11
CONTEXT_POST_SEND = 8 + 8 * 25
CONTEXT_POST_RECV = 8 + 8 * 26
#: byte offset of the user pointer a provider may keep (ibv_qp.qp_context, ibv_cq.cq_context)
QP_USER_CONTEXT = 8
CQ_USER_CONTEXT = 16

SEND_WR_WORDS = 16          # 128 bytes
W_ID, W_NEXT, W_SG_LIST, W_NUM_SGE_OPCODE, W_FLAGS_IMM, W_REMOTE_ADDR, W_RKEY = range(7)
SGE_WORDS = 2               # 16 bytes
G_ADDR, G_LENGTH_LKEY = range(2)
WC_WORDS = 6                # 48 bytes
C_ID, C_STATUS_OPCODE, C_VENDOR_LENGTH, C_IMM_QPN, C_SRC_FLAGS, C_PKEY_SLID_SL = range(6)

_I8P = ir.IntType(8).as_pointer()
_I32 = ir.IntType(32)


@intrinsic
def call_post_send(typingctx, function, qp, wr, bad_wr):
    """``((int (*)(void *, void *, void **))function)(qp, wr, bad_wr)``: addresses as u64."""
    def codegen(context, builder, sig, args):
        pointers = [builder.inttoptr(context.cast(builder, a, t, types.uint64), _I8P)
                    for a, t in zip(args[1:], sig.args[1:])]
        fnty = ir.FunctionType(_I32, [_I8P, _I8P, _I8P])
        target = builder.inttoptr(context.cast(builder, args[0], sig.args[0], types.uint64),
                                  fnty.as_pointer())
        return builder.call(target, pointers)
    return types.int32(function, qp, wr, bad_wr), codegen


@intrinsic
def call_poll_cq(typingctx, function, cq, count, wc):
    """``((int (*)(void *, int, void *))function)(cq, count, wc)``: addresses as u64."""
    def codegen(context, builder, sig, args):
        cq_ptr = builder.inttoptr(context.cast(builder, args[1], sig.args[1], types.uint64), _I8P)
        n = context.cast(builder, args[2], sig.args[2], types.int32)
        wc_ptr = builder.inttoptr(context.cast(builder, args[3], sig.args[3], types.uint64), _I8P)
        fnty = ir.FunctionType(_I32, [_I8P, _I32, _I8P])
        target = builder.inttoptr(context.cast(builder, args[0], sig.args[0], types.uint64),
                                  fnty.as_pointer())
        return builder.call(target, [cq_ptr, n, wc_ptr])
    return types.int32(function, cq, count, wc), codegen


@njit(nogil=True, cache=False)
def byteswap32(value):
    """imm_data is in network byte order in WRs and completions."""
    v = np.uint64(value) & np.uint64(0xFFFFFFFF)
    return (((v & np.uint64(0xFF)) << np.uint64(24)) | ((v & np.uint64(0xFF00)) << np.uint64(8))
            | ((v >> np.uint64(8)) & np.uint64(0xFF00)) | (v >> np.uint64(24)))


@njit(nogil=True, cache=False)
def write_send_wr(wrs, sges, i, wr_id, opcode, local_address, length, lkey, remote_address,
                  rkey, send_flags, imm_data, has_imm):
    """Row `i` of `wrs` as an RDMA WRITE (with immediate) of one SGE (none when length is
    0 and has_imm: a zero-length write-with-immediate). Links are set by :func:`link`.
    Words past ``W_RKEY`` are never written: rows start zeroed (:func:`new_send_wrs`)."""
    sges[i, G_ADDR] = np.uint64(local_address)
    sges[i, G_LENGTH_LKEY] = np.uint64(length) | (np.uint64(lkey) << np.uint64(32))
    num_sge = np.uint64(0) if (length == 0 and has_imm) else np.uint64(1)
    wrs[i, W_ID] = np.uint64(wr_id)
    wrs[i, W_SG_LIST] = np.uint64(sges.ctypes.data) + np.uint64(i * SGE_WORDS * 8)
    wrs[i, W_NUM_SGE_OPCODE] = num_sge | (np.uint64(opcode) << np.uint64(32))
    imm = byteswap32(imm_data) if has_imm else np.uint64(0)
    wrs[i, W_FLAGS_IMM] = np.uint64(send_flags) | (imm << np.uint64(32))
    wrs[i, W_REMOTE_ADDR] = np.uint64(remote_address)
    wrs[i, W_RKEY] = np.uint64(rkey)


@njit(nogil=True, cache=False)
def link(wrs, first, count):
    """Chain rows first .. first+count-1 of `wrs` (next pointers; the last one null)."""
    base = np.uint64(wrs.ctypes.data)
    for i in range(first, first + count):
        if i + 1 < first + count:
            wrs[i, W_NEXT] = base + np.uint64((i + 1) * SEND_WR_WORDS * 8)
        else:
            wrs[i, W_NEXT] = np.uint64(0)
    return base + np.uint64(first * SEND_WR_WORDS * 8)


@njit(nogil=True, cache=False)
def completion(wcs, i):
    """(wr_id, status, opcode, imm_data in host order) of completion row `i`."""
    word = wcs[i, C_STATUS_OPCODE]
    return (wcs[i, C_ID], word & np.uint64(0xFFFFFFFF), word >> np.uint64(32),
            byteswap32(wcs[i, C_IMM_QPN] & np.uint64(0xFFFFFFFF)))


def new_send_wrs(count: int) -> tuple[np.ndarray, np.ndarray]:
    """Zeroed arrays for `count` send WRs and their SGEs."""
    return (np.zeros((count, SEND_WR_WORDS), dtype=np.uint64),
            np.zeros((count, SGE_WORDS), dtype=np.uint64))


def new_completions(count: int) -> np.ndarray:
    return np.zeros((count, WC_WORDS), dtype=np.uint64)


def context_functions(object_address: int) -> tuple[int, int, int]:
    """(post_send, poll_cq, post_recv) of the device context an ibv_qp or ibv_cq at
    `object_address` belongs to (its first word is its ``ibv_context *``)."""
    if not object_address:
        raise ValueError("mkrt.proxy: verbs object address is null")
    context = ctypes.c_uint64.from_address(object_address).value
    if not context:
        raise ValueError(f"mkrt.proxy: verbs object at {object_address:#x} has no context")
    post_send, poll_cq, post_recv = (ctypes.c_uint64.from_address(context + offset).value
                                     for offset in (CONTEXT_POST_SEND, CONTEXT_POLL_CQ,
                                                    CONTEXT_POST_RECV))
    if not post_send or not poll_cq:
        raise ValueError(f"mkrt.proxy: verbs context at {context:#x} has no post_send/poll_cq")
    return post_send, poll_cq, post_recv


# ---- the extended QP API (EFA SRD endpoints post through it) ---------------------------------
# struct ibv_qp is 160 bytes on x86-64 glibc (6 pointers, 4 u32, pthread_mutex_t of 40 and
# pthread_cond_t of 48 bytes, u32, padding); struct ibv_qp_ex begins with it, then
# comp_mask (u64), wr_id (u64), wr_flags (u32) and the function pointers in this order.
IBV_QP_BYTES = 160
QPX_WR_ID = IBV_QP_BYTES + 8
QPX_WR_FLAGS = IBV_QP_BYTES + 16
_QPX_FUNCTIONS = ("atomic_cmp_swp", "atomic_fetch_add", "bind_mw", "local_inv", "rdma_read",
                  "rdma_write", "rdma_write_imm", "send", "send_imm", "send_inv", "send_tso",
                  "set_ud_addr", "set_xrc_srqn", "set_inline_data", "set_inline_data_list",
                  "set_sge", "set_sge_list", "start", "complete", "abort")
#: byte offset in struct ibv_qp_ex of each ``wr_*`` function pointer
QPX = {name: IBV_QP_BYTES + 24 + 8 * i for i, name in enumerate(_QPX_FUNCTIONS)}
QPX_BYTES = QPX["abort"] + 8 + 16          # up to wr_abort, and the two after it

RECV_WR_WORDS = 4                          # struct ibv_recv_wr: wr_id, next, sg_list, num_sge


def _pointer(context, builder, value, typ):
    """`value` (an address) as an i8*."""
    return builder.inttoptr(context.cast(builder, value, typ, types.uint64), _I8P)


@intrinsic
def call_qpx(typingctx, function, qpx):
    """``function(qpx)`` (wr_start, wr_abort)."""
    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.VoidType(), [_I8P])
        target = builder.inttoptr(context.cast(builder, args[0], sig.args[0], types.uint64),
                                  fnty.as_pointer())
        builder.call(target, [_pointer(context, builder, args[1], sig.args[1])])
        return context.get_dummy_value()
    return types.void(function, qpx), codegen


@intrinsic
def call_qpx_complete(typingctx, function, qpx):
    """``int function(qpx)`` (wr_complete: posts what was built since wr_start)."""
    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(_I32, [_I8P])
        target = builder.inttoptr(context.cast(builder, args[0], sig.args[0], types.uint64),
                                  fnty.as_pointer())
        return builder.call(target, [_pointer(context, builder, args[1], sig.args[1])])
    return types.int32(function, qpx), codegen


@intrinsic
def _call_qpx_word_address_word(typingctx, function, qpx, word, address, last_word):
    """``function(qpx, u32 word, u64 address, u32 last_word)``."""
    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.VoidType(), [_I8P, _I32, ir.IntType(64), _I32])
        target = builder.inttoptr(context.cast(builder, args[0], sig.args[0], types.uint64),
                                  fnty.as_pointer())
        builder.call(target, [_pointer(context, builder, args[1], sig.args[1]),
                              context.cast(builder, args[2], sig.args[2], types.uint32),
                              context.cast(builder, args[3], sig.args[3], types.uint64),
                              context.cast(builder, args[4], sig.args[4], types.uint32)])
        return context.get_dummy_value()
    return types.void(function, qpx, word, address, last_word), codegen


#: ``wr_rdma_write_imm(qpx, rkey, remote_address, imm)``, or ``wr_rdma_write(qpx, rkey,
#: remote_address)`` (the fourth argument is then ignored by the callee)
call_qpx_write = _call_qpx_word_address_word
#: ``wr_set_sge(qpx, lkey, address, length)``
call_qpx_sge = _call_qpx_word_address_word


@intrinsic
def call_qpx_ud_addr(typingctx, function, qpx, ah, remote_qpn, remote_qkey):
    """``wr_set_ud_addr(qpx, ah, remote_qpn, remote_qkey)``."""
    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.VoidType(), [_I8P, _I8P, _I32, _I32])
        target = builder.inttoptr(context.cast(builder, args[0], sig.args[0], types.uint64),
                                  fnty.as_pointer())
        builder.call(target, [_pointer(context, builder, args[1], sig.args[1]),
                              _pointer(context, builder, args[2], sig.args[2]),
                              context.cast(builder, args[3], sig.args[3], types.uint32),
                              context.cast(builder, args[4], sig.args[4], types.uint32)])
        return context.get_dummy_value()
    return types.void(function, qpx, ah, remote_qpn, remote_qkey), codegen


def qpx_functions(qp_address: int) -> dict[str, int]:
    """The ``wr_*`` function pointers of the extended QP at `qp_address` (an ibv_qp of an
    extended QP is the start of its ibv_qp_ex)."""
    return {name: ctypes.c_uint64.from_address(qp_address + offset).value
            for name, offset in QPX.items()
            if name in ("rdma_write", "rdma_write_imm", "set_ud_addr", "set_sge", "start",
                        "complete", "abort")}


# ---- address handles (EFA SRD) ----------------------------------------------------------
# pyverbs keeps an AH's ``ibv_ah *`` private, and the compiled loop needs it for every
# write (``wr_set_ud_addr``), so the transport makes its own with libibverbs'
# ``ibv_create_ah`` (an exported function, not an inline one) on the QP's protection domain.

#: byte offset of ``struct ibv_pd *pd`` in ``struct ibv_qp`` (after context, qp_context)
QP_PD = 16


class IbvGlobalRoute(ctypes.Structure):
    """``struct ibv_global_route`` (24 bytes)."""
    _fields_ = [("dgid", ctypes.c_uint8 * 16), ("flow_label", ctypes.c_uint32),
                ("sgid_index", ctypes.c_uint8), ("hop_limit", ctypes.c_uint8),
                ("traffic_class", ctypes.c_uint8)]


class IbvAhAttr(ctypes.Structure):
    """``struct ibv_ah_attr`` (32 bytes)."""
    _fields_ = [("grh", IbvGlobalRoute), ("dlid", ctypes.c_uint16), ("sl", ctypes.c_uint8),
                ("src_path_bits", ctypes.c_uint8), ("static_rate", ctypes.c_uint8),
                ("is_global", ctypes.c_uint8), ("port_num", ctypes.c_uint8)]


def _libibverbs():
    library = ctypes.CDLL("libibverbs.so.1", use_errno=True)
    library.ibv_create_ah.restype = ctypes.c_void_p
    library.ibv_create_ah.argtypes = [ctypes.c_void_p, ctypes.POINTER(IbvAhAttr)]
    library.ibv_destroy_ah.restype = ctypes.c_int
    library.ibv_destroy_ah.argtypes = [ctypes.c_void_p]
    return library


def address_handle_attributes(gid: bytes, sgid_index: int, port: int) -> IbvAhAttr:
    """A global route to `gid` (EFA addresses by GID only), as pyverbs' AHAttr makes it."""
    if len(gid) != 16:
        raise ValueError(f"mkrt.proxy: a GID is 16 bytes; got {len(gid)}")
    attr = IbvAhAttr()
    attr.grh.dgid[:] = list(gid)
    attr.grh.sgid_index = sgid_index
    attr.grh.hop_limit = 1
    attr.is_global = 1
    attr.port_num = port
    return attr


class RawAddressHandle:
    """An ``ibv_ah`` the compiled loop can name (``address``), made on the protection domain
    of the QP at `qp_address`, beside `pyverbs_ah` (what the Python posting path uses)."""

    def __init__(self, qp_address: int, gid: bytes, sgid_index: int, port: int,
                 pyverbs_ah=None, *, library=None):
        self._library = library or _libibverbs()
        self.pyverbs = pyverbs_ah
        pd = ctypes.c_uint64.from_address(qp_address + QP_PD).value
        attr = address_handle_attributes(gid, sgid_index, port)
        self.address = self._library.ibv_create_ah(pd, ctypes.byref(attr)) or 0
        if not self.address:
            raise OSError(ctypes.get_errno(), f"mkrt.proxy: ibv_create_ah failed for GID "
                          f"{gid.hex()} (port {port}, sgid index {sgid_index})")

    def close(self) -> None:
        if self.address:
            self._library.ibv_destroy_ah(self.address)
            self.address = 0
