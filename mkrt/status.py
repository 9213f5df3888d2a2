"""Host side of the status block that bounded waits report into (device/sync.py).

One block per GPU, one record slot per local rank on it. The abort word is mirrored into
pinned host memory, so checking for failures costs the host a memory read, not a
synchronisation: ops check at every call, ``world.synchronize()`` checks after waiting.
"""

from __future__ import annotations

import ctypes
import zlib

import numpy as np

from mkrt.errors import ROLE_NAMES, CommTimeout, WaitRecord
from mkrt.kernels.device.sync import STATUS_HEADER_WORDS, STATUS_RECORD_WORDS

_KERNEL_NAMES: dict[int, str] = {}


def kernel_id(name: str) -> int:
    """Stable id of a kernel family for error records (kept under 2**62)."""
    ident = zlib.crc32(name.encode()) + 1
    _KERNEL_NAMES[ident] = name
    return ident


class PinnedWords:
    """u64 words in pinned, mapped host memory: host view and device pointer."""

    def __init__(self, count: int):
        import cupy
        runtime = cupy.cuda.runtime
        flags = runtime.hostAllocMapped | runtime.hostAllocPortable
        self.nbytes = 8 * count
        self.host_ptr = runtime.hostAlloc(self.nbytes, flags)
        # Unified addressing: a mapped host allocation has the same address on the device.
        self.device_ptr = self.host_ptr
        buffer = (ctypes.c_uint64 * count).from_address(self.host_ptr)
        self.words = np.frombuffer(buffer, dtype=np.uint64)
        self.words[:] = 0

    def close(self):
        if self.host_ptr:
            import cupy
            self.words = None
            cupy.cuda.runtime.freeHost(self.host_ptr)
            self.host_ptr = 0


class StatusBlock:
    def __init__(self, device: int, slots: int, world):
        import cupy
        self.device, self.slots, self.world = device, slots, world
        with cupy.cuda.Device(device):
            self.words = cupy.zeros(STATUS_HEADER_WORDS + STATUS_RECORD_WORDS * slots, np.uint64)
            self.host = PinnedWords(1)
            self._reader = cupy.cuda.Stream(non_blocking=True)
        self.timeout_ms: dict[int, float] = {}

    @property
    def device_ptr(self) -> int:
        return self.words.data.ptr

    @property
    def host_flag_ptr(self) -> int:
        return self.host.device_ptr

    def failed(self) -> bool:
        return bool(self.host.words[0])

    def read(self) -> np.ndarray:
        import cupy
        with cupy.cuda.Device(self.device):
            out = self.words.get(stream=self._reader)
            self._reader.synchronize()
        return out

    def records(self) -> list[WaitRecord]:
        words = self.read()
        out = []
        for slot in range(self.slots):
            rec = words[STATUS_HEADER_WORDS + STATUS_RECORD_WORDS * slot:][:STATUS_RECORD_WORDS]
            if rec[7] == 0:
                continue
            ident = int(rec[7]) & ~(1 << 63)
            role = int(rec[1])
            out.append(WaitRecord(rank=int(rec[0]),
                                  role=ROLE_NAMES[role] if role < len(ROLE_NAMES) else str(role),
                                  cta=int(rec[2]), tile=int(np.int64(rec[3])),
                                  flag=int(np.int64(rec[4])), expected=int(rec[5]), seen=int(rec[6]),
                                  kernel=_KERNEL_NAMES.get(ident, f"kernel#{ident:x}")))
        return out

    def raise_if_failed(self, *, blocking: bool = False) -> None:
        if not self.failed() and not (blocking and self.read()[0]):
            return
        if not blocking:
            # Let the aborting launches drain before reading their records.
            import cupy
            cupy.cuda.Device(self.device).synchronize()
        words = self.read()
        records = self.records()
        self.reset()
        if not records:
            raise CommTimeout(WaitRecord(-1, "unknown", -1, -1, -1, 0, 0), None)
        first = int(words[1]) - 1
        head = next((r for r in records if self.world.device_slot(r.rank) == first), records[0])
        raise CommTimeout(head, self.timeout_ms.get(head.rank), others=int(words[2]) - 1)

    def reset(self) -> None:
        """Clear the block so the device can run again after a reported failure."""
        import cupy
        with cupy.cuda.Device(self.device):
            self.words.fill(0)
            cupy.cuda.Device(self.device).synchronize()
        self.host.words[0] = 0

    def close(self) -> None:
        self.host.close()
        self.words = None
