"""An in-process fake of the verbs backend (what VerbsTransport calls on pyverbs), for CPU tests.

A `Fabric` joins the fake devices of several ranks in one process. RDMA WRITEs really
copy bytes between numpy buffers, translating (rkey, remote address) through the
target's registered regions the way a NIC does (iova for dma-buf registrations, VA
otherwise), and fail with a remote-access error outside them. Posted WRs run later, when
a CQ is polled: in order per QP (RC), or shuffled (EFA SRD). Inline WRs copy their data
at post time (as ibv_post_send does); others read it when they run. Every write is logged
so tests can check that a flag landed after its data.
"""

from __future__ import annotations

import ctypes
import random
import threading

from mkrt.proxy.transports import verbs as V

WC_REM_ACCESS_ERR = 10
WC_RNR_RETRY_EXC_ERR = 13
WC_WR_FLUSH_ERR = 5
WC_GENERAL_ERR = 21


class Fabric:
    def __init__(self, *, efa=False, seed=0, max_run=3):
        self.lock = threading.RLock()
        self.efa, self.rng, self.max_run = efa, random.Random(seed), max_run
        self.qps, self.mrs, self.devices = {}, {}, {}
        self.next_qpn, self.next_key = 100, 1000
        self.log = []                  # (kind, dst VA, length) in the order writes landed
        self.fail_next = None          # status for the next WR that runs
        self.posted_chains = []        # lengths of every post_send chain
        self.stall = False             # True: WRs never run (credits never return)


class FakeCQ:
    def __init__(self, fabric):
        self.fabric, self.entries, self.qps = fabric, [], []

    def poll(self, n):
        with self.fabric.lock:
            for qp in self.qps:
                qp.run_some()
            out, self.entries = self.entries[:n], self.entries[n:]
            return out


class FakeQP:
    def __init__(self, backend, cq, efa):
        f = backend.fabric
        self.backend, self.cq, self.efa = backend, cq, efa
        self.qp_num = f.next_qpn
        f.next_qpn += 1
        f.qps[self.qp_num] = self
        self.pending, self.recvs = [], []
        self.state, self.remote_qpn, self.error = "RESET", None, False
        cq.qps.append(self)

    def run_some(self):
        f = self.backend.fabric
        if f.stall or not self.pending:
            return
        count = f.rng.randint(1, f.max_run)
        for _ in range(min(count, len(self.pending))):
            index = f.rng.randrange(len(self.pending)) if self.efa else 0
            if self.execute(*self.pending.pop(index)) is None and self.pending and \
                    self.pending[0][0].opcode == V.IBV_WR_RDMA_WRITE_WITH_IMM and \
                    not f.qps[self.pending[0][1]].recvs:
                break

    def complete(self, wr, status):
        if status != 0 or wr.send_flags & V.IBV_SEND_SIGNALED:
            self.cq.entries.append(V.Completion(wr.wr_id, status, V.IBV_WC_RDMA_WRITE, 0, self.qp_num))

    def execute(self, wr, target_qpn, inline_bytes):
        f = self.backend.fabric
        if self.error:
            return self.complete(wr, WC_WR_FLUSH_ERR)
        if f.fail_next is not None:
            status, f.fail_next = f.fail_next, None
            self.error = True
            return self.complete(wr, status)
        target = f.qps[target_qpn]
        if wr.opcode == V.IBV_WR_RDMA_WRITE_WITH_IMM and not target.recvs:
            # receiver not ready: the device retries later (rnr_retry = 7, unbounded)
            self.pending.insert(0, (wr, target_qpn, inline_bytes))
            return None
        dst = target.backend.translate(wr.rkey, wr.remote_address, wr.length)
        if dst is None:
            self.error = True
            return self.complete(wr, WC_REM_ACCESS_ERR)
        if inline_bytes is not None:
            data = inline_bytes
        elif wr.length:
            src = self.backend.translate_local(wr.lkey, wr.local_address, wr.length)
            if src is None:
                self.error = True
                return self.complete(wr, WC_GENERAL_ERR)
            data = ctypes.string_at(src, wr.length)
        else:
            data = b""
        if data:
            ctypes.memmove(dst, data, len(data))
        f.log.append(("flag" if inline_bytes is not None else "data", dst, len(data)))
        if wr.opcode == V.IBV_WR_RDMA_WRITE_WITH_IMM:
            if not target.recvs:
                self.error = True
                return self.complete(wr, WC_RNR_RETRY_EXC_ERR)
            recv_id = target.recvs.pop(0)
            target.cq.entries.append(V.Completion(recv_id, 0, V.IBV_WC_RECV_RDMA_WITH_IMM,
                                                  wr.imm_data, target.qp_num))
            f.log.append(("imm", dst, wr.imm_data))
        self.complete(wr, 0)
        return True


class FakeBackend:
    """Same methods as verbs.PyverbsBackend."""

    def __init__(self, fabric, rank, *, max_inline=64):
        self.fabric, self.rank, self.max_inline = fabric, rank, max_inline
        self.regions = []              # (lkey/rkey, base used in WRs, VA, size)
        self.closed = False
        self.connects = []

    def open(self, device_name):
        self.fabric.devices[self.rank] = self
        return V.DeviceInfo("efa_fake" if self.fabric.efa else "mlx5_fake", self.fabric.efa,
                            self.rank + 1, bytes([self.rank]) * 16, 5, self.max_inline)

    def create_cq(self, cqe):
        return FakeCQ(self.fabric)

    def create_qp(self, cq, sq_depth, recv_depth, max_inline, efa):
        with self.fabric.lock:
            return FakeQP(self, cq, efa)

    def connect(self, qp, local, remote):
        if qp.state != "RESET":
            raise RuntimeError("fake: QP not in RESET")
        qp.state, qp.remote_qpn = "RTS", remote.qp_num
        self.connects.append((local.rank, remote.rank, remote.qp_num, remote.psn))

    def connect_srd(self, qp):
        qp.state = "RTS"

    def address(self, remote):
        return ("ah", remote.rank)

    def register(self, address, size, dmabuf_fd=None, dmabuf_offset=0):
        with self.fabric.lock:
            key = self.fabric.next_key
            self.fabric.next_key += 1
        base = dmabuf_offset if dmabuf_fd is not None else address     # pyverbs: iova = offset
        self.regions.append((key, base, address, size))
        return V.Registration(("mr", key), key, key, base)

    def translate(self, rkey, address, length):
        for key, base, va, size in self.regions:
            if key == rkey and base <= address and address + length <= base + size:
                return va + (address - base)
        return None

    translate_local = translate

    def post_send(self, qp, wrs, ah=None, remote=None):
        with self.fabric.lock:
            if qp.state != "RTS":
                raise RuntimeError(f"fake: post_send on a QP in {qp.state}")
            self.fabric.posted_chains.append(len(wrs))
            target = remote.qp_num if qp.efa else qp.remote_qpn
            for w in wrs:
                inline = None
                if w.send_flags & V.IBV_SEND_INLINE:
                    src = self.translate_local(w.lkey, w.local_address, w.length)
                    if src is None:
                        raise RuntimeError("fake: inline WR with no readable SGE")
                    inline = ctypes.string_at(src, w.length)
                elif w.inline_data is not None and w.opcode == V.IBV_WR_RDMA_WRITE:
                    inline = None      # non-inline flag: read from staging when it runs
                qp.pending.append((w, target, inline))

    def post_recv(self, qp, wr_ids):
        with self.fabric.lock:
            qp.recvs.extend(wr_ids)

    def close(self):
        self.closed = True


def connect_all(transports):
    """What connect(comm) does with alltoall, for transports in one process."""
    sent = [t.connection_data() for t in transports]
    for r, t in enumerate(transports):
        t.complete([sent[p][r] for p in range(len(transports))])
