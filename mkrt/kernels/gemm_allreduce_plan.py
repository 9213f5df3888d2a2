"""Planning GEMM+AllReduce (pure Python, runs without a GPU): tiles, owners, the role
split, fused or not, and the schedule checker that proves a plan cannot stall.

Output tile t (``BLOCK_M x BLOCK_N``) is owned by local rank ``t % G`` of every node: it
node-reduces t, sends the node sum to the same local rank of every other node, adds the
nodes' sums in node order and delivers t to its node. :meth:`Plan.schedule` writes that
out as workers and dependencies; :meth:`Plan.check` plays it (every tile reduced and sent
exactly once, no wait cycle).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mkrt.controller.cost import Ceilings, default_reduce_ctas, fitted_times, predict_times
from mkrt.kernels import gemm as gemm_module
from mkrt.kernels.schedule import find_stall

#: the compute role's output tile (the engine's 128 x 256 configuration)
BLOCK_M, BLOCK_N = 128, 256
#: tile widths the fused kernel builds (BLOCK_N the default; narrower tiles give a reduced
#: compute grid more tiles to share)
TILE_WIDTHS = (128, 192, 256)


def check_block_n(block_n, area: str = "gemm_allreduce") -> int | None:
    """`block_n` as an int if it is a tile width the fused kernel builds, None (the GEMM
    rule chooses per shape) as None; ValueError otherwise."""
    if block_n is None:
        return None
    if not isinstance(block_n, (int, np.integer)) or isinstance(block_n, bool) \
            or block_n not in TILE_WIDTHS:
        raise ValueError(f"mkrt.{area}: block_n={block_n!r}; expected one of {TILE_WIDTHS} "
                         "or None (chosen per shape)")
    return int(block_n)


@dataclasses.dataclass(frozen=True)
class FlagLayout:
    """Index of every flag word of a rank (mirrors the template's struct Layout)."""

    G: int
    nodes: int
    slots: int
    tiles: int

    def arrive(self, p): return p
    def target(self, p): return self.G + p
    def node_arrive(self, n): return 2 * self.G + n
    def partial(self, src, slot): return 2 * self.G + self.nodes + src * self.slots + slot
    def inter(self, node, slot): return 2 * self.G + self.nodes + (self.G + node) * self.slots + slot
    def final_tile(self, t): return 2 * self.G + self.nodes + (self.G + self.nodes) * self.slots + t

    @property
    def words(self) -> int:
        return self.final_tile(self.tiles) + 3



@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything one call does: tiles, owners, role split, traffic, fused or not."""

    dtype: str              # "bf16" or "f16"
    b_layout: str           # "kn" or "nk"
    block_m: int            # output tile of the compute role
    block_n: int
    stages: int             # pipeline stages of the GEMM engine
    m: int
    n: int
    k: int
    nodes: int
    ranks_per_node: int
    ctas: int               # per rank
    reduce_ctas: int
    fused: bool
    reason: str
    predicted_fused_us: float
    predicted_unfused_us: float
    send_batch: int = 1     # owned slots per group: one put between nodes per group
    collective: str = "allreduce"   # or "reducescatter": rank w keeps rows of C only

    @property
    def scatter(self) -> bool:
        return self.collective == "reducescatter"

    @property
    def whole_node_tiles(self) -> bool:
        """Whether the reduce-scatter kernel can run this shape: one node, or each node's
        rows whole tiles (an all-reduce always can)."""
        return not self.scatter or self.nodes == 1 or (self.m // self.nodes) % self.block_m == 0

    @property
    def kept_rows(self) -> int:
        """Rows of C each rank ends with (reduce-scatter: M / world size)."""
        return self.m // (self.nodes * self.G) if self.scatter else self.m

    def keeper(self, row: int) -> int:
        """The world rank that ends with `row` of C (reduce-scatter)."""
        return row // self.kept_rows

    def tile_node(self, tile: int) -> int:
        """Reduce-scatter with several nodes: the node that keeps `tile`'s rows."""
        return (tile // self.tiles_n) * self.block_m // (self.kept_rows * self.G)

    def kept_tiles(self, rank: int) -> list[int]:
        """Tiles the final result of `rank` comes from (all of them for an all-reduce)."""
        if not self.scatter:
            return list(range(self.tiles))
        row0 = rank * self.kept_rows
        first, last = row0 // self.block_m, (row0 + self.kept_rows - 1) // self.block_m
        return list(range(first * self.tiles_n, (last + 1) * self.tiles_n))

    def runs(self, group: list[int]) -> list[list[int]]:
        """A group's tiles in runs of one keeping node (reduce-scatter), else the group."""
        if not self.scatter or self.nodes == 1:
            return [group]
        out = []
        for t in group:
            if out and self.tile_node(out[-1][0]) == self.tile_node(t):
                out[-1].append(t)
            else:
                out.append([t])
        return out

    @property
    def G(self) -> int:
        return self.ranks_per_node

    @property
    def tiles_m(self) -> int:
        return -(-self.m // self.block_m)

    @property
    def tiles_n(self) -> int:
        return -(-self.n // self.block_n)

    @property
    def tiles(self) -> int:
        return self.tiles_m * self.tiles_n

    @property
    def slots(self) -> int:
        return -(-self.tiles // self.G)

    @property
    def compute_ctas(self) -> int:
        return self.ctas - self.reduce_ctas

    @property
    def flags(self) -> FlagLayout:
        return FlagLayout(self.G, self.nodes, self.slots, self.tiles)

    @property
    def tile_bytes(self) -> int:
        return self.block_m * self.block_n * np.dtype(np.float16).itemsize

    def owner(self, tile: int) -> int:
        """Local index (in every node) of the rank that reduces `tile`."""
        return tile % self.G

    def owned(self, local: int) -> list[int]:
        return list(range(local, self.tiles, self.G))

    def groups(self, local: int, cta: int) -> list[list[int]]:
        """Tiles reduce CTA `cta` of local rank `local` handles, group by group (one put each)."""
        owned = self.owned(local)
        starts = range(cta * self.send_batch, len(owned), self.reduce_ctas * self.send_batch)
        return [owned[first:first + self.send_batch] for first in starts]

    def traffic(self) -> dict[str, int]:
        """Bytes one call moves per rank (partials and final tiles) and per node (network)."""
        partials = self.tiles * self.tile_bytes * (self.G - 1) // self.G
        if self.scatter:
            # Final rows go to their keeper only; a node sends what other nodes keep.
            gather = len(self.owned(0)) * self.tile_bytes * (self.G - 1) // self.G
            network = self.tiles * self.tile_bytes * (self.nodes - 1) // self.nodes
        else:
            gather = len(self.owned(0)) * self.tile_bytes * (self.G - 1)
            network = self.tiles * self.tile_bytes * (self.nodes - 1)
        return {"intra_partials_per_rank": partials, "intra_gather_per_rank": gather,
                "network_per_node": network, "network_minimum_per_node": network}

    def schedule(self):
        """(workers, depends_on) of one call on every rank, for :func:`find_stall`.

        Compute CTAs never wait. Reduce CTA q of a rank takes its owned tiles in groups
        (:meth:`groups`) and node-reduces them; with several nodes its proxy sends each
        group to every other node and a second pass adds the nodes' sums; finally every
        rank's reduce CTAs wait for its whole C.

        The kernel hands these tasks out from a queue (mkrt/kernels/device/roles.py): any
        free CTA takes the next one, every pass-1 task before any pass-2 task, and a role
        with work left always keeps a CTA. The round-robin assignment here is one way the
        queue can hand them out; a stall free for it and for every interleaving of the
        queue's order rests on the same two facts: compute never waits, and each task
        waits only for tasks earlier in queue order or for compute.
        """
        workers: dict = {}
        depends: dict = {}
        R, G = self.reduce_ctas, self.G
        for node in range(self.nodes):
            for local in range(G):
                rank = node * G + local
                for c in range(self.compute_ctas):
                    workers[("compute", rank, c)] = [("partial", rank, t)
                                                     for t in range(c, self.tiles, self.compute_ctas)]
                sends = []
                for q in range(R):
                    groups = self.groups(local, q)
                    tasks = []
                    for group in groups:
                        for t in group:
                            tasks.append(("node_sum", node, t))
                            depends[("node_sum", node, t)] = [("partial", node * G + src, t)
                                                             for src in range(G)]
                        for run in self.runs(group):
                            for dest in self.destinations(node, run[0]):
                                send = ("send", node, run[0], dest)
                                sends.append(send)
                                depends[send] = [("node_sum", node, t) for t in run]
                    if self.nodes > 1:
                        for group in groups:
                            for run in self.runs(group):
                                if self.scatter and self.tile_node(run[0]) != node:
                                    continue
                                for t in run:
                                    tasks.append(("final", node, t))
                                    depends[("final", node, t)] = [("node_sum", node, t)] + [
                                        ("send", other, run[0], node)
                                        for other in range(self.nodes) if other != node]
                    kept = self.kept_tiles(rank)[q::R]
                    tasks += [("result", rank, t) for t in kept]
                    for t in kept:
                        depends[("result", rank, t)] = [
                            ("final", node, t) if self.nodes > 1 else ("node_sum", node, t)]
                    workers[("reduce", rank, q)] = tasks
                workers[("proxy", rank)] = sends
        return workers, depends

    def destinations(self, node: int, tile: int) -> list[int]:
        """Nodes that `node` sends the node sum of `tile` to (a run starting at it)."""
        if self.scatter:
            keeper = self.tile_node(tile)
            return [] if keeper == node else [keeper]
        return [dest for dest in range(self.nodes) if dest != node]

    def _run_starting_at(self, tile: int) -> list[int]:
        local = self.owner(tile)
        return next(run for q in range(self.reduce_ctas) for g in self.groups(local, q)
                    for run in self.runs(g) if run[0] == tile)

    def check(self) -> list[str]:
        """Problems with this plan (empty: fine): exactly-once reduction and sends, no stall."""
        problems = []
        workers, depends = self.schedule()
        tasks = [t for ts in workers.values() for t in ts]
        for node in range(self.nodes):
            sums = sorted(t[2] for t in tasks if t[0] == "node_sum" and t[1] == node)
            if sums != list(range(self.tiles)):
                problems.append(f"node {node}: tiles are not node-reduced exactly once")
            for dest in range(self.nodes):
                if dest == node:
                    continue
                sent = []
                for task in tasks:
                    if task[0] == "send" and task[1] == node and task[3] == dest:
                        sent += self._run_starting_at(task[2])
                wanted = [t for t in range(self.tiles) if not self.scatter or self.tile_node(t) == dest]
                if sorted(sent) != wanted:
                    problems.append(f"node {node} -> {dest}: tiles not sent exactly once "
                                    "(or sent where they are not kept)")
        for rank in range(self.nodes * self.G):
            got = sorted(t[2] for t in tasks if t[0] == "result" and t[1] == rank)
            if got != self.kept_tiles(rank):
                problems.append(f"rank {rank}: does not wait for every tile of its C exactly once")
        if self.scatter:
            for t in range(self.tiles):
                row0 = (t // self.tiles_n) * self.block_m
                rows = range(row0, min(row0 + self.block_m, self.m))
                keepers = {self.keeper(r) for r in rows}
                if self.nodes > 1 and len({k // self.G for k in keepers}) > 1:
                    problems.append(f"tile {t}: its rows are kept on two nodes")
        try:
            stall = find_stall(workers, depends)
        except ValueError as error:          # a wait on work nobody does
            problems.append(str(error))
            return problems
        if stall:
            problems.append(f"wait cycle: {len(stall)} workers stuck, e.g. {stall[:3]}")
        return problems


def plan(m: int, n: int, k: int, *, nodes: int, ranks_per_node: int, ctas: int,
         dtype: str = "bf16", b_layout: str = "kn", reduce_ctas: int | None = None,
         fuse: bool | None = None, sms_per_gpu: int = 132, ranks_per_gpu: int = 1,
         send_bytes: int = 1 << 20, ceilings: Ceilings = Ceilings(),
         collective: str = "allreduce", block_n: int | None = BLOCK_N) -> Plan:
    """Plan one shape on a world; ``fuse=None`` lets the cost model decide. ``block_n``:
    the compute role's tile width (128, 192 or 256; tiles are BLOCK_M rows); None: the GEMM
    engine's rule chooses it for the compute CTAs of the default role split
    (:func:`mkrt.kernels.gemm_rule.fused_tile_width`; not the default: measured, it loses
    on most multi-node shapes, experiments/notes/gemm_allreduce.md).

    ``send_bytes``: about how much one put between nodes carries (tiles are grouped to
    reach it: a copy-engine put costs microseconds whatever its size).
    """
    for name, value in (("m", m), ("n", n), ("k", k)):
        if not isinstance(value, (int, np.integer)) or not 1 <= value < 2**31:
            raise ValueError(f"mkrt.gemm_allreduce: {name}={value!r} must be an integer in [1, 2**31)")
    if k % 8:
        raise ValueError(f"mkrt.gemm_allreduce: k={k} (per rank) must be a multiple of 8")
    if nodes < 1 or ranks_per_node < 1:
        raise ValueError(f"mkrt.gemm_allreduce: world {nodes}x{ranks_per_node} is empty")
    if ranks_per_node > 32 or nodes > 32:
        raise ValueError(f"mkrt.gemm_allreduce: at most 32 ranks per node and 32 nodes; "
                         f"got {nodes}x{ranks_per_node}")
    if dtype not in ("bf16", "f16") or b_layout not in ("kn", "nk"):
        raise ValueError(f"mkrt.gemm_allreduce: dtype={dtype!r}, b_layout={b_layout!r}; expected "
                         "bf16/f16 and kn/nk")
    block_n = check_block_n(block_n)
    world = nodes * ranks_per_node
    area = "gemm_reducescatter" if collective == "reducescatter" else "gemm_allreduce"
    if collective not in ("allreduce", "reducescatter"):
        raise ValueError(f"mkrt.gemm_allreduce: collective={collective!r}; expected "
                         "'allreduce' or 'reducescatter'")
    if collective == "reducescatter" and m % world:
        raise ValueError(f"mkrt.{area}: m={m} must be a multiple of the world size {world} "
                         f"(rank r keeps rows r*m/{world} .. (r+1)*m/{world})")
    if world == 1:
        block_n = block_n or BLOCK_N
        tile = (dtype, b_layout, BLOCK_M, block_n, gemm_module.max_stages(BLOCK_M, block_n, "direct"))
        return Plan(*tile, m, n, k, 1, 1, ctas, 0, False, "one rank: plain GEMM, nothing to reduce",
                    0.0, 0.0, collective=collective)
    if reduce_ctas is None:
        reduce_ctas = default_reduce_ctas(k, ctas, nodes=nodes, ceilings=ceilings)
    if not 1 <= reduce_ctas < ctas:
        raise ValueError(f"mkrt.gemm_allreduce: reduce_ctas={reduce_ctas} must be in [1, {ctas - 1}] "
                         f"(ctas={ctas} per rank)")
    if block_n is None:
        from mkrt.kernels.gemm_rule import fused_tile_width
        block_n = fused_tile_width(m, n, k, ctas - reduce_ctas, TILE_WIDTHS, b_layout, BLOCK_M)
    tile = (dtype, b_layout, BLOCK_M, block_n, gemm_module.max_stages(BLOCK_M, block_n, "direct"))
    fitted = fitted_times(f"{nodes}x{ranks_per_node}", m, n, k, ctas=ctas,
                          reduce_ctas=reduce_ctas, ranks_per_gpu=ranks_per_gpu)
    if fitted is not None:
        fused_us, unfused_us = fitted
        model = "fitted model"
    else:
        fused_us, unfused_us = predict_times(m, n, k, nodes, ranks_per_node, ctas, reduce_ctas,
                                             sms_per_gpu, ranks_per_gpu, ceilings)
        model = "analytical model (layout not fitted)"
    if fuse is None:
        fused = fused_us < unfused_us
        reason = (f"{model}: fused {fused_us:.0f} us vs unfused {unfused_us:.0f} us"
                  + ("" if fused else " (fusion loses here: unfused path)"))
    else:
        fused, reason = bool(fuse), f"fuse={fuse} requested"
    whole_tiles = nodes == 1 or (m // nodes) % BLOCK_M == 0
    if collective == "reducescatter" and not whole_tiles:
        if fuse:
            raise ValueError(f"mkrt.{area}: the fused kernel on {nodes} nodes needs each node's "
                             f"rows (m / nodes = {m / nodes:g}) to be a multiple of {BLOCK_M}; "
                             "leave fuse=None for the unfused path")
        fused, reason = False, (f"node shards of {m / nodes:g} rows are not whole {BLOCK_M}-row "
                                "tiles: unfused path")
    p = Plan(*tile, m, n, k, nodes, ranks_per_node, ctas, reduce_ctas, fused, reason,
             fused_us, unfused_us, collective=collective)
    if nodes == 1:
        return p
    # p.slots: the most tiles a rank owns.
    send_batch = max(1, min(-(-send_bytes // p.tile_bytes), -(-p.slots // reduce_ctas)))
    return dataclasses.replace(p, send_batch=send_batch)
