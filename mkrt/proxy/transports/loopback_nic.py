"""A loopback stand-in for an RDMA NIC, behind the real libibverbs ABI.

No machine here has an RDMA device, so the compiled verbs path is proven against this:
an ``ibv_context`` whose ops table holds ``post_send`` and ``poll_cq`` compiled with
Numba (C-callable), ``ibv_qp`` and ``ibv_cq`` structs with the real leading fields, and a
completion ring behind each CQ. The poster cannot tell it from a provider: it reads the
function pointers from the context and calls them on real ``ibv_send_wr`` chains
(:mod:`mkrt.proxy.transports.verbs_abi`).

What the stand-in does, as an RC queue pair does:

* an RDMA WRITE copies ``sge.length`` bytes from ``sge.addr`` to ``remote_addr`` at post
  time (inline or not: the data is read when posted), in chain order, so a flag written
  after data lands after it; WRITE-with-immediate then adds a receive completion (opcode
  ``IBV_WC_RECV_RDMA_WITH_IMM``, the immediate in network order) to the peer's CQ;
* addresses go through the fabric's memory registrations as on a NIC: the remote range
  must lie in a registration with the WR's rkey (else ``IBV_WC_REM_ACCESS_ERR``), the
  local one in a registration with the SGE's lkey (else ``IBV_WC_LOC_PROT_ERR``; inline
  data is read from its plain address), each translated from the registration's base
  (the iova of a dma-buf registration) to where the memory is mapped;
* a signalled WR adds a send completion to the QP's send CQ; send-queue slots come back
  when a signalled completion is polled (every WR up to it), and ``post_send`` refuses a
  WR beyond ``depth`` outstanding (ENOMEM, ``*bad_wr`` set) as a provider does;
* fault injection: ``fail_after=n`` makes the n-th WR complete with
  ``IBV_WC_REM_ACCESS_ERR`` without writing anything; the QP is then in error and every
  later WR completes with ``IBV_WC_WR_FLUSH_ERR`` (signalled or not).

Copies use memmove on host addresses; a copy function (``use_copy``: the address of a
C function ``int copy(void *dst, const void *src, size_t n, u64 argument)``) replaces
it, e.g. a device copy for GPU memory (:func:`device_copy_function`). Everything runs on the posting thread (synchronously), so a completion exists
as soon as ``post_send`` returns.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import cfunc, njit, types
from numba.extending import intrinsic

from mkrt.proxy.atomics import (copy_bytes, fetch_add_at, load_acquire_at, spin_pause,
                                store_release_at)
from mkrt.proxy.transports import verbs_abi as A

IBV_WC_SUCCESS = 0
IBV_WC_LOC_PROT_ERR = 4
IBV_WC_WR_FLUSH_ERR = 5
IBV_WC_RNR_RETRY_EXC_ERR = 13
IBV_WC_REM_ACCESS_ERR = 10
IBV_WC_RDMA_WRITE = 1
IBV_WC_RECV_RDMA_WITH_IMM = 129
IBV_WR_RDMA_WRITE_WITH_IMM = 1
IBV_SEND_SIGNALED = 2
IBV_SEND_INLINE = 8
ENOMEM = 12
RNR_SPINS = 20_000_000     # receiver-not-ready retries before IBV_WC_RNR_RETRY_EXC_ERR (~1 s)

# the stand-in's state of one QP (what ibv_qp.qp_context points at), u64 words
Q_DEPTH, Q_POSTED, Q_FREED, Q_FAIL_AFTER, Q_ERROR, Q_PEER_CQ, Q_COPY, Q_QPN, Q_MRS, Q_COPY_ARG, \
    Q_BUILD, Q_BUILT, Q_BUILD_CAPACITY, Q_BUILD_OVERFLOW, Q_REORDER = range(15)
QP_STATE_WORDS = 16
# a WR being built through the extended QP API (state[Q_BUILD] rows)
B_ID, B_FLAGS, B_OPCODE, B_RKEY, B_REMOTE, B_IMM, B_AH, B_SGE, B_LENGTH_LKEY, B_HAS_SGE = range(10)
B_WORDS = 10
# the fabric's registrations: a header (rows per owner, owners), then per owner its rows of
# (key, base, address, size); key = owner << KEY_OWNER_SHIFT | (FIRST_KEY + row); a free
# row is all zeros. An owner is the rank that registered the memory: in one process one
# owner serves every rank; across processes each process registers as its rank and adds
# aliases of its peers' registrations (their keys, mapped to where it maps their memory).
MR_HEADER_WORDS = 2
MR_WORDS = 4
FIRST_KEY = 0x100
KEY_OWNER_SHIFT = 24
KEY_INDEX_MASK = (1 << KEY_OWNER_SHIFT) - 1
# a CQ's ring (what ibv_cq.cq_context points at): header words, then entries
R_CAPACITY, R_HEAD, R_TAIL, R_OVERFLOW, R_RECV_POSTED, R_LOCK_NEXT, R_LOCK_SERVING = range(7)
RING_HEADER_WORDS = 8
# entry words past the ibv_wc ones: which QP state to credit, and up to which WR
E_QP_STATE, E_SEQUENCE = A.WC_WORDS, A.WC_WORDS + 1
ENTRY_WORDS = A.WC_WORDS + 2

_I8P = ir.IntType(8).as_pointer()


@intrinsic
def _call_copy(typingctx, function, dst, src, nbytes, argument):
    """``((int (*)(void *, const void *, size_t, u64))function)(dst, src, nbytes, argument)``."""
    def codegen(context, builder, sig, args):
        d = builder.inttoptr(context.cast(builder, args[1], sig.args[1], types.uint64), _I8P)
        s = builder.inttoptr(context.cast(builder, args[2], sig.args[2], types.uint64), _I8P)
        n = context.cast(builder, args[3], sig.args[3], types.uint64)
        a = context.cast(builder, args[4], sig.args[4], types.uint64)
        fnty = ir.FunctionType(ir.IntType(32), [_I8P, _I8P, ir.IntType(64), ir.IntType(64)])
        target = builder.inttoptr(context.cast(builder, args[0], sig.args[0], types.uint64),
                                  fnty.as_pointer())
        return builder.call(target, [d, s, n, a])
    return types.int32(function, dst, src, nbytes, argument), codegen


@njit(nogil=True, cache=False)
def _word(address, index):
    return load_acquire_at(address + np.uint64(8 * index))


@njit(nogil=True, cache=False)
def _set(address, index, value):
    store_release_at(address + np.uint64(8 * index), np.uint64(value))


@njit(nogil=True, cache=False)
def _push(cq, wr_id, status, opcode, byte_len, imm_network, qp_state, sequence):
    """Append a completion to the ring of the ibv_cq at `cq`; False when it is full. Several
    threads may push (a peer's receive completions, this NIC's own): a ticket lock."""
    ring = _word(cq, 2)                                    # ibv_cq.cq_context
    ticket = fetch_add_at(ring + np.uint64(8 * R_LOCK_NEXT), np.uint64(1))
    while _word(ring, R_LOCK_SERVING) != ticket:
        spin_pause()
    pushed = _push_locked(ring, wr_id, status, opcode, byte_len, imm_network, qp_state, sequence)
    _set(ring, R_LOCK_SERVING, ticket + np.uint64(1))
    return pushed


@njit(nogil=True, cache=False)
def _push_locked(ring, wr_id, status, opcode, byte_len, imm_network, qp_state, sequence):
    capacity, head = _word(ring, R_CAPACITY), _word(ring, R_HEAD)
    if head - _word(ring, R_TAIL) >= capacity:
        _set(ring, R_OVERFLOW, _word(ring, R_OVERFLOW) + np.uint64(1))
        return False
    entry = ring + np.uint64(8 * RING_HEADER_WORDS) + (head % capacity) * np.uint64(8 * ENTRY_WORDS)
    _set(entry, A.C_ID, wr_id)
    _set(entry, A.C_STATUS_OPCODE, np.uint64(status) | (np.uint64(opcode) << np.uint64(32)))
    _set(entry, A.C_VENDOR_LENGTH, np.uint64(byte_len) << np.uint64(32))
    _set(entry, A.C_IMM_QPN, imm_network)
    _set(entry, A.C_SRC_FLAGS, 0)
    _set(entry, A.C_PKEY_SLID_SL, 0)
    _set(entry, E_QP_STATE, qp_state)
    _set(entry, E_SEQUENCE, sequence)
    _set(ring, R_HEAD, head + np.uint64(1))
    return True


@njit(nogil=True, cache=False)
def _translate(mrs, key, address, length):
    """Where [address, address + length) of registration `key` is mapped; 0 if outside
    (or the key is unknown or deregistered). A key names its row: owner and index."""
    per_owner, owners = _word(mrs, 0), _word(mrs, 1)
    owner = key >> np.uint64(KEY_OWNER_SHIFT)
    index = (key & np.uint64(KEY_INDEX_MASK)) - np.uint64(FIRST_KEY)
    if (key & np.uint64(KEY_INDEX_MASK)) < np.uint64(FIRST_KEY) or owner >= owners \
            or index >= per_owner:
        return np.uint64(0)
    row = mrs + np.uint64(8 * MR_HEADER_WORDS) \
        + (owner * per_owner + index) * np.uint64(MR_WORDS * 8)
    base, size = _word(row, 1), _word(row, 3)
    if _word(row, 0) != key or address < base or address - base + length > size:
        return np.uint64(0)
    return _word(row, 2) + (address - base)


@njit(nogil=True, cache=False)
def _execute(state, in_error, sequence, opcode, flags, has_sge, source, length, lkey, remote,
             rkey, imm_network, receiver_cq):
    """Carry out one WR as the NIC would (write, then a receive completion for an
    immediate); returns its completion status."""
    if in_error:
        return IBV_WC_WR_FLUSH_ERR
    if _word(state, Q_FAIL_AFTER) == sequence:
        return IBV_WC_REM_ACCESS_ERR
    mrs = _word(state, Q_MRS)
    if has_sge and length != np.uint64(0):
        if (flags & np.uint64(IBV_SEND_INLINE)) == np.uint64(0):
            source = _translate(mrs, lkey, source, length)
        target = _translate(mrs, rkey, remote, length)
        if source == np.uint64(0):
            return IBV_WC_LOC_PROT_ERR
        if target == np.uint64(0):
            return IBV_WC_REM_ACCESS_ERR
        copy = _word(state, Q_COPY)
        if copy != np.uint64(0):
            if _call_copy(copy, target, source, length, _word(state, Q_COPY_ARG)) != 0:
                return IBV_WC_REM_ACCESS_ERR
        else:
            copy_bytes(target, source, length)
    if opcode == np.uint64(IBV_WR_RDMA_WRITE_WITH_IMM):
        # take a receive posted there; none: retry a while (the receiver's proxy reposts
        # them as it polls), as a NIC's receiver-not-ready retries do, then give up
        ring = _word(receiver_cq, 2)
        spins = 0
        while True:
            posted = _word(ring, R_RECV_POSTED)
            if posted != np.uint64(0):
                if fetch_add_at(ring + np.uint64(8 * R_RECV_POSTED),
                                np.uint64(0xFFFFFFFFFFFFFFFF)) != np.uint64(0):
                    break
                fetch_add_at(ring + np.uint64(8 * R_RECV_POSTED), np.uint64(1))  # raced: undo
            spins += 1
            if spins > RNR_SPINS:
                return IBV_WC_RNR_RETRY_EXC_ERR
            spin_pause()
        _push(receiver_cq, 0, IBV_WC_SUCCESS, IBV_WC_RECV_RDMA_WITH_IMM, length, imm_network,
              np.uint64(0), np.uint64(0))
    return IBV_WC_SUCCESS


@cfunc(types.int32(types.uint64, types.uint64, types.uint64), nogil=True)
def loopback_post_send(qp, wr, bad_wr):
    state = _word(qp, 1)                                   # ibv_qp.qp_context
    send_cq = _word(qp, 3)                                 # ibv_qp.send_cq
    # the QP's words are read once and written back once (as a provider keeps them)
    posted, depth = _word(state, Q_POSTED), _word(state, Q_DEPTH)
    in_error = _word(state, Q_ERROR) != np.uint64(0)
    rc = 0
    while wr != np.uint64(0):
        if posted - _word(state, Q_FREED) >= depth:
            store_release_at(bad_wr, wr)
            rc = ENOMEM
            break
        posted += np.uint64(1)
        num_opcode = _word(wr, A.W_NUM_SGE_OPCODE)
        flags_imm = _word(wr, A.W_FLAGS_IMM)
        flags = flags_imm & np.uint64(0xFFFFFFFF)
        sge = _word(wr, A.W_SG_LIST)
        has_sge = (num_opcode & np.uint64(0xFFFFFFFF)) != np.uint64(0)
        length = _word(sge, A.G_LENGTH_LKEY) & np.uint64(0xFFFFFFFF) if has_sge else np.uint64(0)
        status = _execute(state, in_error, posted, num_opcode >> np.uint64(32), flags, has_sge,
                          _word(sge, A.G_ADDR) if has_sge else np.uint64(0), length,
                          _word(sge, A.G_LENGTH_LKEY) >> np.uint64(32) if has_sge else np.uint64(0),
                          _word(wr, A.W_REMOTE_ADDR), _word(wr, A.W_RKEY) & np.uint64(0xFFFFFFFF),
                          flags_imm >> np.uint64(32), _word(state, Q_PEER_CQ))
        if status != IBV_WC_SUCCESS:
            in_error = True                                # the QP is in error from here on
        if status != IBV_WC_SUCCESS or (flags & np.uint64(IBV_SEND_SIGNALED)) != np.uint64(0):
            _push(send_cq, _word(wr, A.W_ID), status, IBV_WC_RDMA_WRITE, length, 0, state, posted)
        wr = _word(wr, A.W_NEXT)
    _set(state, Q_POSTED, posted)
    _set(state, Q_ERROR, 1 if in_error else 0)
    return rc


# ---- the extended QP API (SRD endpoints): WRs are built by calls, posted by wr_complete ----

@njit(nogil=True, cache=False)
def _building(qpx):
    """(state, address of the WR being built) of the extended QP at `qpx`."""
    state = _word(qpx, 1)
    count = _word(state, Q_BUILT)
    return state, _word(state, Q_BUILD) + (count - np.uint64(1)) * np.uint64(8 * B_WORDS)


@njit(nogil=True, cache=False)
def _begin_wr(qpx, opcode, rkey, remote, imm_network):
    state = _word(qpx, 1)
    count = _word(state, Q_BUILT)
    if count >= _word(state, Q_BUILD_CAPACITY):
        _set(state, Q_BUILD_OVERFLOW, 1)
        return
    entry = _word(state, Q_BUILD) + count * np.uint64(8 * B_WORDS)
    _set(entry, B_ID, load_acquire_at(qpx + np.uint64(A.QPX_WR_ID)))
    _set(entry, B_FLAGS, load_acquire_at(qpx + np.uint64(A.QPX_WR_FLAGS)) & np.uint64(0xFFFFFFFF))
    _set(entry, B_OPCODE, opcode)
    _set(entry, B_RKEY, rkey)
    _set(entry, B_REMOTE, remote)
    _set(entry, B_IMM, imm_network)
    _set(entry, B_AH, 0)
    _set(entry, B_SGE, 0)
    _set(entry, B_LENGTH_LKEY, 0)
    _set(entry, B_HAS_SGE, 0)
    _set(state, Q_BUILT, count + np.uint64(1))


@cfunc(types.void(types.uint64), nogil=True)
def loopback_wr_start(qpx):
    state = _word(qpx, 1)
    _set(state, Q_BUILT, 0)
    _set(state, Q_BUILD_OVERFLOW, 0)


@cfunc(types.void(types.uint64, types.uint32, types.uint64, types.uint32), nogil=True)
def loopback_wr_rdma_write(qpx, rkey, remote, unused):
    _begin_wr(qpx, np.uint64(0), np.uint64(rkey), remote, np.uint64(0))


@cfunc(types.void(types.uint64, types.uint32, types.uint64, types.uint32), nogil=True)
def loopback_wr_rdma_write_imm(qpx, rkey, remote, imm_network):
    _begin_wr(qpx, np.uint64(IBV_WR_RDMA_WRITE_WITH_IMM), np.uint64(rkey), remote,
              np.uint64(imm_network))


@cfunc(types.void(types.uint64, types.uint64, types.uint32, types.uint32), nogil=True)
def loopback_wr_set_ud_addr(qpx, ah, remote_qpn, remote_qkey):
    state, entry = _building(qpx)
    if _word(state, Q_BUILT) != np.uint64(0):
        _set(entry, B_AH, _word(ah, 0))                    # the stand-in's AH: the peer's CQ


@cfunc(types.void(types.uint64, types.uint32, types.uint64, types.uint32), nogil=True)
def loopback_wr_set_sge(qpx, lkey, address, length):
    state, entry = _building(qpx)
    if _word(state, Q_BUILT) != np.uint64(0):
        _set(entry, B_SGE, address)
        _set(entry, B_LENGTH_LKEY, np.uint64(length) | (np.uint64(lkey) << np.uint64(32)))
        _set(entry, B_HAS_SGE, 1)


@cfunc(types.int32(types.uint64), nogil=True)
def loopback_wr_complete(qpx):
    """Post what was built: each WR as post_send would, completions for every signalled
    one; ``reorder`` QPs carry them out last to first (SRD delivers in any order)."""
    state = _word(qpx, 1)
    send_cq = _word(qpx, 3)
    built = _word(state, Q_BUILT)
    _set(state, Q_BUILT, 0)
    if _word(state, Q_BUILD_OVERFLOW) != np.uint64(0):
        return ENOMEM
    posted, depth = _word(state, Q_POSTED), _word(state, Q_DEPTH)
    if posted + built - _word(state, Q_FREED) > depth:
        return ENOMEM
    in_error = _word(state, Q_ERROR) != np.uint64(0)
    reverse = _word(state, Q_REORDER) != np.uint64(0)
    base = _word(state, Q_BUILD)
    for k in range(built):
        i = built - np.uint64(1) - np.uint64(k) if reverse else np.uint64(k)
        entry = base + i * np.uint64(8 * B_WORDS)
        sequence = posted + i + np.uint64(1)
        length_lkey = _word(entry, B_LENGTH_LKEY)
        length = length_lkey & np.uint64(0xFFFFFFFF)
        status = _execute(state, in_error, sequence, _word(entry, B_OPCODE), _word(entry, B_FLAGS),
                          _word(entry, B_HAS_SGE) != np.uint64(0), _word(entry, B_SGE), length,
                          length_lkey >> np.uint64(32), _word(entry, B_REMOTE), _word(entry, B_RKEY),
                          _word(entry, B_IMM), _word(entry, B_AH))
        if status != IBV_WC_SUCCESS:
            in_error = True
        if status != IBV_WC_SUCCESS or (_word(entry, B_FLAGS) & np.uint64(IBV_SEND_SIGNALED)) != np.uint64(0):
            # unordered: a completion frees its own slot only (every WR is signalled on SRD)
            _push(send_cq, _word(entry, B_ID), status, IBV_WC_RDMA_WRITE, length, 0, state,
                  np.uint64(0))
    _set(state, Q_POSTED, posted + built)
    _set(state, Q_ERROR, 1 if in_error else 0)
    return 0


@cfunc(types.void(types.uint64), nogil=True)
def loopback_wr_abort(qpx):
    _set(_word(qpx, 1), Q_BUILT, 0)


@cfunc(types.int32(types.uint64, types.uint64, types.uint64), nogil=True)
def loopback_post_recv(qp, wr, bad_wr):
    """Receives carry no data here (writes with immediate): count them on the QP's CQ."""
    ring = _word(_word(qp, 4), 2)                          # ibv_qp.recv_cq -> its ring
    count = np.uint64(0)
    while wr != np.uint64(0):
        count += np.uint64(1)
        wr = _word(wr, 1)
    fetch_add_at(ring + np.uint64(8 * R_RECV_POSTED), count)
    return 0


@cfunc(types.int32(types.uint64, types.int32, types.uint64), nogil=True)
def loopback_poll_cq(cq, count, wc):
    ring = _word(cq, 2)
    capacity = _word(ring, R_CAPACITY)
    taken = 0
    while taken < count:
        tail = _word(ring, R_TAIL)
        if tail == _word(ring, R_HEAD):
            break
        entry = ring + np.uint64(8 * RING_HEADER_WORDS) + (tail % capacity) * np.uint64(8 * ENTRY_WORDS)
        out = wc + np.uint64(taken * A.WC_WORDS * 8)
        for w in range(A.WC_WORDS):
            _set(out, w, _word(entry, w))
        qp_state = _word(entry, E_QP_STATE)
        if qp_state != np.uint64(0):
            sequence = _word(entry, E_SEQUENCE)
            if sequence != np.uint64(0):                   # RC: every slot up to it is free
                _set(qp_state, Q_FREED, sequence)
            else:                                          # SRD: its own slot
                _set(qp_state, Q_FREED, _word(qp_state, Q_FREED) + np.uint64(1))
        _set(ring, R_TAIL, tail + np.uint64(1))
        taken += 1
    return taken


class LoopbackFabric:
    """The memory registrations the NICs of this process see (rkeys are fabric-wide, as
    (rank, rkey) pairs are on a real network). ``owners``: ranks whose registrations it
    holds (1 when every rank lives in this process and shares owner 0)."""

    def __init__(self, *, owners: int = 1, per_owner: int = 16384):
        if not 1 <= owners <= 1 << (64 - KEY_OWNER_SHIFT - 1) or not 1 <= per_owner < KEY_INDEX_MASK - FIRST_KEY:
            raise ValueError(f"mkrt.proxy: loopback fabric of {owners=}, {per_owner=}")
        self.owners, self.per_owner = owners, per_owner
        self.mrs = np.zeros(MR_HEADER_WORDS + owners * per_owner * MR_WORDS, dtype=np.uint64)
        self.mrs[0], self.mrs[1] = per_owner, owners
        self._used = [0] * owners             # rows ever used, per owner
        self._free: list[list[int]] = [[] for _ in range(owners)]   # rows freed, reused first

    def _row(self, owner: int, index: int) -> int:
        return MR_HEADER_WORDS + (owner * self.per_owner + index) * MR_WORDS

    def register(self, address: int, size: int, base: int | None = None, *, owner: int = 0) -> int:
        """A registration of [address, address + size), addressed in WRs from `base`
        (default: `address`), by `owner`; returns its key (lkey = rkey)."""
        if not 0 <= owner < self.owners:
            raise ValueError(f"mkrt.proxy: loopback owner {owner} outside 0..{self.owners - 1}")
        if self._free[owner]:
            index = self._free[owner].pop()
        else:
            index = self._used[owner]
            if index >= self.per_owner:
                raise ValueError(f"mkrt.proxy: the loopback fabric holds {self.per_owner} "
                                 f"registrations per owner")
            self._used[owner] += 1
        key = (owner << KEY_OWNER_SHIFT) | (FIRST_KEY + index)
        row = self._row(owner, index)
        self.mrs[row:row + MR_WORDS] = (key, address if base is None else base, address, size)
        return key

    def alias(self, key: int, base: int, address: int, size: int) -> None:
        """Another process's registration `key` (WRs address it from `base`), reachable
        here at `address` (this process's mapping of the same memory)."""
        owner, index = self._split(key)
        row = self._row(owner, index)
        self.mrs[row:row + MR_WORDS] = (key, base, address, size)

    def _split(self, key: int) -> tuple[int, int]:
        owner, index = key >> KEY_OWNER_SHIFT, (key & KEY_INDEX_MASK) - FIRST_KEY
        if not (0 <= owner < self.owners and 0 <= index < self.per_owner):
            raise ValueError(f"mkrt.proxy: loopback key {key:#x} names no row of this fabric")
        return owner, index

    def deregister(self, key: int) -> None:
        owner, index = self._split(key)
        row = self._row(owner, index)
        if int(self.mrs[row]) != key:
            raise ValueError(f"mkrt.proxy: loopback key {key:#x} is not registered")
        self.mrs[row:row + MR_WORDS] = 0
        if index < self._used[owner]:
            self._free[owner].append(index)


class LoopbackNic:
    """One device context of the stand-in: a CQ and queue pairs, as raw structs in numpy
    memory this object keeps alive. ``qp_address(i)`` / ``cq_address`` are what pyverbs'
    ``QP.qp`` / ``CQ.cq`` give on a real device."""

    def __init__(self, fabric: LoopbackFabric | None = None, *, cq_entries: int = 4096):
        self.fabric = fabric if fabric is not None else LoopbackFabric()
        self.context = np.zeros(32, dtype=np.uint64)         # device, then the ops table
        self.context[A.CONTEXT_POLL_CQ // 8] = loopback_poll_cq.address
        self.context[A.CONTEXT_POST_SEND // 8] = loopback_post_send.address
        self.context[A.CONTEXT_POST_RECV // 8] = loopback_post_recv.address
        self.ring = np.zeros(RING_HEADER_WORDS + cq_entries * ENTRY_WORDS, dtype=np.uint64)
        self.ring[R_CAPACITY] = cq_entries
        self.cq = np.zeros(8, dtype=np.uint64)
        self.cq[0] = self.context.ctypes.data
        self.cq[A.CQ_USER_CONTEXT // 8] = self.ring.ctypes.data
        self.qps: list[tuple[np.ndarray, np.ndarray]] = []    # (ibv_qp words, state)
        self._keep: list[np.ndarray] = []                       # arrays the structs point at

    @property
    def cq_address(self) -> int:
        return self.cq.ctypes.data

    def create_qp(self, depth: int, *, qp_num: int | None = None, extended: bool = False,
                  reorder: bool = False) -> int:
        """A queue pair with `depth` send slots; returns its index. ``extended``: an SRD-like
        QP posted through the extended QP API (``ibv_qp_ex``); ``reorder``: it carries out
        each posted batch last to first (SRD delivers in any order)."""
        if depth < 1:
            raise ValueError(f"mkrt.proxy: loopback QP depth must be >= 1; got {depth}")
        qp = np.zeros(A.QPX_BYTES // 8 if extended else 16, dtype=np.uint64)
        state = np.zeros(QP_STATE_WORDS, dtype=np.uint64)
        if extended:
            build = np.zeros((depth, B_WORDS), dtype=np.uint64)
            self._keep.append(build)
            state[Q_BUILD], state[Q_BUILD_CAPACITY] = build.ctypes.data, depth
            state[Q_REORDER] = int(reorder)
            for name, function in (("rdma_write", loopback_wr_rdma_write),
                                   ("rdma_write_imm", loopback_wr_rdma_write_imm),
                                   ("set_ud_addr", loopback_wr_set_ud_addr),
                                   ("set_sge", loopback_wr_set_sge), ("start", loopback_wr_start),
                                   ("complete", loopback_wr_complete), ("abort", loopback_wr_abort)):
                qp[A.QPX[name] // 8] = function.address
        state[Q_DEPTH] = depth
        state[Q_QPN] = len(self.qps) + 1 if qp_num is None else qp_num
        state[Q_MRS] = self.fabric.mrs.ctypes.data
        qp[0] = self.context.ctypes.data
        qp[A.QP_USER_CONTEXT // 8] = state.ctypes.data
        qp[3] = qp[4] = self.cq_address                        # send_cq, recv_cq
        qp[6] = int(state[Q_QPN]) << 32                        # handle, qp_num
        self.qps.append((qp, state))
        return len(self.qps) - 1

    def address_handle(self) -> np.ndarray:
        """What the stand-in uses as an ``ibv_ah`` of this NIC (a word holding its CQ's
        address: receive completions of writes with immediate land there)."""
        handle = np.array([self.cq_address], dtype=np.uint64)
        self._keep.append(handle)
        return handle

    def qp_address(self, index: int) -> int:
        return self.qps[index][0].ctypes.data

    def connect(self, index: int, peer_nic: "LoopbackNic") -> None:
        """Receive completions of writes-with-immediate from QP `index` go to `peer_nic`."""
        self.qps[index][1][Q_PEER_CQ] = peer_nic.cq_address

    def fail_after(self, index: int, wrs: int) -> None:
        """The `wrs`-th WR posted on QP `index` (counting from 1, over its life) fails."""
        self.qps[index][1][Q_FAIL_AFTER] = wrs

    def use_copy(self, index: int, function_address: int, argument: int = 0) -> None:
        """Copies of QP `index` call ``function(dst, src, nbytes, argument)`` (0: success)."""
        self.qps[index][1][Q_COPY] = function_address
        self.qps[index][1][Q_COPY_ARG] = argument

    def outstanding(self, index: int) -> int:
        state = self.qps[index][1]
        return int(state[Q_POSTED] - state[Q_FREED])

    @property
    def overflows(self) -> int:
        return int(self.ring[R_OVERFLOW])


class _LoopbackCQ:
    """The transport's CQ object: ``address`` for the compiled loop, ``poll`` for Python."""

    def __init__(self, nic: LoopbackNic):
        import ctypes
        self.nic, self.address = nic, nic.cq_address
        self._wcs = A.new_completions(64)
        self._poll = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_int,
                                      ctypes.c_uint64)(loopback_poll_cq.address)

    def poll(self, count: int):
        from mkrt.proxy.transports.verbs import Completion
        got = self._poll(self.address, min(count, self._wcs.shape[0]), self._wcs.ctypes.data)
        out = []
        for i in range(got):
            wr_id, status, opcode, imm = A.completion(self._wcs, i)
            out.append(Completion(int(wr_id), int(status), int(opcode), int(imm), 0))
        return out


class _LoopbackAH:
    def __init__(self, handle: np.ndarray):
        self.handle, self.address = handle, handle.ctypes.data


class _LoopbackQP:
    def __init__(self, nic: LoopbackNic, index: int):
        self.nic, self.index = nic, index
        self.address = nic.qp_address(index)
        self.qp_num = int(nic.qps[index][1][Q_QPN])


class LoopbackBackend:
    """The verbs transport's backend (same methods as ``PyverbsBackend``) over the
    loopback stand-in: ranks of one process share a :class:`LoopbackFabric`. RC queue
    pairs, or with ``efa=True`` an SRD-like endpoint (one QP behind the extended QP API,
    delivering out of order), as an EFA device would give."""

    def __init__(self, fabric: LoopbackFabric, rank: int, *, max_inline: int = 64,
                 device: int | None = None, efa: bool = False):
        """``device``: the GPU whose memory this rank registers; its queue pairs then copy
        with ``cuMemcpy`` (any memory under unified addressing) instead of memmove."""
        self.fabric, self.rank, self.max_inline, self.device = fabric, rank, max_inline, device
        self.efa = efa
        self.nic: LoopbackNic | None = None
        if not hasattr(fabric, "nics"):
            fabric.nics = {}
        self._post = None
        self._streams = []
        self._wrs, self._sges = A.new_send_wrs(256)
        self._bad = np.zeros(1, dtype=np.uint64)

    def open(self, device_name):
        from mkrt.proxy.transports.verbs import DeviceInfo
        return DeviceInfo("efa_loopback" if self.efa else "loopback", self.efa, self.rank + 1,
                          bytes([self.rank % 256]) * 16, 5, self.max_inline)

    def create_cq(self, cqe):
        self.nic = LoopbackNic(self.fabric, cq_entries=max(64, int(cqe)))
        self.fabric.nics[self.rank] = self.nic
        return _LoopbackCQ(self.nic)

    def create_qp(self, cq, sq_depth, recv_depth, max_inline, efa):
        # efa: an SRD-like endpoint behind the extended QP API, delivering out of order
        index = cq.nic.create_qp(sq_depth, extended=efa, reorder=efa)
        if self.device is not None:
            import cupy
            with cupy.cuda.Device(self.device):
                # its own non-blocking stream: a copy on the legacy stream would wait for
                # the caller's queued work, which waits for the kernels waiting for it
                stream = cupy.cuda.Stream(non_blocking=True)
            self._streams.append(stream)
            cq.nic.use_copy(index, device_copy_function(), stream.ptr)
        return _LoopbackQP(cq.nic, index)

    def thread_setup(self):
        """In the posting thread: make the GPU's primary context current (cuMemcpy)."""
        if self.device is not None:
            import cupy
            cupy.cuda.runtime.setDevice(self.device)
            cupy.cuda.runtime.free(0)

    def deregister(self, registration):
        self.fabric.deregister(registration.lkey)

    def connect(self, qp, local, remote):
        peer = self.fabric.nics.get(remote.rank)    # absent: the peer is another process
        if peer is not None:
            qp.nic.connect(qp.index, peer)

    def connect_srd(self, qp):
        """SRD endpoints need no connection."""

    def address(self, remote):
        """An address handle of `remote`'s NIC (its CQ takes the receive completions)."""
        peer = self.fabric.nics.get(remote.rank)
        if peer is None:
            raise ValueError(f"mkrt.proxy: the loopback stand-in reaches ranks of this process "
                             f"only; rank {remote.rank} is not here")
        return _LoopbackAH(peer.address_handle())

    def register(self, address, size, dmabuf_fd=None, dmabuf_offset=0):
        from mkrt.proxy.transports.verbs import Registration
        base = dmabuf_offset if dmabuf_fd is not None else address     # dma-buf: iova = offset
        key = self.fabric.register(address, size, base,
                                   owner=self.rank if self.fabric.owners > 1 else 0)
        return Registration(("loopback-mr", key), key, key, base)

    def post_send(self, qp, wrs, ah=None, remote=None):
        """The Python transport's post: the same chain the compiled loop would write (RC)."""
        import ctypes
        if ah is not None:
            raise ValueError("mkrt.proxy: the loopback stand-in's SRD endpoints are posted "
                             "through the extended QP API (the compiled loop)")
        if len(wrs) > self._wrs.shape[0]:
            raise ValueError(f"mkrt.proxy: loopback chain of {len(wrs)} WRs; at most "
                             f"{self._wrs.shape[0]}")
        if self._post is None:
            self._post = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64,
                                          ctypes.c_uint64)(loopback_post_send.address)
        for i, w in enumerate(wrs):
            A.write_send_wr(self._wrs, self._sges, i, w.wr_id, w.opcode, w.local_address,
                            w.length, w.lkey, w.remote_address, w.rkey, w.send_flags,
                            0 if w.imm_data is None else w.imm_data, w.imm_data is not None)
        head = A.link(self._wrs, 0, len(wrs))
        rc = self._post(qp.address, int(head), self._bad.ctypes.data)
        if rc != 0:
            raise RuntimeError(f"loopback post_send returned {rc}")

    def post_recv(self, qp, wr_ids):
        """Receives for writes with immediate (SRD): one recv WR each, no buffers."""
        import ctypes
        wrs = np.zeros((max(1, len(wr_ids)), A.RECV_WR_WORDS), dtype=np.uint64)
        for i, wr_id in enumerate(wr_ids):
            wrs[i, 0] = wr_id
            if i + 1 < len(wr_ids):
                wrs[i, 1] = wrs.ctypes.data + 8 * A.RECV_WR_WORDS * (i + 1)
        if wr_ids:
            post = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64,
                                    ctypes.c_uint64)(loopback_post_recv.address)
            post(qp.address, wrs.ctypes.data, self._bad.ctypes.data)

    def close(self):
        self.nic = None
        self._streams = []


_DEVICE_COPY = None


def device_copy_function() -> int:
    """Address of a C-callable ``int copy(void *dst, const void *src, size_t n, CUstream s)``
    that runs ``cuMemcpyAsync`` on `s` and waits for it (unified addressing tells host from
    device memory), for the stand-in's queue pairs on GPU memory. Needs libcuda (built on
    first use)."""
    global _DEVICE_COPY
    if _DEVICE_COPY is None:
        import ctypes
        try:
            cuda = ctypes.CDLL("libcuda.so.1")
        except OSError as error:
            raise RuntimeError(f"mkrt.proxy: the loopback NIC's device copies need libcuda: "
                               f"{error}") from None
        memcpy = cuda.cuMemcpyAsync
        memcpy.restype = ctypes.c_int
        memcpy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_uint64]
        synchronize = cuda.cuStreamSynchronize
        synchronize.restype = ctypes.c_int
        synchronize.argtypes = [ctypes.c_uint64]

        @cfunc(types.int32(types.uint64, types.uint64, types.uint64, types.uint64), nogil=True)
        def device_copy(dst, src, nbytes, stream):
            rc = memcpy(dst, src, nbytes, stream)
            if rc != 0:
                return rc
            return synchronize(stream)
        _DEVICE_COPY = device_copy
    return _DEVICE_COPY.address
