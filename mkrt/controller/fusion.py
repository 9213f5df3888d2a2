"""Fused or unfused, by timing: what ``fuse="measure"`` (and the default, ``fuse=None``) does
for the fused world ops.

Why timing is the default: on 225 shapes that no model was fitted on (GEMM+AllReduce on
emulated 1x2, 1x4 and 2x2, experiments/results/planner.jsonl, 46aa52f and 7aca30c), the
cost model's pick was within 3% of the faster path on 137 (geomean 0.91 of it, worst
0.38); the measured pick on 198 (geomean 1.00, worst 0.76), the misses mostly inside the
5-10% that two op instances of one path differ by on an emulated world.
``fuse="model"`` keeps the model's pick (no timed first call).

A cost model's pick loses where the margin between the two paths depends on what it does
not see (the GEMM engine's speed on the shape against cuBLAS, the communication role's
share of the SMs, the controller's split). ``fuse="measure"`` instead times both paths on
the first call of each *size class* and keeps the faster:

- size class: M rounded up to a power of two, with N, K and dtype exact, so serving with
  varying token counts pays for the timing once per class, not once per M;
- timing: each path's first call alone (compiles; cuBLAS's first call of a shape, which
  may wait for the device, never while a fused kernel waits for another rank or the
  proxy), then :data:`ROUNDS` rounds of :data:`CALLS` back-to-back calls per path, the best
  round, host time included; under mpiexec every process takes the slowest process's
  figures, so all settle alike;
- the timed calls write the caller's output and the settled path then writes it again:
  every output comes from the settled path, so calls stay bit-identical;
- under CUDA graph capture nothing is timed (the op runs its model's pick until an eager
  call of that class settles).

An op keeps one :class:`MeasuredFusion` and has it settle each prepared call
(:meth:`MeasuredFusion.settle`).
"""

from __future__ import annotations

import dataclasses
import time

from mkrt import checks

#: rounds of back-to-back calls per path, and calls per round
ROUNDS, CALLS = 3, 2


def check_fuse(value, area: str):
    """The op's path choice: True, False, "measure" (None, the default, means "measure") or
    "model" (the cost model's pick, never timed); TypeError for anything else."""
    if isinstance(value, str) and value in ("measure", "model"):
        return value
    flag = checks.flag(value, "fuse", area, optional=True)
    return "measure" if flag is None else flag


def size_class(m: int, n: int, k: int, dtype) -> tuple:
    """The key a measured choice is kept under: M up to a power of two; N, K, dtype."""
    return (1 << (int(m) - 1).bit_length(), int(n), int(k), str(dtype))


class MeasuredFusion:
    """An op's measured choices: size class -> (fused?, fused us, unfused us)."""

    def __init__(self):
        #: size class -> (fused, unfused) microseconds per call as measured
        self.times: dict = {}

    def choice(self, key) -> bool | None:
        """True (fused) or False for a measured class; None before it is measured."""
        times = self.times.get(key)
        return None if times is None else times[0] <= times[1]

    def reason(self, key, first: bool) -> str:
        fused_us, unfused_us = self.times[key]
        where = "measured" if first else f"measured on M = {key[0]}'s size class"
        return f"{where}: fused {fused_us:.1f} us vs unfused {unfused_us:.1f} us per call"

    def measure(self, key, world, fused, unfused) -> bool:
        """Time the two paths (callables that each run one call), keep and return the
        choice (True: fused)."""
        paths = {"unfused": unfused, "fused": fused}
        world.synchronize()
        for run in paths.values():
            run()
            world.synchronize()
        best = {name: float("inf") for name in paths}
        for _ in range(ROUNDS):
            for name, run in paths.items():
                start = time.perf_counter()
                for _ in range(CALLS):
                    run()
                world.synchronize()
                best[name] = min(best[name], (time.perf_counter() - start) * 1e6 / CALLS)
        times = (best["fused"], best["unfused"])
        if world.comm is not None:               # every process settles alike
            gathered = world.comm.allgather(times)
            times = tuple(max(t[i] for t in gathered) for i in range(2))
        self.times[key] = times
        return self.choice(key)

    def settle(self, op, call, fused, unfused) -> None:
        """Choose `call`'s path (``call.plan.fused``): the class's measured choice, or
        measure it now with `fused` / `unfused` (callables that run one call of each path
        on `call`). `op` gives the plans (``plan_for(..., mode_fuse=True)``: a ValueError
        says the fused kernel cannot run the shape, which then keeps the model's unfused
        plan) and whether the caller is capturing a graph (then nothing is timed and the
        model's pick runs until an eager call)."""
        p = call.plan
        key = size_class(p.m, p.n, p.k, call.dtype)
        chosen = self.choice(key)
        if chosen is None and op.capturing():
            return
        if chosen is not False:
            try:
                call.plan = op.plan_for(p.m, p.n, p.k, p.dtype, mode_fuse=True)
            except ValueError:
                call.settled = True
                return
        first = chosen is None
        if first:
            chosen = self.measure(key, op.world, fused, unfused)
        call.plan = dataclasses.replace(call.plan, fused=chosen, reason=self.reason(key, first))
        call.settled = True
