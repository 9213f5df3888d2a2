"""The bounded ring of K/V slots (ring attention's slots=k): the design's schedule and the
kernel's (credits, staging, forwards, visits) cannot stall and never overwrite a slot
before its last reader."""

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


@pytest.mark.parametrize("world", [(1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (2, 3), (3, 1), (3, 2),
                                   (4, 2), (2, 4), (3, 3), (4, 4)])
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_the_kernels_moves_never_stall_and_never_race(world, slots):
    steps = B.kernel_schedule(*world, slots=slots, epochs=3)
    assert find_stall(steps.workers, steps.depends_on) == []
    problems, checked = unordered_accesses(steps.workers, steps.depends_on, steps.reads,
                                           steps.writes, epoch_of=lambda t: t[-1])
    assert problems == [] and checked > 0


def test_the_kernel_model_visits_every_source_once_in_the_plans_order():
    from mkrt.kernels import ring_attention as RA
    steps = B.kernel_schedule(2, 3, slots=2, epochs=1)
    for r in range(6):
        visits = [t for t in steps.workers[("compute", r)] if t[0] == "visit"]
        assert [t[2] for t in visits] == list(range(6))
        assert list(RA.source_order(r // 3, r % 3, 3, 2)) == list(B.ring_plan.plan(2, 3, causal=False).order[r])


def _races(steps):
    return unordered_accesses(steps.workers, steps.depends_on, steps.reads, steps.writes,
                              epoch_of=lambda t: t[-1])[0]


def test_a_put_without_the_receivers_credit_races():
    """The landing region's second use in a call (three nodes) needs the credit; its first
    is covered by the arrival the sender waits for before staging."""
    assert not _races(B.kernel_schedule(2, 1, slots=1, epochs=2, credits=False))
    assert _races(B.kernel_schedule(3, 1, slots=1, epochs=2, credits=False))


def test_a_landing_region_freed_before_the_forwards_out_of_it_races():
    assert _races(B.kernel_schedule(3, 2, slots=1, epochs=2, forwards_free=False))


def test_forwarding_out_of_visit_slots_would_deadlock_with_one_slot():
    """The design's schedule forwards out of visit slots; it passes only because it lets a
    forward read before the receiver's slot is free. Made a copy (read and write at once),
    2x2 with one slot stalls: why the kernel lands other nodes' sources apart."""
    steps = B.schedule(2, 2, slots=1, epochs=1)
    for name, deps in list(steps.depends_on.items()):
        if name[0] == "fwd_read":
            write = next(t for t in steps.depends_on if t[0] == "fwd_write" and t[1:4] == name[1:4])
            steps.depends_on[name] = list(deps) + [d for d in steps.depends_on[write] if d != name]
    assert find_stall(steps.workers, steps.depends_on)


def test_staging_before_the_other_nodes_arrive_races_the_last_calls_put():
    problems = _races(B.kernel_schedule(2, 1, slots=1, epochs=2, stage_after_arrival=False))
    assert any("staged" in p for p in problems), problems
