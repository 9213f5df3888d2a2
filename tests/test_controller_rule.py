"""The SM-partition controller's rule (mkrt/controller/rule.py) on simulated calls.

A fluid model of one fused call: compute CTAs finish tiles at `c` tiles per step each,
reduce CTAs reduce finished tiles at `r` each; the call ends when every tile is reduced.
The rule sees what a kernel would count every `interval` steps. Properties: over repeated
calls (each starting from the split the last one settled on) it reaches the best static
split's time within 3%; it does not oscillate; a role with work never has zero CTAs."""

from __future__ import annotations

import itertools
import math

import pytest

from mkrt.controller.rule import Signals, SplitController, SplitMemory


def simulate(ctas, reduce, tiles, c, r, controller=None, interval=4):
    made = reduced = 0.0
    made0 = reduced0 = 0.0
    wait = capacity = 0.0
    steps, splits = 0, [reduce]
    while reduced < tiles - 1e-9:
        made += min((ctas - reduce) * c, tiles - made)
        if tiles - made < 1e-6:
            made = float(tiles)            # no float dust: a kernel counts whole tiles
        can = reduce * r
        done = min(can, made - reduced)
        reduced += done
        wait, capacity = wait + can - done, capacity + can
        steps += 1
        if controller is not None and steps % interval == 0:
            reduce = controller.update(Signals(
                computed=int(made) - int(made0), reduced=int(reduced) - int(reduced0),
                reduce_wait_permille=int(1000 * wait / capacity) if capacity else 0,
                compute_left=math.ceil(tiles - made - 1e-9), backlog=int(made - reduced),
                reduce_left=math.ceil(tiles - reduced - 1e-9)))
            assert 1 <= ctas - reduce or made >= tiles, "compute lost every CTA with work left"
            assert reduce >= 1, "reduce lost every CTA with work left"
            made0, reduced0, wait, capacity = made, reduced, 0.0, 0.0
            splits.append(reduce)
        assert steps < 10**6
    return steps, splits


def best_static(ctas, tiles, c, r):
    return min(simulate(ctas, k, tiles, c, r)[0] for k in range(1, ctas))


CASES = list(itertools.product([16, 33, 66], [2000, 10000], [0.05, 0.2, 1.0], [0.1, 0.5, 2.0],
                               ["low", "mid", "high"]))


@pytest.mark.parametrize("ctas,tiles,c,r,start", CASES)
def test_repeated_calls_reach_the_best_static_split(ctas, tiles, c, r, start):
    best = best_static(ctas, tiles, c, r)
    memory = SplitMemory()
    key = ("gemm_allreduce", ctas, tiles)
    first = {"low": 1, "mid": ctas // 2, "high": ctas - 1}[start]
    for _ in range(6):
        controller = SplitController(ctas=ctas, reduce=memory.start(key, first))
        steps, splits = simulate(ctas, controller.reduce, tiles, c, r, controller)
        memory.remember(key, controller.steady)
        # damped: a call makes few moves (halving steps, then it settles)
        assert controller.moves <= 2 * math.ceil(math.log2(ctas)) + 6, splits
    assert steps <= 1.03 * best, (steps, best, splits[-6:])


def test_the_split_is_frozen_after_repeated_one_cta_reversals():
    """Noise that points one CTA up, then one down, forever: the rule stops following it."""
    ctas = 32
    controller = SplitController(ctas=ctas, reduce=10, settle=2, min_tiles=1)
    seen, frozen_at = [], None
    for step in range(30):
        target = controller.reduce + (1 if step % 2 == 0 else -1)
        # rates whose balance point is target + 0.5 (so the better side is the target)
        computed = round((target + 0.5) * (ctas - controller.reduce) * 10)
        reduced = round((ctas - target - 0.5) * controller.reduce * 10)
        seen.append(controller.update(Signals(computed, reduced, 0, 1000, 0)))
        if controller.frozen and frozen_at is None:
            frozen_at = step
    assert frozen_at is not None and controller.moves <= 10
    assert len(set(seen[frozen_at:])) == 1            # frozen: it no longer follows


def test_roles_with_work_keep_a_cta_whatever_the_signals():
    for ctas, reduce in [(2, 1), (5, 1), (5, 4), (66, 33)]:
        for computed, reduced, wait, compute_left, backlog in itertools.product(
                [0, 1, 1000], [0, 1, 1000], [0, 500, 1000], [0, 1, 50], [0, 10**6]):
            controller = SplitController(ctas=ctas, reduce=reduce, min_tiles=0)
            got = controller.update(Signals(computed, reduced, wait, compute_left, backlog))
            if compute_left > 0:
                assert 1 <= got <= ctas - 1
            else:
                assert got == ctas            # nothing left to compute: every CTA reduces


def test_bad_splits_are_refused():
    with pytest.raises(ValueError, match="at least 2 CTAs"):
        SplitController(ctas=1, reduce=1)
    with pytest.raises(ValueError, match="reduce=0 must be in"):
        SplitController(ctas=8, reduce=0)
    with pytest.raises(ValueError, match="reduce=8 must be in"):
        SplitController(ctas=8, reduce=8)
