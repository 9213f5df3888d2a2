"""verbs transport: the device-free parts on any CPU; the device part skips with its reason."""

from __future__ import annotations

import struct

import pytest

from mkrt.proxy import OP_FENCE, OP_PUT, OP_SIGNAL, TransportUnavailable
from mkrt.proxy.transports import verbs as V


def test_rc_put_then_inline_flag_with_selective_signalling():
    credits = V.Credits(depth=16, signal_every=4)
    builder = V.WorkRequestBuilder(credits)
    src = V.LocalRegion(0x1000, 1 << 20, lkey=7)
    dst = V.RemoteRegion(0x9000_0000, 1 << 20, rkey=9)
    flags = V.RemoteRegion(0x7000_0000, 4096, rkey=11)
    wrs = []
    for i in range(6):
        wrs += builder.put(src, i * 256, dst, i * 256, 256, flag=(flags, 8 * i, i + 1, i))
    assert [w.opcode for w in wrs] == [V.IBV_WR_RDMA_WRITE] * 12
    data, flag_writes = wrs[0::2], wrs[1::2]
    assert all(w.length == 256 and w.lkey == 7 and w.rkey == 9 for w in data)
    assert all(w.send_flags & V.IBV_SEND_INLINE and w.length == 8 for w in flag_writes)
    assert struct.unpack("<Q", flag_writes[2].inline_data)[0] == 3
    assert flag_writes[2].remote_address == 0x7000_0000 + 16
    signalled = [w.wr_id for w in wrs if w.send_flags & V.IBV_SEND_SIGNALED]
    assert signalled == [4, 8, 12]                         # every 4th WR
    assert credits.outstanding == 12
    assert credits.complete(4) == 4 and credits.outstanding == 8
    with pytest.raises(RuntimeError, match="out of order"):
        credits.complete(12)


def test_credits_never_fill_with_unsignalled_and_refuse_overflow():
    credits = V.Credits(depth=8, signal_every=4)
    flags = [credits.take(i) for i in range(1, 9)]
    # every 4th, then every WR once fewer than 4 slots would be left
    assert flags == [False, False, False, True, True, True, True, True]
    with pytest.raises(RuntimeError, match="send queue full"):
        credits.take(9)
    for wr_id in (4, 5, 6, 7, 8):
        credits.complete(wr_id)
    assert credits.available == 8
    with pytest.raises(ValueError, match="signal_every"):
        V.Credits(depth=8, signal_every=5)


def test_efa_write_with_immediate_carries_the_flag():
    builder = V.WorkRequestBuilder(V.Credits(64, 8), efa=True)
    src = V.LocalRegion(0x1000, 4096, 1)
    dst = V.RemoteRegion(0x2000, 4096, 2)
    flags = V.RemoteRegion(0x3000, 4096, 3)
    (wr,) = builder.put(src, 0, dst, 128, 512, flag=(flags, 0, 77, 5))
    assert wr.opcode == V.IBV_WR_RDMA_WRITE_WITH_IMM and wr.length == 512
    assert V.decode_immediate(wr.imm_data) == (5, 77)
    (bare,) = builder.signal(flags, 8, 9, 1)
    assert bare.length == 0 and V.decode_immediate(bare.imm_data) == (1, 9)
    with pytest.raises(ValueError, match="immediate"):
        V.encode_immediate(5000, 1)


def test_bounds_and_alignment_are_checked():
    builder = V.WorkRequestBuilder(V.Credits(16, 4))
    src = V.LocalRegion(0x1000, 1024, 1)
    dst = V.RemoteRegion(0x2000, 1024, 2)
    with pytest.raises(ValueError, match="out of region"):
        builder.put(src, 1000, dst, 0, 100)
    with pytest.raises(ValueError, match="misaligned"):
        builder.signal(dst, 4, 1)


def test_connection_data_round_trip_and_state_machine():
    data = V.ConnectionData(rank=1, qp_num=0x1234, psn=42, lid=3, gid=bytes(range(16)),
                            regions=((0x7000, 4096, 5), (0x8000, 8192, 6)))
    assert V.ConnectionData.unpack(data.pack()) == data
    conn = V.Connection(peer=1)
    conn.advance("INIT")
    with pytest.raises(ValueError, match="connection data"):
        conn.advance("RTR", V.ConnectionData(2, 1, 1, 1, bytes(16)))
    conn.advance("RTR", data)
    with pytest.raises(RuntimeError, match="cannot go"):
        conn.advance("INIT")
    conn.advance("RTS")
    assert conn.ready and conn.remote.regions[1] == (0x8000, 8192, 6)


def test_batching_groups_by_peer_in_order():
    cmds = [dict(opcode=OP_PUT, dst_rank=r, n=i) for i, r in enumerate([1, 0, 1, 1, 0])]
    groups = V.batch_commands(cmds, peers=2)
    assert [c["n"] for c in groups[1]] == [0, 2, 3] and [c["n"] for c in groups[0]] == [1, 4]
    with pytest.raises(ValueError, match="outside"):
        V.batch_commands([dict(opcode=OP_SIGNAL, dst_rank=3)], peers=2)
    with pytest.raises(ValueError, match="opcode"):
        V.batch_commands([dict(opcode=OP_FENCE, dst_rank=0)], peers=2)


def test_device_transport_available_or_skipped_with_reason():
    reason = V.availability()
    if reason is not None:
        with pytest.raises(TransportUnavailable, match="verbs transport unavailable"):
            V.VerbsTransport(0, 1, 2)
        pytest.skip(f"verbs device part not exercised: {reason}")
    transport = V.VerbsTransport(0, 1, 2)       # loopback: one rank connected to itself
    buffer = bytearray(4096)
    import ctypes
    address = ctypes.addressof((ctypes.c_char * 4096).from_buffer(buffer))
    transport.register_region(0, address, 4096)
    transport.complete(transport.connection_data())
    transport.close()


def test_pyverbs_api_surface_when_installed():
    """The classes, attributes and enums the pyverbs backend uses exist (no device needed)."""
    pytest.importorskip("pyverbs.wr", reason="pyverbs not installed (CI: by design)")
    import pyverbs.enums as e
    from pyverbs import addr, cq, device, mr, pd, qp
    for obj, names in [(qp.QP, ["to_init", "to_rtr", "to_rts", "post_send", "post_recv", "qp_num"]),
                       (qp.QPAttr, ["dest_qp_num", "rq_psn", "sq_psn", "path_mtu", "ah_attr", "qkey",
                                    "max_dest_rd_atomic", "min_rnr_timer", "timeout", "retry_cnt",
                                    "rnr_retry", "max_rd_atomic", "qp_access_flags", "port_num"]),
                       (cq.CQ, ["poll"]), (cq.WC, ["wr_id", "status", "opcode", "imm_data", "qp_num"]),
                       (mr.MR, ["lkey", "rkey", "close"]), (mr.DmaBufMR, ["lkey", "rkey"]),
                       (device.Context, ["query_port", "query_gid"]), (pd.PD, ["close"]),
                       (addr.AHAttr, ["dlid", "is_global"])]:
        missing = [n for n in names if not hasattr(obj, n)]
        assert not missing, (obj, missing)
    assert (e.IBV_WR_RDMA_WRITE, e.IBV_WR_RDMA_WRITE_WITH_IMM) == (V.IBV_WR_RDMA_WRITE,
                                                                    V.IBV_WR_RDMA_WRITE_WITH_IMM)
    assert (e.IBV_SEND_SIGNALED, e.IBV_SEND_INLINE, e.IBV_WC_SUCCESS) == (
        V.IBV_SEND_SIGNALED, V.IBV_SEND_INLINE, V.IBV_WC_SUCCESS)
    assert e.IBV_WC_RECV_RDMA_WITH_IMM == V.IBV_WC_RECV_RDMA_WITH_IMM
    assert (e.IBV_ACCESS_LOCAL_WRITE, e.IBV_ACCESS_REMOTE_WRITE, e.IBV_ACCESS_REMOTE_READ) == (
        V.IBV_ACCESS_LOCAL_WRITE, V.IBV_ACCESS_REMOTE_WRITE, V.IBV_ACCESS_REMOTE_READ)
    efadv = pytest.importorskip("pyverbs.providers.efa.efadv")
    assert all(hasattr(efadv, n) for n in ("SRDQPEx", "EfaQPInitAttr", "EfaContext"))
    assert all(hasattr(efadv.SRDQPEx, n) for n in ("wr_start", "wr_rdma_write_imm", "wr_set_sge",
                                                    "wr_set_ud_addr", "wr_complete"))
    # the WR chain the backend posts, built for real (SendWR/SGE need no device)
    b = V.WorkRequestBuilder(V.Credits(16, 4), staging=V.LocalRegion(0x5000, 128, 3))
    wrs = b.put(V.LocalRegion(0x1000, 4096, 1), 0, V.RemoteRegion(0x2000, 4096, 2), 64, 256,
                flag=(V.RemoteRegion(0x3000, 64, 4), 8, 7, 1), force_signal=True)
    head = V.pyverbs_chain(wrs)
    assert head.wr_id == wrs[0].wr_id and head.opcode == e.IBV_WR_RDMA_WRITE
    assert wrs[1].send_flags == e.IBV_SEND_INLINE | e.IBV_SEND_SIGNALED and wrs[1].local_address == 0x5000 + 16


MPI_SCRIPT = r'''"""Run by tests/test_proxy_verbs.py under `mpiexec -n N python -m mpi4py`: connection data
of the verbs transport exchanged with alltoall (fake backend; no RDMA device)."""

import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, sys.argv[1])   # tests/: the fake backend
from mkrt.proxy.transports import verbs as V          # noqa: E402
from test_proxy_verbs_fake import Fabric, FakeBackend  # noqa: E402

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
fabric = Fabric()
fabric.next_qpn = 1000 * (rank + 1)          # distinct QP numbers per process
fabric.next_key = 100 * (rank + 1)
backend = FakeBackend(fabric, rank)
buffers = [np.zeros(4096 * (r + 1), np.uint8) for r in range(2)]
t = V.VerbsTransport(rank, size, 3, backend=backend)
t.register_region(0, buffers[0].ctypes.data, buffers[0].nbytes)
t.register_region(2, buffers[1].ctypes.data, buffers[1].nbytes, dmabuf_fd=7, dmabuf_offset=64)
t.connect(comm)
qpns = comm.allgather({p: t.qps[p].qp_num for p in range(size)})
regions = comm.allgather([tuple(int(x) for x in t.regions[rank, i]) for i in range(3)])
rkeys = comm.allgather([int(k) for k in t.rkeys[rank]])
for local, remote, remote_qpn, psn in backend.connects:
    if qpns[remote][local] != remote_qpn:
        raise SystemExit(f"rank {rank}: QP to {remote} got qpn {remote_qpn}, expected {qpns[remote][local]}")
for p in range(size):
    if not t.connections[p].ready:
        raise SystemExit(f"rank {rank}: connection to {p} is {t.connections[p].state}")
    for i in range(3):
        if p != rank and tuple(int(x) for x in t.regions[p, i]) != regions[p][i] and regions[p][i][3]:
            raise SystemExit(f"rank {rank}: region ({p}, {i}) = {t.regions[p, i]}, expected {regions[p][i]}")
        if int(t.rkeys[p, i]) != rkeys[p][i]:
            raise SystemExit(f"rank {rank}: rkey ({p}, {i}) = {t.rkeys[p, i]}, expected {rkeys[p][i]}")
for p in range(size):
    if p != rank and (int(t.regions[p, 2, 0]) != 64 or int(t.regions[p, 1, 3]) != 0):
        raise SystemExit(f"rank {rank}: dma-buf region of {p} must be addressed by iova 64; got {t.regions[p]}")
print(f"rank {rank} connected {len(backend.connects)}", flush=True)
t.close()
'''


@pytest.mark.parametrize("processes", [2, 4])
def test_connection_data_exchange_over_mpiexec(tmp_path, processes):
    """mpiexec -n 2 and 4: alltoall of connection data with the fake backend; each rank
    checks that its QPs point at the peers' QPs and its region table holds their regions."""
    import subprocess
    from pathlib import Path
    from mkrt import launch
    try:
        script = tmp_path / "proxy_verbs_mpi.py"
        script.write_text(MPI_SCRIPT)
        command = launch.mpiexec_command(processes, str(script), str(Path(__file__).parent))
    except Exception as error:
        pytest.skip(f"no mpiexec: {error}")
    proc = subprocess.run(command, capture_output=True, text=True, timeout=240, env=launch.child_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import re
    lines = sorted(re.findall(r"rank \d connected \d", proc.stdout))   # ranks' output may share a line
    assert lines == [f"rank {r} connected {processes}" for r in range(processes)], \
        proc.stdout + proc.stderr
