"""The host side of a persistent kernel's role board (the device side, its task queues
and the controller, is mkrt/kernels/device/roles.py).

A board is a few u64 words in device memory per op, shape and rank: the queues' counters
for the launch in flight, the split the controller aims at, what it learned (the split
the next launch starts from) and, optionally, a trace buffer. The host makes it once per
prepared call; launches and graph replays read and update it on the GPU only.
"""

from __future__ import annotations

import dataclasses

import numpy as np

#: the board's words, in the order of ``enum Word`` in the device module
WORDS = ("next_compute", "next_comm", "in_comm", "target", "computed", "communicated",
         "exited", "step_lock", "step_tasks", "step_wait_ns", "step_busy_ns", "step_computed",
         "sum_computed", "sum_reduced", "sum_wait", "sum_steps", "last_move", "reversals",
         "frozen", "last_backlog", "moves", "steady", "learned", "static", "switches", "steps",
         "launches", "last_switches", "last_steps", "last_moves", "start_ns", "trace",
         "trace_events", "trace_steps", "move_limit", "search", "searching", "s_best",
         "s_best_ns", "s_trial", "s_step", "s_down", "s_tried_down", "s_settled", "s_n",
         "s_sum_ns", "last_ns")
WORD = {name: i for i, name in enumerate(WORDS)}
#: roles in the trace (``enum Role``)
ROLES = ("compute", "comm", "final", "done")
#: words per control step in the trace: time, then the signals, then the split it chose
STEP_FIELDS = ("time_ns", "computed", "reduced", "wait_permille", "compute_left", "backlog",
               "reduce_left", "reduce_ctas", "target")


@dataclasses.dataclass(frozen=True)
class TraceShape:
    """How much a trace buffer holds: role changes per CTA and control steps."""

    ctas: int
    events: int = 64
    steps: int = 512

    @property
    def words(self) -> int:
        return self.ctas * (1 + 2 * self.events) + 1 + self.steps * len(STEP_FIELDS)


def check_split(ctas: int, comm_ctas: int, area: str) -> None:
    if ctas < 2:
        raise ValueError(f"mkrt.{area}: roles need at least 2 CTAs per rank (compute and "
                         f"communication); got {ctas}")
    if not 1 <= comm_ctas <= ctas - 1:
        raise ValueError(f"mkrt.{area}: {comm_ctas} communication CTAs of {ctas}: must be in "
                         f"[1, {ctas - 1}] (each role keeps at least one CTA)")


def initial_words(ctas: int, comm_ctas: int, *, static: bool, search: bool = False,
                  trace_ptr: int = 0, trace: TraceShape | None = None) -> np.ndarray:
    """A fresh board: no launch yet, starting with `comm_ctas` CTAs communicating;
    `search`: after the rule's first launches, search the split by launch time."""
    check_split(ctas, comm_ctas, "controller")
    words = np.zeros(len(WORDS), dtype=np.uint64)
    words[WORD["search"]] = int(bool(search) and not static)
    for name in ("in_comm", "target", "steady", "learned", "move_limit"):
        words[WORD[name]] = comm_ctas
    words[WORD["static"]] = int(bool(static))
    words[WORD["start_ns"]] = np.uint64(2**64 - 1)
    if trace_ptr:
        words[WORD["trace"]] = trace_ptr
        words[WORD["trace_events"]] = trace.events
        words[WORD["trace_steps"]] = trace.steps
    return words


class Board:
    """One rank's board on its device (a CuPy array), with an optional trace buffer."""

    def __init__(self, ctas: int, comm_ctas: int, *, static: bool, search: bool = False,
                 trace: bool = False, trace_events: int = 64, trace_steps: int = 512):
        import cupy
        self.ctas = ctas
        self.trace_shape = TraceShape(ctas, trace_events, trace_steps) if trace else None
        self.trace = (cupy.zeros(self.trace_shape.words, dtype=cupy.uint64)
                      if trace else None)
        self.words = cupy.asarray(initial_words(
            ctas, comm_ctas, static=static, search=search,
            trace_ptr=self.trace.data.ptr if trace else 0, trace=self.trace_shape))

    @property
    def ptr(self) -> int:
        return self.words.data.ptr

    def state(self) -> dict:
        """The words as a dict (copies from the device: synchronize first)."""
        return decode_state(self.words.get())

    def clear_trace(self) -> None:
        if self.trace is not None:
            self.trace.fill(0)

    def timeline(self) -> dict:
        """The trace since the last :meth:`clear_trace` (synchronize first)."""
        if self.trace is None:
            raise ValueError("mkrt.controller: this board was made without a trace "
                             "(trace=True)")
        return decode_trace(self.trace.get(), self.trace_shape)


def decode_state(words) -> dict:
    state = {name: int(v) for name, v in zip(WORDS, words)}
    state["comm_ctas"] = state["learned"]
    return state


def decode_trace(buffer, shape: TraceShape) -> dict:
    """{"ctas": [[(time_ns, role), ...] per CTA], "steps": [{field: value}, ...]}; times
    are relative to the earliest event."""
    buffer = np.asarray(buffer, dtype=np.uint64)
    per_cta = 1 + 2 * shape.events
    ctas = []
    for c in range(shape.ctas):
        row = buffer[c * per_cta:(c + 1) * per_cta]
        n = min(int(row[0]), shape.events)
        ctas.append([(int(row[1 + 2 * i]), ROLES[int(row[2 + 2 * i])]) for i in range(n)])
    base = shape.ctas * per_cta
    n_steps = min(int(buffer[base]), shape.steps)
    steps = []
    for i in range(n_steps):
        record = buffer[base + 1 + i * len(STEP_FIELDS):base + 1 + (i + 1) * len(STEP_FIELDS)]
        steps.append({f: int(v) for f, v in zip(STEP_FIELDS, record)})
    times = [t for events in ctas for t, _ in events] + [s["time_ns"] for s in steps]
    origin = min(times) if times else 0
    ctas = [[(t - origin, role) for t, role in events] for events in ctas]
    for s in steps:
        s["time_ns"] -= origin
    return {"ctas": ctas, "steps": steps}
