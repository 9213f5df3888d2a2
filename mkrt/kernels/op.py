"""What every world op shares: per-rank arguments, checks before launch, status, timeouts.

An op is built once (``op = mkrt.AllGather(world)``) and called many times; the
function form (``mkrt.allgather(x)``) keeps one op per world and configuration. Arguments
are per rank: a list with one array per rank this process holds, in ``world.local``
order, or a single array when it holds one. Everything is checked before any launch.
"""

from __future__ import annotations

import numpy as np

from mkrt import envs
from mkrt.arrays import as_cupy, dtype_name
from mkrt.errors import MkrtError
from mkrt.proxy import world as _proxy_service  # noqa: F401  (provides world.proxy())
from mkrt import status as _status_service  # noqa: F401  (provides world.status())
from mkrt.world import World, current_world


class Op:
    name = "op"

    def __init__(self, world: World | None = None, *, timeout_ms: float | None = None):
        self.world = world if world is not None else current_world()
        self.timeout_ms = float(timeout_ms if timeout_ms is not None
                                else envs.get("MKRT_WAIT_TIMEOUT_MS"))
        if self.timeout_ms <= 0:
            raise ValueError(f"mkrt.{self.name}: timeout_ms must be > 0, got {self.timeout_ms}")
        self._failed: BaseException | None = None
        self._failures_seen = self.world.failures
        self._signatures: set = set()

    # ---- arguments ---------------------------------------------------------------
    def per_rank(self, value, name: str) -> tuple[list, bool]:
        """(one CuPy array per local rank, whether the caller gave a list)."""
        local = self.world.local
        if isinstance(value, (list, tuple)):
            if len(value) != len(local):
                raise ValueError(f"mkrt.{self.name}: {name} has {len(value)} arrays; this process "
                                 f"holds {len(local)} ranks {[r.rank for r in local]}: one array each")
            arrays, as_list = [as_cupy(v, f"{name}[{i}]") for i, v in enumerate(value)], True
        else:
            if len(local) != 1:
                raise ValueError(f"mkrt.{self.name}: this process holds {len(local)} ranks; pass "
                                 f"{name} as a list of {len(local)} arrays (one per rank)")
            arrays, as_list = [as_cupy(value, name)], False
        for info, array, i in zip(local, arrays, range(len(arrays))):
            label = f"{name}[{i}]" if as_list else name
            if array.device.id != info.device:
                raise ValueError(f"mkrt.{self.name}: {label} (rank {info.rank}) is on GPU "
                                 f"{array.device.id}; rank {info.rank} runs on GPU {info.device}")
            if not array.flags.c_contiguous:
                raise ValueError(f"mkrt.{self.name}: {label} is not C-contiguous "
                                 f"(shape {array.shape}, strides {array.strides})")
        return arrays, as_list

    def same_everywhere(self, arrays: list, name: str) -> None:
        """Every rank (also in other processes) passes the same shape and dtype."""
        local = {(a.shape, a.dtype.str) for a in arrays}
        if len(local) != 1:
            seen = [(a.shape, dtype_name(a.dtype)) for a in arrays]
            raise ValueError(f"mkrt.{self.name}: {name} differs between ranks: {seen}")
        signature = (name, *local)
        if self.world.comm is not None and signature not in self._signatures:
            everyone = self.world.comm.allgather(signature)
            if len(set(everyone)) != 1:
                raise ValueError(f"mkrt.{self.name}: {name} differs between processes: "
                                 f"{[(s[1], np.dtype(s[2]).name) for s in everyone]}")
        self._signatures.add(signature)

    # ---- status ------------------------------------------------------------------
    def before_launch(self) -> None:
        if self._failed is not None:
            raise MkrtError(f"mkrt.{self.name}: this op failed earlier ({self._failed}); its flags "
                            "are out of step: build a new op") from self._failed
        try:
            self.world.check()
        except BaseException as error:
            self._failed = error
            raise
        if self.world.failures != self._failures_seen and self._launched:
            # A wait gave up while this op's launches were in flight: its epochs are off.
            self._failed = MkrtError(f"mkrt.{self.name}: a device-side wait failed during an "
                                     "earlier call (see the CommTimeout raised then)")
            raise MkrtError(f"mkrt.{self.name}: this op failed earlier ({self._failed}); its "
                            "flags are out of step: build a new op")
        self._failures_seen = self.world.failures

    def _event(self, key):
        # Events are reused: a stream wait captures the event's state when it is enqueued.
        import cupy
        events = self.__dict__.setdefault("_events", {})
        if key not in events:
            events[key] = cupy.cuda.Event(disable_timing=True)
        return events[key]

    def join_caller_stream(self) -> None:
        """Each rank's stream waits for the caller's current stream (inputs are ready)."""
        import cupy
        for info in self.world.local:
            with cupy.cuda.Device(info.device):
                event = self._event(("join", info.device))
                event.record(cupy.cuda.get_current_stream())
                self.world.stream(info.rank).wait_event(event)

    def release_to_caller_stream(self) -> None:
        """The caller's current stream waits for each rank's launch (outputs are ready)."""
        import cupy
        for info in self.world.local:
            with cupy.cuda.Device(info.device):
                event = self._event(("release", info.rank))
                event.record(self.world.stream(info.rank))
                cupy.cuda.get_current_stream().wait_event(event)

    _launched = False

    def after_launch(self) -> None:
        self._launched = True
        for info in self.world.local:
            self.world.status(info.device).timeout_ms[info.rank] = self.timeout_ms
        if envs.get("MKRT_SYNC_CHECK"):
            self.synchronize()

    def synchronize(self) -> None:
        """Wait for this process's ranks and raise device-side failures (mkrt.CommTimeout)."""
        try:
            self.world.synchronize()
        except BaseException as error:
            self._failed = error
            raise

    def context_args(self, rank: int) -> tuple:
        """Kernel arguments of mkrt::Context: status, host flag, slot, rank, timeout (ns)."""
        block = self.world.status(self.world.ranks[rank].device)
        return (np.uint64(block.device_ptr), np.uint64(block.host_flag_ptr),
                np.int32(self.world.device_slot(rank)), np.int32(rank),
                np.uint64(int(self.timeout_ms * 1e6)))


_SHARED_OPS: dict = {}


def shared_op(op_class, world=None, **options):
    """The op the function forms (``mkrt.allgather(x)``) call: one per (class, world,
    options), built on first use, replaced once it has failed."""
    world = world if world is not None else current_world()
    key = (op_class, id(world), tuple(sorted(options.items())))
    op = _SHARED_OPS.get(key)
    if op is None or op.world is not world or op._failed is not None:
        op = _SHARED_OPS[key] = op_class(world, **options)
    return op
