"""The shared gathering role (``gather_role`` in kernels/device/gather.py) chunk by chunk,
as tasks and waits for the CPU checks of :mod:`mkrt.kernels.schedule`.

AllGather+GEMM and ring attention gather one block per rank into every rank's symmetric
``gathered`` buffer with this role. Per launch of rank r (node n, local index l):

* comm CTA 0 raises ``arrive`` at every node rank and posts ``node_arrive`` to rank l of
  every other node (through r's proxy queue);
* every comm CTA copies its chunks of r's block into the buffers of the node's ranks (r's
  own too, except on one node when the compute reads r's block from its inputs), after
  every node rank has arrived and, with several nodes, rank l of every other node has;
  each chunk, once copied, is put by the proxy to rank l of every other node, its chunk
  flag there being the landed flag;
* every comm CTA forwards its chunks of each block that lands from another node to the
  other node ranks, each chunk once its put has landed;
* the compute reads every chunk of every block once its flag is up at r.

A launch ends when all its CTAs have; the next launch on r's stream starts after that.
The proxy serves r's queue in order, and may still be copying when r's launch ends.

Locations: ``("gathered", r, b, c)``, chunk c of block b in rank r's buffer. Every task's
name ends with its call (1, 2, ...), as :func:`mkrt.kernels.schedule.unordered_accesses`
expects. `wait_for_node_arrival` and `put_after_copy` exist to show what the checks catch
without them.
"""

from __future__ import annotations

from mkrt import checks
from mkrt.kernels.schedule import Schedule


def schedule(nodes: int, per_node: int, *, comm_ctas: int = 2, chunks: int = 4, epochs: int = 2,
             own_in_input: bool = False, wait_for_node_arrival: bool = True,
             put_after_copy: bool = True) -> Schedule:
    """The role's chunks over `epochs` back-to-back launches on every rank. Workers:
    ``("comm", r, j)`` (comm CTA j of r, copying chunks j, j + comm_ctas, ...),
    ``("compute", r)``, ``("queue", r)`` (r's proxy) and ``("stream", r)`` (launch ends)."""
    G = checks.integer(per_node, "per_node", "gather", low=1, high=64)
    N = checks.integer(nodes, "nodes", "gather", low=1, high=32)
    C = checks.integer(comm_ctas, "comm_ctas", "gather", low=1, high=64)
    K = checks.integer(chunks, "chunks", "gather", low=1, high=64)
    W = N * G
    steps = Schedule()
    task = steps.task

    def node_ranks(r):
        return [r // G * G + p for p in range(G)]

    def same_local(r):
        """Rank r's counterpart (same local index) on each other node, in the role's order."""
        n, l = divmod(r, G)
        return [((n + step) % N) * G + l for step in range(1, N)]

    def landed_from(r):
        """Blocks that land at r from other nodes, in the order r forwards them."""
        n, l = divmod(r, G)
        return [((n + N - step) % N) * G + l for step in range(1, N)]

    def skip_own(r, b):
        return b == r and N == 1 and own_in_input

    def previous_launch(r, e):
        return [("launch_end", r, e - 1)] if e > 1 else []

    def writer(r, b, c, e):
        """The task that puts chunk c of block b into r's buffer in call e."""
        if b // G == r // G:
            return ("push", b, c, e)
        if b % G == r % G:
            return ("put", b, r, c, e)
        return ("forward", r // G * G + b % G, b, c, e)

    for e in range(1, epochs + 1):
        ends = {}
        for r in range(W):
            for j in range(C):
                worker = ("comm", r, j)
                task(worker, ("start", r, j, e), previous_launch(r, e))
                if j == 0:
                    task(worker, ("arrive", r, e))
                    for other in same_local(r):
                        task(("queue", r), ("node_arrive", r, other, e), [("arrive", r, e)])
                waits = [("arrive", p, e) for p in node_ranks(r)]
                if wait_for_node_arrival:
                    waits += [("node_arrive", o, r, e) for o in same_local(r)]
                mine = range(j, K, C)
                for c in mine:
                    targets = [p for p in node_ranks(r) if not skip_own(p, r)]
                    task(worker, ("push", r, c, e), waits,
                         write=[("gathered", p, r, c) for p in targets])
                for b in landed_from(r):
                    for c in mine:
                        task(worker, ("forward", r, b, c, e), [("put", b, r, c, e)],
                             read=[("gathered", r, b, c)],
                             write=[("gathered", p, b, c) for p in node_ranks(r) if p != r])
                ends[worker] = steps.workers[worker][-1]
            # the proxy's puts, in the order the chunks are copied
            for c in range(K):
                for other in same_local(r):
                    task(("queue", r), ("put", r, other, c, e),
                         [("push", r, c, e)] if put_after_copy else [],
                         read=[("gathered", r, r, c)], write=[("gathered", other, r, c)])
            compute = ("compute", r)
            task(compute, ("compute_start", r, e), previous_launch(r, e))
            for b in [r] + [p for p in node_ranks(r) if p != r] + landed_from(r) + [
                    o for o in range(W) if o // G != r // G and o % G != r % G]:
                if skip_own(r, b):
                    continue
                for c in range(K):
                    task(compute, ("read", r, b, c, e), [writer(r, b, c, e)],
                         read=[("gathered", r, b, c)])
            ends[compute] = steps.workers[compute][-1]
        for r in range(W):
            mine = [w for w in ends if w[1] == r]
            task(("stream", r), ("launch_end", r, e), [ends[w] for w in mine])
    return steps
