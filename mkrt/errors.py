"""Exceptions raised by mkrt. Every message starts with the area it comes from."""

from __future__ import annotations

from dataclasses import dataclass


class MkrtError(RuntimeError):
    """Base class of every mkrt runtime failure."""


class CompileError(MkrtError):
    """NVRTC rejected a rendered kernel (or ptxas reported spills with the check on).

    ``spec`` names the kernel spec, ``file``/``line`` the Python file and line holding
    the offending CUDA text (from ``#line``), ``source_path`` the dumped source.
    """

    def __init__(self, message: str, *, spec: str, file: str | None, line: int | None,
                 source_path: str, log: str):
        super().__init__(message)
        self.spec = spec
        self.file = file
        self.line = line
        self.source_path = source_path
        self.log = log


# Roles a CTA can have; the error record stores the index.
ROLE_NAMES = ("compute", "intra", "inter", "reduce", "proxy", "test")


@dataclass(frozen=True)
class WaitRecord:
    """What a device-side wait saw when it gave up (see mkrt/kernels/device/sync.py)."""

    rank: int
    role: str
    cta: int
    tile: int
    flag: int
    expected: int
    seen: int
    kernel: str = ""

    def __str__(self) -> str:
        meaning = SPECIAL_FLAGS.get(self.flag)
        flag = f"{self.flag} ({meaning})" if meaning else str(self.flag)
        return (f"rank={self.rank} role={self.role} cta={self.cta} tile={self.tile} "
                f"flag={flag} expected={self.expected} seen={self.seen}")


# Flag ids that name a condition rather than a flag word (mkrt/kernels/device/queue.py).
SPECIAL_FLAGS = {-2: "the proxy reported an error; seen = its error word",
                 -3: "no space in the proxy's command ring",
                 -4: "an expert id outside [0, experts): tile = the token entry, seen = the id",
                 -5: "more rows routed to this rank than its receive capacity: seen = rows, "
                     "expected = capacity",
                 -6: "ring attention with K/V slots: the tile's state from its previous "
                     "source (tile = the visit's position, expected = epoch x world + step)"}


class CommTimeout(MkrtError):
    """A device-side bounded wait timed out; ``record`` says who waited for what."""

    def __init__(self, record: WaitRecord, timeout_ms: float | None = None,
                 others: int = 0, records: tuple = ()):
        where = f" in {record.kernel}" if record.kernel else ""
        after = f" after {timeout_ms:g} ms" if timeout_ms is not None else ""
        more = f" ({others} more waits also timed out)" if others else ""
        super().__init__(f"mkrt.comm: wait timed out{after}{where}: {record}{more}")
        self.record = record
        self.timeout_ms = timeout_ms
        self.others = others
        #: the first failed wait of every rank on the GPU (``record`` is one of them)
        self.records = tuple(records) or (record,)
