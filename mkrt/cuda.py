"""Facts about the CUDA devices of this process, cached (the lowest layer: no mkrt imports)."""

from __future__ import annotations

import functools


@functools.cache
def device_sm_count(device: int) -> int:
    """Multiprocessors of `device` (cached: the property query takes about a millisecond)."""
    import cupy
    return cupy.cuda.Device(device).attributes["MultiProcessorCount"]


@functools.cache
def launch_config_type():
    """A ctypes mirror of the driver's CUlaunchConfig (cuda.h): the occupancy query and
    cuLaunchKernelEx take one."""
    import ctypes

    class CUlaunchConfig(ctypes.Structure):
        _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                    ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                    ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                    ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                    ("attrs", ctypes.c_void_p), ("numAttrs", ctypes.c_uint)]
    return CUlaunchConfig


@functools.cache
def _cluster_occupancy():
    """The driver's cuOccupancyMaxActiveClusters and the CUlaunchConfig mirror, loaded once."""
    import ctypes
    config_type = launch_config_type()
    query = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveClusters
    query.restype = ctypes.c_int
    query.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p,
                      ctypes.POINTER(config_type)]
    return query, config_type


def max_active_clusters(function_handle: int, grid: int, block: int, shared_mem: int) -> int:
    """How many clusters of a kernel with compile-time cluster dimensions can be resident
    on the device at once (cuOccupancyMaxActiveClusters). A persistent kernel's grid must
    not exceed it: clusters that cannot start wait for resident ones to finish their whole
    work list (the grid's SM count alone overstates it: a cluster needs its CTAs in one
    GPC)."""
    import ctypes
    query, config_type = _cluster_occupancy()
    config = config_type(grid, 1, 1, block, 1, 1, shared_mem, None, None, 0)
    count = ctypes.c_int(0)
    code = query(ctypes.byref(count), ctypes.c_void_p(function_handle), ctypes.byref(config))
    if code:
        raise RuntimeError(f"mkrt.cuda: cuOccupancyMaxActiveClusters failed (CUresult {code})")
    return int(count.value)
