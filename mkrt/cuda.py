"""Facts about the CUDA devices of this process, cached (the lowest layer: no mkrt imports)."""

from __future__ import annotations

import functools


@functools.cache
def device_sm_count(device: int) -> int:
    """Multiprocessors of `device` (cached: the property query takes about a millisecond)."""
    import cupy
    return cupy.cuda.Device(device).attributes["MultiProcessorCount"]
