"""The prepared-call fast path: kernel arguments packed once, patched in place, launched
with one ``cuLaunchKernel``.

An op prepares a :class:`KernelLaunch` per (rank, signature) the first time it sees a
signature (shapes, dtypes, layouts, options): the function, grid, block, shared memory and
every argument's bytes. A call patches only what changed (array pointers, a tensor map
when its pointer changed) and launches. CuPy's ``RawKernel.__call__`` converts every
argument on every call; this path does not (measured per call and phase in
experiments/notes/runtime.md).

The driver copies the argument bytes when ``cuLaunchKernel`` returns, so one buffer per
launch serves every call, also while a CUDA graph is being captured.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np


def struct_size_assert(struct: str, dtype: np.dtype) -> str:
    """A CUDA static_assert tying C struct `struct` to its numpy mirror `dtype` (built with
    ``align=True``, which reproduces C's alignment; NVRTC 13.0 has no offsetof)."""
    return f"static_assert(sizeof({struct}) == {dtype.itemsize}, \"{struct}: see its numpy mirror\");"


class Parameters:
    """The bytes of a kernel's parameters in one host buffer, each at its C alignment.

    ``fields``: (name, dtype or byte count, alignment) in the kernel's parameter order.
    ``view(name)`` is a writable numpy view of one field; ``address(name)`` its address
    (tensor maps are encoded straight into it).
    """

    def __init__(self, fields: list[tuple[str, object, int]]):
        offsets, offset = {}, 0
        for name, kind, align in fields:
            size = kind if isinstance(kind, int) else np.dtype(kind).itemsize
            offset = -(-offset // align) * align
            offsets[name] = (offset, size, kind)
            offset += size
        self._storage = np.zeros(offset + 128, np.uint8)
        base = -self._storage.ctypes.data % 64          # the buffer starts 64-byte aligned
        self.bytes = self._storage[base:base + offset]
        self.base = self.bytes.ctypes.data
        self._offsets = offsets
        self.pointers = (ctypes.c_void_p * len(fields))(
            *[self.base + offsets[name][0] for name, _, _ in fields])

    def address(self, name: str) -> int:
        return self.base + self._offsets[name][0]

    def view(self, name: str) -> np.ndarray:
        """A 0-d (scalar or record) view of field `name`; assign with ``view[()] = value``."""
        offset, size, kind = self._offsets[name]
        raw = self.bytes[offset:offset + size]
        return raw if isinstance(kind, int) else raw.view(kind).reshape(())

    def field_view(self, name: str, field: str) -> np.ndarray:
        """A 0-d view of one field of a record-typed parameter: patching it costs less
        than indexing the record view by name on every call."""
        offset, _, kind = self._offsets[name]
        sub, at = np.dtype(kind).fields[field][:2]
        return self.bytes[offset + at:offset + at + sub.itemsize].view(sub).reshape(())

    def set(self, **values) -> None:
        for name, value in values.items():
            self.view(name)[()] = value


@functools.cache
def _launch_ex():
    """The driver's cuLaunchKernelEx and ctypes mirrors of CUlaunchConfig and
    CUlaunchAttribute (cuda.h), loaded once."""
    class Attribute(ctypes.Structure):
        _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_uint8 * 64)]

    from mkrt.cuda import launch_config_type
    config_type = launch_config_type()
    launch = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    launch.restype = ctypes.c_int
    launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return launch, config_type, Attribute


#: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h)
_PROGRAMMATIC_STREAM_SERIALIZATION = 6


def function_handle(function) -> int:
    """The CUfunction of a loaded kernel (a CuPy RawKernel or a module's function)."""
    return function.kernel.ptr if hasattr(function, "kernel") else function.ptr


class KernelLaunch:
    """One kernel on one device with prepared parameters: ``launch(stream_ptr)``.

    ``programmatic=True`` launches it as a programmatic dependent of the stream's previous
    kernel (cuLaunchKernelEx, programmatic stream serialisation): it may start while that
    kernel finishes, so its set-up overlaps the other's tail. The kernel must wait
    (``griddepcontrol.wait``, the GEMM engine's ``grid_dependency_wait``) before it loads
    or stores anything another kernel touches."""

    def __init__(self, function, grid: int, block: int, shared_mem: int, params: Parameters,
                 programmatic: bool = False):
        from cupy_backends.cuda.api import driver
        self.function = function                 # keeps the module (and the CUfunction) alive
        self.handle = function_handle(function)
        self.grid, self.block, self.shared_mem = int(grid), int(block), int(shared_mem)
        self.params = params
        self.launched = False                   # Op.launch: processes meet before the first
        self._pointers = ctypes.addressof(params.pointers)
        # CuPy's compiled binding of cuLaunchKernel: plain ints in, no ctypes conversion of
        # eleven arguments per call (about a microsecond less per launch than ctypes).
        self._launch = driver.launchKernel
        self._error = driver.CUDADriverError
        self.programmatic = bool(programmatic)
        if self.programmatic:
            launch_ex, config_type, attribute_type = _launch_ex()
            self._attribute = attribute_type(_PROGRAMMATIC_STREAM_SERIALIZATION, 0)
            self._attribute.value[0] = 1                    # programmaticStreamSerializationAllowed
            self._config = config_type(self.grid, 1, 1, self.block, 1, 1, self.shared_mem, None,
                                       ctypes.addressof(self._attribute), 1)
            self._launch_ex, self._config_address = launch_ex, ctypes.addressof(self._config)

    def __call__(self, stream_ptr: int) -> None:
        if self.programmatic:
            self._config.hStream = stream_ptr
            code = self._launch_ex(self._config_address, self.handle, self._pointers, None)
            if code:
                raise RuntimeError(f"mkrt.launch: cuLaunchKernelEx failed (CUresult {code}; grid "
                                   f"{self.grid}, block {self.block}, shared {self.shared_mem})")
            return
        try:
            self._launch(self.handle, self.grid, 1, 1, self.block, 1, 1, self.shared_mem,
                         stream_ptr, self._pointers, 0)
        except self._error as error:
            raise RuntimeError(f"mkrt.launch: cuLaunchKernel failed: {error} (grid {self.grid}, "
                               f"block {self.block}, shared {self.shared_mem})") from None


def stream_workspace(cache: dict, device: int, stream_ptr: int, make):
    """(workspace, kept) of launches on `stream_ptr`: what ``make()`` builds, on that stream
    (its zeroing ordered before the launches), made on first use and kept in `cache` by
    stream, so two streams never share one. On a stream being captured into a CUDA graph a
    new one is made each time and kept under a key of its own, not the stream's: its
    zeroing is a node of the graph, which runs at each replay but never ran eagerly, so an
    eager launch must not inherit it (``kept`` is then False: do not bind to the stream)."""
    import cupy
    from cupy_backends.cuda.api import runtime

    capturing = stream_ptr != 0 and runtime.streamIsCapturing(stream_ptr) != 0
    found = None if capturing else cache.get(stream_ptr)
    if found is None:
        with cupy.cuda.Device(device), cupy.cuda.ExternalStream(stream_ptr):
            found = make()
        cache[("captured", len(cache)) if capturing else stream_ptr] = found
    return found, not capturing
