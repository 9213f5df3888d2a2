"""Decoding the status block the bounded waits write (layout: mkrt/kernels/device/sync.py)."""

from __future__ import annotations

import numpy as np

from mkrt.kernels.device.sync import STATUS_HEADER_WORDS, STATUS_RECORD_WORDS
from mkrt.status import decode_records, kernel_id


def test_records_decode_by_slot_with_signed_fields_and_kernel_name():
    words = np.zeros(STATUS_HEADER_WORDS + 3 * STATUS_RECORD_WORDS, np.uint64)
    ident = kernel_id("gemm_allreduce")
    slot2 = STATUS_HEADER_WORDS + 2 * STATUS_RECORD_WORDS
    words[slot2:slot2 + 8] = [5, 3, 17, np.uint64(2**64 - 1), np.uint64(2**64 - 2), 12, 11,
                              np.uint64(ident | (1 << 63))]
    records = decode_records(words, 3)
    assert list(records) == [2]                      # empty slots are absent
    record = records[2]
    assert (record.rank, record.role, record.cta, record.tile, record.flag) == (5, "reduce", 17, -1, -2)
    assert (record.expected, record.seen, record.kernel) == (12, 11, "gemm_allreduce")
    assert "proxy reported an error" in str(record)


class _FailedBlock:
    """A status block whose wait gave up (what StatusBlock.raise_if_failed raises)."""

    host_word = np.ones(1, np.uint64)

    def __init__(self, records):
        self.records = records

    def raise_if_failed(self, *, blocking=False):
        from mkrt.errors import CommTimeout
        raise CommTimeout(self.records[0], 50.0, others=len(self.records) - 1,
                          records=tuple(self.records))


class _Proxy:
    def __init__(self, caught_up):
        self._caught_up = caught_up

    def check(self):
        pass

    def caught_up(self):
        if isinstance(self._caught_up, Exception):
            raise self._caught_up
        return self._caught_up


def _world_with(block, proxy):
    import mkrt
    world = mkrt.init(emulate="1x2")
    world._status_blocks = lambda: [block]
    world.running_service = lambda name, key=None: proxy if name == "proxy" else None
    return world


def test_timeout_lists_every_rank_and_names_a_stalled_proxy_stream():
    import pytest

    from mkrt.errors import CommTimeout, WaitRecord
    from mkrt.world import PROXY_STALL_HINT
    records = [WaitRecord(0, "reduce", 31, -1, 5, 2, 1), WaitRecord(2, "reduce", 29, -1, 4, 2, 1)]
    world = _world_with(_FailedBlock(records), _Proxy(True))
    with pytest.raises(CommTimeout) as caught:
        world.check()
    assert caught.value.records == tuple(records)
    assert "1 more waits" in str(caught.value) and str(caught.value).endswith(PROXY_STALL_HINT)
    assert world.failures == 1
    # A proxy that had not issued everything, or whose queues cannot be read: no hint.
    for state in (False, RuntimeError("device in error")):
        world = _world_with(_FailedBlock(records), _Proxy(state))
        with pytest.raises(CommTimeout) as caught:
            world.check()
        assert PROXY_STALL_HINT not in str(caught.value)


class _BrokenProxy(_Proxy):
    """A proxy whose thread reported an error (raised once, like Proxy.check)."""

    def __init__(self):
        super().__init__(True)
        self.closed = False
        self._raised = False

    def check(self):
        if not self._raised:
            self._raised = True
            raise RuntimeError("mkrt.proxy: destination rank out of range")

    def close(self):
        self.closed = True


def test_a_failed_proxy_is_reported_once_then_retired_for_a_fresh_one():
    import pytest

    import mkrt
    world = mkrt.init(emulate="1x2")
    proxy = _BrokenProxy()
    world._services[("proxy", None)] = proxy
    world._status_blocks = lambda: []
    with pytest.raises(RuntimeError, match="destination rank"):
        world.check()
    assert proxy.closed and world.running_service("proxy") is None
    assert world.failures == 1              # ops that launched before now refuse
    world.check()                           # nothing left to report


class _AbortedBlock:
    """A status block the kernels wrote into after the proxy failed (read once idle)."""

    def __init__(self, records):
        self._records, self.cleared = list(records), False
        self.host_word = np.zeros(1, np.uint64)     # the mirror lagged: the fast path misses it

    def read(self):
        return np.array([0 if self.cleared else 1], np.uint64)

    def failed(self):
        return False

    def records(self):
        return [] if self.cleared else list(self._records)

    def reset(self):
        self.cleared = True


def test_waits_that_gave_up_on_a_failed_proxy_go_with_its_error_not_to_the_next_op():
    import pytest

    import mkrt
    from mkrt.errors import WaitRecord
    world = mkrt.init(emulate="1x2")
    world._services[("proxy", None)] = _BrokenProxy()
    records = [WaitRecord(0, "reduce", 3, 6, -2, 2, 2566)]
    block = _AbortedBlock(records)
    world._status_blocks = lambda: [block]
    with pytest.raises(RuntimeError, match="destination rank") as caught:
        world.check()
    assert caught.value.records == tuple(records)
    assert block.cleared
    world.check()                           # the next op's check finds nothing stale
