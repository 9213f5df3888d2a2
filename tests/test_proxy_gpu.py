"""GPU tests of the queue + proxy + `ce` transport (pytest -m gpu).

Two ranks of an emulated world share device 0: rank 0's kernels post puts into rank 1's
buffer through the proxy (the inter-node path), flags included. Every kernel wait is
bounded (timeout_ns), so a dead proxy ends in CommTimeout, never a hang.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

TIMEOUT_NS = np.uint64(5_000_000_000)


def _world(chunk, ctas, count, *, slots=64, queues=4, ranks=2):
    import cupy
    from mkrt.proxy import QueueSet, new_region_table, set_region, REGION_DEVICE
    nbytes = chunk * ctas * count
    src = cupy.random.randint(0, 256, nbytes, dtype=np.uint8)   # rank 0, region 0
    dst = cupy.full(nbytes, 0xA5, dtype=np.uint8)              # rank 1, region 0 (poisoned)
    flags = cupy.zeros(max(ctas, 8), dtype=np.uint64)           # rank 1, region 1
    regions = new_region_table(ranks, 2)
    set_region(regions, 0, 0, src.data.ptr, src.nbytes, REGION_DEVICE)
    set_region(regions, 1, 0, dst.data.ptr, dst.nbytes, REGION_DEVICE)
    set_region(regions, 1, 1, flags.data.ptr, flags.nbytes, REGION_DEVICE)
    qs = QueueSet(queues, slots, [0] * queues, memory="pinned")
    return qs, regions, src, dst, flags


def _launch_puts(qs, flags, chunk, ctas, count, status, *, dst_rank=1, signal_every=1,
                 timeout_ns=TIMEOUT_NS):
    import cupy
    from mkrt.proxy.kernels import ProxyKernelsSpec
    fn = ProxyKernelsSpec().function("post_puts", 0)
    result = cupy.full(ctas, 7, dtype=np.uint64)
    fn((ctas,), (32,), (qs.device_descriptors(), np.int32(qs.queues), np.uint32(dst_rank),
                        np.uint32(1), flags, np.uint64(chunk), np.int32(count),
                        np.int32(signal_every), *status.args, np.uint64(timeout_ns), result))
    return result


def test_command_layout_on_device_matches_dtype():
    import cupy
    from mkrt.proxy.kernels import ProxyKernelsSpec
    from mkrt.proxy.queue import COMMAND_DTYPE
    out = cupy.full(len(COMMAND_DTYPE.names) + 1, 999, dtype=np.uint64)
    ProxyKernelsSpec().function("command_layout", 0)((1,), (1,), (out,))
    expected = [COMMAND_DTYPE.fields[n][1] for n in COMMAND_DTYPE.names] + [COMMAND_DTYPE.itemsize]
    assert out.get().tolist() == expected


@pytest.mark.parametrize("copy_method", ["kernel", "batch", "each"])
def test_ce_thousands_of_puts_data_and_flags(copy_method):
    import cupy
    from mkrt.proxy import Proxy
    from mkrt.proxy.kernels import raise_status, status_words
    from mkrt.proxy.transports.ce import CopyEngineTransport
    chunk, ctas, count = 4096, 32, 128           # 4096 puts, 16 MiB, ring of 64 wraps 16 times
    qs, regions, src, dst, flags = _world(chunk, ctas, count)
    status = status_words()
    with Proxy(qs, regions, CopyEngineTransport(0, copy_method=copy_method), threads=2,
               batch=32) as proxy:
        result = _launch_puts(qs, flags, chunk, ctas, count, status)
        cupy.cuda.Device(0).synchronize()
        raise_status(status)
        assert result.get().tolist() == [0] * ctas
        deadline = time.monotonic() + 10
        while proxy.stats["commands"] < ctas * count and time.monotonic() < deadline:
            time.sleep(0.001)
    stats = proxy.stats
    assert stats["puts"] == ctas * count and stats["errors"] == 0
    assert flags[:ctas].get().tolist() == [count] * ctas
    assert bool((dst == src).all())
    qs.close()


def test_ce_put_to_unregistered_rank_errors_on_both_sides():
    import cupy
    from mkrt.errors import CommTimeout
    from mkrt.proxy import Proxy, ProxyError
    from mkrt.proxy.kernels import raise_status, status_words
    from mkrt.proxy.transports.ce import CopyEngineTransport
    qs, regions, src, dst, flags = _world(256, 2, 4)
    status = status_words()
    proxy = Proxy(qs, regions, CopyEngineTransport(0), threads=1)
    try:
        _launch_puts(qs, flags, 256, 2, 4, status, dst_rank=1)   # fine
        cupy.cuda.Device(0).synchronize()
        raise_status(status)
        flags[:] = 0
        result = _launch_puts(qs, flags, 256, 2, 4, status, dst_rank=9)  # rank 9: not in the table
        cupy.cuda.Device(0).synchronize()
        assert set(result.get().tolist()) <= {1, 2}
        with pytest.raises(CommTimeout) as info:
            raise_status(status)
        assert info.value.record.flag == -2            # PROXY_ERROR_FLAG: the proxy said why
    finally:
        with pytest.raises(ProxyError, match="destination rank out of range"):
            proxy.close()
        qs.close()


def test_killed_proxy_ends_in_comm_timeout():
    import cupy
    from mkrt.errors import CommTimeout
    from mkrt.proxy import Proxy
    from mkrt.proxy.kernels import ProxyKernelsSpec, raise_status, status_words
    from mkrt.proxy.transports.host import HostTransport
    from mkrt.proxy import QueueSet, new_region_table, set_region, REGION_HOST
    qs = QueueSet(1, 16, [0], memory="pinned")
    flags = QueueSet(1, 2, [0], memory="pinned")      # any pinned words will do as flags
    regions = new_region_table(1, 2)
    set_region(regions, 0, 1, flags.memory.address, flags.memory.nbytes, REGION_HOST)
    status = status_words()
    fn = ProxyKernelsSpec().function("post_signals", 0)
    proxy = Proxy(qs, regions, HostTransport(), threads=1)
    result = cupy.full(4, 7, dtype=np.uint64)
    start = time.monotonic()
    fn((4,), (32,), (qs.device_descriptors(), np.int32(1), np.uint32(0), np.uint32(1),
                     np.int32(10_000_000), *status.args, np.uint64(300_000_000), result))
    time.sleep(0.05)
    proxy.kill()                                          # dead proxy, ring fills
    cupy.cuda.Device(0).synchronize()                     # bounded by the 300 ms wait
    assert time.monotonic() - start < 30
    assert result.get().tolist() == [1, 1, 1, 1]
    with pytest.raises(CommTimeout) as info:
        raise_status(status, timeout_ms=300)
    assert info.value.record.flag == -3                   # QUEUE_TAIL_FLAG: no ring space
    proxy.close()
    qs.close()
    flags.close()


@pytest.mark.parametrize("owned", [0, 1, 3])
def test_ping_pong_through_a_shared_and_an_owned_queue(owned):
    """1000 signals, each waited for, on a 16-slot ring (wraps 62 times); an owned queue
    hands its head back, so a shared poster can go on after it. owned 3: a shared queue
    whose descriptor is read from device memory at every post."""
    import cupy
    from mkrt.proxy import HostTransport, Proxy, QueueSet, REGION_HOST, new_region_table, set_region
    from mkrt.proxy.kernels import ProxyKernelsSpec, raise_status, status_words
    from mkrt.proxy.queue import PinnedMemory
    iters = 1000
    qs = QueueSet(1, 16, [0], memory="pinned")
    flag = PinnedMemory(4096)
    regions = new_region_table(1, 2)
    set_region(regions, 0, 1, flag.address, flag.nbytes, REGION_HOST)
    status = status_words()
    cycles = cupy.zeros(iters, dtype=np.int64)
    elapsed = cupy.zeros(2, dtype=np.uint64)
    spec = ProxyKernelsSpec()
    with Proxy(qs, regions, HostTransport()) as proxy:
        spec.function("ping_pong_proxy", 0)(
            (1,), (32,), (qs.device_descriptors(), np.uint32(0), np.uint32(1), np.uint64(0),
                          np.uint64(flag.device_address), np.int32(iters), *status.args,
                          TIMEOUT_NS, cycles, elapsed, np.int32(owned)))
        cupy.cuda.Device(0).synchronize()
        raise_status(status)
        assert int(qs.device_heads()[0]) == iters
        assert int(flag.array.view(np.uint64)[0]) == iters
        assert (cycles.get() > 0).all()
        # a shared poster after it: 100 more signals to word 8*1 (CTA 1 of post_signals)
        result = cupy.full(2, 7, dtype=np.uint64)
        spec.function("post_signals", 0)((2,), (32,), (qs.device_descriptors(), np.int32(1),
                                                       np.uint32(0), np.uint32(1), np.int32(100),
                                                       *status.args, TIMEOUT_NS, result))
        cupy.cuda.Device(0).synchronize()
        raise_status(status)
        assert result.get().tolist() == [0, 0]
        deadline = time.monotonic() + 10
        while proxy.stats["commands"] < iters + 200 and time.monotonic() < deadline:
            time.sleep(0.001)
    assert proxy.stats["commands"] == iters + 200 and proxy.stats["errors"] == 0
    assert int(flag.array.view(np.uint64)[1]) == 100
    assert int(qs.device_heads()[0]) == iters + 200
    qs.close()
    flag.close()
