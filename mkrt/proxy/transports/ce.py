"""`ce` transport: copies issued by the proxy, then a stream-ordered flag write.

Per proxy thread: one non-blocking CUDA stream. Puts are collected while the proxy reads
a batch of commands and go out together (``copy_method``):

* ``"kernel"`` (default): ONE launch of mkrt's batch copy kernel
  (:mod:`mkrt.proxy.transports.ce_copy`) for up to :data:`MAX_PENDING` puts;
* ``"batch"``: one ``cuMemcpyBatchAsync`` (the driver still runs one copy per put);
* ``"each"``: one ``cuMemcpyAsync`` per put.

On the H200 a device-to-device copy is an SM kernel either way (measured; the driver's
copy-engine hint does not change it), so per-copy launch cost, not bandwidth, is what
limits 1 MiB messages: the batch kernel pays it once per batch.

A signal lands after every put before it: ``cuStreamWriteValue64(stream, flag, value)``
on the same stream, after the launch that copies them. While puts are pending, signals
wait with them (in order) and go out right after their copies, so a run of put+signal
commands read in one batch (a kernel putting a block chunk by chunk, a flag per chunk)
costs one copy launch, not one per put; until 2026-12-07 each signal issued the pending
puts on its own. A signal with no copy pending or outstanding whose flag lies in mapped
host memory is a plain release store (no driver call, lowest latency).

Copies of one batch may run in any order, so a put that overlaps a pending one (writes
what it reads or writes, or reads what it writes) issues the pending ones first: puts
land as if in order.

libcuda is called from the compiled loop through ctypes function objects (Numba calls
them directly, without the GIL). The proxy thread makes the device's primary context
current before its loop (``thread_setup``).
"""

from __future__ import annotations

import ctypes

import numpy as np
from numba import njit

from mkrt.proxy.atomics import store_release_at
from mkrt.proxy.queue import REGION_HOST
from mkrt.proxy.transports.base import Transport, TransportUnavailable
from mkrt.proxy.transports.ce_copy import COPY_THREADS, MAX_PENDING, copy_function_handle

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1
COPY_METHODS = {"each": 0, "batch": 1, "kernel": 2}

# thread state (u64 words)
T_STREAM = 0        # CUstream
T_OUTSTANDING = 1   # driver operations issued since the stream was last seen idle
T_PENDING = 2       # puts collected, not yet issued
T_METHOD = 3        # COPY_METHODS value
T_COPY_CALLS = 4    # driver copy calls or launches made (statistics)
T_FAIL_INDEX = 5    # cuMemcpyBatchAsync (v1) writes the failing copy's index here
T_ATTRS = 6         # CUmemcpyAttributes (24 bytes), then its index word (9)
T_FUNCTION = 10     # CUfunction of the batch copy kernel
T_PARAMS = 11       # kernelParams[0]: the address of the CopyBatch below
T_SMS = 12          # most CTAs a copy launch uses
T_COUNT = 13        # CopyBatch {count; dst[MAX]; src[MAX]; bytes[MAX]} from here
T_DSTS = T_COUNT + 1
T_SRCS = T_DSTS + MAX_PENDING
T_SIZES = T_SRCS + MAX_PENDING
T_SIGNALS = T_SIZES + MAX_PENDING          # signals waiting for the pending puts' launch
T_SIGNAL_ADDRESSES = T_SIGNALS + 1
T_SIGNAL_VALUES = T_SIGNAL_ADDRESSES + MAX_PENDING
STATE_WORDS = T_SIGNAL_VALUES + MAX_PENDING
#: bytes one CTA of the copy kernel moves per pass over a batch (sizes its grid)
BYTES_PER_CTA = COPY_THREADS * 16 * 8


def _libcuda():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        raise TransportUnavailable(f"mkrt.proxy: ce transport needs the CUDA driver (libcuda.so.1): {error}") from None


def _function(lib, names, argtypes, required=True):
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
            return fn
    if required:
        raise TransportUnavailable(f"mkrt.proxy: libcuda has none of {names}")
    return None


_DRIVER_OPS = None


def build_ops(lib):
    """The transport's four loop functions over `lib` (libcuda, or a fake with the same
    function names in CPU tests), and whether it has a batch copy call."""
    u64 = ctypes.c_uint64
    memcpy_async = _function(lib, ["cuMemcpyAsync"], [u64, u64, u64, u64])
    write_value = _function(lib, ["cuStreamWriteValue64_v2", "cuStreamWriteValue64"],
                            [u64, u64, u64, ctypes.c_uint32])
    stream_query = _function(lib, ["cuStreamQuery"], [u64])
    stream_sync = _function(lib, ["cuStreamSynchronize"], [u64])
    # CUDA 13 (_v2): (dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, stream);
    # CUDA 12.8: the same with size_t* fail_idx before the stream.
    batch_v2 = _function(lib, ["cuMemcpyBatchAsync_v2"], [u64] * 8, required=False)
    batch_v1 = None if batch_v2 else _function(lib, ["cuMemcpyBatchAsync"], [u64] * 9,
                                               required=False)
    has_batch = batch_v2 is not None or batch_v1 is not None
    u32 = ctypes.c_uint32
    launch = _function(lib, ["cuLaunchKernel"], [u64, u32, u32, u32, u32, u32, u32, u32, u64,
                                                 u64, u64])

    @njit(nogil=True, cache=False)
    def launch_copies(state, base, count):
        """One launch of the batch copy kernel over the pending puts."""
        total = np.uint64(0)
        for i in range(np.int64(count)):
            total += state[T_SIZES + i]
        ctas = min(state[T_SMS], max(np.uint64(1), (total + np.uint64(BYTES_PER_CTA - 1))
                                     // np.uint64(BYTES_PER_CTA)))
        state[T_COUNT] = count
        state[T_PARAMS] = base + np.uint64(8 * T_COUNT)
        return launch(state[T_FUNCTION], np.uint32(ctas), np.uint32(1), np.uint32(1),
                      np.uint32(COPY_THREADS), np.uint32(1), np.uint32(1), np.uint32(0),
                      state[T_STREAM], base + np.uint64(8 * T_PARAMS), np.uint64(0))

    if batch_v2 is not None:
        @njit(nogil=True, cache=False)
        def memcpy_batch(state, base, count):
            return batch_v2(base + np.uint64(8 * T_DSTS), base + np.uint64(8 * T_SRCS),
                            base + np.uint64(8 * T_SIZES), count, base + np.uint64(8 * T_ATTRS),
                            base + np.uint64(8 * (T_ATTRS + 3)), np.uint64(1), state[T_STREAM])
    elif batch_v1 is not None:
        @njit(nogil=True, cache=False)
        def memcpy_batch(state, base, count):
            return batch_v1(base + np.uint64(8 * T_DSTS), base + np.uint64(8 * T_SRCS),
                            base + np.uint64(8 * T_SIZES), count, base + np.uint64(8 * T_ATTRS),
                            base + np.uint64(8 * (T_ATTRS + 3)), np.uint64(1),
                            base + np.uint64(8 * T_FAIL_INDEX), state[T_STREAM])
    else:
        @njit(nogil=True, cache=False)
        def memcpy_batch(state, base, count):
            return 801   # CUDA_ERROR_NOT_SUPPORTED (never called: "batch" becomes "each")

    @njit(nogil=True, cache=False)
    def issue_copies(state):
        count = state[T_PENDING]
        if count == np.uint64(0):
            return 0
        state[T_PENDING] = np.uint64(0)
        state[T_OUTSTANDING] += count
        method = state[T_METHOD]
        if method == np.uint64(2):
            state[T_COPY_CALLS] += np.uint64(1)
            return launch_copies(state, np.uint64(state.ctypes.data), count)
        if method == np.uint64(1):    # also one copy: it carries the copy-engine hint
            state[T_COPY_CALLS] += np.uint64(1)
            return memcpy_batch(state, np.uint64(state.ctypes.data), count)
        for i in range(np.int64(count)):
            state[T_COPY_CALLS] += np.uint64(1)
            rc = memcpy_async(state[T_DSTS + i], state[T_SRCS + i], state[T_SIZES + i],
                              state[T_STREAM])
            if rc != CUDA_SUCCESS:
                return rc
        return 0

    @njit(nogil=True, cache=False)
    def issue(state):
        """Hand the pending puts to the driver, then the signals that wait for them, in
        order (0 or a CUDA error)."""
        rc = issue_copies(state)
        if rc != CUDA_SUCCESS:
            state[T_SIGNALS] = np.uint64(0)     # never a flag without its data
            return rc
        count = np.int64(state[T_SIGNALS])
        state[T_SIGNALS] = np.uint64(0)
        for i in range(count):
            rc = write_value(state[T_STREAM], state[T_SIGNAL_ADDRESSES + i],
                             state[T_SIGNAL_VALUES + i], np.uint32(0))
            state[T_OUTSTANDING] += np.uint64(1)
            if rc != CUDA_SUCCESS:
                return rc
        return 0

    @njit(nogil=True, cache=False)
    def overlaps(a, an, b, bn):
        return a < b + bn and b < a + an

    @njit(nogil=True, cache=False)
    def put(state, dst, src, nbytes, dst_kind):
        # copies of one batch run in any order: a dependent copy must not share one
        for i in range(np.int64(state[T_PENDING])):
            pd, ps, pn = state[T_DSTS + i], state[T_SRCS + i], state[T_SIZES + i]
            if overlaps(dst, nbytes, pd, pn) or overlaps(src, nbytes, pd, pn) \
                    or overlaps(dst, nbytes, ps, pn):
                rc = issue(state)
                if rc != CUDA_SUCCESS:
                    return rc
                break
        count = np.int64(state[T_PENDING])
        state[T_DSTS + count] = dst
        state[T_SRCS + count] = src
        state[T_SIZES + count] = nbytes
        state[T_PENDING] = np.uint64(count + 1)
        if state[T_PENDING] == np.uint64(MAX_PENDING):
            return issue(state)
        return 0

    @njit(nogil=True, cache=False)
    def signal(state, address, value, kind):
        if state[T_PENDING] != np.uint64(0):
            # puts are pending: the signal goes out right after their launch (with any
            # later puts of this batch in it too: a flag may only land later, never sooner)
            count = np.int64(state[T_SIGNALS])
            state[T_SIGNAL_ADDRESSES + count] = address
            state[T_SIGNAL_VALUES + count] = value
            state[T_SIGNALS] = np.uint64(count + 1)
            if state[T_SIGNALS] == np.uint64(MAX_PENDING):
                return issue(state)
            return 0
        rc = issue(state)
        if rc != CUDA_SUCCESS:
            return rc
        if state[T_OUTSTANDING] == np.uint64(0) and kind == np.uint64(REGION_HOST):
            store_release_at(address, value)
            return 0
        rc = write_value(state[T_STREAM], address, value, np.uint32(0))
        state[T_OUTSTANDING] += np.uint64(1)
        return rc

    @njit(nogil=True, cache=False)
    def progress(state, idle):
        rc = issue(state)            # the proxy read a batch: its puts go out now
        if rc != CUDA_SUCCESS:
            return -rc
        if state[T_OUTSTANDING] == np.uint64(0):
            return 1
        if not idle:
            return 0
        rc = stream_query(state[T_STREAM])
        if rc == CUDA_SUCCESS:
            state[T_OUTSTANDING] = np.uint64(0)
            return 1
        if rc == CUDA_ERROR_NOT_READY:
            return 0
        return -rc

    @njit(nogil=True, cache=False)
    def quiesce(state):
        rc = issue(state)
        if rc != CUDA_SUCCESS:
            return rc
        if state[T_OUTSTANDING] == np.uint64(0):
            return 0
        rc = stream_sync(state[T_STREAM])
        if rc == CUDA_SUCCESS:
            state[T_OUTSTANDING] = np.uint64(0)
        return rc

    return (put, signal, progress, quiesce), has_batch


class CopyEngineTransport(Transport):
    """Copies between any registered regions of one process (an emulated world's ranks).

    ``copy_method``: "kernel" (one batch copy launch per batch of puts), "batch" (one
    ``cuMemcpyBatchAsync``; "each" when the driver lacks it) or "each" (one
    ``cuMemcpyAsync`` per put). ``prefer_copy_engines``: the "batch" call's hint to use
    copy engines (it did not change where copies ran on the H200).
    """

    name = "ce"

    def __init__(self, device: int = 0, *, copy_method: str = "kernel",
                 prefer_copy_engines: bool = True):
        if copy_method not in COPY_METHODS:
            raise ValueError(f"mkrt.proxy: copy_method={copy_method!r}; expected one of "
                             f"{sorted(COPY_METHODS)}")
        self.device = device
        self._ops, has_batch = self._driver_ops()
        self.copy_method = "each" if copy_method == "batch" and not has_batch else copy_method
        self.prefer_copy_engines = bool(prefer_copy_engines)
        self._kernel = self._copy_kernel() if self.copy_method == "kernel" else 0
        self._streams = []
        self._states = []

    @staticmethod
    def _driver_ops():
        global _DRIVER_OPS
        import cupy
        if not cupy.cuda.is_available():
            raise TransportUnavailable("mkrt.proxy: ce transport needs a CUDA GPU; none is visible")
        if _DRIVER_OPS is None:
            _DRIVER_OPS = build_ops(_libcuda())
        return _DRIVER_OPS

    def _copy_kernel(self) -> int:
        return copy_function_handle(self.device)

    def _copy_ctas(self) -> int:
        from mkrt.cuda import device_sm_count
        return device_sm_count(self.device)

    def _new_stream(self) -> int:
        import cupy
        with cupy.cuda.Device(self.device):
            stream = cupy.cuda.Stream(non_blocking=True)
        self._streams.append(stream)
        return stream.ptr

    def ops(self):
        return self._ops

    def thread_state(self, thread: int):
        state = np.zeros(STATE_WORDS, dtype=np.uint64)
        state[T_STREAM] = self._new_stream()
        state[T_METHOD] = COPY_METHODS[self.copy_method]
        state[T_FUNCTION] = self._kernel
        state[T_SMS] = self._copy_ctas()
        # CUmemcpyAttributes {u32 srcAccessOrder; CUmemLocation src, dst (i32 type, i32 id);
        # u32 flags} then attrsIdxs[0] = 0: one attribute for every copy of a batch.
        attrs = state[T_ATTRS:T_ATTRS + 4].view(np.uint32)
        attrs[0] = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        attrs[5] = CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE if self.prefer_copy_engines else 0
        self._states.append(state)
        return state

    def copy_calls(self) -> int:
        """Driver copy calls or launches the proxy threads made (a batch counts once)."""
        return int(sum(int(s[T_COPY_CALLS]) for s in self._states))

    def thread_setup(self):
        import cupy
        cupy.cuda.runtime.setDevice(self.device)   # primary context current in this thread
        cupy.cuda.runtime.free(0)

    def close(self):
        for stream in self._streams:
            stream.synchronize()
        self._streams = []
