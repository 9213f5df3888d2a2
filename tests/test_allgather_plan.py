"""allgather's plan and schedule on the CPU (no GPU): who sends what to whom, that every
block reaches every rank once and crosses each node pair once, that no wait cycle exists,
and that no buffer is overwritten before its last reader is done; the kernel compiles."""

from __future__ import annotations

from collections import Counter

import pytest

from mkrt.kernels import allgather as ag
from mkrt.kernels.schedule import find_stall, happens_before, unordered_accesses

WORLDS = [(n, g) for n in (1, 2, 3, 4) for g in (1, 2, 3, 4, 8) if n * g >= 2]


@pytest.mark.parametrize("nodes,per_node", WORLDS, ids=lambda v: str(v))
def test_every_block_reaches_every_rank_exactly_once(nodes, per_node):
    R = nodes * per_node
    transfers = ag.plan(nodes, per_node)
    into_outputs = Counter((t.block, t.dst) for t in transfers if t.kind in ("push", "forward"))
    assert set(into_outputs) == {(b, r) for b in range(R) for r in range(R)}
    assert set(into_outputs.values()) == {1}


@pytest.mark.parametrize("nodes,per_node", WORLDS, ids=lambda v: str(v))
def test_each_block_crosses_each_node_pair_once(nodes, per_node):
    G = per_node
    transfers = ag.plan(nodes, per_node)
    crossings = Counter()
    for t in transfers:
        if t.src // G != t.dst // G:
            # only the proxy crosses nodes, and only with the sender's own block
            assert t.kind == "put" and t.block == t.src, t
            crossings[(t.block, t.dst // G)] += 1
        else:
            assert t.kind != "put", t
    expected = {(b, m) for b in range(nodes * G) for m in range(nodes) if m != b // G}
    assert set(crossings) == expected
    assert set(crossings.values()) <= {1}
    # a put goes to the same local rank of the other node, which forwards it
    for t in transfers:
        if t.kind == "put":
            assert t.src % G == t.dst % G
    forwarders = {(t.block, t.src) for t in transfers if t.kind == "forward"}
    puts = {(t.block, t.dst) for t in transfers if t.kind == "put"}
    assert forwarders == puts
    # bytes between nodes: (nodes - 1) blocks per rank, never more
    assert sum(crossings.values()) == nodes * G * (nodes - 1)


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("nodes,per_node", WORLDS, ids=lambda v: str(v))
def test_schedule_has_no_wait_cycle(nodes, per_node, staged):
    s = ag.schedule(nodes, per_node, epochs=3, staged=staged)
    assert find_stall(s.workers, s.depends_on) == []


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("nodes,per_node", [(1, 2), (2, 1), (2, 2), (2, 3), (3, 1), (3, 2),
                                            (2, 4), (4, 2), (4, 8)], ids=lambda v: str(v))
def test_no_buffer_is_overwritten_before_its_reader_is_done(nodes, per_node, staged):
    """Every two accesses of one location, one a write, are ordered by waits: within a call
    the write comes first, across calls the earlier call's access comes first."""
    s = ag.schedule(nodes, per_node, epochs=2, staged=staged)
    problems, checked = unordered_accesses(s.workers, s.depends_on, s.reads, s.writes)
    assert problems == []
    assert checked > 0


def test_the_checks_catch_a_broken_schedule():
    """Sending only after receiving everything deadlocks: the checker must say so."""
    s = ag.schedule(2, 2, epochs=1)
    s.depends_on[("send", 0, 1)] = list(s.depends_on[("send", 0, 1)]) + [("wait", 2, 1)]
    s.depends_on[("send", 2, 1)] = list(s.depends_on[("send", 2, 1)]) + [("wait", 0, 1)]
    stuck = find_stall(s.workers, s.depends_on)
    assert stuck and {w for w, _ in stuck} >= {("rank", 0), ("rank", 2)}


def test_hazard_check_catches_a_missing_arrival_wait():
    """Without waiting for the other node's arrival, the next call's send overwrites the
    slot the previous call's put still reads."""
    s = ag.schedule(2, 1, epochs=2)
    s.depends_on[("send", 0, 2)] = []
    index, reach = happens_before(s.workers, s.depends_on)
    put, send = ("put", 0, 1, 1), ("send", 0, 2)
    assert ("recv", 0, 0) in s.reads[put] and ("recv", 0, 0) in s.writes[send]
    assert not reach[send] >> index[put] & 1
    problems, _ = unordered_accesses(s.workers, s.depends_on, s.reads, s.writes)
    assert any("('recv', 0, 0)" in p for p in problems), problems


def test_flag_layout_matches_the_kernel_text():
    layout = ag.FlagLayout(G=4, N=3)
    words = [layout.arrive(0), layout.target(0), layout.node_arrive(0), layout.landed(0),
             layout.ready(0), layout.sent(), layout.pushed(), layout.forwarded(0),
             layout.finished()]
    assert words == sorted(words) and len(set(words)) == len(words)
    assert layout.ready(11) < layout.sent()
    assert layout.forwarded(2) < layout.finished()
    assert layout.words == layout.finished() + 3
    text = ag.ALLGATHER.text
    for name in ("arrive", "target", "node_arrive", "landed", "ready", "sent", "pushed",
                 "forwarded", "finished", "ctas_before", "launches"):
        assert f"int {name}(" in text, name


def test_plan_and_op_reject_bad_arguments():
    with pytest.raises(ValueError, match="mkrt.allgather"):
        ag.plan(0, 2)
    with pytest.raises(ValueError, match="threads"):
        ag.AllGatherSpec(threads=100)


def test_world_wide_kernel_compiles_for_sm90a_without_spills():
    spec = ag.default_specs()[0]
    build = spec.build(check_spills=True)
    assert build.resources["allgather"].spills == 0
    # the inter-node path is in this build: it posts to the proxy's queue
    assert "post_put_signal" in spec.render()
