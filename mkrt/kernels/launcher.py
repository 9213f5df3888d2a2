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


@functools.cache
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    launch = lib.cuLaunchKernel
    launch.restype = ctypes.c_int
    launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    name = lib.cuGetErrorName
    name.restype = ctypes.c_int
    name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return launch, name


def driver_error_name(code: int) -> str:
    text = ctypes.c_char_p()
    _driver()[1](code, ctypes.byref(text))
    return text.value.decode() if text.value else f"CUresult {code}"


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


class KernelLaunch:
    """One kernel on one device with prepared parameters: ``launch(stream_ptr)``."""

    def __init__(self, function, grid: int, block: int, shared_mem: int, params: Parameters):
        self.function = function                 # keeps the module (and the CUfunction) alive
        self.handle = function.kernel.ptr if hasattr(function, "kernel") else function.ptr
        self.grid, self.block, self.shared_mem = int(grid), int(block), int(shared_mem)
        self.params = params
        self.launched = False                   # Op.launch: processes meet before the first
        # Arguments converted once: ctypes passes its own objects without conversion.
        one = ctypes.c_uint(1)
        self._head = (ctypes.c_void_p(self.handle), ctypes.c_uint(self.grid), one, one,
                      ctypes.c_uint(self.block), one, one, ctypes.c_uint(self.shared_mem))
        self._tail = (ctypes.cast(params.pointers, ctypes.c_void_p), None)
        self._launch = _driver()[0]

    def __call__(self, stream_ptr: int) -> None:
        code = self._launch(*self._head, stream_ptr, *self._tail)
        if code:
            raise RuntimeError(f"mkrt.launch: cuLaunchKernel failed: {driver_error_name(code)} "
                               f"(grid {self.grid}, block {self.block}, shared {self.shared_mem})")
