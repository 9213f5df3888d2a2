"""Where proxy threads run and where their pinned memory lives: near their GPU.

Every command a proxy serves is PCIe traffic between its GPU and host memory: the GPU
writes the command, the proxy thread reads it and writes back flags the GPU reads. On a
host with more than one NUMA node, a thread or a ring on the far node adds the
inter-socket hop to each of those, so proxy threads pin themselves to the CPUs the GPU's
PCIe slot is local to, and queue memory is allocated from one of them (first-touch
placement). Linux only; elsewhere, and when the topology is unknown, nothing is pinned.
"""

from __future__ import annotations

import contextlib
import os

#: where Linux lists a PCI device's local CPUs (``<bus id>/local_cpulist``)
SYSFS_PCI_DEVICES = "/sys/bus/pci/devices"


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def allowed_cpus() -> list[int]:
    """The CPUs the calling thread may run on (empty where the OS does not say)."""
    if not hasattr(os, "sched_getaffinity"):
        return []
    return sorted(os.sched_getaffinity(0))


def gpu_local_cpus(device: int) -> list[int]:
    """CPUs on `device`'s NUMA node that the calling thread may use; [] when unknown (no
    CUDA device, no sysfs entry, not Linux) or when none of them is allowed."""
    try:
        import cupy
    except ImportError:
        return []
    try:
        bus_id = cupy.cuda.runtime.deviceGetPCIBusId(device).lower()
        with open(os.path.join(SYSFS_PCI_DEVICES, bus_id, "local_cpulist")) as f:
            local = parse_cpulist(f.read())
    except (cupy.cuda.runtime.CUDARuntimeError, OSError, ValueError):
        return []
    allowed = set(allowed_cpus())
    return [cpu for cpu in local if cpu in allowed]


def gpu_remote_cpus(device: int) -> list[int]:
    """Allowed CPUs NOT on `device`'s NUMA node (for measurements; [] on one-node hosts)."""
    local = set(gpu_local_cpus(device))
    return [cpu for cpu in allowed_cpus() if cpu not in local] if local else []


def pin_current_thread(cpus) -> bool:
    """Restrict the calling thread to `cpus`; False (nothing changed) when `cpus` is empty
    or the OS cannot pin threads."""
    cpus = list(cpus or [])
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return False
    os.sched_setaffinity(0, cpus)      # 0: the calling thread (Linux)
    return True


@contextlib.contextmanager
def running_on(cpus):
    """Run the body with the calling thread on `cpus` (memory it first touches is placed
    on their node), then restore its affinity. No-op for empty `cpus`."""
    before = allowed_cpus()
    pinned = pin_current_thread(cpus)
    try:
        yield pinned
    finally:
        if pinned:
            os.sched_setaffinity(0, before)
