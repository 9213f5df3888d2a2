"""Planning MoE expert parallelism (pure Python / NumPy, runs without a GPU): where every
routed token goes, in which order it lands, and how its results come back.

World: N nodes x G ranks; E experts, E / W on each rank (rank w holds experts
w*E/W .. (w+1)*E/W - 1). Each rank holds T_w tokens, their top-k expert ids and weights.

**Dispatch** (routed, hierarchical): a token of rank (n, l) goes
  * to every rank of its own node that holds one of its experts (peer stores), and
  * once to each other node that holds one of its experts, to that node's rank with the
    same local index l (through the proxy), which forwards it to the ranks of its node
    that hold the experts.
So a token crosses to a node at most once, and only to nodes that need it (the reference
sends every node's whole token buffer to every other node).

**Landing order** at a rank: expert-major (its local experts in order), inside an expert
by (source rank, token index): a fixed order, the same every call, that the grouped GEMM
walks as one contiguous block per expert.

**Combine**: every (token, expert) row is weighted by its router weight in fp32; the rows
of one token from experts of one node are summed on that node, in expert order, by the
rank that received the token for the node (its same-local-index rank, or the source itself
for its own node); one partial per (token, node) crosses back; the source adds its nodes'
partials in node order. Fixed orders throughout: bit-identical results between calls.

:func:`plan` gives all of it as arrays, and :meth:`MoePlan.check` proves: every (token,
expert) pair is computed exactly once by the rank that holds the expert; every token
crosses to each node at most once and only if needed; every landing position is used once;
the combine adds each pair exactly once. :func:`reference` is the float64 forward.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mkrt import checks
from mkrt.kernels.schedule import Schedule


@dataclasses.dataclass(frozen=True)
class Arrival:
    """Rows that land at rank `rank`, expert-major: row i is token ``tokens[i]`` of rank
    ``sources[i]`` for local expert ``experts[i]`` (weight ``weights[i]``)."""

    rank: int
    experts: np.ndarray         # global expert ids, nondecreasing
    sources: np.ndarray         # source rank of each row
    tokens: np.ndarray          # token index at the source
    slots: np.ndarray           # which of the token's k choices (0..k-1)
    weights: np.ndarray         # router weight (fp32)
    expert_offsets: np.ndarray  # [E_local + 1]: rows of local expert j are offsets[j]..[j+1]


@dataclasses.dataclass(frozen=True)
class MoePlan:
    nodes: int
    ranks_per_node: int
    experts: int
    k: int
    tokens: tuple               # tokens per rank
    arrivals: tuple             # Arrival per rank
    crossings: tuple            # (source rank, token, destination node): each inter-node copy
    forwards: tuple             # (via rank, source rank, token, destination rank) inside a node
    combines: tuple             # (source, token, node, summing rank, ((expert, slot), ...)):
                                # one weighted partial per token and node, experts in order

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def experts_per_rank(self) -> int:
        return self.experts // self.world

    def holder(self, expert: int) -> int:
        return expert // self.experts_per_rank

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def traffic(self, hidden: int, itemsize: int = 2) -> dict[str, int]:
        """Bytes of token rows between nodes: routed (this plan), the routed minimum (the
        same: a token crosses to a node once, only where needed) and broadcast (every
        node's tokens to every other node, as the reference does)."""
        row = hidden * itemsize
        routed = len(self.crossings) * row
        total = sum(self.tokens)
        broadcast = total * (self.nodes - 1) * row
        return {"routed": routed, "routed_minimum": routed, "broadcast": broadcast}

    def check(self, topk_ids: list[np.ndarray]) -> list[str]:
        """Problems (empty: fine) of this plan for the routing `topk_ids` it was made from."""
        problems = []
        G = self.ranks_per_node
        wanted = set()
        for s, ids in enumerate(topk_ids):
            for t in range(ids.shape[0]):
                for j in range(ids.shape[1]):
                    wanted.add((s, t, int(ids[t, j]), j))
        computed = []
        for arrival in self.arrivals:
            for e, s, t, j in zip(arrival.experts, arrival.sources, arrival.tokens, arrival.slots):
                if self.holder(int(e)) != arrival.rank:
                    problems.append(f"rank {arrival.rank} got a row for expert {e} it does not hold")
                computed.append((int(s), int(t), int(e), int(j)))
            order = list(zip(arrival.experts.tolist(), arrival.sources.tolist(), arrival.tokens.tolist(),
                             arrival.slots.tolist()))
            if order != sorted(order):
                problems.append(f"rank {arrival.rank}: rows are not expert-major in (source, token) order")
            first = arrival.rank * self.experts_per_rank
            for j in range(self.experts_per_rank):
                lo, hi = arrival.expert_offsets[j], arrival.expert_offsets[j + 1]
                if not np.all(arrival.experts[lo:hi] == first + j):
                    problems.append(f"rank {arrival.rank}: expert {first + j} rows are not at their offsets")
        if len(computed) != len(set(computed)):
            problems.append("a (token, expert) pair is computed twice")
        if set(computed) != wanted:
            problems.append(f"{len(wanted - set(computed))} (token, expert) pairs are never computed")
        crossings = [(s, t, d) for s, t, d in self.crossings]
        if len(crossings) != len(set(crossings)):
            problems.append("a token crosses to a node twice")
        for s, t, d in crossings:
            needed = {self.node_of(self.holder(int(e))) for e in topk_ids[s][t]}
            if d == self.node_of(s) or d not in needed:
                problems.append(f"token {t} of rank {s} crosses to node {d}, which needs none of it")
        for s, ids in enumerate(topk_ids):
            for t in range(ids.shape[0]):
                needed = {self.node_of(self.holder(int(e))) for e in ids[t]} - {self.node_of(s)}
                got = {d for (s2, t2, d) in crossings if s2 == s and t2 == t}
                if got != needed:
                    problems.append(f"token {t} of rank {s} reaches nodes {sorted(got)}, needs {sorted(needed)}")
        summed = []
        for s, t, node, at, pairs in self.combines:
            expected_at = s if node == self.node_of(s) else node * G + s % G
            if at != expected_at:
                problems.append(f"token {t} of rank {s}: node {node}'s partial summed on rank {at}")
            if list(pairs) != sorted(pairs):
                problems.append(f"token {t} of rank {s}: node {node}'s partial not in expert order")
            for e, j in pairs:
                if self.node_of(self.holder(e)) != node:
                    problems.append(f"token {t} of rank {s}: expert {e} summed on the wrong node")
                summed.append((s, t, e, j))
        if sorted(summed) != sorted(wanted):
            problems.append("the combine does not add every (token, expert) pair exactly once")
        for via, s, t, d in self.forwards:
            if self.node_of(via) != self.node_of(d) or via % G != s % G:
                problems.append(f"forward of token {t} of rank {s} through rank {via} to {d} is not "
                                "from the same-local-index rank of the node")
        return problems


def plan(topk_ids: list, *, experts: int, nodes: int, ranks_per_node: int,
         topk_weights: list | None = None) -> MoePlan:
    """The dispatch and combine of one call. ``topk_ids[w]``: rank w's [T_w, k] expert ids
    (int), ``topk_weights[w]``: its [T_w, k] weights (default: 1/k)."""
    area = "moe"
    nodes = checks.integer(nodes, "nodes", area, low=1, high=32)
    ranks_per_node = checks.integer(ranks_per_node, "ranks_per_node", area, low=1, high=64)
    world = nodes * ranks_per_node
    experts = checks.integer(experts, "experts", area, low=1)
    if experts % world:
        raise ValueError(f"mkrt.moe: {experts} experts do not divide over {world} ranks")
    if len(topk_ids) != world:
        raise ValueError(f"mkrt.moe: topk_ids has {len(topk_ids)} entries, one per rank expected ({world})")
    ids = [np.asarray(x) for x in topk_ids]
    k = ids[0].shape[1] if ids[0].ndim == 2 else -1
    for w, x in enumerate(ids):
        if x.ndim != 2 or x.shape[1] != k or not np.issubdtype(x.dtype, np.integer):
            raise ValueError(f"mkrt.moe: topk_ids[{w}] is {x.shape} {x.dtype}; expected [T, {k}] integers")
        if x.size and (x.min() < 0 or x.max() >= experts):
            raise ValueError(f"mkrt.moe: topk_ids[{w}] holds expert ids outside [0, {experts})")
        if x.size and np.any(np.sort(x, axis=1)[:, 1:] == np.sort(x, axis=1)[:, :-1]):
            raise ValueError(f"mkrt.moe: topk_ids[{w}] names an expert twice for one token")
    if not 1 <= k <= 8:
        raise ValueError(f"mkrt.moe: k={k}; 1 to 8 experts per token")
    weights = ([np.full(x.shape, 1.0 / k, np.float32) for x in ids] if topk_weights is None
               else [np.asarray(w, np.float32) for w in topk_weights])
    per_rank = experts // world
    G = ranks_per_node
    rows: list[list] = [[] for _ in range(world)]
    crossings, forwards, combines = [], [], []
    for s, x in enumerate(ids):
        node = s // G
        for t in range(x.shape[0]):
            holders = sorted({int(e) // per_rank for e in x[t]})
            by_node: dict[int, list] = {}
            for j in range(k):
                e = int(x[t, j])
                by_node.setdefault(e // per_rank // G, []).append((e, j))
            for d, pairs in sorted(by_node.items()):
                at = s if d == node else d * G + s % G
                combines.append((s, t, d, at, tuple(sorted(pairs))))
            for d in sorted({h // G for h in holders} - {node}):
                crossings.append((s, t, d))
                via = d * G + s % G
                for h in holders:
                    if h // G == d and h != via:
                        forwards.append((via, s, t, h))
            for j in range(k):
                e = int(x[t, j])
                rows[e // per_rank].append((e, s, t, j, float(weights[s][t, j])))
    arrivals = []
    for r in range(world):
        rs = sorted(rows[r])
        experts_col = np.array([e for e, *_ in rs], np.int64)
        offsets = np.searchsorted(experts_col, r * per_rank + np.arange(per_rank + 1), side="left")
        arrivals.append(Arrival(r, experts_col, np.array([s for _, s, *_ in rs], np.int64),
                                np.array([t for _, _, t, *_ in rs], np.int64),
                                np.array([j for *_, j, _ in rs], np.int64),
                                np.array([w for *_, w in rs], np.float32), offsets))
    return MoePlan(nodes, ranks_per_node, experts, k, tuple(x.shape[0] for x in ids), tuple(arrivals),
                   tuple(crossings), tuple(forwards), tuple(combines))


def silu(x):
    return x / (1.0 + np.exp(-x))


def reference(x: list, topk_ids: list, topk_weights: list, w1: list, w2: list) -> list:
    """Every rank's y [T, H] in float64: y = sum over the token's k experts of weight *
    w2_e @ (SiLU(gate) * up), [gate; up] = w1_e @ x. ``w1[w]``: rank w's [E_local, 2I, H],
    ``w2[w]``: [E_local, H, I]."""
    world = len(x)
    per_rank = w1[0].shape[0]
    out = []
    for s in range(world):
        xs = np.asarray(x[s], np.float64)
        y = np.zeros_like(xs)
        for t in range(xs.shape[0]):
            for e, weight in zip(topk_ids[s][t], topk_weights[s][t]):
                holder, local = divmod(int(e), per_rank)
                a = np.asarray(w1[holder][local], np.float64) @ xs[t]
                inter = a.shape[0] // 2
                h = silu(a[:inter]) * a[inter:]
                y[t] += float(weight) * (np.asarray(w2[holder][local], np.float64) @ h)
        out.append(y)
    return out


def schedule(nodes: int, per_node: int, *, epochs: int = 2) -> Schedule:
    """mkrt/kernels/moe.py's protocol (moe_dispatch, the GEMMs, moe_combine) as a schedule.
    Every rank may hold experts every other rank routes to, so every exchange is present.

    Locations: ("counts", r, s) (rank s's counts row at r), ("routes_out", r),
    ("pack_slot", r), ("outbox", r), ("inbox", r, m) and ("routes_in", r, m) (what rank
    (m, local) sent r), ("received", h, w) (rows that rank w wrote at holder h, sources
    included), ("results", h), ("back", s, h) (rows h sent back to s), ("weights_out", r),
    ("weights_in", g, m), ("partial_out", g, m), ("partial_in", s, m).

    Workers per rank r: ``("cta0", r)`` (CTA 0's own steps), ``("ctas", r)`` (the steps
    every CTA runs; CTA 0 joins them after its own) and ``("queue", r)`` (the proxy serves
    r's commands in order)."""
    G, N = per_node, nodes
    W = N * G
    steps = Schedule()
    task = steps.task

    def node_ranks(n):
        return [n * G + p for p in range(G)]

    def arrival(s, r, e):
        """The task after which rank r knows rank s began call e."""
        return ("arrive", s, e) if s // G == r // G else ("arrive_signal", s, r, e)

    def counts_in(s, r, e):
        return ("counts", s, e) if s // G == r // G else ("counts_put", s, r, e)

    for e in range(1, epochs + 1):
        for r in range(W):
            n, l = divmod(r, G)
            others = [m for m in range(N) if m != n]
            cta0, ctas, queue = ("cta0", r), ("ctas", r), ("queue", r)
            # -- dispatch, CTA 0: arrive, rank entries, counts
            after_last = [("final", r, e - 1)] if e > 1 else []
            task(cta0, ("arrive", r, e), after_last)
            for s in range(W):
                if s // G != n:
                    task(queue, ("arrive_signal", r, s, e), [("arrive", r, e)])
            task(cta0, ("rank_entries", r, e), write=[("routes_out", r), ("pack_slot", r)])
            task(cta0, ("wait_arrive", r, e), [arrival(s, r, e) for s in range(W)])
            task(cta0, ("counts", r, e), write=[("counts", p, r) for p in node_ranks(n)])
            for s in range(W):
                if s // G != n:
                    task(queue, ("counts_put", r, s, e), [("counts", r, e)],
                         read=[("counts", r, r)], write=[("counts", s, r)])
            # -- dispatch, every CTA: pack and send rows, place them, forward arrivals
            if N > 1:
                task(ctas, ("pack", r, e), after_last + [("rank_entries", r, e)],
                     read=[("pack_slot", r)], write=[("outbox", r)])
                dsts = [m * G + l for m in others]
                # the last CTA to finish packing (CTA 0 among them, after its counts) posts
                task(ctas, ("post_rows", r, e), [("counts", r, e)] + [arrival(d, r, e) for d in dsts])
                for d in dsts:
                    task(queue, ("rows_put", r, d, e), [("post_rows", r, e)],
                         read=[("outbox", r), ("routes_out", r)],
                         write=[("inbox", d, n), ("routes_in", d, n)])
            task(ctas, ("wait_counts", r, e), after_last + [counts_in(s, r, e) for s in range(W)])
            counts_row = [("counts", r, s) for s in range(W)]
            task(ctas, ("place_own", r, e), read=counts_row,
                 write=[("received", h, r) for h in node_ranks(n)])
            for m in others:
                src = m * G + l
                task(ctas, ("forward", r, m, e), [("rows_put", src, r, e)],
                     read=counts_row + [("inbox", r, m), ("routes_in", r, m)],
                     write=[("received", h, (r, m)) for h in node_ranks(n)])
            task(ctas, ("rows_ready", r, e))
            task(ctas, ("wait_rows", r, e), [("rows_ready", p, e) for p in node_ranks(n)])
            # -- the expert GEMMs on the rank's stream
            rows_here = [("received", r, w) for w in node_ranks(n)] + \
                        [("received", r, (w, m)) for w in node_ranks(n) for m in range(N) if m != n]
            task(ctas, ("gemm", r, e), read=rows_here, write=[("results", r)])
            # -- combine, CTA 0: results readable, weights out
            task(cta0, ("results_ready", r, e), [("gemm", r, e)])
            if N > 1:
                task(cta0, ("weights", r, e), write=[("weights_out", r)])
                for m in others:
                    d = m * G + l
                    task(queue, ("weights_put", r, d, e), [("weights", r, e)],
                         read=[("weights_out", r)], write=[("weights_in", d, n)])
            # -- combine, every CTA
            task(ctas, ("push_back", r, e), read=[("results", r)] + rows_here,
                 write=[("back", s, r) for s in node_ranks(n)])
            task(ctas, ("back_ready", r, e))
            for m in others:
                src = m * G + l
                task(ctas, ("sums", r, m, e),
                     [("results_ready", p, e) for p in node_ranks(n)] + [("weights_put", src, r, e)],
                     read=counts_row + [("routes_in", r, m), ("weights_in", r, m)]
                     + [("results", p) for p in node_ranks(n)],
                     write=[("partial_out", r, m)])
                task(queue, ("sums_put", r, src, e), [("sums", r, m, e)],
                     read=[("partial_out", r, m)], write=[("partial_in", src, n)])
            task(ctas, ("final", r, e),
                 [("back_ready", p, e) for p in node_ranks(n)]
                 + [("sums_put", m * G + l, r, e) for m in others],
                 read=[("back", r, p) for p in node_ranks(n)] + [("partial_in", r, m) for m in others]
                 + [("pack_slot", r), ("routes_out", r)])
    return steps
