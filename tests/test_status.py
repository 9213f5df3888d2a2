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
