"""The compiled verbs proxy (mkrt/proxy/verbs_loop.py) over the loopback stand-in for a
NIC (mkrt/proxy/transports/loopback_nic.py), with the host-side producer in place of the
GPU: the ibv structs it writes, what lands where, credits, errors, and agreement with the
Python VerbsProxy on the same commands."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from mkrt.proxy import OP_BARRIER, OP_FENCE, OP_PUT, OP_PUT_SIGNAL, OP_SIGNAL, REGION_HOST, QueueSet
from mkrt.errors import MkrtError
from mkrt.proxy import ProxyError
from mkrt.proxy import producer as PR
from mkrt.proxy import queue as Q
from mkrt.proxy.transports import loopback_nic as L
from mkrt.proxy.transports import verbs as V
from mkrt.proxy.transports import verbs_abi as A
from mkrt.proxy.verbs_loop import CompiledVerbsProxy
from mkrt.proxy.verbs_proxy import VerbsProxy
from test_proxy_verbs_proxy import Ranks as VerbsRanks

SPINS = np.int64(2_000_000_000)
DATA = 1 << 16


# ---- the ABI, checked against ctypes mirrors of verbs.h -----------------------------------

class IbvSge(ctypes.Structure):
    _fields_ = [("addr", ctypes.c_uint64), ("length", ctypes.c_uint32), ("lkey", ctypes.c_uint32)]


class _Rdma(ctypes.Structure):
    _fields_ = [("remote_addr", ctypes.c_uint64), ("rkey", ctypes.c_uint32)]


class _Atomic(ctypes.Structure):
    _fields_ = [("remote_addr", ctypes.c_uint64), ("compare_add", ctypes.c_uint64),
                ("swap", ctypes.c_uint64), ("rkey", ctypes.c_uint32)]


class _Wr(ctypes.Union):
    _fields_ = [("rdma", _Rdma), ("atomic", _Atomic)]


class _BindInfo(ctypes.Structure):
    _fields_ = [("mr", ctypes.c_void_p), ("addr", ctypes.c_uint64), ("length", ctypes.c_uint64),
                ("mw_access_flags", ctypes.c_uint)]


class _BindMw(ctypes.Structure):
    _fields_ = [("mw", ctypes.c_void_p), ("rkey", ctypes.c_uint32), ("bind_info", _BindInfo)]


class IbvSendWr(ctypes.Structure):
    _fields_ = [("wr_id", ctypes.c_uint64), ("next", ctypes.c_void_p), ("sg_list", ctypes.c_void_p),
                ("num_sge", ctypes.c_int), ("opcode", ctypes.c_int), ("send_flags", ctypes.c_uint),
                ("imm_data", ctypes.c_uint32), ("wr", _Wr), ("remote_srqn", ctypes.c_uint32),
                ("bind_mw", _BindMw)]


class IbvWc(ctypes.Structure):
    _fields_ = [("wr_id", ctypes.c_uint64), ("status", ctypes.c_int), ("opcode", ctypes.c_int),
                ("vendor_err", ctypes.c_uint32), ("byte_len", ctypes.c_uint32),
                ("imm_data", ctypes.c_uint32), ("qp_num", ctypes.c_uint32),
                ("src_qp", ctypes.c_uint32), ("wc_flags", ctypes.c_uint),
                ("pkey_index", ctypes.c_uint16), ("slid", ctypes.c_uint16), ("sl", ctypes.c_uint8),
                ("dlid_path_bits", ctypes.c_uint8)]


def test_struct_sizes_match_verbs_h():
    assert ctypes.sizeof(IbvSendWr) == A.SEND_WR_WORDS * 8 == 128
    assert ctypes.sizeof(IbvSge) == A.SGE_WORDS * 8 == 16
    assert ctypes.sizeof(IbvWc) == A.WC_WORDS * 8 == 48


def test_address_handle_attributes_have_verbs_h_layout():
    """struct ibv_global_route / ibv_ah_attr as libibverbs lays them out (x86-64)."""
    assert ctypes.sizeof(A.IbvGlobalRoute) == 24 and ctypes.sizeof(A.IbvAhAttr) == 32
    offsets = {name: getattr(A.IbvAhAttr, name).offset for name, _ in A.IbvAhAttr._fields_}
    assert offsets == {"grh": 0, "dlid": 24, "sl": 26, "src_path_bits": 27, "static_rate": 28,
                       "is_global": 29, "port_num": 30}
    route = {name: getattr(A.IbvGlobalRoute, name).offset for name, _ in A.IbvGlobalRoute._fields_}
    assert route == {"dgid": 0, "flow_label": 16, "sgid_index": 20, "hop_limit": 21,
                     "traffic_class": 22}
    with pytest.raises(ValueError, match="16 bytes"):
        A.address_handle_attributes(b"short", 0, 1)


def test_raw_address_handle_is_made_on_the_qps_protection_domain():
    """The EFA loop's ibv_ah: ibv_create_ah(qp->pd, global route to the peer's GID), and
    ibv_destroy_ah once on close; a NULL from ibv_create_ah raises."""
    qp = (ctypes.c_uint64 * 20)()
    qp[2] = 0xBEEF00                                   # ibv_qp.pd
    calls = []

    class Library:
        @staticmethod
        def ibv_create_ah(pd, attr):
            attr = ctypes.cast(attr, ctypes.POINTER(A.IbvAhAttr)).contents
            calls.append(("create", pd, bytes(attr.grh.dgid), attr.grh.sgid_index,
                          attr.is_global, attr.port_num))
            return 0xA40 if pd else None

        @staticmethod
        def ibv_destroy_ah(ah):
            calls.append(("destroy", ah))
            return 0

    gid = bytes(range(16))
    ah = A.RawAddressHandle(ctypes.addressof(qp), gid, 3, 1, "pyverbs-ah", library=Library)
    assert ah.address == 0xA40 and ah.pyverbs == "pyverbs-ah"
    assert calls == [("create", 0xBEEF00, gid, 3, 1, 1)]
    ah.close()
    ah.close()
    assert calls[1:] == [("destroy", 0xA40)]
    qp[2] = 0
    with pytest.raises(OSError, match="ibv_create_ah failed"):
        A.RawAddressHandle(ctypes.addressof(qp), gid, 0, 1, library=Library)


def test_send_wr_fields_read_back_through_ctypes():
    wrs, sges = A.new_send_wrs(2)
    A.write_send_wr(wrs, sges, 0, 0xAB, 0, 0x1000, 4096, 7, 0x2000, 9, 2, 0, False)
    A.write_send_wr(wrs, sges, 1, 0xCD, 1, 0x3000, 0, 7, 0x4000, 11, 0, 0x12345678, True)
    head = A.link(wrs, 0, 2)
    first = IbvSendWr.from_address(int(head))
    assert (first.wr_id, first.num_sge, first.opcode, first.send_flags) == (0xAB, 1, 0, 2)
    assert (first.wr.rdma.remote_addr, first.wr.rdma.rkey) == (0x2000, 9)
    sge = IbvSge.from_address(first.sg_list)
    assert (sge.addr, sge.length, sge.lkey) == (0x1000, 4096, 7)
    second = IbvSendWr.from_address(first.next)
    assert (second.wr_id, second.num_sge, second.opcode, second.next) == (0xCD, 0, 1, None)
    assert second.imm_data == int.from_bytes((0x12345678).to_bytes(4, "big"), "little")


def test_completion_fields_read_through_ctypes():
    wcs = A.new_completions(1)
    wc = IbvWc.from_address(wcs.ctypes.data)
    wc.wr_id, wc.status, wc.opcode, wc.imm_data = 77, 10, 129, int.from_bytes(b"\x00\x01\x02\x03", "little")
    assert A.completion(wcs, 0) == (77, 10, 129, 0x00010203)


def test_context_functions_read_the_ops_table():
    nic = L.LoopbackNic()
    index = nic.create_qp(4)
    post, poll, post_recv = A.context_functions(nic.qp_address(index))
    assert post == L.loopback_post_send.address and poll == L.loopback_poll_cq.address
    assert post_recv == L.loopback_post_recv.address
    assert A.context_functions(nic.cq_address) == (post, poll, post_recv)
    with pytest.raises(ValueError, match="null"):
        A.context_functions(0)


# ---- the stand-in NIC on its own ------------------------------------------------------------

def _nic_with_memory(depth=4):
    fabric = L.LoopbackFabric()
    nic = L.LoopbackNic(fabric)
    qp = nic.create_qp(depth)
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(256, dtype=np.uint8)
    skey = fabric.register(src.ctypes.data, src.nbytes)
    dkey = fabric.register(dst.ctypes.data, dst.nbytes, base=0x10000)       # an iova-style base
    return fabric, nic, qp, src, dst, skey, dkey


def _post(nic, qp, rows):
    wrs, sges = A.new_send_wrs(len(rows))
    for i, row in enumerate(rows):
        A.write_send_wr(wrs, sges, i, *row)
    bad = np.zeros(1, dtype=np.uint64)
    post = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64)(
        L.loopback_post_send.address)
    return post(nic.qp_address(qp), int(A.link(wrs, 0, len(rows))), bad.ctypes.data), int(bad[0]), wrs


def _poll(nic, n=16):
    return [(c.wr_id, c.status) for c in L._LoopbackCQ(nic).poll(n)]


def test_loopback_writes_translates_and_completes_signalled_wrs():
    fabric, nic, qp, src, dst, skey, dkey = _nic_with_memory()
    rc, _, _ = _post(nic, qp, [(1, 0, src.ctypes.data + 16, 32, skey, 0x10000 + 100, dkey, 0, 0, False),
                               (2, 0, src.ctypes.data, 8, skey, 0x10000, dkey, 2, 0, False)])
    assert rc == 0
    assert np.array_equal(dst[100:132], src[16:48]) and np.array_equal(dst[:8], src[:8])
    assert _poll(nic) == [(2, 0)]
    assert nic.outstanding(qp) == 0          # the signalled completion freed both slots


def test_loopback_refuses_beyond_its_depth_and_names_the_bad_wr():
    fabric, nic, qp, src, dst, skey, dkey = _nic_with_memory(depth=2)
    rows = [(i, 0, src.ctypes.data, 8, skey, 0x10000, dkey, 0, 0, False) for i in range(3)]
    rc, bad, wrs = _post(nic, qp, rows)
    assert rc == L.ENOMEM and bad == wrs.ctypes.data + 2 * 128


@pytest.mark.parametrize("fault", ["rkey", "bounds", "lkey"])
def test_loopback_access_errors_complete_with_an_error_and_flush(fault):
    fabric, nic, qp, src, dst, skey, dkey = _nic_with_memory(depth=8)
    bad_write = {"rkey": (1, 0, src.ctypes.data, 8, skey, 0x10000, dkey + 99, 0, 0, False),
                 "bounds": (1, 0, src.ctypes.data, 8, skey, 0x10000 + 250, dkey, 0, 0, False),
                 "lkey": (1, 0, src.ctypes.data, 8, dkey, 0x10000, dkey, 0, 0, False)}[fault]
    rc, _, _ = _post(nic, qp, [bad_write, (2, 0, src.ctypes.data, 8, skey, 0x10000, dkey, 2, 0, False)])
    assert rc == 0
    status = L.IBV_WC_LOC_PROT_ERR if fault == "lkey" else L.IBV_WC_REM_ACCESS_ERR
    assert _poll(nic) == [(1, status), (2, L.IBV_WC_WR_FLUSH_ERR)]
    assert not dst.any()


def test_loopback_fail_after_injects_a_completion_error():
    fabric, nic, qp, src, dst, skey, dkey = _nic_with_memory(depth=8)
    nic.fail_after(qp, 2)
    rows = [(i, 0, src.ctypes.data + 8 * i, 8, skey, 0x10000 + 8 * i, dkey, 0, 0, False) for i in range(3)]
    _post(nic, qp, rows)
    assert np.array_equal(dst[:8], src[:8]) and not dst[8:].any()
    assert _poll(nic) == [(1, L.IBV_WC_REM_ACCESS_ERR), (2, L.IBV_WC_WR_FLUSH_ERR)]


# ---- ranks in one process: compiled and Python proxies over the stand-in ------------------

class Ranks:
    """`n` ranks, each: data region 0 (dma-buf style iova base), flag region 1 (host), a
    verbs transport over one loopback fabric."""

    def __init__(self, n=2, *, sq_depth=16, signal_every=4, max_inline=64, seed=0, efa=False,
                 efa_flags="immediate"):
        self.fabric = L.LoopbackFabric()
        rng = np.random.default_rng(seed)
        self.data = [rng.integers(0, 256, DATA, dtype=np.uint8) for _ in range(n)]
        self.flags = [np.zeros(512, dtype=np.uint64) for _ in range(n)]
        self.transports = []
        for r in range(n):
            backend = L.LoopbackBackend(self.fabric, r, max_inline=max_inline)
            if efa:                    # the stand-in then makes SRD endpoints
                backend.open = lambda name, r=r: V.DeviceInfo("efa_loopback", True, r + 1,
                                                              bytes([r]) * 16, 5, 32)
            t = V.VerbsTransport(r, n, 2, backend=backend, sq_depth=sq_depth,
                                 signal_every=1 if efa else signal_every, recv_depth=64,
                                 efa_flags=efa_flags, timeout=5.0)
            dmabuf = {} if efa else dict(dmabuf_fd=99, dmabuf_offset=4096)
            t.register_region(0, self.data[r].ctypes.data, DATA, **dmabuf)
            t.register_region(1, self.flags[r].ctypes.data, self.flags[r].nbytes, kind=REGION_HOST)
            self.transports.append(t)
        sent = [t.connection_data() for t in self.transports]
        for r, t in enumerate(self.transports):
            t.complete([sent[p][r] for p in range(n)])
        self.queues = [QueueSet(1, 64, [r]) for r in range(n)]
        self.proxies = []

    def start(self, compiled=True, **kw):
        kind = CompiledVerbsProxy if compiled else VerbsProxy
        self.proxies = [kind(self.queues[r], t.regions, t, **kw) for r, t in enumerate(self.transports)]
        return self.proxies

    def post(self, rank, records):
        qs = self.queues[rank]
        cmds = PR.commands(records)
        assert PR.post_many(qs.ring, qs.header, np.uint64(qs.slots), 0, cmds, SPINS) == len(cmds)

    def wait_flag(self, rank, index, value):
        assert PR.wait_at_least(self.flags[rank], index, np.uint64(value), SPINS), \
            f"flag {index} of rank {rank} never reached {value}: {self.flags[rank][index]}"

    def close(self):
        errors = VerbsRanks.close(self)        # the Python-proxy tests' teardown
        for t in self.transports:
            t.close()
        return errors


def _traffic(n_puts=400, seed=3):
    """Puts of rank 0's data into rank 1 (random sizes and offsets), a flag every few."""
    rng = np.random.default_rng(seed)
    records, expected = [], {}
    for i in range(n_puts):
        nbytes = int(rng.integers(1, 2048))
        src_offset = int(rng.integers(0, DATA - nbytes))
        dst_offset = int(rng.integers(0, DATA - nbytes))
        if i % 3 == 0:
            records.append(dict(opcode=OP_PUT_SIGNAL, dst_rank=1, src_offset=src_offset,
                                dst_offset=dst_offset, nbytes=nbytes, signal_region=1,
                                signal_offset=8 * (i % 64), signal_value=i + 1))
        else:
            records.append(dict(opcode=OP_PUT, dst_rank=1, src_offset=src_offset,
                                dst_offset=dst_offset, nbytes=nbytes))
        expected[i] = (src_offset, dst_offset, nbytes)
    records.append(dict(opcode=OP_FENCE, dst_rank=1, signal_region=1, signal_offset=8 * 100,
                        signal_value=7))
    return records, expected


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize("max_inline", [64, 0], ids=["inline", "staged"])
def test_puts_and_flags_land_as_on_a_serial_copy(compiled, max_inline):
    ranks = Ranks(max_inline=max_inline)
    try:
        records, expected = _traffic()
        want = ranks.data[1].copy()
        for i in range(len(expected)):
            s, d, n = expected[i]
            want[d:d + n] = ranks.data[0][s:s + n]
        ranks.start(compiled=compiled)
        ranks.post(0, records)
        ranks.wait_flag(1, 100, 7)              # the fence's flag: everything before it landed
        assert np.array_equal(ranks.data[1], want)
        want_flags = np.zeros_like(ranks.flags[1])
        for i in range(0, len(expected), 3):          # in order: the last write of a slot stays
            want_flags[i % 64] = i + 1
        want_flags[100] = 7
        assert np.array_equal(ranks.flags[1], want_flags)
        stats = ranks.proxies[0].stats
        assert stats["puts"] == len(expected) and stats["errors"] == 0
    finally:
        assert ranks.close() == []


def test_compiled_and_python_proxies_write_the_same_bytes():
    results = []
    for compiled in (True, False):
        ranks = Ranks(seed=5)
        try:
            records, _ = _traffic(seed=9)
            ranks.start(compiled=compiled)
            ranks.post(0, records)
            ranks.wait_flag(1, 100, 7)
            results.append((ranks.data[1].copy(), ranks.flags[1].copy()))
        finally:
            assert ranks.close() == []
    assert np.array_equal(results[0][0], results[1][0])
    assert np.array_equal(results[0][1], results[1][1])


def test_done_word_advances_once_the_wrs_completed():
    ranks = Ranks(sq_depth=8, signal_every=2)
    try:
        ranks.start()
        ranks.post(0, [dict(opcode=OP_PUT, dst_rank=1, src_offset=0, dst_offset=0, nbytes=64)] * 50
                   + [dict(opcode=OP_SIGNAL, dst_rank=1, signal_region=1, signal_offset=0, signal_value=3)])
        ranks.wait_flag(1, 0, 3)
        header = ranks.queues[0].header
        assert PR.wait_at_least(header, Q.H_DONE, np.uint64(51), SPINS)
        assert ranks.proxies[0].idle
    finally:
        assert ranks.close() == []


def test_barrier_writes_this_ranks_slot_on_every_rank():
    ranks = Ranks(n=3)
    try:
        ranks.start()
        for r in range(3):
            ranks.post(r, [dict(opcode=OP_BARRIER, dst_rank=r, signal_region=1, signal_offset=8 * 200,
                                signal_value=5)])
        for r in range(3):
            for slot in range(3):
                ranks.wait_flag(r, 200 + slot, 5)
    finally:
        assert ranks.close() == []


@pytest.mark.parametrize("efa,record", [
    (False, dict(opcode=OP_PUT, dst_rank=1, src_offset=DATA - 8, dst_offset=0, nbytes=64)),
    (True, dict(opcode=OP_SIGNAL, dst_rank=1, signal_region=1, signal_offset=0,
                signal_value=1 << 20))], ids=["rc-put-out-of-region", "efa-unencodable-flag"])
def test_a_refused_command_fails_its_queue_with_its_code(efa, record):
    """Out of its region (the shared validation), or a flag a write with immediate cannot
    carry (EFA): the queue's error word says E_BOUNDS, and the host raises it once."""
    ranks = Ranks(efa=efa)
    try:
        ranks.start()
        ranks.post(0, [record])
        header = ranks.queues[0].header
        assert PR.wait_at_least(header, Q.H_ERROR, np.uint64(1), SPINS)
        assert int(header[Q.H_ERROR]) & 0xFF == Q.E_BOUNDS
    finally:
        errors = ranks.close()
    assert len(errors) == 1 and errors[0].code == Q.E_BOUNDS


def test_completion_error_fails_every_queue_and_names_peer_and_wr():
    ranks = Ranks()
    try:
        ranks.start()
        ranks.transports[0].qps[1].nic.fail_after(ranks.transports[0].qps[1].index, 5)
        ranks.post(0, [dict(opcode=OP_PUT, dst_rank=1, src_offset=0, dst_offset=0, nbytes=64)] * 20)
        header = ranks.queues[0].header
        assert PR.wait_at_least(header, Q.H_ERROR, np.uint64(1), SPINS)
        assert int(header[Q.H_ERROR]) & 0xFF == Q.E_TRANSPORT
        with pytest.raises(ProxyError, match=r"rank 0 -> rank 1: completion failed, work request "
                                             r"0x10000000005 \(sequence 5\), status 10"):
            ranks.proxies[0].check()
    finally:
        ranks.close()


def test_credits_wrap_many_times_with_a_small_send_queue():
    ranks = Ranks(sq_depth=4, signal_every=2)
    try:
        ranks.start()
        records = [dict(opcode=OP_PUT_SIGNAL, dst_rank=1, src_offset=8 * (i % 100), dst_offset=8 * (i % 100),
                        nbytes=8, signal_region=1, signal_offset=8, signal_value=i + 1) for i in range(3000)]
        ranks.post(0, records)
        ranks.wait_flag(1, 1, 3000)
        assert np.array_equal(ranks.data[1][:800], ranks.data[0][:800])
        assert all(t.cq.nic.overflows == 0 for t in ranks.transports)   # no completion lost
    finally:
        assert ranks.close() == []


def test_a_copy_function_replaces_memmove_and_gets_its_argument():
    """The hook the GPU stand-in uses (cuMemcpyAsync on its own stream): here a host copy
    that counts its calls in the word its argument points at; a nonzero return fails the WR."""
    from numba import cfunc, types

    from mkrt.proxy.atomics import copy_bytes, load_acquire_at, store_release_at

    @cfunc(types.int32(types.uint64, types.uint64, types.uint64, types.uint64), nogil=True)
    def counting_copy(dst, src, nbytes, counter):
        copy_bytes(dst, src, nbytes)
        calls = load_acquire_at(counter) + np.uint64(1)
        store_release_at(counter, calls)
        return 0 if calls < np.uint64(3) else 5

    fabric, nic, qp, src, dst, skey, dkey = _nic_with_memory(depth=8)
    counter = np.zeros(1, dtype=np.uint64)
    nic.use_copy(qp, counting_copy.address, counter.ctypes.data)
    rows = [(i, 0, src.ctypes.data + 8 * i, 8, skey, 0x10000 + 8 * i, dkey, 2, 0, False) for i in range(4)]
    _post(nic, qp, rows)
    assert int(counter[0]) == 3                        # the third copy failed; the QP stopped
    assert np.array_equal(dst[:16], src[:16]) and not dst[24:].any()
    assert _poll(nic) == [(0, 0), (1, 0), (2, L.IBV_WC_REM_ACCESS_ERR), (3, L.IBV_WC_WR_FLUSH_ERR)]


def test_two_fabrics_reach_each_others_memory_through_aliases():
    """What two processes do (MKRT_VERBS_PROVIDER=loopback under mpiexec): each registers
    its memory as its own rank and aliases the other's registration onto its own mapping of
    that memory; a write from process 0 with process 1's rkey lands in process 1's buffer,
    and a key nobody aliased is refused."""
    fabrics = [L.LoopbackFabric(owners=2, per_owner=8) for _ in range(2)]
    buffers = [np.zeros(64, dtype=np.uint8) for _ in range(2)]
    src = np.arange(64, dtype=np.uint8)
    keys = [fabrics[r].register(buffers[r].ctypes.data, 64, base=0x5000, owner=r) for r in range(2)]
    assert keys[0] >> L.KEY_OWNER_SHIFT == 0 and keys[1] >> L.KEY_OWNER_SHIFT == 1
    skey = fabrics[0].register(src.ctypes.data, 64, owner=0)
    nic = L.LoopbackNic(fabrics[0])
    qp = nic.create_qp(4)
    rc, _, _ = _post(nic, qp, [(1, 0, src.ctypes.data, 16, skey, 0x5000, keys[1], 2, 0, False)])
    assert rc == 0 and _poll(nic) == [(1, L.IBV_WC_REM_ACCESS_ERR)]      # not aliased yet
    nic = L.LoopbackNic(fabrics[0])
    qp = nic.create_qp(4)
    # process 0 maps process 1's buffer (here: the same memory) and aliases its key
    fabrics[0].alias(keys[1], 0x5000, buffers[1].ctypes.data, 64)
    rc, _, _ = _post(nic, qp, [(2, 0, src.ctypes.data, 16, skey, 0x5000 + 8, keys[1], 2, 0, False)])
    assert rc == 0 and _poll(nic) == [(2, 0)]
    assert np.array_equal(buffers[1][8:24], src[:16]) and not buffers[0].any()
    fabrics[0].deregister(keys[1])
    with pytest.raises(ValueError, match="not registered"):
        fabrics[0].deregister(keys[1])


def test_extended_qp_api_of_the_stand_in_posts_writes_with_immediate():
    """The ibv_qp_ex path (EFA SRD): wr_start, wr_rdma_write(_imm), wr_set_ud_addr,
    wr_set_sge, wr_complete called through the QP's function pointers from compiled code;
    a reordering QP carries the batch out last to first, every WR completes on its own,
    each immediate needs a posted receive at the destination."""
    from numba import njit

    fabric = L.LoopbackFabric()
    sender, receiver = L.LoopbackNic(fabric), L.LoopbackNic(fabric)
    qp = sender.create_qp(8, extended=True, reorder=True)
    rq = receiver.create_qp(8, extended=True)
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    skey = fabric.register(src.ctypes.data, 64)
    dkey = fabric.register(dst.ctypes.data, 64)
    ah = receiver.address_handle()
    f = A.qpx_functions(sender.qp_address(qp))
    post_recv = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64)(
        L.loopback_post_recv.address)
    recv_wrs = np.zeros((2, A.RECV_WR_WORDS), dtype=np.uint64)
    recv_wrs[0, 1] = recv_wrs.ctypes.data + 8 * A.RECV_WR_WORDS       # a chain of two
    assert post_recv(receiver.qp_address(rq), recv_wrs.ctypes.data, 0) == 0

    @njit
    def post(qpx, f_start, f_write, f_imm, f_ud, f_sge, f_complete, ah, skey, src, dkey, dst):
        A.call_qpx(f_start, qpx)
        for i in range(3):
            store_release_at(qpx + np.uint64(A.QPX_WR_ID), np.uint64(10 + i))
            store_release_at(qpx + np.uint64(A.QPX_WR_FLAGS), np.uint64(2))      # signalled
            if i < 2:
                A.call_qpx_write(f_imm, qpx, dkey, dst + np.uint64(16 * i),
                                 A.byteswap32(np.uint64(0x100 + i)))
            else:
                A.call_qpx_write(f_write, qpx, dkey, dst + np.uint64(32), 0)
            A.call_qpx_ud_addr(f_ud, qpx, ah, 7, 0x11111111)
            A.call_qpx_sge(f_sge, qpx, skey, src + np.uint64(16 * i), 16)
        return A.call_qpx_complete(f_complete, qpx)

    from mkrt.proxy.atomics import store_release_at
    rc = post(np.uint64(sender.qp_address(qp)), f["start"], f["rdma_write"], f["rdma_write_imm"],
              f["set_ud_addr"], f["set_sge"], f["complete"], np.uint64(ah.ctypes.data), skey,
              np.uint64(src.ctypes.data), dkey, np.uint64(dst.ctypes.data))
    assert rc == 0
    assert np.array_equal(dst[:48], src[:48])
    sent = [(c.wr_id, c.status) for c in L._LoopbackCQ(sender).poll(8)]
    assert sent == [(12, 0), (11, 0), (10, 0)]                   # carried out last to first
    received = L._LoopbackCQ(receiver).poll(8)
    assert sorted(c.imm_data for c in received) == [0x100, 0x101]
    assert all(c.opcode == L.IBV_WC_RECV_RDMA_WITH_IMM for c in received)
    assert sender.outstanding(qp) == 0
    # a third immediate finds no receive posted: receiver-not-ready, nothing written
    dst[:] = 0
    rc = post(np.uint64(sender.qp_address(qp)), f["start"], f["rdma_write"], f["rdma_write_imm"],
              f["set_ud_addr"], f["set_sge"], f["complete"], np.uint64(ah.ctypes.data), skey,
              np.uint64(src.ctypes.data), dkey, np.uint64(dst.ctypes.data))
    statuses = sorted(c.status for c in L._LoopbackCQ(sender).poll(8))
    assert L.IBV_WC_RNR_RETRY_EXC_ERR in statuses


def EfaRanks(n=2, *, sq_depth=16, seed=0):
    """Ranks whose transports are EFA SRD endpoints on the loopback NIC (completions and
    deliveries reordered; flags written by the receiving proxy from immediates)."""
    return Ranks(n, sq_depth=sq_depth, seed=seed, efa=True)


def test_efa_puts_with_flags_land_and_flags_never_go_backwards():
    ranks = EfaRanks()
    try:
        ranks.start(compiled=True)
        # SRD delivers in any order: writes to overlapping bytes would have no defined
        # winner, so every put here has its own destination bytes
        rng = np.random.default_rng(4)
        records, expected = [], {}
        for i in range(300):
            nbytes, src_offset = int(rng.integers(1, 200)), int(rng.integers(0, DATA - 200))
            records.append(dict(opcode=OP_PUT_SIGNAL if i % 3 == 0 else OP_PUT, dst_rank=1,
                                src_offset=src_offset, dst_offset=200 * i, nbytes=nbytes,
                                signal_region=1 if i % 3 == 0 else Q.NO_REGION,
                                signal_offset=8 * (i % 64), signal_value=i + 1))
            expected[i] = (src_offset, 200 * i, nbytes)
        want = ranks.data[1].copy()
        for i in range(len(expected)):
            s, d, n = expected[i]
            want[d:d + n] = ranks.data[0][s:s + n]
        ranks.post(0, records + [dict(opcode=OP_SIGNAL, dst_rank=1, signal_region=1,
                                      signal_offset=8 * 100, signal_value=9)])
        ranks.wait_flag(1, 100, 9)                   # a bare flag: after everything before it
        assert PR.wait_at_least(ranks.queues[0].header, Q.H_DONE, np.uint64(len(records) + 1), SPINS)
        assert np.array_equal(ranks.data[1], want)
        for slot in range(64):                       # the largest value each slot was sent
            sent = [i + 1 for i in range(0, len(expected), 3) if i % 64 == slot]
            assert int(ranks.flags[1][slot]) == (max(sent) if sent else 0)
        assert all(t.cq.nic.overflows == 0 for t in ranks.transports)   # no completion lost
    finally:
        assert ranks.close() == []


def test_efa_direct_flags_land_after_their_data_in_any_region_with_any_value():
    """efa_flags="direct" (worlds: flags in GPU memory): each flag is an 8-byte WRITE the
    sender posts once everything before it has completed. The stand-in carries out each
    posted batch last to first, so a flag posted in its data's batch would land first: a
    copy hook records the order of every write. Flags go into the data region (not host
    memory, not the immediate format's region) with values past 2**20."""
    from numba import cfunc, types

    from mkrt.proxy.atomics import copy_bytes, load_acquire_at, store_release_at

    @cfunc(types.int32(types.uint64, types.uint64, types.uint64, types.uint64), nogil=True)
    def logging_copy(dst, src, nbytes, log):
        copy_bytes(dst, src, nbytes)
        n = load_acquire_at(log)
        store_release_at(log + np.uint64(8) * (np.uint64(1) + np.uint64(2) * n), dst)
        store_release_at(log + np.uint64(8) * (np.uint64(2) + np.uint64(2) * n), nbytes)
        store_release_at(log, n + np.uint64(1))
        return 0

    ranks = Ranks(efa=True, efa_flags="direct")
    log = np.zeros(1 + 2 * 4096, dtype=np.uint64)
    sender = ranks.transports[0].qps[0]
    sender.nic.use_copy(sender.index, logging_copy.address, log.ctypes.data)
    try:
        flag_base = DATA - 8 * 64                        # the data region's last 64 words
        ranks.data[1][flag_base:] = 0
        ranks.start(compiled=True)
        rng = np.random.default_rng(5)
        records, puts = [], []
        for i in range(200):
            nbytes, src_offset = int(rng.integers(1, 200)), int(rng.integers(0, DATA - 200))
            flagged = i % 4 == 0
            records.append(dict(opcode=OP_PUT_SIGNAL if flagged else OP_PUT, dst_rank=1,
                                src_offset=src_offset, dst_offset=200 * i, nbytes=nbytes,
                                signal_region=0 if flagged else Q.NO_REGION,
                                signal_offset=flag_base + 8 * (i % 64),
                                signal_value=(1 << 40) + i))
            puts.append((src_offset, 200 * i, nbytes, flagged))
        want = ranks.data[1].copy()
        for s_, d, n, _ in puts:
            want[d:d + n] = ranks.data[0][s_:s_ + n]
        ranks.post(0, records + [dict(opcode=OP_SIGNAL, dst_rank=1, signal_region=1,
                                      signal_offset=8 * 100, signal_value=(1 << 33) + 7)])
        ranks.wait_flag(1, 100, (1 << 33) + 7)           # the bare flag: after everything
        assert PR.wait_at_least(ranks.queues[0].header, Q.H_DONE, np.uint64(len(records) + 1), SPINS)
        flags_seen = ranks.data[1][flag_base:].view(np.uint64)
        for slot in range(64):
            sent = [(1 << 40) + i for i in range(0, 200, 4) if i % 64 == slot]
            assert int(flags_seen[slot]) == (max(sent) if sent else 0)
        want[flag_base:] = ranks.data[1][flag_base:]
        assert np.array_equal(ranks.data[1], want)
        # every flag write comes after the write of its put's data, in the order of posts
        base = int(ranks.data[1].ctypes.data)
        writes = [(int(log[1 + 2 * j]) - base, int(log[2 + 2 * j])) for j in range(int(log[0]))]
        data_writes = {(d, n): j for j, (d, n) in enumerate(writes) if d < flag_base}
        flag_writes: dict = {}           # slot -> positions of its writes, in order
        for j, (d, n) in enumerate(writes):
            if d >= flag_base:
                flag_writes.setdefault((d - flag_base) // 8, []).append(j)
        for i, (_, d, n, flagged) in enumerate(puts):
            if flagged:      # the m-th flag to a slot is the m-th write of that slot
                slot = i % 64
                m = sum(1 for e in range(0, i, 4) if e % 64 == slot)
                assert data_writes[(d, n)] < flag_writes[slot][m], (i, data_writes[(d, n)],
                                                                    flag_writes[slot])
        with pytest.raises(MkrtError, match="compiled loop only"):
            ranks.transports[0].post_commands(1, [])    # the Python proxy's way in
    finally:
        assert ranks.close() == []


def test_two_processes_through_the_loopback_nic_over_mpi():
    """mpiexec -n 2: connection data over MPI, each process aliasing the peer's
    registrations onto its mapping of the peer's memory, the compiled loop posting."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path
    mpiexec = Path(sys.executable).with_name("mpiexec")
    if not mpiexec.exists():
        pytest.skip(f"no mpiexec beside {sys.executable}")
    script = Path(__file__).with_name("verbs_loopback_mpi_script.py")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run([str(mpiexec), "-n", "2", sys.executable, "-m", "mpi4py", str(script)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = sorted(re.findall(r"rank (\d+) ok (\d+)", proc.stdout))
    assert reports == [("0", "2000"), ("1", "2000")], proc.stdout + proc.stderr
