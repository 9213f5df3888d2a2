"""Timing and result records shared by `python -m mkrt demo` and experiments/.

Times are CUDA events on the caller's stream around each call (ops join their ranks'
streams to it), after warm-up; reports take the median. Records are the JSON lines
every experiment writes (experiments/results/<experiment>.jsonl).
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path
from statistics import median


def time_calls(call, *, warmup: int = 5, iters: int = 50) -> list[float]:
    """Milliseconds of each of `iters` calls of `call()`, each timed by its own events."""
    import cupy
    stream = cupy.cuda.get_current_stream()
    for _ in range(warmup):
        call()
    stream.synchronize()
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(iters)]
    for start, end in events:
        start.record(stream)
        call()
        end.record(stream)
    stream.synchronize()
    return [cupy.cuda.get_elapsed_time(start, end) for start, end in events]


def batch_ms(call, *, iterations: int = 10, repeats: int = 5, warmup: int = 3) -> float:
    """Median over `repeats` batches of the milliseconds per call of `iterations`
    back-to-back calls (one event pair per batch: what a model's loop sees, host time
    included), after `warmup` calls. Events on CuPy's current stream, which is also
    torch's default stream."""
    import cupy
    stream = cupy.cuda.get_current_stream()
    for _ in range(warmup):
        call()
    stream.synchronize()
    return median(_batch(call, iterations, stream) for _ in range(repeats))


def _batch(call, iterations: int, stream) -> float:
    """Milliseconds per call of `iterations` back-to-back calls, one event pair around them."""
    import cupy
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    for _ in range(iterations):
        call()
    stop.record(stream)
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / iterations


def interleaved_ms(calls: dict, *, iterations: int = 10, rounds: int = 5,
                   warmup: int = 2) -> dict:
    """Per name of `calls`, the median over `rounds` of the milliseconds per call of
    `iterations` back-to-back calls, the calls taking turns round by round: clock and
    power drift (a GPU fresh from idle runs its first long kernels faster) falls on every
    call alike instead of favouring the first timed. Timed one after the other, a GEMM
    sweep saw its first configuration up to 17% faster than in rounds. Each round takes the
    calls in a new order (a seeded shuffle, the same in every run), so no call always follows
    the same one: a slow host-bound baseline leaves the GPU at other clocks for whatever
    comes next, and with the rounds only rotated (until c526389) each call always followed
    the same one; two rings of one configuration then differed by 2-10% in one run. Each
    call's warm-up is
    synchronized before the next one's: a first call may wait for the device (a module
    load, a memory pool growing), and on an emulated world with nodes that holds back the
    proxy's copies of a fused call still in flight (a 2x2 ring timed out so)."""
    import cupy
    stream = cupy.cuda.get_current_stream()
    for call in calls.values():
        for _ in range(warmup):
            call()
        stream.synchronize()
    samples: dict = {name: [] for name in calls}
    for order in round_orders(list(calls), rounds):
        for name in order:
            samples[name].append(_batch(calls[name], iterations, stream))
    return {name: median(values) for name, values in samples.items()}


def round_orders(names: list, rounds: int, seed: int = 0) -> list[list]:
    """The order of `names` in each of `rounds` rounds (interleaved_ms): round k leads with
    name k mod n (each leads equally often), the rest in a seeded shuffle."""
    import random
    shuffle = random.Random(seed).shuffle
    orders = []
    for k in range(rounds):
        i = k % len(names)
        rest = names[:i] + names[i + 1:]
        shuffle(rest)
        orders.append([names[i]] + rest)
    return orders


def repeated(call, count: int, context=None):
    """A call of `count` back-to-back calls of `call`, inside ``context()`` if given, entered
    once (a torch SDPA backend's selection costs host time a model pays once, not per
    call): time it with ``interleaved_ms(..., iterations=1)`` and divide by `count`."""
    import contextlib

    def run():
        with (context() if context is not None else contextlib.nullcontext()):
            for _ in range(count):
                call()
    return run


def median_ms(call, **kwargs) -> float:
    return median(time_calls(call, **kwargs))


def capture_graph(call):
    """(graph, stream): what `call()` launches, captured into a CUDA graph on a new
    non-blocking stream (replay with ``graph.launch(stream)``)."""
    import cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        call()
        graph = stream.end_capture()
    return graph, stream


def gpu_name() -> str:
    try:
        import cupy
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        name = props["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        return "none"


def git_commit() -> str:
    from mkrt import envs
    if envs.get("MKRT_BENCH_COMMIT"):
        return envs.get("MKRT_BENCH_COMMIT")
    try:
        root = Path(__file__).resolve().parents[1]
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def record(experiment: str, case: str, metric: str, value: float, baseline: float | None,
           unit: str, *, higher_is_better: bool = True, **extra) -> dict:
    """One result line; ratio > 1 means mkrt is better than the baseline."""
    ratio = None
    if baseline:
        ratio = value / baseline if higher_is_better else baseline / value
    return {"experiment": experiment, "case": case, "metric": metric, "value": value,
            "baseline": baseline, "ratio": ratio, "unit": unit, "gpu": gpu_name(),
            "date": datetime.date.today().isoformat(), "commit": git_commit(),
            "command": " ".join([Path(sys.executable).name, *sys.argv]), **extra}


def append_jsonl(path: str | Path, records: list[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        for item in records:
            handle.write(json.dumps(item) + "\n")
