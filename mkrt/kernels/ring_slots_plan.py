"""A bounded ring of K/V slots for ring attention, as a schedule checked on the CPU.

**Status:** the kernel does this (``RingAttention(slots=k)``,
`mkrt/kernels/ring_attention.py`: ``move_to_slots``, ``RingWork::resume``, ``VisitRows``;
a put learns that the receiver's slot is free from the receiver's credit, a proxy signal);
the default ring still gathers every rank's K/V (W x the local K/V per rank). The bounded
version this module models (experiments/notes/attention.md, "Plan: a bounded ring of K/V
slots") turns the order around so that memory does not grow with the world:

* **Source-major steps.** Rank r works through its sources in `ring_attention_plan.plan`'s
  order; step 0 is its own K/V, read in place; step s >= 1 reads source order[r][s] from
  slot (s - 1) % k of its receive buffer. Each CTA owns the tiles t = c, c + ctas, ... for
  every step (so the fp32 partial state a tile-step leaves for the next is read back by
  the CTA that wrote it, in program order).
* **Slot-free flags.** When every CTA of rank r has finished step s, r raises "step s
  done"; a copy into r's slot for step s + k waits for it (and the first copies of a call
  into a slot wait for the previous call's last step that used the slot).
* **Movement** as today: a source's K/V go to its node peers by peer stores, once to each
  other node (to the rank with the same local index, by the proxy), which forwards them to
  its node peers. A sender keeps **one copy stream per destination** (copies to one peer
  in the order that peer's steps need them): with one stream for all its destinations, a
  copy waiting for one peer's slot blocks the copies another peer is waiting for, and the
  model stalls (2x3 with one slot). A slot is free again only when the step's compute is
  done *and* the forwards out of it have read it (without the second, a forward races the
  next copy into the slot on 2x2).

:func:`schedule` writes this out as tasks and waits (`mkrt.kernels.schedule`); the tests
check that it cannot stall (no wait cycle) and that no slot is overwritten before its
last reader or read before it is written, for worlds 1x2 to 4x4 and k = 1 to 3 slots.
"""

from __future__ import annotations

from mkrt import checks
from mkrt.kernels import ring_attention_plan as ring_plan
from mkrt.kernels.schedule import Schedule


def generations(world: int, slots: int) -> int:
    """Uses of a slot per call, at most (steps 1 .. world - 1 over `slots` slots)."""
    return -(-(world - 1) // slots)


def slot_of(step: int, slots: int) -> int:
    return (step - 1) % slots


def generation(step: int, slots: int, epoch: int, world: int) -> int:
    """The use of its slot that `step` of call `epoch` (1, 2, ...) is, counted over calls;
    step 0 (own K/V in place, no slot) comes before the call's first use."""
    first = (epoch - 1) * generations(world, slots)
    return first - 1 if step == 0 else first + (step - 1) // slots


def _world(nodes, per_node, slots):
    """(G, N, k, W, step_of): step_of[r][source] is the step at which rank r visits source."""
    G = checks.integer(per_node, "per_node", "ring_attention", low=1, high=64)
    N = checks.integer(nodes, "nodes", "ring_attention", low=1, high=32)
    k = checks.integer(slots, "slots", "ring_attention", low=1, high=64)
    W = N * G
    order = ring_plan.plan(N, G, causal=False).order
    return G, N, k, W, [{source: s for s, source in enumerate(order[r])} for r in range(W)]


def schedule(nodes: int, per_node: int, *, slots: int = 2, ctas: int = 2, tiles: int = 3,
             epochs: int = 2, wait_for_free_slots: bool = True, wait_for_landed: bool = True,
             stream_per_destination: bool = True, free_after_forwards: bool = True) -> Schedule:
    """The bounded ring's steps over `epochs` back-to-back calls. Workers: ``("cta", r,
    c)`` (c of `ctas` compute CTAs of rank r), ``("flags", r)`` (r's step-done flags, raised
    by its last CTA out of each step), ``("push", r, p)`` (r's copying CTAs' stream to node
    peer p: stores of r's K/V and forwards of what other nodes put to r) and ``("queue",
    r)`` (the proxy's puts of r's K/V to other nodes). `tiles`: query tiles per rank.

    Locations: ``("slot", r, j)``, slot j of r's receive buffer; a task's last element is
    the slot's use it belongs to (:func:`generation`: pass ``epoch_of=lambda t: t[-1]`` to
    `unordered_accesses`, so each use is checked as a call). `wait_for_free_slots`,
    `wait_for_landed`, `stream_per_destination` and `free_after_forwards` exist to show what
    the checks catch without them."""
    G, N, k, W, step_of = _world(nodes, per_node, slots)
    steps = Schedule()
    task = steps.task

    def gen(s, e):
        return generation(s, k, e, W)

    def free(r, s, e):
        """What a copy into r's slot for step s of call e waits for: the slot's last use done."""
        if not wait_for_free_slots:
            return []
        if s - k >= 1:
            return [("step_done", r, s - k, e)]
        if e == 1:
            return []
        last = max(t for t in range(1, W) if slot_of(t, k) == slot_of(s, k))
        return [("step_done", r, last, e - 1)]

    landed: dict = {}            # (r, s, e) -> the task that writes r's slot for step s
    readers: dict = {}           # (r, s, e) -> forwards that read r's slot for step s
    copies: dict = {}            # worker -> [(call, destination step, destination, parts)]

    def push(sender, destination):
        return ("push", sender, destination if stream_per_destination else "all")

    def copy(worker, e, s, p, parts):
        copies.setdefault(worker, []).append((e, s, p, parts))

    for e in range(1, epochs + 1):
        for q in range(W):
            qn, ql = divmod(q, G)
            for p in range(W):
                pn, pl = divmod(p, G)
                if p == q or (pn != qn and pl != ql):
                    continue
                s = step_of[p][q]
                kind, worker = ("store", push(q, p)) if pn == qn else ("put", ("queue", q))
                name = (kind, q, p, s, e, gen(s, e))
                copy(worker, e, s, p, [(name, free(p, s, e), [], [("slot", p, slot_of(s, k))])])
                landed[(p, s, e)] = name
        for q in range(W):               # what other nodes put to `via`, forwarded to its peers
            qn, ql = divmod(q, G)
            for via in range(W):
                if via // G == qn or via % G != ql:
                    continue
                s_via = step_of[via][q]
                for p in range(via // G * G, via // G * G + G):
                    if p == via:
                        continue
                    s = step_of[p][q]
                    read = ("fwd_read", via, q, p, e, gen(s_via, e))
                    wrote = ("fwd_write", via, q, p, s, e, gen(s, e))
                    copy(push(via, p), e, s, p, [
                        (read, [landed[(via, s_via, e)]], [("slot", via, slot_of(s_via, k))], []),
                        (wrote, free(p, s, e), [], [("slot", p, slot_of(s, k))])])
                    landed[(p, s, e)] = wrote
                    readers.setdefault((via, s_via, e), []).append(read)
    # each sender copies in the order its destinations need the data (call, step, rank)
    for worker, items in copies.items():
        for *_, parts in sorted(items, key=lambda item: item[:3]):
            for name, deps, read, write in parts:
                task(worker, name, deps, read=read, write=write)
    # the fp32 partials need no flags: a tile's steps all run on the CTA that owns it, in
    # order, so they are not modelled as locations
    for e in range(1, epochs + 1):
        for r in range(W):
            for c in range(ctas):
                for s in range(W):
                    for t in range(c, tiles, ctas):
                        deps = [landed[(r, s, e)]] if s > 0 and wait_for_landed else []
                        read = [("slot", r, slot_of(s, k))] if s > 0 else []
                        task(("cta", r, c), ("tile", r, t, s, e, gen(s, e)), deps, read=read)
                    task(("cta", r, c), ("cta_done", r, c, s, e))
            # a slot is free again when the step's compute is done and the forwards out of
            # it have read it (r's copying CTAs count themselves out of the step too)
            for s in range(W):
                task(("flags", r), ("step_done", r, s, e),
                     [("cta_done", r, c, s, e) for c in range(ctas)]
                     + (readers.get((r, s, e), []) if free_after_forwards else []))
    return steps


def kernel_schedule(nodes: int, per_node: int, *, slots: int = 2, epochs: int = 2,
                    credits: bool = True, forwards_free: bool = True,
                    stage_after_arrival: bool = True) -> Schedule:
    """What the kernel does (``move_to_slots`` and the visits of ring_attention.py with
    SLOTS), as tasks and waits, over `epochs` back-to-back calls. Unlike :func:`schedule`,
    a source that another node puts to a rank lands in a region of its own (``landing``)
    and is forwarded from there; the other sources take the rank's visit slots in turn
    (ring_attention.slot_region). Forwarding out of visit slots, as :func:`schedule` has
    it, is right only if a forward could read before the receiver's slot is free; a copy
    cannot, and then 2x2 with one slot deadlocks (two ranks each waiting for the other to
    forward out of its only slot): this model found it.

    Every transfer is a worker of its own (the kernel polls them, so none waits behind
    another); every proxy command is a worker of its own (the proxy never waits inside a
    queue: a command runs once posted). Per rank r = (n, l) and call:

    * ``arrive`` (its launch began; its previous one is over), ``node_arrive`` signals to
      rank l of every other node, then ``stage``: r's K/V copied to its staging region once
      rank l of every other node has arrived (its puts from there last call have landed);
    * ``push`` to each node peer p, into p's visit slot for p's step of r, once free there;
    * ``credit_post`` once r's landing region is free for step G i (step G (i - 1) visited
      and forwarded on), delivered by r's proxy to the source of that step; ``put_post``
      once staged and credited, then the proxy reads the staging region and writes the
      receiver's landing region;
    * ``forward`` of what landed to each node peer, into its visit slot once free there;
      ``fwd_done`` once every forward out of the landing region is done;
    * ``visit`` of every step in order, each once its source is in (step 0: the inputs).

    A visit slot is free for its first `slots` uses at its rank's arrival, later once the
    step that used it last was visited. `credits`, `forwards_free` and
    `stage_after_arrival` exist to show what the checks catch without them. Task names end
    with (call, use) of the region they touch; pass ``epoch_of=lambda t: t[-1]`` to
    `unordered_accesses`."""
    from mkrt.kernels.ring_attention import slot_region
    G, N, k, W, step_of = _world(nodes, per_node, slots)
    steps = Schedule()
    task = steps.task

    def put_here(s):
        return N > 1 and s >= G and s % G == 0

    def local(s):
        return s - s // G if N > 1 else s

    def step_of_local(index):
        return index + (index - 1) // (G - 1) if N > 1 else index

    def where(r, s, e):
        """(location, (call, use)) that step s of rank r reads."""
        if put_here(s):
            return ("landing", r), (e, s // G)
        return ("slot", r, slot_region(s, G, N, k)), (e, (local(s) - 1) // k)

    def slot_free(p, s, e):
        index = local(s)
        if index <= k:
            return [("arrive", p, e)]
        v = step_of_local(index - k)
        return [("visit", p, v, e, where(p, v, e)[1])]

    def landing_free(r, i, e):
        if i == 1:
            return [("arrive", r, e)]
        s = G * (i - 1)
        waits = [("visit", r, s, e, where(r, s, e)[1])]
        if forwards_free and G > 1:
            waits.append(("fwd_done", r, s, e, where(r, s, e)[1]))
        return waits

    for e in range(1, epochs + 1):
        landed, last = {}, {}
        for r in range(W):
            n, l = divmod(r, G)
            start = [("launch_end", r, e - 1)] if e > 1 else []
            last[("start", r)] = task(("start", r), ("arrive", r, e), start)
            for m in range(N):
                if m != n:
                    task(("proxy", "node_arrive", r, m, e), ("node_arrive", r, m, e), [("arrive", r, e)])
            if N > 1:
                waits = [("node_arrive", m * G + l, n, e) for m in range(N) if m != n]
                last[("stage", r)] = task(("stage", r), ("stage", r, e, (e, 0)),
                                          start + (waits if stage_after_arrival else []),
                                          write=[("staged", r)])
            for p in range(G):
                if p == l:
                    continue
                dest = n * G + p
                s = step_of[dest][r]
                location, use = where(dest, s, e)
                name = task(("push", r, p), ("push", r, p, s, e, use), start + slot_free(dest, s, e),
                            write=[location])
                landed[(dest, s)] = last[("push", r, p)] = name
            for i in range(1, N):
                s = G * i
                source = ((n + i) % N) * G + l
                posted = task(("credit", r, i), ("credit_post", r, i, e),
                              start + (landing_free(r, i, e) if credits else []))
                last[("credit", r, i)] = posted
                task(("proxy", "credit", r, i, e), ("credit", r, source, s, e), [posted])
                m = (n + N - i) % N                      # r is node m's source i nodes on
                via = m * G + l
                posted = task(("put", r, m), ("put_post", r, m, e),
                              [("stage", r, e, (e, 0)), ("credit", via, r, s, e)])
                last[("put", r, m)] = posted
                worker = ("proxy", "put", r, m, e)
                task(worker, ("put_read", r, m, e, (e, 0)), [posted], read=[("staged", r)])
                location, use = where(via, s, e)
                landed[(via, s)] = task(worker, ("put_write", r, m, s, e, use), write=[location])
        for r in range(W):
            n, l = divmod(r, G)
            start = [("launch_end", r, e - 1)] if e > 1 else []
            for i in range(1, N):
                s = G * i
                source = ((n + i) % N) * G + l
                here, here_use = where(r, s, e)
                outs = []
                for p in range(G):
                    if p == l:
                        continue
                    dest = n * G + p
                    s_p = step_of[dest][source]
                    location, use = where(dest, s_p, e)
                    worker = ("forward", r, i, p)
                    task(worker, ("fwd_read", r, i, p, e, here_use),
                         start + [landed[(r, s)]] + slot_free(dest, s_p, e), read=[here])
                    outs.append(task(worker, ("fwd_write", r, i, p, s_p, e, use), write=[location]))
                    landed[(dest, s_p)] = last[worker] = outs[-1]
                if outs:
                    last[("fwd_done", r, i)] = task(("fwd_done", r, i), ("fwd_done", r, s, e, here_use), outs)
        for r in range(W):
            start = [("launch_end", r, e - 1)] if e > 1 else []
            compute = ("compute", r)
            for s in range(W):
                if s == 0:
                    task(compute, ("visit", r, 0, e, (e, 0)), start)
                else:
                    location, use = where(r, s, e)
                    task(compute, ("visit", r, s, e, use), [landed[(r, s)]], read=[location])
            last[compute] = steps.workers[compute][-1]
        for r in range(W):
            task(("stream", r), ("launch_end", r, e),
                 [name for worker, name in last.items() if worker[1] == r])
    return steps
