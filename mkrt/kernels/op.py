"""What every world op shares: per-rank arguments, checks before launch, status, timeouts.

An op is built once (``op = mkrt.AllGather(world)``) and called many times; the
function form (``mkrt.allgather(x)``) keeps one op per world and configuration. Arguments
are per rank: a list with one array per rank this process holds, in ``world.local``
order, or a single array when it holds one. Everything is checked before any launch.
"""

from __future__ import annotations

import numpy as np
from cupy_backends.cuda.api import runtime as _runtime
from cupy.cuda import get_current_stream as _current_stream

from mkrt import checks, envs
from mkrt.arrays import as_cupy, dtype_name
from mkrt.errors import MkrtError
from mkrt.proxy import world as _proxy_service  # noqa: F401  (provides world.proxy())
from mkrt import status as _status_service  # noqa: F401  (provides world.status())
from mkrt import pacing as _pacing_service  # noqa: F401  (provides world.service("pacer"))
from mkrt.world import World, current_world

#: the kernel parameters of mkrt::Context, in order, that :meth:`Op.context_params` fills
CONTEXT_PARAMETERS = [("status", np.uint64, 8), ("host_flag", np.uint64, 8),
                      ("slot", np.int32, 4), ("rank", np.int32, 4), ("timeout_ns", np.uint64, 8)]


class Op:
    name = "op"

    def __init__(self, world: World | None = None, *, timeout_ms: float | None = None):
        self.world = world if world is not None else current_world()
        self.timeout_ms = checks.timeout_ms(timeout_ms if timeout_ms is not None
                                            else envs.get("MKRT_WAIT_TIMEOUT_MS"), self.name)
        self._failed: BaseException | None = None
        self._failures_seen = self.world.failures
        self._signatures: set = set()
        self._stream_plumbing = None
        self._last_stream = None         # one local rank: the stream of the last launch
        self._local_count = len(self.world.local)
        self._local_devices = tuple(info.device for info in self.world.local)
        self._multi_device = len(set(self._local_devices)) > 1
        self._sync_check = envs.get("MKRT_SYNC_CHECK")     # read once per op
        self._timeout_slots = None
        self._pacers = None              # (device, HostPacer) where the proxy's traffic is GPU work
        self._scratch: dict = {}         # kept_buffers: per-rank buffers kept between calls

    # ---- per-rank buffers --------------------------------------------------------
    def new_outputs(self, shape, dtype) -> list:
        """One new array per local rank, each on its rank's GPU."""
        import cupy
        outs = []
        for device in self._local_devices:
            with self.on_device(device):
                outs.append(cupy.empty(shape, dtype))
        return outs

    def kept_buffers(self, name: str, shape, dtype) -> list:
        """Per-rank buffers kept between calls while `shape` and `dtype` stay the same: an
        allocation while persistent kernels wait for the proxy can hold back its copies
        (mkrt/DESIGN.md, "Runtime hazards"). Memory replaced here is reused stream-ordered
        by CuPy's pool: the caller's stream waits for the launches that read it."""
        kept = self._scratch.get(name)
        if kept is None or kept[0].shape != tuple(shape) or kept[0].dtype != dtype:
            kept = self._scratch[name] = self.new_outputs(shape, dtype)
        return kept

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

    def arrays(self, value, name: str) -> tuple[list, bool]:
        """(one CuPy view per local rank, whether the caller gave a list): conversion and
        count only; :meth:`check_arrays` checks them against a prepared signature."""
        import cupy
        if isinstance(value, (list, tuple)):
            if len(value) != self._local_count:
                self.per_rank(value, name)          # raises the full message
            return [v if type(v) is cupy.ndarray else as_cupy(v, f"{name}[{i}]")
                    for i, v in enumerate(value)], True
        if self._local_count != 1:
            self.per_rank(value, name)
        return [value if type(value) is cupy.ndarray else as_cupy(value, name)], False

    def check_arrays(self, arrays: list, name: str, shape: tuple, dtype, *,
                     aligned: bool = False) -> None:
        """The per-call checks of a prepared signature: shape, dtype, GPU, layout and (with
        ``aligned``) a 16-byte base, for each rank's array. A mismatch raises the same
        errors the first call of a signature would."""
        for x, device in zip(arrays, self._local_devices):
            if (x.shape != shape or x.dtype != dtype or x.data.device_id != device
                    or not x._c_contiguous or (aligned and x.data.ptr & 15)):
                self._explain(arrays, name, shape, dtype, aligned)

    def _explain(self, arrays, name, shape, dtype, aligned) -> None:
        several = self._local_count > 1
        self.per_rank(arrays if several else arrays[0], name)   # GPU, layout
        for i, x in enumerate(arrays):
            label = f"{name}[{i}]" if several else name
            if x.shape != shape or x.dtype != dtype:
                raise ValueError(f"mkrt.{self.name}: {label} is {x.shape} {dtype_name(x.dtype)}; "
                                 f"expected {shape} {dtype_name(dtype)}")
            if aligned and x.data.ptr % 16:
                raise ValueError(f"mkrt.{self.name}: {label} starts at {x.data.ptr:#x}, "
                                 "not 16-byte aligned")
        # check_arrays saw a problem: never let the call go on without saying which.
        raise ValueError(f"mkrt.{self.name}: {name} failed its checks (shapes "
                         f"{[x.shape for x in arrays]}, expected {shape} {dtype_name(dtype)})")

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

    # ---- streams: each rank's launches are ordered on the rank's own stream --------
    def _plumbing(self):
        """Per local rank: (device, stream ptr, release event ptr, join event ptr of its
        device); per device: its join event. Built once per op: a call then costs one
        runtime call per record or wait."""
        if self._stream_plumbing is None:
            import cupy
            events = []           # kept alive with the op
            ranks, joins = [], {}
            for info in self.world.local:
                with cupy.cuda.Device(info.device):
                    release = cupy.cuda.Event(disable_timing=True)
                    events.append(release)
                    if info.device not in joins:
                        join = cupy.cuda.Event(disable_timing=True)
                        events.append(join)
                        joins[info.device] = join.ptr
                    ranks.append((info.device, self.world.stream(info.rank).ptr, release.ptr,
                                  joins[info.device]))
            with cupy.cuda.Device(self._local_devices[0]):
                events.append(cupy.cuda.Event(disable_timing=True))
            self._events_alive = events
            self._order_event = events[-1].ptr
            self._stream_plumbing = (tuple(ranks), tuple(joins.items()))
            self._rank_streams = tuple(stream for _, stream, _, _ in ranks)
        return self._stream_plumbing

    def join_caller_stream(self) -> None:
        """Each rank's stream waits for the caller's current stream (inputs are ready)."""
        ranks, joins = self._plumbing()
        for device, event in joins:
            _runtime.eventRecord(event, _current_stream(device).ptr)
        for _, stream, _, join in ranks:
            _runtime.streamWaitEvent(stream, join, 0)

    def release_to_caller_stream(self) -> None:
        """The caller's current stream waits for each rank's launch (outputs are ready)."""
        ranks, joins = self._plumbing()
        caller = _current_stream(joins[0][0]).ptr
        for device, stream, release, _ in ranks:
            _runtime.eventRecord(release, stream)
            _runtime.streamWaitEvent(_current_stream(device).ptr if self._multi_device
                                     else caller, release, 0)

    def launch(self, launches: list) -> None:
        """Launch each local rank's prepared kernel (mkrt/kernels/launcher.py), ordered
        after the caller's work, with the caller's stream ordered after them."""
        if not launches[0].launched:
            # Processes meet before a prepared kernel's first launch: each has compiled and
            # loaded it, so a slow compile in one is not spent inside another's bounded waits.
            self.world.barrier()
            for launch in launches:
                launch.launched = True
        streams = self._launch_streams()
        for launch, stream, device in zip(launches, streams, self._local_devices):
            with self.on_device(device):
                launch(stream)
        if self._local_count != 1:
            self.release_to_caller_stream()

    def _launch_streams(self) -> tuple:
        """The stream of each local rank's launch, ordered after the caller's work.

        A process holding one rank launches straight on the caller's current stream (as
        NCCL does): nothing to join. Launches of an op must stay ordered, so when the
        caller's stream changed since the last call, the new one first waits for the old.
        Several ranks in one process run concurrently, each on its own stream, joined to
        and released back to the caller's stream by events."""
        self._plumbing()
        if self._local_count == 1:
            current = _current_stream(self._local_devices[0])
            stream = current.ptr
            if stream != self._last_stream:
                # A stream being captured may not wait for uncaptured work: a graph's
                # launches are ordered where it is replayed (see the op's docstring).
                if current.is_capturing():
                    return (stream,)
                if self._last_stream is not None:
                    _runtime.eventRecord(self._order_event, self._last_stream)
                    _runtime.streamWaitEvent(stream, self._order_event, 0)
                self._last_stream = stream
            return (stream,)
        self.join_caller_stream()
        return self._rank_streams

    def capturing(self) -> bool:
        """Whether the caller's current stream is being captured into a CUDA graph."""
        return bool(self._local_devices) and self._local_devices[0] is not None and \
            _current_stream(self._local_devices[0]).is_capturing()

    def on_device(self, device: int):
        """Context for work on `device`: a no-op when it is already the current one (the
        common case: the op's ranks share one device)."""
        if _runtime.getDevice() == device:
            return _NO_CONTEXT
        import cupy
        return cupy.cuda.Device(device)

    _launched = False

    def after_launch(self) -> None:
        self._launched = True
        if self._timeout_slots is None:
            self._timeout_slots = [(self.world.status(info.device).timeout_ms, info.rank)
                                   for info in self.world.local]
        for table, rank in self._timeout_slots:    # what a CommTimeout reports as the bound
            table[rank] = self.timeout_ms
        if self._pacers is None:
            # Bounded run-ahead where the proxy sends by GPU copies (mkrt/pacing.py).
            devices = sorted({info.device for info in self.world.local
                              if self.world.copies_need_sms(info.rank)})
            self._pacers = tuple((d, self.world.service("pacer", d)) for d in devices)
        for device, pacer in self._pacers:
            pacer.after_call(_current_stream(device).ptr)
        if self._sync_check:
            self.synchronize()

    def synchronize(self) -> None:
        """Wait for this process's ranks and raise device-side failures (mkrt.CommTimeout)."""
        try:
            self.world.synchronize()
        except BaseException as error:
            self._failed = error
            raise

    def context_params(self, rank: int) -> dict:
        """Values of a kernel's mkrt::Context parameters (status, host_flag, slot, rank,
        timeout_ns), by name: ``Parameters.set(**op.context_params(rank))``."""
        block = self.world.status(self.world.ranks[rank].device)
        return {"status": block.device_ptr, "host_flag": block.host_flag_ptr,
                "slot": self.world.device_slot(rank), "rank": rank,
                "timeout_ns": int(self.timeout_ms * 1e6)}

    def context_args(self, rank: int) -> tuple:
        """The same values as typed arguments, for a kernel launched through CuPy."""
        c = self.context_params(rank)
        return (np.uint64(c["status"]), np.uint64(c["host_flag"]), np.int32(c["slot"]),
                np.int32(c["rank"]), np.uint64(c["timeout_ns"]))


class _NoContext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NO_CONTEXT = _NoContext()

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
