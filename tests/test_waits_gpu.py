"""Bounded waits: a flag nobody sets ends in mkrt.CommTimeout with the right record."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def test_wait_on_unset_flag_times_out_with_record():
    import cupy
    import mkrt
    from mkrt.kernels.probe import wait_for_flag
    world = mkrt.init(emulate="1x1")
    block = world.status(0)
    flag = cupy.zeros(1, np.uint64)
    start = time.perf_counter()
    seen = wait_for_flag(flag, 5, world_status=block.device_ptr, host_flag=block.host_flag_ptr,
                         rank=0, flag_id=41, timeout_ms=200, ctas=3)
    with pytest.raises(mkrt.CommTimeout) as info:
        world.synchronize()
    elapsed = time.perf_counter() - start
    record = info.value.record
    assert (record.rank, record.role, record.flag, record.expected, record.seen) == (0, "test", 41, 5, 0)
    assert record.tile == record.cta and 0 <= record.cta < 3
    assert 0.15 < elapsed < 5.0
    assert "flag=41" in str(info.value) and "expected=5" in str(info.value)
    assert list(seen.get()) == [2**64 - 1] * 3       # every waiter gave up and said so
    world.close()


def test_wait_released_by_a_flag_set_from_another_stream():
    import cupy
    import mkrt
    from mkrt.kernels.probe import ProbeSpec, wait_for_flag
    world = mkrt.init(emulate="1x1")
    block = world.status(0)
    flag = cupy.zeros(1, np.uint64)
    waiter, setter = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    # Load the setter before the waiter runs: loading a module may wait for running kernels.
    set_flag = ProbeSpec().function("set_flag", 0)
    seen = wait_for_flag(flag, 9, world_status=block.device_ptr, host_flag=block.host_flag_ptr,
                         timeout_ms=5000, stream=waiter)
    set_flag((1,), (32,), (flag, np.uint64(9)), stream=setter)
    waiter.synchronize()
    world.synchronize()
    assert int(seen.get()[0]) == 9
    world.close()
