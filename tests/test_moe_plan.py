"""MoE dispatch/combine planning on the CPU (mkrt/kernels/moe_plan.py) under realistic and
adversarial routing: every (token, expert) pair computed once by its holder, tokens cross
to a node at most once and only where needed, expert-major landing, the combine adds every
pair once in a fixed order; bad routing is refused; the float64 reference is checked
against a direct dense computation."""

from __future__ import annotations

import numpy as np
import pytest

from mkrt.kernels import moe_plan

WORLDS = [(1, 2), (1, 4), (2, 2), (1, 3), (2, 4), (4, 2)]


def routing(kind, world, tokens, experts, k, seed):
    rng = np.random.default_rng(seed)
    out = []
    for w in range(world):
        t = 0 if (kind == "empty_rank" and w == world - 1) else tokens
        if kind in ("uniform", "empty_rank"):
            ids = np.stack([rng.choice(experts, k, replace=False) for _ in range(t)]) if t else \
                np.zeros((0, k), np.int64)
        elif kind == "zipf":
            p = 1.0 / np.arange(1, experts + 1) ** 1.2
            ids = np.stack([rng.choice(experts, k, replace=False, p=p / p.sum()) for _ in range(t)])
        elif kind == "one_hot_expert":                 # every token picks expert 0 first
            ids = np.stack([np.concatenate([[0], rng.choice(np.arange(1, experts), k - 1, replace=False)])
                            for _ in range(t)])
        else:
            raise ValueError(kind)
        out.append(ids.astype(np.int32))
    return out


CASES = [(n, g, kind, e, k) for n, g in WORLDS
         for kind in ["uniform", "zipf", "one_hot_expert", "empty_rank"]
         for e, k in [(8, 2), (16, 8), (64, 4), (48, 3)] if e % (n * g) == 0]


@pytest.mark.parametrize("nodes,per_node,kind,experts,k", CASES)
def test_plan_routes_each_pair_once_and_crosses_each_node_once(nodes, per_node, kind, experts, k):
    world = nodes * per_node
    ids = routing(kind, world, 37, experts, k, seed=nodes * 10 + per_node)
    p = moe_plan.plan(ids, experts=experts, nodes=nodes, ranks_per_node=per_node)
    assert p.check(ids) == []
    t = p.traffic(hidden=1024)
    assert t["routed"] <= t["broadcast"]
    if nodes == 1:
        assert t["routed"] == 0 and not p.crossings


def test_a_plan_that_drops_a_token_is_reported():
    ids = routing("uniform", 4, 10, 16, 2, seed=1)
    p = moe_plan.plan(ids, experts=16, nodes=2, ranks_per_node=2)
    broken = moe_plan.MoePlan(p.nodes, p.ranks_per_node, p.experts, p.k, p.tokens, p.arrivals,
                              p.crossings[1:], p.forwards, p.combines)
    assert any("reaches nodes" in problem for problem in broken.check(ids))


@pytest.mark.parametrize("bad,match", [
    (lambda ids: [ids[0], ids[1] + 100], "outside"),
    (lambda ids: [ids[0], ids[1].astype(np.float32)], "integers"),
    (lambda ids: [ids[0]], "one per rank"),
    (lambda ids: [np.zeros((3, 9), np.int32), np.zeros((3, 9), np.int32)], "names an expert twice"),
    (lambda ids: [np.stack([[1, 1]] * 3).astype(np.int32), ids[1][:3]], "names an expert twice"),
])
def test_bad_routing_is_refused(bad, match):
    ids = routing("uniform", 2, 3, 8, 2, seed=2)
    with pytest.raises(ValueError, match=match):
        moe_plan.plan(bad(ids), experts=8, nodes=1, ranks_per_node=2)


def test_reference_matches_a_dense_computation():
    rng = np.random.default_rng(3)
    world, experts, k, H, inter = 2, 4, 2, 8, 6
    per_rank = experts // world
    x = [rng.standard_normal((5, H)) for _ in range(world)]
    ids = routing("uniform", world, 5, experts, k, seed=4)
    weights = [rng.random((5, k)).astype(np.float32) for _ in range(world)]
    w1 = [rng.standard_normal((per_rank, 2 * inter, H)) for _ in range(world)]
    w2 = [rng.standard_normal((per_rank, H, inter)) for _ in range(world)]
    got = moe_plan.reference(x, ids, weights, w1, w2)
    all_w1 = np.concatenate(w1)
    all_w2 = np.concatenate(w2)
    for s in range(world):
        for t in range(5):
            want = np.zeros(H)
            for e, wt in zip(ids[s][t], weights[s][t]):
                a = all_w1[e] @ x[s][t]
                want += wt * (all_w2[e] @ (moe_plan.silu(a[:inter]) * a[inter:]))
            assert np.allclose(got[s][t], want)
