"""The role board's host side (mkrt/controller/board.py) against its device side
(mkrt/kernels/device/roles.py), and the weighted rule the device runs."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from mkrt.controller import board
from mkrt.controller.rule import (RULE_LAUNCHES, LaunchSearch, Signals, SplitController,
                                  SplitMemory)
from mkrt.kernels.device.roles import ROLES


def _enum(name: str) -> list[str]:
    body = re.search(r"enum %s \{(.*?)\};" % name, ROLES.text, re.S).group(1)
    code = " ".join(line.split("//")[0] for line in body.split("\n"))
    return [re.sub(r"\s*=.*", "", item).strip() for item in code.split(",") if item.strip()]


def test_board_words_match_the_device_enum():
    device = [w for w in _enum("Word") if w != "WORDS"]
    assert [w.lower() for w in device] == list(board.WORDS)


def test_trace_roles_match_the_device_enum():
    assert [r.lower() for r in _enum("Role")] == list(board.ROLES)


def test_rule_constants_match_the_controller_defaults():
    defaults = {f.name: f.default for f in dataclasses.fields(SplitController)}
    device = dict(re.findall(r"(MIN_TILES|BACKLOG_HIGH|IDLE_PERMILLE|SETTLE|MIN_REDUCE) = (\d+)",
                             ROLES.text))
    assert {k: int(v) for k, v in device.items()} == {
        "MIN_TILES": defaults["min_tiles"], "BACKLOG_HIGH": defaults["backlog_high"],
        "IDLE_PERMILLE": defaults["idle_permille"], "SETTLE": defaults["settle"],
        "MIN_REDUCE": defaults["min_reduce"]}
    assert len(board.STEP_FIELDS) == int(re.search(r"STEP_RECORD = (\d+)", ROLES.text).group(1))
    search = {f.name: f.default for f in dataclasses.fields(LaunchSearch)}
    device = dict(re.findall(r"(RULE_LAUNCHES|SEARCH_SAMPLES|MIN_GAIN_PERMILLE) = (\d+)", ROLES.text))
    assert {k: int(v) for k, v in device.items()} == {
        "RULE_LAUNCHES": RULE_LAUNCHES, "SEARCH_SAMPLES": search["samples"],
        "MIN_GAIN_PERMILLE": search["min_gain_permille"]}


def test_a_fresh_board_starts_from_the_split_it_is_given():
    words = board.initial_words(66, 7, static=False)
    state = board.decode_state(words)
    assert state["in_comm"] == state["target"] == state["learned"] == state["steady"] == 7
    assert state["static"] == 0 and state["launches"] == 0 and state["trace"] == 0
    assert state["start_ns"] == 2**64 - 1
    assert board.decode_state(board.initial_words(8, 1, static=True))["static"] == 1


@pytest.mark.parametrize("ctas,comm", [(1, 1), (8, 0), (8, 8), (2, 2)])
def test_splits_that_leave_a_role_empty_are_refused(ctas, comm):
    with pytest.raises(ValueError, match="roles need at least 2 CTAs|must be in"):
        board.initial_words(ctas, comm, static=False)


def test_trace_decoding():
    shape = board.TraceShape(ctas=3, events=4, steps=2)
    buf = np.zeros(shape.words, dtype=np.uint64)
    per = 1 + 2 * shape.events
    # CTA 0: compute at 100, comm at 250, done at 400; CTA 2: comm at 120, done at 300
    buf[0:7] = [3, 100, 0, 250, 1, 400, 3]
    buf[2 * per:2 * per + 5] = [2, 120, 1, 300, 3]
    base = 3 * per
    buf[base] = 1
    buf[base + 1:base + 10] = [200, 5, 2, 300, 40, 1, 20, 3, 4]
    out = board.decode_trace(buf, shape)
    assert out["ctas"][0] == [(0, "compute"), (150, "comm"), (300, "done")]
    assert out["ctas"][1] == []
    assert out["ctas"][2] == [(20, "comm"), (200, "done")]
    assert out["steps"] == [dict(time_ns=100, computed=5, reduced=2, wait_permille=300,
                                 compute_left=40, backlog=1, reduce_left=20, reduce_ctas=3,
                                 target=4)]


# ---- the weighted rule: compute and reduce queues of different sizes -----------------

def simulate(ctas, reduce, compute_tiles, per_tile, c, r, controller=None):
    """A fluid launch: compute CTAs make tiles at `c` each per step; every `per_tile`
    computed tiles make one reduce task ready; reduce CTAs do `r` tasks each per step.
    Static (no controller): the split holds to the end, as with roles="static". With a
    controller, as on the GPU: a CTA moves to the reduce queue at a step that finds the
    reduce role behind (one per such step, up to the rule's split), none moves back before
    the next launch (which starts from the rule's split), and all of them reduce once
    compute is done; a control step
    comes every max(4, reduce CTAs) reduce tasks finished, or max(8, CTAs / 2) tiles
    computed (the device's triggers)."""
    tasks = compute_tiles / per_tile
    made = reduced = made0 = reduced0 = wait = capacity = 0.0
    steps, comm = 0, reduce
    while reduced < tasks - 1e-9:
        computing = ctas - comm if made < compute_tiles else 0
        made = min(compute_tiles, made + computing * c)
        if compute_tiles - made < 1e-6:
            made = float(compute_tiles)
        workers = comm if made < compute_tiles or controller is None else ctas
        can = workers * r
        done = min(can, made / per_tile - reduced)
        reduced += done
        wait, capacity = wait + can - done, capacity + can
        steps += 1
        if controller is not None and (reduced - reduced0 >= max(4, comm)
                                       or made - made0 >= max(8, ctas // 2)):
            target = controller.update(Signals(
                computed=int(made) - int(made0), reduced=int(reduced) - int(reduced0),
                reduce_wait_permille=int(1000 * wait / capacity) if capacity else 0,
                compute_left=math.ceil(compute_tiles - made - 1e-9),
                backlog=max(0, int(made / per_tile - reduced)),
                reduce_left=math.ceil(tasks - reduced - 1e-9), reduce_ctas=comm))
            if controller.behind:      # one more reduce CTA per step that found it behind
                comm = max(comm, min(target, comm + 1, ctas - 1))
            made0, reduced0, wait, capacity = made, reduced, 0.0, 0.0
        assert steps < 10**6
    return steps


@pytest.mark.parametrize("ctas,per_tile,c,r", [(33, 2, 0.2, 0.5), (66, 4, 0.1, 0.3),
                                               (66, 2, 0.05, 0.02), (44, 3, 0.5, 2.0)])
@pytest.mark.parametrize("start", ["low", "high"])
def test_the_weighted_rule_settles_near_the_best_static_split(ctas, per_tile, c, r, start):
    compute_tiles = 4000
    best = min(simulate(ctas, k, compute_tiles, per_tile, c, r) for k in range(1, ctas))
    memory = SplitMemory()
    first = 1 if start == "low" else ctas - 1
    for _ in range(8):
        controller = SplitController(ctas=ctas, reduce=memory.start("k", first),
                                     compute_total=compute_tiles,
                                     reduce_total=compute_tiles // per_tile,
                                     min_tiles=max(4, compute_tiles // 16))   # as the device
        steps = simulate(ctas, controller.reduce, compute_tiles, per_tile, c, r, controller)
        memory.remember("k", controller.steady)
    assert steps <= 1.03 * best, (steps, best, controller.steady)


# ---- the rule against what the GPU did ----------------------------------------------

TRACE = Path(__file__).resolve().parents[1] / "experiments" / "results" / "controller_trace.json"


def _replays():
    """(layout, launch, rank, trace) of the committed GPU trace (experiments/controller.py
    --trace at 40eba35: 4096x4096x512 on 1x2 and 2x2, six launches from one reduce CTA)."""
    data = json.loads(TRACE.read_text())
    return [(layout, i, r, entry["shape"], trace) for layout, entry in data.items()
            for i, launch in enumerate(entry["launches"]) for r, trace in enumerate(launch)]


@pytest.mark.parametrize("layout,launch,rank,shape,trace", _replays(),
                         ids=lambda v: str(v) if not isinstance(v, (dict, list)) else "")
def test_the_rule_replays_every_control_step_the_gpu_took(layout, launch, rank, shape, trace):
    """Every control step recorded on the GPU, fed to SplitController from the split the
    launch started with: the same decision each time (the device runs this rule)."""
    from mkrt.kernels.gemm_allreduce_plan import plan
    from mkrt.world import parse_layout
    nodes, per_node = parse_layout(layout)
    ctas = len(trace["ctas"])
    p = plan(*shape, nodes=nodes, ranks_per_node=per_node, ctas=ctas, reduce_ctas=1, fuse=True)
    groups = -(-len(p.owned(rank % per_node)) // p.send_batch)
    controller = SplitController(
        ctas=ctas, reduce=sum(1 for events in trace["ctas"] if events and events[0][1] == "comm"),
        compute_total=p.tiles, reduce_total=groups * (2 if nodes > 1 else 1),
        min_tiles=max(4, p.tiles // 16))
    assert trace["steps"], "a launch without control steps replays nothing"
    for i, step in enumerate(trace["steps"]):
        fields = [step[f] for f in ("computed", "reduced", "wait_permille", "compute_left",
                                    "backlog", "reduce_left", "reduce_ctas")]
        assert controller.update(Signals(*fields)) == step["target"], f"step {i}: {step}"


def test_the_op_checks_its_role_options_before_anything_runs():
    import mkrt
    world = mkrt.init(emulate="1x2")
    try:
        for bad in ("Adaptive", "dynamic", None, 3, ["static"]):
            with pytest.raises(ValueError, match="mkrt.gemm_allreduce: roles="):
                mkrt.GemmAllReduce(world, roles=bad)
        with pytest.raises(ValueError, match="mkrt.gemm_reducescatter: roles="):
            mkrt.GemmReduceScatter(world, roles="none")
        with pytest.raises(ValueError, match="role_trace needs trace=True"):
            mkrt.GemmAllReduce(world).role_trace()
        op = mkrt.GemmAllReduce(world, roles="static", trace=True)
        assert (op.roles, op.trace) == ("static", True)
        assert op.controller_state() == []          # no call yet: no board
    finally:
        world.close()


def _replay(layout, shape, trace, rank, start):
    from mkrt.kernels.gemm_allreduce_plan import plan
    from mkrt.world import parse_layout
    nodes, per_node = parse_layout(layout)
    ctas = len(trace["ctas"])
    p = plan(*shape, nodes=nodes, ranks_per_node=per_node, ctas=ctas, reduce_ctas=1, fuse=True)
    groups = -(-len(p.owned(rank % per_node)) // p.send_batch)
    controller = SplitController(ctas=ctas, reduce=start, compute_total=p.tiles,
                                 reduce_total=groups * (2 if nodes > 1 else 1),
                                 min_tiles=max(4, p.tiles // 16))
    for step in trace["steps"]:
        controller.update(Signals(*[step[f] for f in ("computed", "reduced", "wait_permille",
                                                      "compute_left", "backlog", "reduce_left",
                                                      "reduce_ctas")]))
    return controller


@pytest.mark.parametrize("layout", ["1x2", "2x2"])
def test_each_launch_starts_where_the_rule_left_the_last_one(layout):
    """Across the six recorded launches of every rank: the split the rule held while compute
    remained (SplitController.steady) is the split the GPU's next launch started with, and
    the last one is the board's LEARNED word; it settles (the last three launches' starts
    lie within a few CTAs of each other)."""
    entry = json.loads(TRACE.read_text())[layout]
    launches = entry["launches"]
    for rank in range(len(launches[0])):
        starts = [sum(1 for events in launch[rank]["ctas"] if events and events[0][1] == "comm")
                  for launch in launches]
        steady = [_replay(layout, entry["shape"], launch[rank], rank, start).steady
                  for launch, start in zip(launches, starts)]
        assert steady[:-1] == starts[1:], (rank, starts, steady)
        assert steady[-1] == entry["state"][rank]["learned"]
        assert max(starts[-3:]) - min(starts[-3:]) <= 6, starts


# ---- roles="search": the split found by launch time ----------------------------------

@pytest.mark.parametrize("ctas,per_tile,c,r", [(66, 2, 0.2, 0.5), (66, 4, 0.1, 0.3),
                                               (32, 2, 0.3, 0.2), (132, 1, 0.05, 0.2),
                                               (33, 16, 0.5, 0.05)])
@pytest.mark.parametrize("noise", [0.0, 0.005])
def test_the_search_settles_within_3_percent_of_the_best_static_split(ctas, per_tile, c, r, noise):
    """Launch times of every static split from the fluid model (with multiplicative noise
    on each measured launch): from any start the search settles in a few dozen launches on
    a split within 3% of the best one."""
    import random
    times = {k: simulate(ctas, k, 4000, per_tile, c, r) for k in range(1, ctas)}
    best = min(times.values())
    rng = random.Random(ctas * 1000 + per_tile)
    for start in (1, ctas // 2, ctas - 1):
        search = LaunchSearch(ctas, start)
        split, launches = search.trial, 0
        while not search.settled:
            split = search.record(int(times[split] * 1000 * (1 + rng.uniform(-noise, noise))))
            launches += 1
            assert launches <= 80, (start, search)
            assert 1 <= split <= ctas - 1
        assert times[search.best] <= 1.03 * best, (start, search.best, times[search.best], best)
        assert search.record(1) == search.best          # settled: it stays


def test_the_search_refuses_a_start_outside_the_roles():
    with pytest.raises(ValueError, match="start=0"):
        LaunchSearch(8, 0)
    with pytest.raises(ValueError, match="start=8"):
        LaunchSearch(8, 8)


@pytest.mark.parametrize("kind,area", [("AllGatherGemm", "allgather_gemm"),
                                       ("RingAttention", "ring_attention")])
def test_gathering_ops_take_static_or_search_roles_only(kind, area):
    import mkrt
    world = mkrt.init(emulate="1x2")
    try:
        for bad in ("adaptive", "Search", None, 2):
            with pytest.raises(ValueError, match=f"mkrt.{area}: roles="):
                getattr(mkrt, kind)(world, roles=bad)
        assert getattr(mkrt, kind)(world, roles="search").roles == "search"
        assert getattr(mkrt, kind)(world).controller_state() == []     # static: no board
    finally:
        world.close()
