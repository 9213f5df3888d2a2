"""Checking a fused kernel's schedule on the CPU: does every wait get satisfied?

A schedule is a set of *workers* (CTAs, or proxy threads), each running its list of
tasks in order, and *dependencies*: a task may start only after the tasks it waits for
have finished. :func:`find_stall` plays the schedule out greedily (every worker runs
its next task as soon as that task's dependencies are done) and returns the tasks left
waiting if it gets stuck: a wait cycle that on the GPU would end in ``CommTimeout``.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Hashable, Iterable

Task = Hashable


@dataclasses.dataclass
class Schedule:
    """Tasks of every worker in order, what each waits for, and the buffer locations each
    reads and writes: the input of :func:`find_stall` and :func:`unordered_accesses`. A
    kernel's model builds it with :meth:`task`, worker by worker in program order."""

    workers: dict = dataclasses.field(default_factory=dict)
    depends_on: dict = dataclasses.field(default_factory=dict)
    reads: dict = dataclasses.field(default_factory=dict)
    writes: dict = dataclasses.field(default_factory=dict)

    def task(self, worker, name, deps=(), read=(), write=()):
        """Append task `name` to `worker`: it starts once `deps` are done, and reads and
        writes the given locations. Returns `name`."""
        self.workers.setdefault(worker, []).append(name)
        self.depends_on[name] = list(deps)
        self.reads[name], self.writes[name] = list(read), list(write)
        return name


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


def happens_before(workers: dict, depends_on: dict) -> tuple[dict, dict]:
    """(index, reach): ``reach[task] >> index[other] & 1`` when `other` finishes before
    `task` starts, through waits and the order of each worker's tasks."""
    index = {task: i for i, task in enumerate(depends_on)}
    preds = {task: set(deps) for task, deps in depends_on.items()}
    for tasks in workers.values():
        for before, after in zip(tasks, tasks[1:]):
            preds[after].add(before)
    reach: dict = {}
    # iterative DFS, so deep chains do not hit the recursion limit
    for root in depends_on:
        stack = [(root, False)]
        while stack:
            task, expanded = stack.pop()
            if task in reach:
                continue
            if expanded:
                bits = 0
                for p in preds[task]:
                    bits |= reach[p] | (1 << index[p])
                reach[task] = bits
            else:
                stack.append((task, True))
                stack.extend((p, False) for p in preds[task] if p not in reach)
    return index, reach


def unordered_accesses(workers: dict, depends_on: dict, reads: dict, writes: dict,
                       epoch_of=lambda task: task[-1]) -> tuple[list[str], int]:
    """Races between calls and inside one: every two accesses of a location, one a write,
    must be ordered -- inside a call the write first, across calls the earlier call's
    access first -- and each location is written once per call. Returns (problems, pairs
    checked). Locations are any hashable names; a task's call is ``epoch_of(task)``."""
    index, reach = happens_before(workers, depends_on)
    accesses: dict = {}
    for task in depends_on:
        epoch = epoch_of(task)
        for where in reads.get(task, ()):
            accesses.setdefault(where, []).append((epoch, "read", task))
        for where in writes.get(task, ()):
            accesses.setdefault(where, []).append((epoch, "write", task))

    def before(a, b):
        return bool(reach[b] >> index[a] & 1)

    problems, checked = [], 0
    for where, seen in accesses.items():
        per_epoch: dict = defaultdict(int)
        for e, kind, _ in seen:
            per_epoch[e] += kind == "write"
        if any(count != 1 for count in per_epoch.values()):
            problems.append(f"{where}: written {dict(per_epoch)} times per call")
        for e1, k1, t1 in seen:
            for e2, k2, t2 in seen:
                if t1 == t2 or "write" not in (k1, k2):
                    continue
                if e1 < e2:
                    checked += 1
                    if not before(t1, t2):
                        problems.append(f"{where}: {t1} ({k1}) not done before {t2} ({k2})")
                elif e1 == e2 and k1 == "write":
                    checked += 1
                    if not before(t1, t2):
                        problems.append(f"{where}: {t2} reads before {t1} wrote")
    return problems, checked
