"""Host side of the status block that bounded waits report into (device/sync.py).

One block per GPU, one record slot per local rank on it. The abort word is mirrored into
pinned host memory, so checking for failures costs the host a memory read, not a
synchronisation: ops check at every call, ``world.synchronize()`` checks after waiting.
"""

from __future__ import annotations

import zlib

import numpy as np

from mkrt.errors import ROLE_NAMES, CommTimeout, WaitRecord
from mkrt.kernels.device.sync import STATUS_HEADER_WORDS, STATUS_RECORD_WORDS
from mkrt.proxy.queue import PinnedMemory
from mkrt.world import register_service

_KERNEL_NAMES: dict[int, str] = {}


def kernel_id(name: str) -> int:
    """Stable id of a kernel family for error records (kept under 2**62)."""
    ident = zlib.crc32(name.encode()) + 1
    _KERNEL_NAMES[ident] = name
    return ident


def decode_records(words: np.ndarray, slots: int) -> dict[int, WaitRecord]:
    """slot -> the record a failed wait wrote there (slots with none are absent)."""
    out = {}
    for slot in range(slots):
        rec = words[STATUS_HEADER_WORDS + STATUS_RECORD_WORDS * slot:][:STATUS_RECORD_WORDS]
        if rec[7] == 0:
            continue
        ident = int(rec[7]) & ~(1 << 63)
        role = int(rec[1])
        out[slot] = WaitRecord(rank=int(rec[0]),
                               role=ROLE_NAMES[role] if role < len(ROLE_NAMES) else str(role),
                               cta=int(rec[2]), tile=int(np.int64(rec[3])),
                               flag=int(np.int64(rec[4])), expected=int(rec[5]), seen=int(rec[6]),
                               kernel=_KERNEL_NAMES.get(ident, f"kernel#{ident:x}"))
    return out


class StatusBlock:
    def __init__(self, device: int, slots: int, world):
        import cupy
        self.device, self.slots, self.world = device, slots, world
        with cupy.cuda.Device(device):
            self.words = cupy.zeros(STATUS_HEADER_WORDS + STATUS_RECORD_WORDS * slots, np.uint64)
            self.host = PinnedMemory(8)      # the abort word's mirror, readable for free
            self.host_word = self.host.array.view(np.uint64)
            self._reader = cupy.cuda.Stream(non_blocking=True)
        self.timeout_ms: dict[int, float] = {}

    @property
    def device_ptr(self) -> int:
        return self.words.data.ptr

    @property
    def host_flag_ptr(self) -> int:
        return self.host.device_address

    def failed(self) -> bool:
        return bool(self.host_word[0])

    def read(self) -> np.ndarray:
        import cupy
        with cupy.cuda.Device(self.device):
            out = self.words.get(stream=self._reader)
            self._reader.synchronize()
        return out

    def records(self) -> list[WaitRecord]:
        return list(decode_records(self.read(), self.slots).values())

    def raise_if_failed(self, *, blocking: bool = False) -> None:
        if not self.failed() and not (blocking and self.read()[0]):
            return
        if not blocking:
            # Let the aborting launches drain before reading their records.
            import cupy
            cupy.cuda.Device(self.device).synchronize()
        words = self.read()
        records = decode_records(words, self.slots)
        self.reset()
        if not records:
            raise CommTimeout(WaitRecord(-1, "unknown", -1, -1, -1, 0, 0), None)
        head = records.get(int(words[1]) - 1, next(iter(records.values())))
        raise CommTimeout(head, self.timeout_ms.get(head.rank), others=int(words[2]) - 1,
                          records=tuple(records.values()))

    def reset(self) -> None:
        """Clear the block so the device can run again after a reported failure."""
        import cupy
        with cupy.cuda.Device(self.device):
            self.words.fill(0)
            cupy.cuda.Device(self.device).synchronize()
        self.host_word[0] = 0

    def close(self) -> None:
        self.host_word = None
        self.host.close()
        self.words = None


def _new_status_block(world, device: int) -> StatusBlock:
    return StatusBlock(device, len(world.ranks_on_device(device)), world)


register_service("status", _new_status_block)
