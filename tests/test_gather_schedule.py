"""The gathering role's chunked protocol (kernels/device/gather.py, modelled in
mkrt/kernels/gather_schedule.py) on the CPU: no wait cycle, no chunk overwritten before
its reader is done or read before it is written, over back-to-back calls."""

import pytest

from mkrt.kernels import gather_schedule as gs
from mkrt.kernels.schedule import find_stall, unordered_accesses

WORLDS = [(1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (2, 3), (3, 1), (3, 2), (4, 2)]


@pytest.mark.parametrize("own_in_input", [False, True], ids=["own_copied", "own_in_input"])
@pytest.mark.parametrize("nodes,per_node", WORLDS, ids=lambda v: str(v))
def test_no_wait_cycle_and_no_race_over_three_calls(nodes, per_node, own_in_input):
    s = gs.schedule(nodes, per_node, comm_ctas=2, chunks=4, epochs=3, own_in_input=own_in_input)
    assert find_stall(s.workers, s.depends_on) == []
    problems, checked = unordered_accesses(s.workers, s.depends_on, s.reads, s.writes)
    assert problems == []
    # a lone rank reading its own inputs gathers nothing
    assert checked > 0 or (nodes * per_node == 1 and own_in_input)


def test_every_rank_reads_every_chunk_of_every_block_once_per_call():
    nodes, per_node, chunks = 3, 2, 4
    s = gs.schedule(nodes, per_node, chunks=chunks, epochs=2)
    W = nodes * per_node
    for r in range(W):
        reads = [t for t in s.workers[("compute", r)] if t[0] == "read"]
        assert sorted((t[2], t[3], t[4]) for t in reads) == sorted(
            (b, c, e) for b in range(W) for c in range(chunks) for e in (1, 2))
    # each chunk crosses to each other node once: one put per (chunk, other node) per rank
    puts = [t for w, ts in s.workers.items() if w[0] == "queue" for t in ts if t[0] == "put"]
    assert len(puts) == 2 * W * (nodes - 1) * chunks
    assert all(t[1] // per_node != t[2] // per_node and t[1] % per_node == t[2] % per_node
               for t in puts)


def test_without_the_wait_for_the_other_nodes_the_next_copy_races_a_put():
    """A rank overwrites its own buffer's chunk while the proxy may still be putting the
    previous call's copy of it: waiting for the other node's next arrival orders them."""
    s = gs.schedule(2, 2, epochs=2, wait_for_node_arrival=False)
    problems, _ = unordered_accesses(s.workers, s.depends_on, s.reads, s.writes)
    assert any("'put'" in p and "'push'" in p for p in problems), problems


def test_a_put_that_does_not_wait_for_its_copy_reads_before_the_write():
    s = gs.schedule(2, 1, epochs=1, put_after_copy=False)
    problems, _ = unordered_accesses(s.workers, s.depends_on, s.reads, s.writes)
    assert any("reads before" in p and "'put'" in p for p in problems), problems


def test_forwarding_before_the_chunk_lands_would_stall_nothing_but_is_caught_as_a_race():
    """The forward's wait for the put is what orders its read after the landing."""
    s = gs.schedule(2, 2, epochs=1)
    forward = next(t for t in s.depends_on if t[0] == "forward")
    s.depends_on[forward] = []
    problems, _ = unordered_accesses(s.workers, s.depends_on, s.reads, s.writes)
    assert any("reads before" in p and str(forward) in p for p in problems), problems


def test_the_kernel_does_what_the_model_says_in_the_same_order():
    """The device role's text: arrivals waited for before the first copy, each chunk put
    after it is copied and fenced, forwards only after their chunk's flag."""
    from mkrt.kernels.device.gather import GATHER_ROLE
    role = GATHER_ROLE.text[GATHER_ROLE.text.index("void gather_role("):]
    order = ["cta_wait_words(a.flags, L.arrive(0)", "cta_wait_words(a.flags, L.node_arrive(0)",
             "spread_chunk(targets, a.G, (a.me + 1) % a.G, a.input0", "__threadfence_system();",
             "post_put_signal(", "L.chunk(block, c), 0, 1", "spread_chunk(targets, a.G, (a.me + 1) % a.G, landed"]
    at = [role.index(piece) for piece in order]
    assert at == sorted(at)
    # the put's landed flag is the receiver's chunk flag of our block
    assert "(u64)L.chunk(mine, c) * 8, epoch, ROLE_INTER, mine)" in role
