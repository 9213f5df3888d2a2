"""GEMM+ReduceScatter planning on the CPU: worlds 1x2 to 4x8, every tile reduced once,
every node sum sent once and only to the node that keeps its rows (so every byte crosses
between two nodes at most once), each rank waiting for exactly its rows' tiles, no wait
cycle; shapes the fused kernel cannot take are refused or fall back."""

from __future__ import annotations

import pytest

from mkrt.kernels.gemm_allreduce_plan import plan

WORLDS = [(1, 2), (1, 4), (1, 8), (2, 2), (2, 3), (2, 4), (3, 1), (3, 2), (4, 2), (4, 8)]


@pytest.mark.parametrize("nodes,per_node", WORLDS)
@pytest.mark.parametrize("m_tiles,n", [(1, 256), (3, 1000), (8, 4096)])
@pytest.mark.parametrize("reduce_ctas", [1, 3, 16])
def test_scatter_plan_sends_each_tile_once_to_its_keeper(nodes, per_node, m_tiles, n, reduce_ctas):
    world = nodes * per_node
    m = 128 * nodes * m_tiles * per_node          # whole tiles per node, rows per rank integral
    p = plan(m, n, 128, nodes=nodes, ranks_per_node=per_node, ctas=32, fuse=True,
             reduce_ctas=reduce_ctas, collective="reducescatter")
    assert p.fused and p.scatter and p.kept_rows * world == m
    assert p.check() == []
    # All-reduce sends every tile to every other node; reduce-scatter 1/N of that per pair.
    if nodes > 1:
        allreduce = plan(m, n, 128, nodes=nodes, ranks_per_node=per_node, ctas=32, fuse=True,
                         reduce_ctas=reduce_ctas)
        ratio = p.traffic()["network_per_node"] / allreduce.traffic()["network_per_node"]
        assert ratio == pytest.approx(1 / nodes, rel=0.05)
    # The ranks' kept tiles cover C: each tile row is kept by the ranks whose rows it holds.
    covered = set()
    for rank in range(world):
        covered |= set(p.kept_tiles(rank))
    assert covered == set(range(p.tiles))


def test_a_broken_scatter_plan_is_reported(monkeypatch):
    p = plan(1024, 512, 128, nodes=2, ranks_per_node=2, ctas=32, fuse=True, reduce_ctas=2,
             collective="reducescatter")
    monkeypatch.setattr(type(p), "destinations", lambda self, node, tile: [
        d for d in range(self.nodes) if d != node])        # the all-reduce's: every node
    assert any("not sent exactly once" in problem for problem in p.check())


@pytest.mark.parametrize("m,nodes,per_node,fuse,expect", [
    (301, 1, 2, None, "must be a multiple of the world size 2"),
    (200, 2, 2, True, "multiple of 128"),
])
def test_shapes_the_kernel_cannot_take_are_refused(m, nodes, per_node, fuse, expect):
    with pytest.raises(ValueError, match=expect):
        plan(m, 512, 64, nodes=nodes, ranks_per_node=per_node, ctas=32, fuse=fuse,
             collective="reducescatter")


def test_node_shards_that_split_a_tile_take_the_unfused_path():
    p = plan(200, 512, 64, nodes=2, ranks_per_node=2, ctas=32, collective="reducescatter")
    assert not p.fused and "not whole" in p.reason


def test_the_op_checks_shapes_before_anything_runs():
    import mkrt
    world = mkrt.init(emulate="2x2")
    try:
        op = mkrt.GemmReduceScatter(world)
        assert op.out_shape(512, 100) == (128, 100)
        with pytest.raises(ValueError, match="m=510 must be a multiple of the world size 4"):
            op.out_shape(510, 100)
    finally:
        world.close()
