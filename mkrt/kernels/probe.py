"""Diagnostic kernels for the signalling layer: set a flag, wait on a flag.

`wait_for_flag` is the smallest user of the bounded wait: tests use it to check that a
flag nobody sets ends in ``mkrt.CommTimeout`` with the right record, and that a flag
someone sets releases the waiter.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mkrt.jit import cuda_source
from mkrt.jit.spec import KernelSpec
from mkrt.status import kernel_id

PROBE = cuda_source("probe", r"""
extern "C" __global__ void wait_for_flag(const mkrt::u64* flag, mkrt::u64 expected, int flag_id,
                                         mkrt::u64* status, mkrt::u64* host_flag, int slot,
                                         int rank, mkrt::u64 timeout_ns, mkrt::u64* seen_out) {
    const mkrt::Context ctx{status, host_flag, slot, rank, timeout_ns, $KERNEL_ID};
    if (threadIdx.x != 0) return;
    const bool ok = mkrt::wait_at_least(flag, expected, ctx, mkrt::ROLE_TEST, (int)blockIdx.x, flag_id);
    seen_out[blockIdx.x] = ok ? mkrt::ld_acquire_sys(flag) : ~0ull;
}

extern "C" __global__ void set_flag(mkrt::u64* flag, mkrt::u64 value) {
    if (threadIdx.x == 0 && blockIdx.x == 0) mkrt::st_release_sys(flag, value);
}
""", requires=("sync",), register=False)

KERNEL_ID = kernel_id("probe")


@dataclasses.dataclass(frozen=True)
class ProbeSpec(KernelSpec):
    family = "probe"
    entry_points = ("wait_for_flag", "set_flag")

    def template(self):
        return PROBE

    def params(self):
        return {"KERNEL_ID": f"{KERNEL_ID}ull"}


def default_specs():
    return [ProbeSpec()]


def wait_for_flag(flag, expected: int, *, world_status: int, host_flag: int, slot: int = 0,
                  rank: int = 0, flag_id: int = 0, timeout_ms: float = 100.0, ctas: int = 1,
                  stream=None):
    """Launch `ctas` waiters on the u64 device word `flag` (a 1-element cupy array);
    returns, per CTA, the value seen (all ones when the wait gave up)."""
    import cupy
    function = ProbeSpec().function("wait_for_flag", flag.device.id)
    seen = cupy.full(ctas, 0xDEAD, dtype=np.uint64)
    function((ctas,), (32,), (flag, np.uint64(expected), np.int32(flag_id),
                              np.uint64(world_status), np.uint64(host_flag), np.int32(slot),
                              np.int32(rank), np.uint64(int(timeout_ms * 1e6)), seen),
             stream=stream)
    return seen
