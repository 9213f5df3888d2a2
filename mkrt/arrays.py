"""One checked view of the device arrays users hand to mkrt, and results in their type.

Accepted: CuPy arrays, anything with ``__dlpack__`` (torch tensors: bfloat16 only travels
through DLPack: mkrt/DESIGN.md, "Machine facts") and anything with ``__cuda_array_interface__``. Host arrays are
refused with a clear error. bfloat16 is ``ml_dtypes.bfloat16``.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

try:
    import ml_dtypes
    bfloat16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    bfloat16 = None

#: the 16-bit floating types the tensor-core kernels take (fp16, and bf16 where ml_dtypes is)
HALF_DTYPES = (np.dtype(np.float16),) + ((bfloat16,) if bfloat16 is not None else ())

DTYPE_NAMES = {np.dtype(np.float16): "f16", np.dtype(np.float32): "f32",
               np.dtype(np.float64): "f64", np.dtype(np.int32): "i32",
               np.dtype(np.int64): "i64", np.dtype(np.uint8): "u8"}
if bfloat16 is not None:
    DTYPE_NAMES[bfloat16] = "bf16"


def dtype_name(dtype) -> str:
    """Short name used in URIs: bf16, f16, f32, ..."""
    dtype = np.dtype(dtype)
    return DTYPE_NAMES.get(dtype, dtype.name)


def is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def as_cupy(x, name: str = "array"):
    """A CuPy view of device array `x` (no copy), or TypeError saying what `x` is."""
    import cupy
    if isinstance(x, cupy.ndarray):
        return x
    if isinstance(x, np.ndarray):
        raise TypeError(f"mkrt.arrays: {name} is a host numpy array {x.shape} {x.dtype}; "
                        "mkrt ops take device arrays (cupy.asarray(...) first)")
    if is_torch(x) and hasattr(x, "__dlpack__"):
        if not x.is_cuda:
            raise TypeError(f"mkrt.arrays: {name} is a CPU torch tensor; move it to the GPU")
        return cupy.from_dlpack(x)
    if hasattr(x, "__cuda_array_interface__"):
        return cupy.asarray(x)
    if hasattr(x, "__dlpack__"):
        return cupy.from_dlpack(x)
    raise TypeError(f"mkrt.arrays: {name} of type {type(x).__name__} is not a device array "
                    "(need a CuPy array, a DLPack tensor or __cuda_array_interface__)")


class _Memory:
    __slots__ = ("ptr", "device_id")

    def __init__(self, ptr: int, device_id: int):
        self.ptr, self.device_id = ptr, device_id


class _Flags:
    __slots__ = ("c_contiguous",)

    def __init__(self, c_contiguous: bool):
        self.c_contiguous = c_contiguous


class TorchView:
    """What a launch path reads from a CUDA torch tensor (shape, byte strides, numpy dtype,
    pointer, device, layout), taken without a DLPack round trip: a few attribute reads
    instead of building a CuPy array (measured: the conversions were most of a small
    attention call's host time). Holds the tensor alive."""

    __slots__ = ("tensor", "shape", "strides", "dtype", "itemsize", "data", "flags")

    def __init__(self, tensor, name: str = "array"):
        if not tensor.is_cuda:
            raise TypeError(f"mkrt.arrays: {name} is a CPU torch tensor; move it to the GPU")
        dtype = _torch_dtypes().get(tensor.dtype)
        if dtype is None:
            raise TypeError(f"mkrt.arrays: {name} has torch dtype {tensor.dtype}, which mkrt "
                            "does not take")
        self.tensor = tensor
        self.shape = tuple(tensor.shape)
        self.dtype = dtype
        self.itemsize = dtype.itemsize
        self.strides = tuple(s * self.itemsize for s in tensor.stride())
        self.data = _Memory(tensor.data_ptr(), tensor.device.index)
        self.flags = _Flags(tensor.is_contiguous())


_TORCH_DTYPES: dict = {}


def _torch_dtypes() -> dict:
    if not _TORCH_DTYPES:
        import torch
        _TORCH_DTYPES.update({torch.float16: np.dtype(np.float16), torch.float32: np.dtype(np.float32),
                              torch.float64: np.dtype(np.float64), torch.int32: np.dtype(np.int32),
                              torch.int64: np.dtype(np.int64), torch.uint8: np.dtype(np.uint8)})
        if bfloat16 is not None:
            _TORCH_DTYPES[torch.bfloat16] = bfloat16
    return _TORCH_DTYPES


def like_input(result, original):
    """Give `result` (a CuPy array) back in the type of `original` (torch in, torch out)."""
    if is_torch(original):
        import torch
        return torch.from_dlpack(result)
    return result


def check_array(x, name: str, *, dtype=None, dtypes: Iterable | None = None, ndim: int | None = None,
                shape: Sequence[int | None] | None = None, device: int | None = None,
                contiguous: bool = True):
    """`x` as CuPy, after checking dtype, rank, shape (None = any), device and layout."""
    array = as_cupy(x, name)
    allowed = [np.dtype(d) for d in (dtypes or ([dtype] if dtype is not None else []))]
    if allowed and array.dtype not in allowed:
        names = ", ".join(dtype_name(d) for d in allowed)
        raise TypeError(f"mkrt: {name} has dtype {dtype_name(array.dtype)}; expected {names}")
    if ndim is not None and array.ndim != ndim:
        raise ValueError(f"mkrt: {name} must have {ndim} dimensions; got shape {array.shape}")
    if shape is not None:
        if len(shape) != array.ndim or any(s is not None and s != a for s, a in zip(shape, array.shape)):
            want = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"mkrt: {name} has shape {array.shape}; expected {want}")
    if device is not None and array.device.id != device:
        raise ValueError(f"mkrt: {name} is on GPU {array.device.id}; expected GPU {device}")
    if contiguous and not array.flags.c_contiguous:
        raise ValueError(f"mkrt: {name} with shape {array.shape} and strides {array.strides} "
                         "is not C-contiguous (row-major); pass a contiguous array")
    return array
