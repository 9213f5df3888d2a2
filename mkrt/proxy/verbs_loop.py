"""The compiled verbs proxy: RC queue pairs posted from a Numba loop, without the GIL.

One proxy thread runs one ``@njit(nogil=True)`` loop for every queue of a rank. Per batch
of commands it does what :class:`mkrt.proxy.verbs_proxy.VerbsProxy` does in Python, with
no Python per command:

* takes and validates commands exactly as every proxy does
  (:func:`mkrt.proxy.proxy.validate_command`), so the same commands fail the same way;
* groups puts and signals by destination (each destination's order kept) and writes one
  ``ibv_send_wr`` chain per destination into preallocated arrays: a put is an RDMA WRITE,
  its flag an 8-byte RDMA WRITE after it (inline when the device takes inline data, else
  from a registered host staging slot), RC delivering them in order;
* posts each chain through the provider's ``post_send`` and reaps completions through
  ``poll_cq``, both called through the function pointers of the device context
  (:mod:`mkrt.proxy.transports.verbs_abi`); a WR is signalled every ``signal_every`` WRs
  and at the end of each chain, and a destination's send-queue credits come back with
  its signalled completions (waiting for credits is bounded by ``timeout``);
* a queue's ``done`` word advances once every WR posted for its commands has completed;
  fence and barrier wait for everything posted first, then write their flags.

A failed completion or post fails every queue of the rank with ``E_TRANSPORT`` (the GPU's
waits see it) and the proxy's error names the rank, the destination, the work request and
the completion status. EFA's SRD endpoint (one QP for every destination, completions in any
order) is posted through the extended QP API (``ibv_wr_*``): a put with its flag is one
write with immediate, a bare flag waits for everything posted before it, every WR is
signalled, and received immediates are written as flags (never backwards) by this loop.
With the transport's ``efa_flags="direct"`` (worlds, whose flags are GPU memory in any
region) the sender writes each flag itself, as an 8-byte WRITE posted once everything
before it has completed: no immediates, no receiver CPU.

State is u64 numpy arrays (``P_*``, ``CF_*`` word names), built by
:class:`CompiledVerbsProxy` from a connected :class:`~mkrt.proxy.transports.verbs.VerbsTransport`.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
from numba import njit

from mkrt.errors import MkrtError
from mkrt.proxy import proxy as P
from mkrt.proxy import queue as Q
from mkrt.proxy.atomics import (load_acquire, load_acquire_at, spin_pause, store_release,
                                store_release_at)
from mkrt.proxy.transports import verbs_abi as A
from mkrt.proxy.transports.verbs import (IBV_SEND_INLINE, IBV_SEND_SIGNALED, IBV_WR_RDMA_WRITE,
                                         PEER_SHIFT)
from mkrt.proxy.verbs_proxy import check_arguments

_HW = Q.HEADER_WORDS
_SEQUENCE_MASK = np.uint64((1 << PEER_SHIFT) - 1)

# per destination (peers[p, ...])
P_QP, P_POST, P_OUTSTANDING, P_UNSIGNALLED, P_NEXT, P_SIG_HEAD, P_SIG_TAIL, P_AH, P_QPN, \
    P_LOW = range(10)
PEER_WORDS = 10
# configuration and error record (config[...])
CF_DEPTH, CF_SIGNAL_EVERY, CF_INLINE, CF_STAGING_LKEY, CF_CQ, CF_POLL, CF_TIMEOUT_NS, \
    CF_ERR_PEER, CF_ERR_WR, CF_ERR_STATUS, CF_ERR_KIND, \
    CF_EFA, CF_EFA_FLAG_REGION, CF_EFA_FLAGS, CF_EFA_FLAGS_SIZE, CF_POST_RECV, CF_RECV_QP, \
    CF_RECV_ID, CF_QKEY, CF_EFA_DIRECT = range(20)
CF_RECV_WR = 24         # config[24:28]: the ibv_recv_wr a receive is reposted with
CONFIG_WORDS = 28
# extended-QP functions (EFA SRD), qpx[...]
X_START, X_WRITE, X_WRITE_IMM, X_UD_ADDR, X_SGE, X_COMPLETE, X_ABORT = range(7)
EFA_FLAG_INDEX_LIMIT, EFA_FLAG_VALUE_LIMIT = 1 << 12, 1 << 20
# what failed (config[CF_ERR_KIND])
ERR_COMPLETION, ERR_POST, ERR_CREDITS, ERR_ORDER = 1, 2, 3, 4
ERR_KIND_NAMES = {ERR_COMPLETION: "completion failed", ERR_POST: "post_send refused",
                  ERR_CREDITS: "no send completion in time", ERR_ORDER: "completion out of order"}

MAX_CHAIN = 64          # WRs per post_send call
MARKS = 64              # batches per queue whose completion is still awaited

_libc = ctypes.CDLL(None)
_clock_gettime = _libc.clock_gettime
_clock_gettime.restype = ctypes.c_int
_clock_gettime.argtypes = [ctypes.c_int, ctypes.c_uint64]
_CLOCK_MONOTONIC = 1


@njit(nogil=True, cache=False)
def _now_ns(timespec):
    _clock_gettime(_CLOCK_MONOTONIC, timespec.ctypes.data)
    return np.uint64(timespec[0]) * np.uint64(1_000_000_000) + np.uint64(timespec[1])


@njit(nogil=True, cache=False)
def _fail(config, kind, peer, wr_id, status):
    if config[CF_ERR_KIND] == np.uint64(0):
        config[CF_ERR_KIND] = np.uint64(kind)
        config[CF_ERR_PEER] = np.uint64(peer)
        config[CF_ERR_WR] = np.uint64(wr_id)
        config[CF_ERR_STATUS] = np.uint64(status)
    return -1


@njit(nogil=True, cache=False)
def _receive_immediate(config, imm):
    """EFA: a write with immediate arrived; its flag (index, value) is written here, never
    backwards (completions are unordered), and the receive is posted again."""
    index, value = imm >> np.uint64(20), imm & np.uint64(EFA_FLAG_VALUE_LIMIT - 1)
    if np.uint64(8) * index + np.uint64(8) <= config[CF_EFA_FLAGS_SIZE]:
        flag = config[CF_EFA_FLAGS] + np.uint64(8) * index
        if load_acquire_at(flag) < value:
            store_release_at(flag, value)
    config[CF_RECV_ID] += np.uint64(1)
    config[CF_RECV_WR] = config[CF_RECV_ID]
    A.call_post_send(config[CF_POST_RECV], config[CF_RECV_QP],
                     np.uint64(config.ctypes.data) + np.uint64(8 * CF_RECV_WR),
                     np.uint64(config.ctypes.data) + np.uint64(8 * (CF_RECV_WR + 3)))


@njit(nogil=True, cache=False)
def _complete_unordered(peers, signalled, config, sequence):
    """EFA: one WR of the shared send queue completed (in any order); the low-water mark
    (first sequence not yet complete) moves over every completed one."""
    depth = config[CF_DEPTH]
    peers[0, P_OUTSTANDING] -= np.uint64(1)
    signalled[0, sequence % depth, 0] = np.uint64(1)
    low = peers[0, P_LOW]
    while signalled[0, low % depth, 0] != np.uint64(0) and low < peers[0, P_NEXT]:
        signalled[0, low % depth, 0] = np.uint64(0)
        low += np.uint64(1)
    peers[0, P_LOW] = low


@njit(nogil=True, cache=False)
def efa_refusal(config, v):
    """(error code, detail) when a write with immediate cannot carry this command's flag
    (flags live in one region, index < 4096, value < 2**20), else (0, 0)."""
    if v[P.V_SIGNAL] == np.uint64(0):
        return 0, np.uint64(0)
    if v[P.V_GREGION] != config[CF_EFA_FLAG_REGION]:
        return Q.E_REGION, v[P.V_GREGION]
    if v[P.V_GOFFSET] // np.uint64(8) >= np.uint64(EFA_FLAG_INDEX_LIMIT):
        return Q.E_BOUNDS, v[P.V_GOFFSET]
    if v[P.V_VALUE] >= np.uint64(EFA_FLAG_VALUE_LIMIT):
        return Q.E_BOUNDS, v[P.V_VALUE]
    return 0, np.uint64(0)


@njit(nogil=True, cache=False)
def poll(peers, signalled, config, wcs):
    """Reap completions; credits go back to their destination. Returns how many, or -1
    after recording a failure in `config`."""
    n = A.call_poll_cq(config[CF_POLL], config[CF_CQ], wcs.shape[0], wcs.ctypes.data)
    if n < 0:
        return _fail(config, ERR_COMPLETION, 0, 0, -n)
    depth = config[CF_DEPTH]
    for i in range(n):
        wr_id, status, opcode, imm = A.completion(wcs, i)
        p = wr_id >> np.uint64(PEER_SHIFT)
        if config[CF_EFA] != np.uint64(0):
            if status != np.uint64(0):
                if opcode & np.uint64(0x80):
                    p = np.uint64(0)
                return _fail(config, ERR_COMPLETION, p, wr_id, status)
            if opcode & np.uint64(0x80):
                _receive_immediate(config, imm)
            else:
                _complete_unordered(peers, signalled, config, wr_id & _SEQUENCE_MASK)
            continue
        if status != np.uint64(0):
            return _fail(config, ERR_COMPLETION, p, wr_id, status)
        if p >= np.uint64(peers.shape[0]) or peers[p, P_SIG_TAIL] == peers[p, P_SIG_HEAD]:
            return _fail(config, ERR_ORDER, p, wr_id, 0)
        slot = peers[p, P_SIG_TAIL] % depth
        if signalled[p, slot, 0] != (wr_id & _SEQUENCE_MASK):     # RC completes in order
            return _fail(config, ERR_ORDER, p, wr_id, signalled[p, slot, 0])
        peers[p, P_OUTSTANDING] -= signalled[p, slot, 1]
        peers[p, P_SIG_TAIL] += np.uint64(1)
    return n


@njit(nogil=True, cache=False)
def _wait_credits(peers, signalled, config, wcs, p, need, timespec):
    """Poll until destination `p` has `need` free send slots (bounded); 0 or -1."""
    deadline = _now_ns(timespec) + config[CF_TIMEOUT_NS]
    if config[CF_EFA] != np.uint64(0):
        p = 0                                    # one send queue for every destination
    while config[CF_DEPTH] - peers[p, P_OUTSTANDING] < np.uint64(need):
        got = poll(peers, signalled, config, wcs)
        if got < 0:
            return -1
        if got == 0:
            if _now_ns(timespec) > deadline:
                return _fail(config, ERR_CREDITS, p, 0, peers[p, P_OUTSTANDING])
            spin_pause()
    return 0


@njit(nogil=True, cache=False)
def quiesce(peers, signalled, config, wcs, timespec):
    """Poll until every WR posted has completed (bounded); 0 or -1."""
    deadline = _now_ns(timespec) + config[CF_TIMEOUT_NS]
    while True:
        busy = False
        for p in range(peers.shape[0]):
            if peers[p, P_OUTSTANDING] != np.uint64(0):
                busy = True
        if not busy:
            return 0
        got = poll(peers, signalled, config, wcs)
        if got < 0:
            return -1
        if got == 0:
            if _now_ns(timespec) > deadline:
                return _fail(config, ERR_CREDITS, 0, 0, 0)
            spin_pause()


@njit(nogil=True, cache=False)
def _post(peers, config, wrs, count, p, bad):
    if count == 0:
        return 0
    head = A.link(wrs, 0, count)
    rc = A.call_post_send(peers[p, P_POST], peers[p, P_QP], head, bad.ctypes.data)
    if rc != 0:
        return _fail(config, ERR_POST, p, wrs[0, A.W_ID], rc)
    return 0


@njit(nogil=True, cache=False)
def _carries(decoded, r):
    """(bytes to write, a flag to write) of validated command row `r`."""
    opcode = decoded[r, P.V_OPCODE]
    has_data = (opcode == np.uint64(Q.OP_PUT) or opcode == np.uint64(Q.OP_PUT_SIGNAL)) \
        and decoded[r, P.V_BYTES] != np.uint64(0)
    return has_data, decoded[r, P.V_SIGNAL] != np.uint64(0)


@njit(nogil=True, cache=False)
def post_to(peers, signalled, config, qpx, staging, rkeys, lkeys, wrs, sges, wcs, bad,
            timespec, decoded, picks, count, p):
    """Post commands decoded[picks[0..count)] (puts and signals, in order) to destination
    `p` as chains; returns WRs posted, or -1 after a failure.

    The destination's counters live in locals while a chain is built and go back to
    `peers` before anything reads them (post_send, polling): read-modify-writes of
    `peers` between the WR writes cost about 40 ns per WR on the CPU measured (the
    compiler must assume the arrays alias), against 3 ns from locals."""
    if config[CF_EFA] != np.uint64(0):
        return _efa_post_to(peers, signalled, config, qpx, staging, rkeys, lkeys, wcs, timespec,
                            decoded, picks, count, p)
    depth, every = config[CF_DEPTH], config[CF_SIGNAL_EVERY]
    inline = config[CF_INLINE] != np.uint64(0)
    staging_lkey = config[CF_STAGING_LKEY]
    staging_base = np.uint64(staging.ctypes.data) + np.uint64(8) * np.uint64(p) * depth
    peer_bits = np.uint64(p) << np.uint64(PEER_SHIFT)
    sequence, outstanding = peers[p, P_NEXT], peers[p, P_OUTSTANDING]
    unsignalled, sig_head = peers[p, P_UNSIGNALLED], peers[p, P_SIG_HEAD]
    in_ring = sequence % depth                    # sequence's staging slot, kept incrementally
    k = 0
    posted = 0
    for i in range(count):
        r = picks[i]
        has_data, has_flag = _carries(decoded, r)
        need = (1 if has_data else 0) + (1 if has_flag else 0)
        if need == 0:
            continue
        if depth - outstanding < np.uint64(need) or k + need > MAX_CHAIN:
            peers[p, P_NEXT], peers[p, P_OUTSTANDING] = sequence, outstanding
            peers[p, P_UNSIGNALLED], peers[p, P_SIG_HEAD] = unsignalled, sig_head
            if _post(peers, config, wrs, k, p, bad) < 0:
                return -1
            posted += k
            k = 0
            if _wait_credits(peers, signalled, config, wcs, p, need, timespec) < 0:
                return -1
            outstanding = peers[p, P_OUTSTANDING]
        for w in range(need):
            is_flag = has_flag and w == need - 1
            # signalled: every N WRs, the chain's last, and before the send queue could
            # fill with unsignalled WRs
            outstanding += np.uint64(1)
            unsignalled += np.uint64(1)
            flags = np.uint64(0)
            if (i == count - 1 and w == need - 1) or unsignalled >= every \
                    or depth - outstanding < every:
                slot = sig_head % depth
                signalled[p, slot, 0] = sequence
                signalled[p, slot, 1] = unsignalled
                sig_head += np.uint64(1)
                unsignalled = np.uint64(0)
                flags = np.uint64(IBV_SEND_SIGNALED)
            if is_flag:
                staging[np.uint64(p) * depth + in_ring] = decoded[r, P.V_VALUE]
                if inline:                 # inline: copied at post; else read by the NIC
                    flags |= np.uint64(IBV_SEND_INLINE)
                A.write_send_wr(wrs, sges, k, peer_bits | sequence, IBV_WR_RDMA_WRITE,
                                staging_base + np.uint64(8) * in_ring, 8, staging_lkey,
                                decoded[r, P.V_FLAG], rkeys[p, decoded[r, P.V_GREGION]], flags,
                                0, False)
            else:
                A.write_send_wr(wrs, sges, k, peer_bits | sequence, IBV_WR_RDMA_WRITE,
                                decoded[r, P.V_SRC], decoded[r, P.V_BYTES],
                                lkeys[decoded[r, P.V_SREGION]], decoded[r, P.V_DST],
                                rkeys[p, decoded[r, P.V_DREGION]], flags, 0, False)
            sequence += np.uint64(1)
            in_ring += np.uint64(1)
            if in_ring == depth:
                in_ring = np.uint64(0)
            k += 1
    peers[p, P_NEXT], peers[p, P_OUTSTANDING] = sequence, outstanding
    peers[p, P_UNSIGNALLED], peers[p, P_SIG_HEAD] = unsignalled, sig_head
    if _post(peers, config, wrs, k, p, bad) < 0:
        return -1
    return posted + k


@njit(nogil=True, cache=False)
def _efa_open_wr(peers, signalled, config, qpx, wcs, timespec, qp, p, k, after_all):
    """Room for one more WR to destination `p` in the open extended-QP batch (`k` WRs
    built): when the send queue is full, the batch long, or the WR must follow everything
    posted before it (`after_all`: SRD delivers out of order), post the batch, then wait
    for credits and, with `after_all`, for every WR to complete. Then the WR's id and
    flags (signalled). Returns (WRs posted, WRs now in the batch, the WR's sequence), or
    (-1, 0, 0) after a failure."""
    posted = 0
    if config[CF_DEPTH] - peers[0, P_OUTSTANDING] < np.uint64(1) or k + 1 > MAX_CHAIN \
            or (after_all and k > 0):
        rc = A.call_qpx_complete(qpx[X_COMPLETE], qp)
        if rc != 0:
            return _fail(config, ERR_POST, p, 0, rc), 0, np.uint64(0)
        posted, k = k, 0
        if _wait_credits(peers, signalled, config, wcs, 0, 1, timespec) < 0:
            return -1, 0, np.uint64(0)
        A.call_qpx(qpx[X_START], qp)
    if after_all and quiesce(peers, signalled, config, wcs, timespec) < 0:
        A.call_qpx(qpx[X_ABORT], qp)
        return -1, 0, np.uint64(0)
    sequence = peers[0, P_NEXT]
    peers[0, P_NEXT] = sequence + np.uint64(1)
    peers[0, P_OUTSTANDING] += np.uint64(1)
    store_release_at(qp + np.uint64(A.QPX_WR_ID), (np.uint64(p) << np.uint64(PEER_SHIFT)) | sequence)
    store_release_at(qp + np.uint64(A.QPX_WR_FLAGS), np.uint64(IBV_SEND_SIGNALED))
    return posted, k + 1, sequence


@njit(nogil=True, cache=False)
def _efa_post_to(peers, signalled, config, qpx, staging, rkeys, lkeys, wcs, timespec, decoded,
                 picks, count, p):
    """EFA SRD, one QP for every destination, every WR signalled, built through the
    extended QP API and posted by wr_complete; SRD may deliver out of order. Returns WRs
    posted, or -1.

    Immediate flags: each command one WR (a put with its flag: one write with immediate;
    a bare flag: a zero-length write with immediate, after everything posted before it has
    completed). Direct flags (``CF_EFA_DIRECT``; worlds, flags in GPU memory in any
    region): a put is one write; a flag is an 8-byte write of its value, from a registered
    staging slot, into the flag's own word, after everything posted before it has
    completed (a write's completion says it was placed)."""
    qp = peers[p, P_QP]
    depth = config[CF_DEPTH]
    direct = config[CF_EFA_DIRECT] != np.uint64(0)
    staging_base = np.uint64(staging.ctypes.data) + np.uint64(8) * np.uint64(p) * depth
    k = 0
    posted = 0
    A.call_qpx(qpx[X_START], qp)
    for i in range(count):
        r = picks[i]
        has_data, has_flag = _carries(decoded, r)
        separate_flag = has_flag and (direct or not has_data)
        need = (1 if has_data else 0) + (1 if separate_flag else 0)
        for w in range(need):
            flag_wr = separate_flag and w == need - 1      # after everything before it
            got, k, sequence = _efa_open_wr(peers, signalled, config, qpx, wcs, timespec, qp, p,
                                            k, flag_wr)
            if got < 0:
                return -1
            posted += got
            if flag_wr and direct:
                # the slot is reused `depth` sequences later: by then this WR has completed
                slot = sequence % depth
                staging[np.uint64(p) * depth + slot] = decoded[r, P.V_VALUE]
                A.call_qpx_write(qpx[X_WRITE], qp, rkeys[p, decoded[r, P.V_GREGION]],
                                 decoded[r, P.V_FLAG], 0)
                source_key, source = config[CF_STAGING_LKEY], staging_base + np.uint64(8) * slot
                length = np.uint64(8)
            elif has_flag and not direct:
                imm = ((decoded[r, P.V_GOFFSET] // np.uint64(8)) << np.uint64(20)) | decoded[r, P.V_VALUE]
                target = decoded[r, P.V_DST] if has_data else decoded[r, P.V_FLAG]
                region = decoded[r, P.V_DREGION] if has_data else decoded[r, P.V_GREGION]
                A.call_qpx_write(qpx[X_WRITE_IMM], qp, rkeys[p, region], target, A.byteswap32(imm))
                source_key, source = config[CF_STAGING_LKEY], np.uint64(staging.ctypes.data)
                length = np.uint64(0)
            else:
                A.call_qpx_write(qpx[X_WRITE], qp, rkeys[p, decoded[r, P.V_DREGION]],
                                 decoded[r, P.V_DST], 0)
            if has_data and not flag_wr:
                source_key, source, length = lkeys[decoded[r, P.V_SREGION]], decoded[r, P.V_SRC], \
                    decoded[r, P.V_BYTES]
            A.call_qpx_ud_addr(qpx[X_UD_ADDR], qp, peers[p, P_AH], peers[p, P_QPN], config[CF_QKEY])
            A.call_qpx_sge(qpx[X_SGE], qp, source_key, source, length)
    rc = A.call_qpx_complete(qpx[X_COMPLETE], qp)
    if rc != 0:
        return _fail(config, ERR_POST, p, 0, rc)
    return posted + k


@njit(nogil=True, cache=False)
def _flush(peers, signalled, config, qpx, staging, rkeys, lkeys, wrs, sges, wcs, bad, timespec,
           decoded, pending, npending, picks, stats):
    """Post the pending commands, one destination at a time (each one's order kept)."""
    for p in range(peers.shape[0]):
        count = 0
        for i in range(npending):
            if decoded[pending[i], P.V_RANK] == np.uint64(p):
                picks[count] = pending[i]
                count += 1
        if count > 0:
            if post_to(peers, signalled, config, qpx, staging, rkeys, lkeys, wrs, sges, wcs, bad,
                       timespec, decoded, picks, count, p) < 0:
                return -1
            stats[P.S_TRANSPORT] += np.uint64(1)
    return 0


@njit(nogil=True, cache=False)
def _completed(peers, signalled, config, mark):
    """Has every WR posted before `mark` (per destination, the last sequence) completed?"""
    if config[CF_EFA] != np.uint64(0):
        return peers[0, P_LOW] > mark[0]
    depth = config[CF_DEPTH]
    for p in range(peers.shape[0]):
        if peers[p, P_OUTSTANDING] == np.uint64(0):
            continue
        if peers[p, P_SIG_TAIL] == peers[p, P_SIG_HEAD]:
            return False
        slot = peers[p, P_SIG_TAIL] % depth
        first_pending = signalled[p, slot, 0] - signalled[p, slot, 1] + np.uint64(1)
        if first_pending <= mark[p]:
            return False
    return True


@njit(nogil=True, cache=False)
def loop(ring, header, regions, my_rank, slots, batch, control, stats, peers, signalled,
         config, qpx, staging, rkeys, lkeys):
    nq = header.shape[0] // _HW
    np_ = peers.shape[0]
    tails = np.zeros(nq, dtype=np.uint64)
    done = np.zeros(nq, dtype=np.uint64)
    failed = np.zeros(nq, dtype=np.uint8)
    marks = np.zeros((nq, MARKS, np_ + 1), dtype=np.uint64)    # (tail, last sequence per peer)
    mark_head = np.zeros(nq, dtype=np.int64)
    mark_tail = np.zeros(nq, dtype=np.int64)
    decoded = np.zeros((batch, P.VALIDATED_WORDS), dtype=np.uint64)
    pending = np.zeros(batch, dtype=np.int64)
    picks = np.zeros(batch, dtype=np.int64)
    wrs = np.zeros((MAX_CHAIN, A.SEND_WR_WORDS), dtype=np.uint64)    # words past W_RKEY stay 0
    sges = np.zeros((MAX_CHAIN, A.SGE_WORDS), dtype=np.uint64)
    wcs = np.zeros((64, A.WC_WORDS), dtype=np.uint64)
    bad = np.zeros(1, dtype=np.uint64)
    timespec = np.zeros(2, dtype=np.int64)
    mask = slots - np.uint64(1)
    for q in range(nq):
        tails[q] = load_acquire(header, q * _HW + Q.H_TAIL)
        done[q] = tails[q]
    broken = False
    idle_streak = 0
    store_release(control, P.C_RUNNING, np.uint64(1))
    while True:
        stop = load_acquire(control, P.C_STOP)
        if stop == np.uint64(P.STOP_NOW):
            break
        worked = False
        for q in range(nq):
            if mark_head[q] - mark_tail[q] >= MARKS:
                continue                               # wait for completions first
            tail = tails[q]
            n = 0
            npending = 0
            while n < batch:
                base = (np.uint64(q) * slots + ((tail + np.uint64(n)) & mask)) * np.uint64(8)
                if load_acquire(ring, base) != tail + np.uint64(n) + np.uint64(1):
                    break
                ticket = tail + np.uint64(n)
                v = decoded[n]
                err, detail = P.validate_command(ring, base, regions, my_rank, v)
                if err == 0 and config[CF_EFA] != np.uint64(0) and config[CF_EFA_DIRECT] == np.uint64(0):
                    err, detail = efa_refusal(config, v)
                n += 1
                if failed[q] != 0 or broken:
                    stats[P.S_DROPPED] += np.uint64(1)
                    continue
                opcode = v[P.V_OPCODE]
                if opcode == np.uint64(Q.OP_FENCE) or opcode == np.uint64(Q.OP_BARRIER):
                    if _flush(peers, signalled, config, qpx, staging, rkeys, lkeys, wrs, sges, wcs,
                              bad, timespec, decoded, pending, npending, picks, stats) < 0 \
                            or quiesce(peers, signalled, config, wcs, timespec) < 0:
                        broken = True
                        continue
                    npending = 0
                    if opcode == np.uint64(Q.OP_FENCE):
                        stats[P.S_FENCES] += np.uint64(1)
                if err != 0:
                    if _flush(peers, signalled, config, qpx, staging, rkeys, lkeys, wrs, sges, wcs,
                              bad, timespec, decoded, pending, npending, picks, stats) < 0:
                        broken = True
                    npending = 0
                    failed[q] = 1
                    P._error(header, q, control, stats, err, detail, ticket, q)
                    continue
                if opcode == np.uint64(Q.OP_PUT) or opcode == np.uint64(Q.OP_PUT_SIGNAL):
                    stats[P.S_PUTS] += np.uint64(1)
                    stats[P.S_BYTES] += v[P.V_BYTES]
                    if opcode == np.uint64(Q.OP_PUT_SIGNAL):
                        stats[P.S_SIGNALS] += np.uint64(1)
                    pending[npending] = n - 1
                    npending += 1
                elif opcode == np.uint64(Q.OP_SIGNAL) or (opcode == np.uint64(Q.OP_FENCE)
                                                         and v[P.V_SIGNAL] != np.uint64(0)):
                    stats[P.S_SIGNALS] += np.uint64(1)
                    pending[npending] = n - 1
                    npending += 1
                elif opcode == np.uint64(Q.OP_BARRIER):
                    # this rank's slot on every rank that registered the flag region
                    gregion = v[P.V_GREGION]
                    for r in range(regions.shape[0]):
                        if regions[r, gregion, 3] != np.uint64(0):
                            flag, kind, e, d = P._address(regions, np.uint64(r), gregion,
                                                          v[P.V_GOFFSET], np.uint64(8))
                            v[P.V_FLAG] = flag
                            v[P.V_RANK] = np.uint64(r)
                            picks[0] = n - 1
                            if post_to(peers, signalled, config, qpx, staging, rkeys, lkeys, wrs,
                                       sges, wcs, bad, timespec, decoded, picks, 1, r) < 0:
                                broken = True
                                break
                    stats[P.S_BARRIERS] += np.uint64(1)
            if n == 0:
                continue
            worked = True
            if not broken and _flush(peers, signalled, config, qpx, staging, rkeys, lkeys, wrs,
                                     sges, wcs, bad, timespec, decoded, pending, npending,
                                     picks, stats) < 0:
                broken = True
            tails[q] = tail + np.uint64(n)
            store_release(header, q * _HW + Q.H_TAIL, tails[q])
            slot = mark_head[q] % MARKS
            marks[q, slot, 0] = tails[q]
            for p in range(np_):
                marks[q, slot, p + 1] = peers[p, P_NEXT] - np.uint64(1)
            mark_head[q] += 1
            stats[P.S_COMMANDS] += np.uint64(n)
            stats[P.S_BATCHES] += np.uint64(1)
            if np.uint64(n) > stats[P.S_MAX_BATCH]:
                stats[P.S_MAX_BATCH] = np.uint64(n)
        if not broken and poll(peers, signalled, config, wcs) < 0:
            broken = True
        if broken:
            for q in range(nq):
                if failed[q] == 0:
                    failed[q] = 1
                    P._error(header, q, control, stats, Q.E_TRANSPORT,
                             config[CF_ERR_STATUS] & np.uint64(0xFFFFFFFF), tails[q], q)
                mark_tail[q] = mark_head[q]
        for q in range(nq):
            while mark_tail[q] < mark_head[q]:
                slot = mark_tail[q] % MARKS
                if not _completed(peers, signalled, config, marks[q, slot, 1:]):
                    break
                if marks[q, slot, 0] != done[q]:
                    done[q] = marks[q, slot, 0]
                    store_release(header, q * _HW + Q.H_DONE, done[q])
                mark_tail[q] += 1
        if not worked:
            stats[P.S_IDLE] += np.uint64(1)
            settled = broken
            if not settled:
                settled = True
                for p in range(np_):
                    if peers[p, P_OUTSTANDING] != np.uint64(0):
                        settled = False
            if stop == np.uint64(P.STOP_DRAIN) and settled:
                break
            idle_streak += 1
            if idle_streak > P.HOT_POLLS:
                spin_pause()
        else:
            idle_streak = 0
    store_release(control, P.C_RUNNING, np.uint64(0))
    return 0


def _raw_address(obj, kind: str) -> int:
    """The ibv_qp / ibv_cq address behind a backend object: pyverbs' QP.qp / CQ.cq, the
    transport's CQ wrapper around a pyverbs CQ, or a stand-in's ``address``."""
    for path in (("address",), ("qp",), ("cq",), ("cq", "cq")):
        value = obj
        for name in path:
            value = getattr(value, name, None)
        if isinstance(value, (int, np.integer)) and value:
            return int(value)
    raise MkrtError(f"mkrt.proxy: cannot find the raw ibv_{kind} address of {obj!r} "
                    "(pyverbs QP.qp / CQ.cq)")


class CompiledVerbsProxy(P.Proxy):
    """One compiled proxy thread serving every queue of `queue_set` through a connected
    :class:`~mkrt.proxy.transports.verbs.VerbsTransport` (``regions``: the transport's
    table), RC queue pairs or an EFA SRD endpoint. The transport's pyverbs objects (or the
    loopback stand-in's) made the device, queue pairs, CQ and registrations; from then on
    only the compiled loop touches them, so the transport's Python posting methods must not
    be used while this runs."""

    def __init__(self, queue_set: Q.QueueSet, regions: np.ndarray, transport, *,
                 batch: int = 64, start: bool = True):
        check_arguments("CompiledVerbsProxy", queue_set, transport)
        if batch > 1024:
            raise ValueError(f"mkrt.proxy: batch must be <= 1024; got {batch}")
        ranks, depth = transport.ranks, transport.sq_depth
        self.peers = np.zeros((ranks, PEER_WORDS), dtype=np.uint64)
        for p in range(ranks):
            qp = _raw_address(transport.qps[p], "qp")
            self.peers[p, P_QP] = qp
            self.peers[p, P_POST] = A.context_functions(qp)[0]
            self.peers[p, P_NEXT] = 1
        cq = _raw_address(transport.cq, "cq")
        self.signalled = np.zeros((ranks, depth, 2), dtype=np.uint64)
        self.config = np.zeros(CONFIG_WORDS, dtype=np.uint64)
        self.config[CF_DEPTH] = depth
        self.config[CF_SIGNAL_EVERY] = transport.signal_every
        self.config[CF_INLINE] = int(transport.info.max_inline >= 8)
        self.config[CF_STAGING_LKEY] = transport._staging_reg.lkey
        self.config[CF_CQ] = cq
        self.config[CF_POLL] = A.context_functions(cq)[1]
        self.config[CF_TIMEOUT_NS] = int(transport.timeout * 1e9)
        self.staging = transport._staging            # registered: [ranks * depth] u64
        self.rkeys = transport.rkeys                  # the transport's tables, read live:
        self.lkeys = transport.lkeys                  # regions registered later show up
        self.qpx = np.zeros(8, dtype=np.uint64)
        if transport.efa:
            self._configure_efa(transport)
        super().__init__(queue_set, regions, transport, threads=1, batch=batch, start=start)

    def _configure_efa(self, transport) -> None:
        """One SRD QP for every destination: its extended-QP functions, an address handle
        and QP number per destination; with immediate flags, the flag region receivers
        write and their receives."""
        from mkrt.proxy.transports.verbs import QKEY
        qp = int(self.peers[0, P_QP])
        functions = A.qpx_functions(qp)
        for index, name in ((X_START, "start"), (X_WRITE, "rdma_write"),
                            (X_WRITE_IMM, "rdma_write_imm"), (X_UD_ADDR, "set_ud_addr"),
                            (X_SGE, "set_sge"), (X_COMPLETE, "complete"), (X_ABORT, "abort")):
            self.qpx[index] = functions[name]
        for p in range(transport.ranks):
            self.peers[p, P_AH] = _raw_address(transport._ah[p], "ah")
            self.peers[p, P_QPN] = transport.connections[p].remote.qp_num
        self.peers[0, P_LOW] = 1
        self.config[CF_EFA] = 1
        self.config[CF_QKEY] = QKEY
        if transport.efa_direct:       # the sender writes flags: no flag region, no receives
            self.config[CF_EFA_DIRECT] = 1
            return
        region = transport.efa_flag_region
        if region not in transport.local:
            raise MkrtError(f"mkrt.proxy: EFA flags live in region {region}, which this rank "
                            "has not registered")
        local, address, _ = transport.local[region]
        self.config[CF_EFA_FLAG_REGION] = region
        self.config[CF_EFA_FLAGS] = address
        self.config[CF_EFA_FLAGS_SIZE] = local.size
        self.config[CF_POST_RECV] = A.context_functions(qp)[2]
        self.config[CF_RECV_QP] = qp
        self.config[CF_RECV_ID] = transport._recv_id

    def _arguments(self, control, stats):
        qs = self.queue_set
        return (qs.ring, qs.header, self.regions, np.int64(self.transport.rank),
                np.uint64(qs.slots), np.int64(self.batch), control, stats, self.peers,
                self.signalled, self.config, self.qpx, self.staging, self.rkeys, self.lkeys)

    def start(self):
        if self.closed:
            raise MkrtError("mkrt.proxy: start() after close()")
        if self._threads:
            raise MkrtError("mkrt.proxy: already started")
        warm = np.zeros(P.CONTROL_WORDS, dtype=np.uint64)
        warm[P.C_STOP] = P.STOP_NOW                    # compile here, not in the thread
        loop(*self._arguments(warm, np.zeros(P.STATS_WORDS, np.uint64)))
        self.controls[:] = 0
        thread = threading.Thread(target=self._run_compiled, name="mkrt-proxy-verbs-compiled",
                                  daemon=True)
        self._threads.append(thread)
        thread.start()
        return self

    def _run_compiled(self):
        try:
            self.transport.thread_setup()
            loop(*self._arguments(self.controls[0], self.stats_by_thread[0]))
        except BaseException as error:   # reported by check()/close()
            self._failures.append(error)

    def error(self):
        error = super().error()
        kind = int(self.config[CF_ERR_KIND])
        if error is None or not kind:
            return error
        wr_id = int(self.config[CF_ERR_WR])
        detail = (f"; rank {self.transport.rank} -> rank {int(self.config[CF_ERR_PEER])}: "
                  f"{ERR_KIND_NAMES.get(kind, kind)}, work request {wr_id:#x} (sequence "
                  f"{wr_id & int(_SEQUENCE_MASK)}), status {int(self.config[CF_ERR_STATUS])}")
        return P.ProxyError(str(error) + detail, code=error.code, detail=error.detail,
                            queue=error.queue, ticket=error.ticket)

    @property
    def idle(self) -> bool:
        return not self.peers[:, P_OUTSTANDING].any()
