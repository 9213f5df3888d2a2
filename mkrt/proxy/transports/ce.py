"""`ce` transport: copy-engine DMA issued by the proxy, then a stream-ordered flag write.

Per proxy thread: one non-blocking CUDA stream. A put is ``cuMemcpyAsync(dst, src, n,
stream)`` (unified addresses: device or mapped host memory); a signal is
``cuStreamWriteValue64(stream, flag, value)`` after it on the same stream, so the flag
lands after the data. A signal with no copy outstanding on the stream whose flag lies
in mapped host memory is a plain release store (no driver call, lowest latency).

libcuda is called from the compiled loop through ctypes function objects (Numba calls
them directly, without the GIL). The proxy thread makes the device's primary context
current before its loop (``thread_setup``).

Thread state words: [0] stream handle, [1] operations outstanding on the stream since it
was last seen idle.
"""

from __future__ import annotations

import ctypes

import numpy as np
from numba import njit

from mkrt.proxy.atomics import store_release_at
from mkrt.proxy.queue import REGION_HOST
from mkrt.proxy.transports.base import Transport, TransportUnavailable

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600


def _libcuda():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        raise TransportUnavailable(f"mkrt.proxy: ce transport needs the CUDA driver (libcuda.so.1): {error}") from None


def _function(lib, names, argtypes):
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
            return fn
    raise TransportUnavailable(f"mkrt.proxy: libcuda has none of {names}")


_OPS = None


def _build_ops():
    lib = _libcuda()
    u64 = ctypes.c_uint64
    memcpy_async = _function(lib, ["cuMemcpyAsync"], [u64, u64, u64, u64])
    write_value = _function(lib, ["cuStreamWriteValue64_v2", "cuStreamWriteValue64"],
                            [u64, u64, u64, ctypes.c_uint32])
    stream_query = _function(lib, ["cuStreamQuery"], [u64])
    stream_sync = _function(lib, ["cuStreamSynchronize"], [u64])

    @njit(nogil=True, cache=False)
    def put(state, dst, src, nbytes, dst_kind):
        rc = memcpy_async(dst, src, nbytes, state[0])
        state[1] += np.uint64(1)
        return rc

    @njit(nogil=True, cache=False)
    def signal(state, address, value, kind):
        if state[1] == np.uint64(0) and kind == np.uint64(REGION_HOST):
            store_release_at(address, value)
            return 0
        rc = write_value(state[0], address, value, np.uint32(0))
        state[1] += np.uint64(1)
        return rc

    @njit(nogil=True, cache=False)
    def progress(state, idle):
        if state[1] == np.uint64(0):
            return 1
        if not idle:
            return 0
        rc = stream_query(state[0])
        if rc == CUDA_SUCCESS:
            state[1] = np.uint64(0)
            return 1
        if rc == CUDA_ERROR_NOT_READY:
            return 0
        return -rc

    @njit(nogil=True, cache=False)
    def quiesce(state):
        if state[1] == np.uint64(0):
            return 0
        rc = stream_sync(state[0])
        if rc == CUDA_SUCCESS:
            state[1] = np.uint64(0)
        return rc

    return put, signal, progress, quiesce


class CopyEngineTransport(Transport):
    """Copies between any registered regions of one process (an emulated world's ranks)."""

    name = "ce"

    def __init__(self, device: int = 0):
        global _OPS
        import cupy
        if not cupy.cuda.is_available():
            raise TransportUnavailable("mkrt.proxy: ce transport needs a CUDA GPU; none is visible")
        if _OPS is None:
            _OPS = _build_ops()
        self.device = device
        self._streams = []

    def ops(self):
        return _OPS

    def thread_state(self, thread: int):
        import cupy
        with cupy.cuda.Device(self.device):
            stream = cupy.cuda.Stream(non_blocking=True)
        self._streams.append(stream)
        state = np.zeros(8, dtype=np.uint64)
        state[0] = stream.ptr
        return state

    def thread_setup(self):
        import cupy
        cupy.cuda.runtime.setDevice(self.device)   # primary context current in this thread
        cupy.cuda.runtime.free(0)

    def close(self):
        for stream in self._streams:
            stream.synchronize()
        self._streams = []
