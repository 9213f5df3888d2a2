"""Ring attention planning and numerics on the CPU (mkrt/kernels/ring_attention_plan.py):
every rank attends to every K/V shard once (own first), causal zigzag work equal on every
rank, each K/V shard crossing to each other node once, and the ring's chunk-by-chunk LSE
merge equal to full attention in float64 (causal and not, GQA, worlds 1x1 to 2x4)."""

from __future__ import annotations

import numpy as np
import pytest

from mkrt.kernels import ring_attention_plan as ring

WORLDS = [(1, 1), (1, 2), (1, 4), (2, 2), (2, 3), (3, 1), (2, 4), (4, 8)]


@pytest.mark.parametrize("nodes,per_node", WORLDS)
@pytest.mark.parametrize("causal", [True, False])
def test_plan_covers_every_shard_once_with_equal_causal_work(nodes, per_node, causal):
    p = ring.plan(nodes, per_node, causal=causal)
    assert p.check() == []
    if causal:
        W = p.world
        # (2W)^2 block pairs: W(2W-1) full, 2W diagonal (half), W(2W-1) skipped; zigzag
        # gives every rank the same 2W blocks of work
        assert all(p.work(r) == pytest.approx(2 * W) for r in range(W))
        skipped = sum(kind == ring.SKIPPED for r in range(W) for s in range(W)
                      for *_, kind in p.pairs(r, s))
        assert skipped == W * (2 * W - 1)


def test_contiguous_causal_sharding_would_be_unbalanced():
    """Why zigzag: with contiguous chunks the last rank has far more work than the first."""
    W = 4
    work = []
    for r in range(W):
        mine = (2 * r, 2 * r + 1)
        work.append(sum({ring.FULL: 1.0, ring.DIAGONAL: 0.5}.get(ring.mask_kind(q, k, True), 0.0)
                        for q in mine for k in range(2 * W)))
    assert max(work) > 3 * min(work)


@pytest.mark.parametrize("nodes,per_node", [(1, 1), (1, 2), (2, 2), (1, 3)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
def test_ring_merge_equals_full_attention(nodes, per_node, causal, heads):
    rng = np.random.default_rng(nodes * 7 + per_node)
    hq, hkv = heads
    W = nodes * per_node
    S, D = 8 * W, 16
    q = rng.standard_normal((2, S, hq, D))
    k = rng.standard_normal((2, S, hkv, D))
    v = rng.standard_normal((2, S, hkv, D))
    full_o, full_lse = ring.attention(q, k, v, causal=causal)
    c = S // (2 * W)
    for mine in ring.ring_reference(q, k, v, nodes=nodes, ranks_per_node=per_node, causal=causal):
        for chunk, o, lse in mine:
            rows = slice(chunk * c, (chunk + 1) * c)
            assert np.allclose(o, full_o[:, rows], atol=1e-12)
            assert np.allclose(lse, full_lse[:, :, rows], atol=1e-12)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="multiple of 2 x world"):
        ring.ring_reference(np.zeros((1, 6, 2, 4)), np.zeros((1, 6, 2, 4)), np.zeros((1, 6, 2, 4)),
                            nodes=1, ranks_per_node=2, causal=True)
    with pytest.raises(ValueError, match="not a multiple of 2 key heads"):
        ring.attention(np.zeros((1, 4, 3, 4)), np.zeros((1, 4, 2, 4)), np.zeros((1, 4, 2, 4)),
                       causal=False)
    with pytest.raises(TypeError, match="causal"):
        ring.plan(1, 2, causal="yes")
