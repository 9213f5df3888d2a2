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
            V.VerbsTransport(comm=None)
        pytest.skip(f"verbs device part not exercised: {reason}")
    transport = V.VerbsTransport(comm=None)
    transport.close()
