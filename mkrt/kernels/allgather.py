"""AllGather over the world, hierarchical: each block crosses to each other node once.

``out[r][s] = x[s]`` for every pair of world ranks r, s (``group="world"``, the default):
every rank gets ``[nodes * G, *x.shape]`` in world-rank order. ``group="node"`` gathers
inside the caller's node only (``[G, *x.shape]``, slot l holding local rank l's x).

One launch per rank, ``ctas`` CTAs each. Rank (node n, local l), block index b = n*G + l:

1. *arrive*: the launch has started, so everything earlier on this rank's stream (the
   readers of its previous output, its previous launch) is done. It tells each node peer
   so, and where its output lives (emulated worlds: peers write straight into it; under
   mpiexec into the rank's symmetric receive buffer, copied out at the end); it tells the
   rank with local index l on every other node through the proxy (``node_arrive``).
2. *send* (several nodes): once every other node's rank l has arrived (its previous
   launch has received, and so finished reading, what we sent last time), copy x into our
   own slot of our symmetric receive buffer; the last CTA posts one put+signal of it to
   rank l of every other node (``landed`` there). Proxy puts need registered memory at
   both ends, hence the copy.
3. *push*: x to every rank of the node (itself included) with 16-byte peer stores; the
   last CTA release-stores ``ready[b]`` at each of them.
4. *forward* (several nodes): for each other node m, wait until rank (m, l)'s block has
   landed in our receive buffer, then store it into every node rank's output and
   release-store ``ready[m*G + l]`` there. So each block crosses to node m once (to rank
   (m, l)) and is spread inside node m over peer pointers.
5. *wait* until every ``ready`` reaches this epoch (then copy out if staged).

Flags are epochs (launch count), read and advanced on the device: no host sync between
calls, no reset, nothing the host must know per call (graph-capturable). Every wait is
bounded (mkrt.CommTimeout names rank, role, tile = block index, flag word).

Receive buffer (symmetric, registered with the proxy): emulated worlds, several nodes:
``nodes`` slots, slot m holding the block of rank (m, l); under mpiexec: one slot per
block (it stages the whole output). Between nodes the proxy moves data (``ce`` copies
when the nodes share a process or host, as in emulated worlds); inside a node, ranks
store into each other's memory (plain peer pointers emulated, CUDA IPC under mpiexec).

Flag words per rank (G = ranks per node, N = nodes, R = N*G) are in :class:`FlagLayout`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mkrt import checks
from mkrt.jit import cuda_source
from mkrt.jit.spec import KernelSpec
from mkrt.kernels.launcher import KernelLaunch, Parameters
from mkrt.kernels.op import CONTEXT_PARAMETERS, Op, shared_op
from mkrt.kernels.schedule import Schedule
from mkrt.memory import SymmetricBuffer, flags
from mkrt.status import kernel_id

#: most ranks per node (peer targets live in shared memory)
MAX_NODE_RANKS = 64

ALLGATHER = cuda_source("allgather", r"""
using namespace mkrt;
constexpr int MAX_NODE_RANKS = $MAX_NODE_RANKS;

// Where each flag word of a rank lives (mirrors FlagLayout in Python).
struct Layout {
    int G, N;
    __device__ int arrive(int p) const { return p; }                 // node peer p's launch began
    __device__ int target(int p) const { return G + p; }             // node peer p's output (direct)
    __device__ int node_arrive(int n) const { return 2 * G + n; }    // rank (n, me) began (proxy)
    __device__ int landed(int n) const { return 2 * G + N + n; }     // rank (n, me)'s block is here
    __device__ int ready(int b) const { return 2 * G + 2 * N + b; }  // block b is in our output
    __device__ int sent() const { return 2 * G + 2 * N + N * G; }    // CTA counters from here on
    __device__ int pushed() const { return sent() + 1; }
    __device__ int forwarded(int n) const { return sent() + 2 + n; }
    __device__ int finished() const { return sent() + 2 + N; }
    __device__ int ctas_before() const { return finished() + 1; }
    __device__ int launches() const { return finished() + 2; }
};

extern "C" __global__ void __launch_bounds__($THREADS, 1)
allgather(const unsigned char* input, unsigned char* output, u64 nbytes,
          u64* flags, const u64* peer_flags, const u64* peer_receive, unsigned char* receive,
          const Queue* queue, int me, int node, int G, int N,
          int receive_region, int flags_region, int muted_rank,
          u64* status, u64* host_flag, int slot, int rank, u64 timeout_ns) {
    const Context ctx{status, host_flag, slot, rank, timeout_ns, $KERNEL_ID};
    const Layout L{G, N};
    // staged (processes): every block goes into the node ranks' receive buffers (one slot
    // per block), copied out at the end; direct (one process): into their outputs.
    const bool staged = peer_receive != nullptr;
    const int mine = node * G + me;                  // this rank's block index
    const bool muted = rank == muted_rank;
    const u64 worker = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 workers = (u64)gridDim.x * blockDim.x;
    __shared__ unsigned char* targets[MAX_NODE_RANKS];

    // The previous launch on this stream is complete, so these words are stable.
    __shared__ u64 epoch_shared, base_shared;
    if (threadIdx.x == 0) {
        epoch_shared = ld_acquire_gpu(flags + L.launches()) + 1;
        base_shared = ld_acquire_gpu(flags + L.ctas_before());
    }
    __syncthreads();
    const u64 epoch = epoch_shared;
    const u64 all_ctas = base_shared + gridDim.x;   // counters reach this when every CTA is done

    // 1. arrive: node peers (their data for us may come), then rank `me` of other nodes.
    if (blockIdx.x == 0 && threadIdx.x < G) {
        u64* peer = (u64*)peer_flags[threadIdx.x];
        st_relaxed_sys(peer + L.target(me), (u64)output);
        st_release_sys(peer + L.arrive(me), epoch);
    }
    if (N > 1 && blockIdx.x == 0 && threadIdx.x == blockDim.x - 1) {
        const Queue q = *queue;
        for (int step = 1; step < N; ++step) {
            const int other = (node + step) % N;
            if (post_signal(q, ctx, (unsigned)(other * G + me), (unsigned)flags_region,
                            (u64)L.node_arrive(node) * 8, epoch, ROLE_INTER, mine) == POST_FAILED) break;
        }
    }

    // 2. send: our block into our receive slot (what the puts read), then the puts.
    const u64 my_slot = staged ? (u64)mine : (u64)node;
    if (N > 1) {
        // Last launch's puts read this slot until every other node has begun this launch.
        if (!cta_wait_words(flags, L.node_arrive(0), 1, N, node, epoch, ctx, ROLE_INTER, mine, 0, queue))
            return;
        copy_span(receive + my_slot * nbytes, input, nbytes, worker, workers);
        if (last_cta_done(flags + L.sent(), all_ctas) && !muted) {
            const Queue q = *queue;
            for (int step = 1; step < N; ++step) {
                const int other = (node + step) % N;
                if (post_put_signal(q, ctx, (unsigned)(other * G + me), (unsigned)receive_region,
                                    my_slot * nbytes, (unsigned)receive_region, my_slot * nbytes,
                                    nbytes, (unsigned)flags_region, (u64)L.landed(node) * 8, epoch,
                                    ROLE_INTER, mine) == POST_FAILED) break;
            }
        }
    }

    // 3. push: our block to every node rank once it has arrived (itself last).
    if (!cta_wait_words(flags, L.arrive(0), 1, G, -1, epoch, ctx, ROLE_INTRA, node * G, 1, nullptr))
        return;
    if (threadIdx.x < G) {
        const int p = threadIdx.x;
        // staged, several nodes: step 2 already put our block in our own slot
        targets[p] = staged ? (p == me && N > 1 ? nullptr : (unsigned char*)peer_receive[p] + (u64)mine * nbytes)
                            : (unsigned char*)ld_relaxed_sys(flags + L.target(p)) + (u64)mine * nbytes;
    }
    __syncthreads();
    scatter_span(targets, G, (me + 1) % G, input, nbytes, worker, workers);
    if (last_cta_done(flags + L.pushed(), all_ctas) && !muted) {
        for (int p = 0; p < G; ++p) st_release_sys((u64*)peer_flags[p] + L.ready(mine), epoch);
    }

    // 4. forward: the block of rank `me` of each other node, as it lands, to the node.
    for (int step = 1; step < N; ++step) {
        const int other = (node + N - step) % N;     // the node whose send posted first to us
        const int block = other * G + me;
        if (!cta_wait_words(flags, L.landed(other), 0, 1, -1, epoch, ctx, ROLE_INTER, block, 0, queue))
            return;
        if (threadIdx.x < G) {
            const int p = threadIdx.x;
            targets[p] = staged ? (p == me ? nullptr : (unsigned char*)peer_receive[p] + (u64)block * nbytes)
                                : (unsigned char*)ld_relaxed_sys(flags + L.target(p)) + (u64)block * nbytes;
        }
        __syncthreads();
        const unsigned char* landed = receive + (staged ? (u64)block : (u64)other) * nbytes;
        scatter_span(targets, G, (me + 1) % G, landed, nbytes, worker, workers);
        if (last_cta_done(flags + L.forwarded(other), all_ctas)) {
            for (int p = 0; p < G; ++p) st_release_sys((u64*)peer_flags[p] + L.ready(block), epoch);
        }
        __syncthreads();      // targets is rewritten next step
    }

    // 5. wait: direct, each CTA waits for its share of the blocks (the launch ends when
    // all are in); staged, every CTA waits for all of them, then copies out its share.
    const int R = N * G;
    const int first = staged ? 0 : (int)blockIdx.x, stride = staged ? 1 : (int)gridDim.x;
    const int count = first < R ? (R - first + stride - 1) / stride : 0;
    if (!cta_wait_words(flags, L.ready(first), stride, count, -1, epoch, ctx, ROLE_INTRA, first,
                        stride, nullptr))
        return;
    if (staged) copy_span(output, receive, (u64)R * nbytes, worker, workers);

    // The last CTA out publishes the epoch for the next launch.
    __syncthreads();
    if (threadIdx.x == 0)
        finish_launch(flags + L.finished(), flags + L.ctas_before(), flags + L.launches(), epoch, all_ctas);
}
""", requires=("sync", "copy", "queue", "gather"), register=False)

KERNEL_ID = kernel_id("allgather")
GROUPS = ("world", "node")


@dataclasses.dataclass(frozen=True)
class FlagLayout:
    """Index of every flag word of a rank (mirrors the template's struct Layout).

    ``G`` ranks per node, ``N`` nodes of the group (1 for ``group="node"``)."""

    G: int
    N: int

    def arrive(self, p): return p
    def target(self, p): return self.G + p
    def node_arrive(self, n): return 2 * self.G + n
    def landed(self, n): return 2 * self.G + self.N + n
    def ready(self, b): return 2 * self.G + 2 * self.N + b
    def sent(self): return 2 * self.G + 2 * self.N + self.N * self.G
    def pushed(self): return self.sent() + 1
    def forwarded(self, n): return self.sent() + 2 + n
    def finished(self): return self.sent() + 2 + self.N

    @property
    def words(self) -> int:
        return self.finished() + 3


@dataclasses.dataclass(frozen=True)
class AllGatherSpec(KernelSpec):
    family = "allgather"
    entry_points = ("allgather",)
    threads: int = dataclasses.field(default=512, metadata={"short": "t"})

    def __post_init__(self):
        super().__post_init__()
        # 1024 threads leave 64 registers a thread: the kernel spills (ptxas, sm_90a).
        if self.threads % 32 or not 64 <= self.threads <= 512:
            raise ValueError(f"mkrt.allgather: threads must be a multiple of 32 in [64, 512], "
                             f"got {self.threads}")

    def template(self):
        return ALLGATHER

    def params(self):
        return {"THREADS": self.threads, "KERNEL_ID": f"{KERNEL_ID}ull",
                "MAX_NODE_RANKS": MAX_NODE_RANKS}


def default_specs() -> list[AllGatherSpec]:
    return [AllGatherSpec(threads=512)]


# ---- the plan (pure Python, runs without a GPU; the kernel above does exactly this) ------

@dataclasses.dataclass(frozen=True)
class Transfer:
    """One movement of block ``block`` from rank ``src`` to rank ``dst``: ``put`` (through
    the proxy, into dst's receive buffer), ``push`` (src's own block into dst's output, peer
    stores) or ``forward`` (a block that landed at src, into dst's output)."""

    kind: str
    block: int
    src: int
    dst: int


def plan(nodes: int, per_node: int) -> list[Transfer]:
    """Every movement of data one world-wide gather makes, on ``nodes`` x ``per_node``
    ranks (rank = node * per_node + local index)."""
    nodes = checks.integer(nodes, "nodes", "allgather", low=1)
    per_node = checks.integer(per_node, "per_node", "allgather", low=1)
    G, N = per_node, nodes
    out = []
    for rank in range(N * G):
        n, l = divmod(rank, G)
        out += [Transfer("put", rank, rank, ((n + step) % N) * G + l) for step in range(1, N)]
        out += [Transfer("push", rank, rank, n * G + p) for p in range(G)]
        for step in range(1, N):
            block = ((n + N - step) % N) * G + l
            out += [Transfer("forward", block, rank, n * G + p) for p in range(G)]
    return out


def schedule(nodes: int, per_node: int, *, epochs: int = 2, staged: bool = False) -> Schedule:
    """The kernel's steps over ``epochs`` back-to-back calls as tasks and waits. Workers:
    ``("rank", r)`` (all CTAs of r's launch run the same steps, so one worker stands for
    them) and ``("queue", r)`` (the proxy serves r's queue in order).

    Locations: ``("out", r, b)`` (rank r's output slot b) and ``("recv", r, slot)`` (r's
    receive buffer; staged, slot b stands for output slot b: the copy-out reads it)."""
    G, N = per_node, nodes
    R = N * G
    steps = Schedule()
    task = steps.task

    def recv_slot(block):
        return block if staged else block // G

    def out(r, b):
        return ("recv", r, b) if staged else ("out", r, b)

    for e in range(1, epochs + 1):
        for r in range(R):
            n, l = divmod(r, G)
            node_ranks = [n * G + p for p in range(G)]
            rank = ("rank", r)
            task(rank, ("arrive", r, e))
            for step in range(1, N):
                other = ((n + step) % N) * G + l
                task(("queue", r), ("node_arrive", r, other, e), [("arrive", r, e)])
            if N > 1:
                peers = [((n + step) % N) * G + l for step in range(1, N)]
                task(rank, ("send", r, e), [("node_arrive", o, r, e) for o in peers],
                     write=[("recv", r, recv_slot(r))])
                for other in peers:
                    task(("queue", r), ("put", r, other, e), [("send", r, e)],
                         read=[("recv", r, recv_slot(r))], write=[("recv", other, recv_slot(r))])
            own = [] if (staged and N > 1) else [out(r, r)]
            task(rank, ("push", r, e), [("arrive", p, e) for p in node_ranks],
                 write=[out(p, r) for p in node_ranks if p != r] + own)
            for step in range(1, N):
                block = ((n + N - step) % N) * G + l
                task(rank, ("forward", r, block, e), [("put", block, r, e)],
                     read=[("recv", r, recv_slot(block))],
                     write=[out(p, block) for p in node_ranks if not (staged and p == r)])
            producers = []
            for b in range(R):
                bn, bl = divmod(b, G)
                producer = n * G + bl
                producers.append(("push", b, e) if bn == n else ("forward", producer, b, e))
            task(rank, ("wait", r, e), producers, read=[out(r, b) for b in range(R)])
            task(rank, ("finish", r, e))
    return steps


def reference(inputs: list, world=None, group: str = "world") -> list:
    """What each local rank holds afterwards: the stack of every rank's input (of its node
    with ``group="node"``). ``inputs``: one array per rank of the world, in rank order."""
    import cupy
    if group not in GROUPS:
        raise ValueError(f"mkrt.allgather: group={group!r}; expected one of {GROUPS}")
    if world is None or group == "world":
        stacked = cupy.stack([cupy.asarray(x) for x in inputs])
        ranks = range(len(inputs)) if world is None else [info.rank for info in world.local]
        return [stacked.copy() for _ in ranks]
    return [cupy.stack([cupy.asarray(inputs[r]) for r in world.node_ranks(info.node)])
            for info in world.local]


class AllGather(Op):
    """``out = op(x)``: each rank gets ``[ranks, *x.shape]``, slot s holding rank s's x.

    ``group``: ``"world"`` (default) gathers every rank of the world, hierarchically (each
    block crosses to each other node once, through the world's proxy, and is spread inside
    that node over peer pointers); ``"node"`` gathers the caller's node only
    (``[G, *x.shape]``, slot l holding the node's local rank l; no proxy).
    ``ctas``: CTAs per rank (default: as many as the rank's SM share, fewer for small
    inputs). ``muted_rank``: a world rank whose block is never delivered (tests of the
    bounded waits); leave it None.
    """

    name = "allgather"

    def __init__(self, world=None, *, group: str = "world", ctas: int | None = None,
                 threads: int = 512, timeout_ms: float | None = None,
                 muted_rank: int | None = None):
        super().__init__(world, timeout_ms=timeout_ms)
        if group not in GROUPS:
            raise ValueError(f"mkrt.allgather: group={group!r}; expected one of {GROUPS}")
        ctas = checks.integer(ctas, "ctas", "allgather", low=1, high=checks.MAX_GRID, optional=True)
        threads = checks.integer(threads, "threads", "allgather")
        muted_rank = checks.integer(muted_rank, "muted_rank", "allgather", low=0,
                                    high=self.world.size - 1, optional=True)
        sizes = sorted({len(self.world.node_ranks(n)) for n in range(self.world.nodes)})
        if len(sizes) != 1:
            raise ValueError(f"mkrt.allgather: nodes of different sizes {sizes} are not supported "
                             f"(layout {self.world.layout})")
        self.G = sizes[0]
        self.N = self.world.nodes if group == "world" else 1
        if self.G > MAX_NODE_RANKS:
            raise ValueError(f"mkrt.allgather: {self.G} ranks per node; at most {MAX_NODE_RANKS}")
        if self.N > 1:
            disordered = [r.rank for r in self.world.ranks if r.rank != r.node * self.G + r.local_rank]
            if disordered:
                raise ValueError(f"mkrt.allgather: group='world' needs ranks numbered node by "
                                 f"node (rank = node * {self.G} + local rank); ranks {disordered[:8]} "
                                 "are not; use group='node'")
        devices = [info for info in self.world.local if info.device is not None]
        if ctas is not None and devices:
            share = min(self.world.sm_count(info.rank) for info in devices)
            if ctas > share:
                # CTAs wait for other ranks' CTAs: all of them must be resident together.
                raise ValueError(f"mkrt.allgather: ctas={ctas} exceeds this rank's share of "
                                 f"{share} SMs (ranks sharing a GPU split its SMs)")
        self.group = group
        self.spec = AllGatherSpec(threads=threads)
        self.ctas = ctas
        self.muted_rank = -1 if muted_rank is None else int(muted_rank)
        self.layout = FlagLayout(self.G, self.N)
        self._flags = flags(self.world, self.layout.words, name="allgather.flags")
        self._receive: SymmetricBuffer | None = None
        self._receive_tables: dict[int, object] = {}
        self._prepared: dict = {}        # (shape, dtype) -> _PreparedGather
        self._generation = 0             # counts receive-buffer allocations
        if self.N > 1:
            # Compile first: a compile error shows before any proxy thread starts.
            self.spec.build()
            self.world.proxy()       # starts the proxy; it registers every symmetric buffer

    @property
    def ranks(self) -> int:
        """Blocks each rank receives (world size, or its node's size with group='node')."""
        return self.N * self.G

    def _grid(self, rank: int, nbytes: int) -> int:
        if self.ctas is not None:
            return self.ctas
        # About 256 KiB stored per CTA: small gathers need few CTAs, large ones the rank's share.
        wanted = -(-nbytes * self.ranks // (256 * 1024))
        return int(max(1, min(self.world.sm_count(rank), wanted)))

    def _receive_buffer(self, nbytes: int) -> SymmetricBuffer | None:
        """The symmetric receive buffer: a slot per block under mpiexec (it stages the
        output), a slot per node in emulated worlds with several nodes, else none."""
        slots = self.ranks if not self.world.emulated else (self.N if self.N > 1 else 0)
        needed = slots * nbytes
        if needed == 0:
            return None
        if self._receive is None or self._receive.nbytes < needed:
            if self._receive is not None:
                self._receive.close()       # synchronizes first: no launch still uses it
            self._receive = SymmetricBuffer(self.world, needed, name="allgather.receive", zero=False)
            self._receive_tables.clear()
            self._generation += 1           # launches prepared on the old buffer are stale
        return self._receive

    def _check_new(self, inputs, outputs) -> "_PreparedGather":
        """Every check of a new signature; the prepared path repeats the per-array ones."""
        self.per_rank(inputs, "x")
        self.same_everywhere(inputs, "x")
        shape, dtype = inputs[0].shape, inputs[0].dtype
        out_shape = (self.ranks, *shape)
        if outputs is not None:
            self.per_rank(outputs, "out")
            for i, o in enumerate(outputs):
                if o.shape != out_shape or o.dtype != dtype:
                    raise ValueError(f"mkrt.allgather: out[{i}] is {o.shape} {o.dtype}; "
                                     f"expected {out_shape} {dtype} (group={self.group!r})")
        call = _PreparedGather(shape, dtype, out_shape, inputs[0].nbytes)
        self._prepared[(shape, dtype)] = call
        return call

    def _launches(self, call: "_PreparedGather") -> list:
        """One prepared launch per local rank (made again when the receive buffer was)."""
        receive = self._receive_buffer(call.nbytes)
        if call.launches is not None and call.generation == self._generation:
            return call.launches
        proxy = self.world.proxy() if self.N > 1 else None
        # Load on every device before any launch: loading may wait for running kernels.
        functions = [self.spec.function("allgather", info.device) for info in self.world.local]
        launches = []
        for info, function in zip(self.world.local, functions):
            staged_table = 0
            if receive is not None and not self.world.emulated:
                if info.rank not in self._receive_tables:
                    self._receive_tables[info.rank] = receive.peer_table(info.rank)
                staged_table = self._receive_tables[info.rank].data.ptr
            params = Parameters(LAUNCH_PARAMETERS)
            params.set(nbytes=call.nbytes, flags=self._flags.local_ptr(info.rank),
                       peer_flags=self._flags.peer_table(info.rank).data.ptr,
                       peer_receive=staged_table,
                       receive=receive.local_ptr(info.rank) if receive is not None else 0,
                       queue=proxy.queue_pointer(info.rank) if proxy is not None else 0,
                       me=info.local_rank, node=info.node if self.N > 1 else 0, G=self.G,
                       N=self.N, receive_region=receive.region if receive is not None else -1,
                       flags_region=self._flags.region, muted_rank=self.muted_rank,
                       **self.context_params(info.rank))
            launches.append(KernelLaunch(function, self._grid(info.rank, call.nbytes),
                                         self.spec.threads, 0, params))
        call.launches, call.generation = launches, self._generation
        call.pointers = [(params.view("input"), params.view("output")) for params in
                         (launch.params for launch in launches)]
        return launches

    def __call__(self, x, out=None):
        inputs, as_list = self.arrays(x, "x")
        outputs = self.arrays(out, "out")[0] if out is not None else None
        call = self._prepared.get((inputs[0].shape, inputs[0].dtype))
        if call is None:
            call = self._check_new(inputs, outputs)
        else:
            self.check_arrays(inputs, "x", call.shape, call.dtype)
            if outputs is not None:
                self.check_arrays(outputs, "out", call.out_shape, call.dtype)
        if outputs is not None:
            for i, (o, source) in enumerate(zip(outputs, inputs)):
                if o.data.ptr < source.data.ptr + call.nbytes and source.data.ptr < o.data.ptr + o.nbytes:
                    raise ValueError(f"mkrt.allgather: out[{i}] overlaps x[{i}]")
        self.before_launch()
        if outputs is None:
            outputs = self.new_outputs(call.out_shape, call.dtype)
        if call.nbytes == 0:
            return outputs if as_list else outputs[0]
        launches = self._launches(call)
        for (input_word, output_word), source, target in zip(call.pointers, inputs, outputs):
            input_word[()] = source.data.ptr
            output_word[()] = target.data.ptr
        self.launch(launches)
        self.after_launch()
        if out is not None:
            return out
        return outputs if as_list else outputs[0]

    def close(self) -> None:
        self._flags.close()
        if self._receive is not None:
            self._receive.close()
            self._receive = None


#: kernel parameters of allgather, in order
LAUNCH_PARAMETERS = [(name, np.uint64, 8) for name in (
    "input", "output", "nbytes", "flags", "peer_flags", "peer_receive", "receive", "queue")] + [
    (name, np.int32, 4) for name in (
        "me", "node", "G", "N", "receive_region", "flags_region", "muted_rank")] + CONTEXT_PARAMETERS


@dataclasses.dataclass(eq=False)
class _PreparedGather:
    """One signature (shape, dtype) of an AllGather: its launches, made once."""

    shape: tuple
    dtype: np.dtype
    out_shape: tuple
    nbytes: int
    launches: list | None = None
    generation: int = -1
    pointers: list = dataclasses.field(default_factory=list)   # per rank: input, output words


def allgather(x, *, world=None, out=None, group: str = "world", ctas: int | None = None,
              timeout_ms: float | None = None):
    """Gather x from every rank of the world (``group="node"``: of the caller's node); see
    :class:`AllGather`. Keeps one op per (world, group, ctas, timeout); an op that failed
    is replaced on the next call."""
    return shared_op(AllGather, world, group=group, ctas=ctas, timeout_ms=timeout_ms)(x, out=out)
