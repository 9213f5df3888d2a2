"""The bounded ring of K/V slots (a design for ring attention, not yet a kernel): its
schedule cannot stall and never overwrites a slot before its last reader."""

from __future__ import annotations

import pytest

from mkrt.kernels import ring_slots_plan as B
from mkrt.kernels.schedule import find_stall, unordered_accesses

WORLDS = [(1, 2), (1, 4), (2, 2), (2, 3), (3, 1), (3, 2), (2, 4), (4, 2), (4, 4)]


def _check(steps):
    stall = find_stall(steps.workers, steps.depends_on)
    if stall:
        return stall, None
    problems, checked = unordered_accesses(steps.workers, steps.depends_on, steps.reads, steps.writes)
    return [], (problems, checked)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_bounded_slots_never_stall_and_never_race(world, slots):
    stall, (problems, checked) = _check(B.schedule(*world, slots=slots))
    assert stall == [] and problems == []
    assert checked > 0


def test_every_slot_use_is_written_once_and_read_by_every_tile():
    steps = B.schedule(2, 2, slots=2, ctas=2, tiles=3, epochs=1)
    writes = [w for t, ws in steps.writes.items() for w in ws]
    reads = [r for t, rs in steps.reads.items() if t[0] == "tile" for r in rs]
    W = 4
    # per rank: one write per step 1 .. W-1 into (step-1) % 2; 3 tiles read each
    for r in range(W):
        for j in range(2):
            uses = sum(1 for s in range(1, W) if B.slot_of(s, 2) == j)
            assert writes.count(("slot", r, j)) == uses
            assert reads.count(("slot", r, j)) == 3 * uses


def test_copies_that_do_not_wait_for_a_free_slot_race():
    _, (problems, _) = _check(B.schedule(1, 4, slots=2, wait_for_free_slots=False))
    assert any("not done before" in p for p in problems)


def test_tiles_that_do_not_wait_for_their_copy_race():
    _, (problems, _) = _check(B.schedule(1, 2, slots=1, wait_for_landed=False))
    assert any("reads before" in p for p in problems)


def test_one_copy_stream_per_sender_stalls():
    stall, _ = _check(B.schedule(2, 3, slots=1, stream_per_destination=False))
    assert stall and all(worker[0] in ("push", "queue") for worker, _ in stall[:2])


def test_a_slot_freed_before_its_forwards_read_it_races():
    _, (problems, _) = _check(B.schedule(2, 2, slots=2, free_after_forwards=False))
    assert any("fwd_read" in p for p in problems)


def test_generations_count_slot_uses_across_calls():
    assert B.generations(5, 2) == 2 and B.generations(2, 3) == 1
    # world 5, 2 slots: steps 1, 2 are the first uses, 3, 4 the second; call 2 goes on
    assert [B.generation(s, 2, 1, 5) for s in range(5)] == [-1, 0, 0, 1, 1]
    assert [B.generation(s, 2, 2, 5) for s in range(5)] == [1, 2, 2, 3, 3]
