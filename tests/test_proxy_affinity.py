"""Proxy threads and queue memory near their GPU (mkrt/proxy/affinity.py); CPU only."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from mkrt.proxy import HostTransport, Proxy, QueueSet, new_region_table
from mkrt.proxy import affinity as A

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"),
                                reason="thread affinity is Linux-only")


def test_parse_cpulist():
    assert A.parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert A.parse_cpulist("5") == [5]
    assert A.parse_cpulist("") == []
    with pytest.raises(ValueError):
        A.parse_cpulist("0-x")


@linux_only
def test_running_on_pins_only_the_body_and_only_this_thread():
    allowed = A.allowed_cpus()
    first = allowed[:1]
    other_thread_saw = []
    with A.running_on(first) as pinned:
        assert pinned and A.allowed_cpus() == first
        t = threading.Thread(target=lambda: other_thread_saw.append(A.allowed_cpus()))
        t.start()
        t.join(10)
    assert A.allowed_cpus() == allowed
    assert other_thread_saw == [first]          # a new thread inherits the creator's mask
    with A.running_on([]) as pinned:            # nothing to pin to: unchanged
        assert not pinned and A.allowed_cpus() == allowed


@linux_only
def test_a_pin_inside_a_thread_leaves_the_caller_alone():
    allowed = A.allowed_cpus()
    seen = []

    def body():
        A.pin_current_thread(allowed[-1:])
        seen.append(A.allowed_cpus())
    t = threading.Thread(target=body)
    t.start()
    t.join(10)
    assert seen == [allowed[-1:]] and A.allowed_cpus() == allowed


@linux_only
def test_proxy_threads_run_on_the_cpus_they_are_given():
    cpu = A.allowed_cpus()[-1]
    qs = QueueSet(2, 16, [0, 0])
    with Proxy(qs, new_region_table(1, 1), HostTransport(), threads=2, cpus=[cpu]) as proxy:
        masks = [os.sched_getaffinity(t.native_id) for t in proxy._threads]
    assert masks == [{cpu}, {cpu}]
    assert os.sched_getaffinity(0) == set(A.allowed_cpus())     # the caller is untouched
    with Proxy(qs, new_region_table(1, 1), HostTransport(), threads=1) as proxy:
        assert os.sched_getaffinity(proxy._threads[0].native_id) == set(A.allowed_cpus())
    qs.close()


@linux_only
def test_gpu_local_cpus_reads_the_gpus_pci_node(tmp_path, monkeypatch):
    cupy = pytest.importorskip("cupy")
    allowed = A.allowed_cpus()
    bus = "0000:19:00.0"
    (tmp_path / bus).mkdir()
    (tmp_path / bus / "local_cpulist").write_text(f"{allowed[0]},{max(allowed) + 1}-{max(allowed) + 4}\n")
    monkeypatch.setattr(A, "SYSFS_PCI_DEVICES", str(tmp_path))
    monkeypatch.setattr(cupy.cuda.runtime, "deviceGetPCIBusId", lambda device: bus.upper())
    assert A.gpu_local_cpus(0) == [allowed[0]]            # CPUs this process may not use are dropped
    assert A.gpu_remote_cpus(0) == allowed[1:]
    (tmp_path / bus / "local_cpulist").write_text(f"{max(allowed) + 1}\n")
    assert A.gpu_local_cpus(0) == [] and A.gpu_remote_cpus(0) == []
    monkeypatch.setattr(A, "SYSFS_PCI_DEVICES", str(tmp_path / "missing"))
    assert A.gpu_local_cpus(0) == []


def test_gpu_local_cpus_is_empty_without_a_gpu():
    cupy = pytest.importorskip("cupy")
    try:
        cupy.cuda.runtime.getDeviceCount()
        has_gpu = True
    except cupy.cuda.runtime.CUDARuntimeError:
        has_gpu = False
    if has_gpu:
        pytest.skip("a GPU is present")
    assert A.gpu_local_cpus(0) == []


@pytest.mark.gpu
def test_pinned_queue_memory_near_the_gpu_works():
    """Queue memory allocated from the GPU's NUMA node is ordinary pinned memory."""
    cupy = pytest.importorskip("cupy")
    cpus = A.gpu_local_cpus(0)
    before = A.allowed_cpus()
    qs = QueueSet(1, 16, [0], memory="pinned", cpus=cpus)
    assert A.allowed_cpus() == before                     # the allocation's pin is undone
    qs.ring[:] = np.arange(qs.ring.size, dtype=np.uint64)
    on_device = cupy.empty(qs.ring.size, dtype=np.uint64)
    cupy.cuda.runtime.memcpy(on_device.data.ptr, qs.ring.ctypes.data, qs.ring.nbytes,
                             cupy.cuda.runtime.memcpyDefault)
    assert (on_device.get() == qs.ring).all()
    qs.close()
