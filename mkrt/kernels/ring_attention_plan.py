"""Planning ring attention (pure Python / NumPy, runs without a GPU): which K/V chunk each
rank attends to at each step, which block pairs the causal mask skips, how K/V moves, and
the float64 references the kernel is checked against.

**Sharding.** The sequence of S tokens is cut into 2W chunks (W = world size). Causal
attention uses zigzag sharding: rank r holds chunks r and 2W-1-r of Q, K and V, so every
rank has the same work (an early chunk with little to attend to, paired with a late one
with much). Non-causal attention may use contiguous sharding (chunks 2r and 2r+1).

**Order.** Each rank attends to its own K/V first, then its node peers' (in rank order
after itself), then the other nodes' (node by node after its own): the data that is
already there, or arrives soonest, first.

**Movement.** A rank's K/V chunks go to every rank of its node by peer stores, and once to
each other node, to the rank with the same local index there, which spreads them inside
its node: each K/V chunk crosses to each node at most once.

**Masking.** A (query chunk i, key chunk j) block pair is *full* when j < i, *diagonal*
(causal inside the block) when j == i, and *skipped* when j > i (entirely masked).

**Merging.** Each block pair gives a partial output O and its log-sum-exp L (fp32);
partials merge as O = (e^(L1-M) O1 + e^(L2-M) O2) / (e^(L1-M) + e^(L2-M)), M = max(L1, L2),
L = M + log(e^(L1-M) + e^(L2-M)), never re-rounded to bf16 between steps.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mkrt import checks

FULL, DIAGONAL, SKIPPED = "full", "diagonal", "skipped"


def chunks_of(rank: int, world: int, causal: bool) -> tuple[int, int]:
    """The two sequence chunks (of 2W) rank `rank` holds: zigzag when causal."""
    return (rank, 2 * world - 1 - rank) if causal else (2 * rank, 2 * rank + 1)


def mask_kind(q_chunk: int, k_chunk: int, causal: bool) -> str:
    if not causal or k_chunk < q_chunk:
        return FULL
    return DIAGONAL if k_chunk == q_chunk else SKIPPED


@dataclasses.dataclass(frozen=True)
class RingPlan:
    nodes: int
    ranks_per_node: int
    causal: bool
    order: tuple            # per rank: the source ranks of K/V in the order attended to
    transfers: tuple        # (source rank, destination rank, kind): "store" or "put" or "forward"

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    def pairs(self, rank: int, step: int) -> list[tuple[int, int, str]]:
        """(query chunk, key chunk, mask kind) block pairs of `rank` at `step`."""
        source = self.order[rank][step]
        return [(q, k, mask_kind(q, k, self.causal))
                for q in chunks_of(rank, self.world, self.causal)
                for k in chunks_of(source, self.world, self.causal)]

    def work(self, rank: int) -> float:
        """Blocks of attention a rank computes (a diagonal block counts one half)."""
        weight = {FULL: 1.0, DIAGONAL: 0.5, SKIPPED: 0.0}
        return sum(weight[kind] for step in range(self.world) for *_, kind in self.pairs(rank, step))

    def check(self) -> list[str]:
        problems = []
        W, G = self.world, self.ranks_per_node
        for r in range(W):
            if sorted(self.order[r]) != list(range(W)) or self.order[r][0] != r:
                problems.append(f"rank {r}: attends to {self.order[r]}, not every rank once, own first")
        works = {self.work(r) for r in range(W)}
        if self.causal and len(works) != 1:
            problems.append(f"causal work differs between ranks: {sorted(works)}")
        crossings = [(s, d) for s, d, kind in self.transfers if kind == "put"]
        for s in range(W):
            nodes = [d // G for s2, d in crossings if s2 == s]
            if sorted(nodes) != [n for n in range(self.nodes) if n != s // G]:
                problems.append(f"rank {s}'s K/V crosses to nodes {sorted(nodes)}: not each other node once")
        received = {(s, d) for s, d, _ in self.transfers} | {(r, r) for r in range(W)}
        for r in range(W):
            for s in range(W):
                if (s, r) not in received:
                    problems.append(f"rank {r} never receives rank {s}'s K/V")
        return problems


def plan(nodes: int, ranks_per_node: int, *, causal: bool) -> RingPlan:
    nodes = checks.integer(nodes, "nodes", "ring_attention", low=1, high=32)
    G = checks.integer(ranks_per_node, "ranks_per_node", "ring_attention", low=1, high=64)
    causal = checks.flag(causal, "causal", "ring_attention")
    W = nodes * G
    order, transfers = [], []
    for r in range(W):
        node, local = divmod(r, G)
        peers = [node * G + (local + i) % G for i in range(G)]
        remote = [((node + i) % nodes) * G + (local + j) % G for i in range(1, nodes) for j in range(G)]
        order.append(tuple(peers + remote))
        transfers += [(r, p, "store") for p in peers if p != r]
        for i in range(1, nodes):
            via = ((node + i) % nodes) * G + local
            transfers.append((r, via, "put"))
            transfers += [(r, (via // G) * G + j, "forward") for j in range(G) if (via // G) * G + j != via]
    return RingPlan(nodes, G, causal, tuple(order), tuple(transfers))


# ---- references (float64) ---------------------------------------------------------------

def attention(q, k, v, *, causal: bool, q_offset: int = 0, k_offset: int = 0):
    """(O, LSE) of softmax(q k^T / sqrt(d)) v in float64 for q [B, Sq, Hq, D], k/v
    [B, Sk, Hkv, D] (GQA), positions starting at the offsets; LSE [B, Hq, Sq] (natural log);
    rows with every key masked give O = 0 and LSE = -inf (mkrt.kernels.attention.reference)."""
    from mkrt.kernels.attention import reference
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    return reference(q, k, v, causal=causal, q_offset=q_offset, k_offset=k_offset,
                     dtype=np.float64)


def merge(o1, lse1, o2, lse2):
    """Two partial (O, LSE) over disjoint keys -> the combined (O, LSE)."""
    m = np.maximum(lse1, lse2)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    w1, w2 = np.exp(lse1 - m_safe), np.exp(lse2 - m_safe)
    total = w1 + w2
    safe = np.where(total > 0, total, 1.0)
    scale1 = np.transpose(w1 / safe, (0, 2, 1))[..., None]      # [B, Sq, Hq, 1]
    scale2 = np.transpose(w2 / safe, (0, 2, 1))[..., None]
    lse = np.where(total > 0, m_safe + np.log(safe), -np.inf)
    return o1 * scale1 + o2 * scale2, lse


def ring_reference(q, k, v, *, nodes: int, ranks_per_node: int, causal: bool):
    """Every rank's (O, LSE) for its two chunks, computed the way the ring kernel does:
    shard, attend chunk by chunk in the plan's order, skip masked pairs, merge in fp64.
    Returns per rank [(O, LSE) of chunk a, (O, LSE) of chunk b] and the chunk ids."""
    p = plan(nodes, ranks_per_node, causal=causal)
    W = p.world
    S = q.shape[1]
    if S % (2 * W):
        raise ValueError(f"mkrt.ring_attention: sequence {S} is not a multiple of 2 x world ({2 * W})")
    c = S // (2 * W)
    chunk = lambda x, i: x[:, i * c:(i + 1) * c]      # noqa: E731
    results = []
    for r in range(W):
        mine = []
        for qc in chunks_of(r, W, causal):
            o = lse = None
            for step in range(W):
                for kc in chunks_of(p.order[r][step], W, causal):
                    if mask_kind(qc, kc, causal) == SKIPPED:
                        continue
                    part = attention(chunk(q, qc), chunk(k, kc), chunk(v, kc), causal=causal,
                                     q_offset=qc * c, k_offset=kc * c)
                    o, lse = part if o is None else merge(o, lse, *part)
            mine.append((qc, o, lse))
        results.append(mine)
    return results
