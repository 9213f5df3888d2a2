"""CPU tests of the `ce` transport's batching over a fake driver.

The fake driver keeps every copy and flag write queued, like a stream, and runs them only
when the proxy queries or synchronizes the stream; a batch (a cuMemcpyBatchAsync, or a
launch of the batch copy kernel, whose threads copy in no set order) runs its copies in
REVERSE order. So a put that depends on
an earlier one lands wrong unless the transport split the batch, and a flag that
overtook its data would be seen before the data is there.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

from mkrt.proxy import OP_PUT, OP_PUT_SIGNAL, Proxy, ProxyError, QueueSet
from mkrt.proxy import new_region_table, set_region
from mkrt.proxy import producer as P
from mkrt.proxy import queue as Q
from mkrt.proxy.transports import ce as CE

SPINS = np.int64(2_000_000_000)   # bound of every host-side wait (seconds)
FAKE_KERNEL = 0xC0FFEE            # the CUfunction handle the fake transport launches
BATCHING = ["kernel", "batch"]
u64 = ctypes.c_uint64


class FakeDriver:
    """cuMemcpyAsync, cuMemcpyBatchAsync_v2, cuLaunchKernel (of the batch copy kernel),
    cuStreamWriteValue64_v2, cuStreamQuery, cuStreamSynchronize over host memory, with a
    queue standing in for the stream."""

    def __init__(self, *, fail_batch: int = 0):
        self.lock = threading.Lock()
        self.stream = []                 # ("copy", dst, src, n) | ("write", address, value)
        self.history = []                # every stream operation ever queued, in order
        self.calls = {"copy": 0, "batch": 0, "launch": 0, "write": 0}
        self.batch_sizes = []           # copies per batch call or launch
        self.grids = []
        self.attrs_seen = []
        self.fail_batch = fail_batch

        def memcpy_async(dst, src, n, stream):
            with self.lock:
                self.calls["copy"] += 1
                self.stream.append(("copy", dst, src, n))
            return 0

        def memcpy_batch(dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, stream):
            words = lambda address: np.ctypeslib.as_array((ctypes.c_uint64 * count).from_address(address))
            attr = np.ctypeslib.as_array((ctypes.c_uint32 * 6).from_address(attrs)).copy()
            first = ctypes.c_uint64.from_address(attr_idxs).value
            with self.lock:
                self.calls["batch"] += 1
                self.batch_sizes.append(count)
                self.attrs_seen.append((attr.tolist(), first, num_attrs))
                if self.fail_batch:
                    return self.fail_batch
                for d, s, n in reversed(list(zip(words(dsts), words(srcs), words(sizes)))):
                    self.stream.append(("copy", int(d), int(s), int(n)))
            return 0

        def launch(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            # kernelParams[0] -> CopyBatch {count; dst[MAX]; src[MAX]; bytes[MAX]}, read
            # now: the driver copies parameters at launch
            batch = ctypes.c_uint64.from_address(params).value
            words = np.ctypeslib.as_array((ctypes.c_uint64 * (1 + 3 * CE.MAX_PENDING)).from_address(batch))
            count = int(words[0])
            dsts, srcs, sizes = (words[1 + k * CE.MAX_PENDING: 1 + k * CE.MAX_PENDING + count]
                                 for k in range(3))
            with self.lock:
                self.calls["launch"] += 1
                self.batch_sizes.append(count)
                self.grids.append((function, gx, bx))
                if self.fail_batch:
                    return self.fail_batch
                for d, s, n in reversed(list(zip(dsts, srcs, sizes))):
                    self.stream.append(("copy", int(d), int(s), int(n)))
            return 0

        def write_value(stream, address, value, flags):
            with self.lock:
                self.calls["write"] += 1
                self.stream.append(("write", address, value))
            return 0

        def run(stream):
            with self.lock:
                self.history += self.stream
                for op in self.stream:
                    if op[0] == "copy":
                        ctypes.memmove(op[1], op[2], op[3])
                    else:
                        ctypes.c_uint64.from_address(op[1]).value = op[2]
                self.stream.clear()
            return 0

        I = ctypes.c_int
        self.cuMemcpyAsync = ctypes.CFUNCTYPE(I, u64, u64, u64, u64)(memcpy_async)
        self.cuMemcpyBatchAsync_v2 = ctypes.CFUNCTYPE(I, *[u64] * 8)(memcpy_batch)
        u32 = ctypes.c_uint32
        self.cuLaunchKernel = ctypes.CFUNCTYPE(I, u64, *[u32] * 7, u64, u64, u64)(launch)
        self.cuStreamWriteValue64_v2 = ctypes.CFUNCTYPE(I, u64, u64, u64, ctypes.c_uint32)(write_value)
        self.cuStreamQuery = ctypes.CFUNCTYPE(I, u64)(run)
        self.cuStreamSynchronize = ctypes.CFUNCTYPE(I, u64)(run)


class FakeCopyEngine(CE.CopyEngineTransport):
    """The real transport code over a FakeDriver (no GPU, no stream)."""

    def __init__(self, driver, **options):
        self.driver = driver
        super().__init__(0, **options)

    def _driver_ops(self):
        return CE.build_ops(self.driver)

    def _new_stream(self):
        return 0

    def _copy_kernel(self):
        return FAKE_KERNEL

    def _copy_ctas(self):
        return 132

    def thread_setup(self):
        pass


class World:
    """Rank 0's region 0 is `src`, rank 1's region 0 is `dst` (random too), rank 1's
    region 1 holds the flags."""

    def __init__(self, data_bytes=1 << 16):
        rng = np.random.default_rng()
        self.src = rng.integers(0, 256, data_bytes, dtype=np.uint8)
        self.dst = rng.integers(0, 256, data_bytes, dtype=np.uint8)
        self.flags = np.zeros(64, dtype=np.uint64)    # device memory in real use: written by the stream
        self.regions = new_region_table(2, 2)
        set_region(self.regions, 0, 0, self.src.ctypes.data, data_bytes)
        set_region(self.regions, 1, 0, self.dst.ctypes.data, data_bytes)
        set_region(self.regions, 1, 1, self.flags.ctypes.data, self.flags.nbytes)


def put(src_offset, dst_offset, nbytes, signal=None):
    """A put to rank 1's region 0 (from the queue's rank's region 0), signalling flag
    signal[0] = signal[1] when given."""
    record = dict(opcode=OP_PUT, dst_rank=1, src_region=0, dst_region=0,
                  src_offset=src_offset, dst_offset=dst_offset, nbytes=nbytes)
    if signal is not None:
        record.update(opcode=OP_PUT_SIGNAL, signal_region=1, signal_offset=8 * signal[0],
                      signal_value=signal[1])
    return record


def run(world, transport, records, *, queue_rank=0, flag_value=1):
    """Post every command BEFORE the proxy starts (so they form one proxy batch), then
    wait for flag 0 to reach `flag_value`."""
    qs = QueueSet(1, 512, [queue_rank])
    proxy = Proxy(qs, world.regions, transport, batch=512, start=False)
    with proxy:
        posted = P.post_many(qs.ring, qs.header, np.uint64(qs.slots), 0, P.commands(records), SPINS)
        assert posted == len(records)
        proxy.start()
        assert P.wait_at_least(world.flags, 0, np.uint64(flag_value), SPINS)
    stats = proxy.stats
    qs.close()
    return stats


@pytest.mark.parametrize("method", BATCHING)
def test_batched_puts_land_before_their_flag(method):
    world, driver = World(), FakeDriver()
    chunk, n = 256, 200
    records = [put(i * chunk, i * chunk, chunk, signal=(0, i + 1) if (i + 1) % 50 == 0 else None)
               for i in range(n)]
    stats = run(world, FakeCopyEngine(driver, copy_method=method), records, flag_value=n)
    assert (world.dst[: n * chunk] == world.src[: n * chunk]).all()
    assert stats["puts"] == n and stats["errors"] == 0
    # 200 puts, a signal every 50, read in one proxy batch: the signals wait with the puts,
    # which go out when MAX_PENDING (128) are pending, then the rest; 4 flag writes
    expected = {"copy": 0, "batch": 0, "launch": 0, "write": 4}
    expected["launch" if method == "kernel" else "batch"] = 2
    assert driver.calls == expected
    assert driver.batch_sizes == [CE.MAX_PENDING, n - CE.MAX_PENDING]
    if method == "kernel":
        # the transport's kernel, 512 threads, one CTA per 64 KiB of the batch (at least 1)
        assert driver.grids == [(FAKE_KERNEL, 1, CE.COPY_THREADS)] * 2
    else:
        # one attribute for every copy: stream-ordered source, copy-engine hint
        assert driver.attrs_seen[0] == ([CE.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, 0, 0, 0, 0,
                                         CE.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE], 0, 1)


@pytest.mark.parametrize("method", BATCHING)
def test_put_signal_runs_share_a_launch_and_each_flag_follows_its_data(method):
    """A block put chunk by chunk, a flag per chunk (the gathering role's puts): one copy
    launch for the run, each flag written after it, in order; the fake runs a stream in
    order and a batch backwards, so a flag ahead of its data would be caught by reading
    the data when the flag is seen."""
    world, driver = World(), FakeDriver()
    chunk, n = 512, 48                                # flags 1 .. 48 of the 64-word region
    records = [put(i * chunk, i * chunk, chunk, signal=(1 + i, 7)) for i in range(n)]
    records.append(put(60000, 60000, 8, signal=(0, 1)))
    run(world, FakeCopyEngine(driver, copy_method=method), records)
    assert (world.dst[: n * chunk] == world.src[: n * chunk]).all()
    assert (world.flags[1:1 + n] == 7).all()
    assert driver.batch_sizes == [n + 1]
    assert driver.calls["write"] == n + 1
    # on the stream: the launch's copies, then the flags in the order they were posted
    kinds = [op[0] for op in driver.history]
    assert kinds == ["copy"] * (n + 1) + ["write"] * (n + 1)
    flag_base = world.flags.ctypes.data
    assert [(op[1] - flag_base) // 8 for op in driver.history[n + 1:]] == list(range(1, n + 1)) + [0]


def test_copy_kernel_grid_grows_with_the_batch_up_to_the_sms():
    world, driver = World(data_bytes=1 << 22), FakeDriver()
    n, chunk = 100, 40000                       # 4 MB in one batch: 62 CTAs of 64 KiB
    records = [put(i * chunk, i * chunk, chunk) for i in range(n)] + [put(4_190_000, 4_190_000, 8, signal=(0, 1))]
    run(world, FakeCopyEngine(driver, copy_method="kernel"), records)
    assert (world.dst[: n * chunk] == world.src[: n * chunk]).all()
    total = n * chunk + 8
    assert driver.grids == [(FAKE_KERNEL, -(-total // CE.BYTES_PER_CTA), CE.COPY_THREADS)]


@pytest.mark.parametrize("method", BATCHING)
def test_a_full_batch_goes_out_at_max_pending(method):
    world, driver = World(), FakeDriver()
    n = CE.MAX_PENDING + 10
    records = [put(i * 64, i * 64, 64) for i in range(n)] + [put(60000, 60000, 8, signal=(0, 1))]
    run(world, FakeCopyEngine(driver, copy_method=method), records)
    assert driver.batch_sizes == [CE.MAX_PENDING, 11]
    assert (world.dst[: n * 64] == world.src[: n * 64]).all()


@pytest.mark.parametrize("method", BATCHING)
def test_dependent_puts_are_not_reordered_inside_a_batch(method):
    """Read-after-write, write-after-read and write-after-write on the same bytes, in one
    proxy batch: the fake runs a batch backwards, so only a split keeps them right."""
    world, driver = World(), FakeDriver()
    records = [                                   # rank 1's queue: dst -> dst
        put(0, 8192, 1024),                       # dst[8192:9216]  = dst[0:1024]
        put(8192, 16384, 1024),                   # RAW: reads what the first wrote
        put(20000, 0, 512),                       # WAR: overwrites what the first reads
        put(30000, 16384, 256),                   # WAW: over the second's bytes
        put(40000, 50000, 64),                    # independent
        put(0, 60000, 8, signal=(0, 1)),
    ]
    expected = world.dst.copy()
    for r in records:                             # the order the queue promises
        s, d, n = r["src_offset"], r["dst_offset"], r["nbytes"]
        expected[d:d + n] = expected[s:s + n].copy()
    run(world, FakeCopyEngine(driver, copy_method=method), records, queue_rank=1)
    assert (world.dst == expected).all()
    # split where a put depends on a pending one: [1] | [2, 3] | [4, 5, 6]
    assert driver.calls["copy"] == 0 and driver.batch_sizes == [1, 2, 3]


def test_one_call_per_put_without_batching():
    world, driver = World(), FakeDriver()
    n = 40
    records = [put(i * 128, i * 128, 128, signal=(0, 1) if i == n - 1 else None) for i in range(n)]
    run(world, FakeCopyEngine(driver, copy_method="each"), records)
    assert (world.dst[: n * 128] == world.src[: n * 128]).all()
    assert driver.calls == {"copy": n, "batch": 0, "launch": 0, "write": 1}


def test_copy_engine_hint_can_be_turned_off():
    world, driver = World(), FakeDriver()
    records = [put(i * 64, i * 64, 64, signal=(0, 1) if i == 9 else None) for i in range(10)]
    run(world, FakeCopyEngine(driver, copy_method="batch", prefer_copy_engines=False), records)
    assert driver.attrs_seen and all(a[0][5] == 0 for a in driver.attrs_seen)


def test_an_unknown_copy_method_is_refused():
    with pytest.raises(ValueError, match="copy_method"):
        FakeCopyEngine(FakeDriver(), copy_method="dma")


@pytest.mark.parametrize("method", BATCHING)
def test_a_failing_batch_call_is_a_transport_error(method):
    world, driver = World(), FakeDriver(fail_batch=1)     # CUDA_ERROR_INVALID_VALUE
    qs = QueueSet(1, 64, [0])
    commands = P.commands([put(i * 64, i * 64, 64) for i in range(8)] + [put(60000, 60000, 8, signal=(0, 1))])
    proxy = Proxy(qs, world.regions, FakeCopyEngine(driver, copy_method=method), start=False)
    assert P.post_many(qs.ring, qs.header, np.uint64(qs.slots), 0, commands, SPINS) == 9
    proxy.start()
    assert P.wait_at_least(qs.header, Q.H_ERROR, np.uint64(1), SPINS)    # the GPU's waits see it
    with pytest.raises(ProxyError, match="transport failure"):
        proxy.close()
    assert world.flags[0] == 0                                          # no flag without its data
    qs.close()
