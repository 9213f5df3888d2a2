"""Checking a fused kernel's schedule on the CPU: does every wait get satisfied?

A schedule is a set of *workers* (CTAs, or proxy threads), each running its list of
tasks in order, and *dependencies*: a task may start only after the tasks it waits for
have finished. :func:`find_stall` plays the schedule out greedily (every worker runs
its next task as soon as that task's dependencies are done) and returns the tasks left
waiting if it gets stuck: a wait cycle that on the GPU would end in ``CommTimeout``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Hashable, Iterable

Task = Hashable


def find_stall(workers: dict[Hashable, list[Task]],
               depends_on: dict[Task, Iterable[Task]]) -> list[tuple[Hashable, Task]]:
    """[] when the schedule completes; else (worker, task it is stuck at) for each stuck worker."""
    position = {w: 0 for w in workers}
    done: set = set()
    owner = {}
    for worker, tasks in workers.items():
        for task in tasks:
            if task in owner:
                raise ValueError(f"mkrt.schedule: task {task!r} is given to {owner[task]!r} "
                                 f"and to {worker!r}")
            owner[task] = worker
    missing = {d for deps in depends_on.values() for d in deps} - set(owner)
    if missing:
        raise ValueError(f"mkrt.schedule: tasks are waited for but nobody runs them: "
                         f"{sorted(map(repr, missing))[:5]}")
    waiting_on: dict[Task, list] = defaultdict(list)     # dependency -> workers parked on it
    ready = list(workers)
    while ready:
        worker = ready.pop()
        tasks = workers[worker]
        while position[worker] < len(tasks):
            task = tasks[position[worker]]
            pending = [d for d in depends_on.get(task, ()) if d not in done]
            if pending:
                waiting_on[pending[0]].append(worker)
                break
            done.add(task)
            position[worker] += 1
            ready.extend(waiting_on.pop(task, ()))
    return [(w, workers[w][position[w]]) for w in workers if position[w] < len(workers[w])]
