"""AllGather+GEMM: the column-parallel linear with sequence-sharded input, fused.

Every rank holds A_r, rows r*R .. (r+1)*R of A (R = M / W rows, world rank order) and its
weight shard B_r ([K, N_r] or [N_r, K]); every rank ends with C_r = A @ B_r [M, N_r] (and,
if asked, A itself: Megatron keeps it for the backward pass). One persistent kernel per
rank; its CTAs take two roles:

* **communication** CTAs move the blocks of A into every rank's *gathered* buffer (a
  symmetric [M, K] buffer), as mkrt.allgather moves them (mkrt/kernels/allgather.py): each
  block crosses to each other node once, through the proxy, to the rank with the same
  local index, and is spread inside the node with peer stores; a ``ready[b]`` flag at
  every receiving rank says block b is in place.
* **compute**: the GEMM engine over C's tiles, the tile rows of the rank's own block
  first, then the blocks in the order they can arrive (:func:`block_at`): the node peers'
  (pushed straight in), then each other node's, the one its rank with this rank's local
  index puts here first, the ones forwarded from node peers after. Tiles are claimed one at a time from a per-launch counter: the compute CTAs
  start at once, and each communication CTA joins them when its copies are done, so no
  SM idles after the gather. Before loading a tile's rows of A, the engine's producer
  waits for the flags of the chunks those rows come from, then fences them for TMA (the
  blocks were written by generic stores of other ranks). Which CTA computes a tile does
  not change its result: outputs are bit-identical between calls.

The gathered buffer is reused by the next call: a rank writes into a peer's buffer only
after the peer's launch has begun (``arrive``), so the peer's previous GEMM has read it.
Flags are epochs read and advanced on the device (no host sync per call; graph-capturable);
every wait is bounded (mkrt.CommTimeout). The unfused baseline is ``op.unfused``:
mkrt.allgather of A, then cuBLAS.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math

import numpy as np

from mkrt import checks
from mkrt.arrays import like_input
from mkrt.controller.fusion import MeasuredFusion, check_fuse
from mkrt.jit import cuda_source
from mkrt.jit.spec import KernelSpec
from mkrt.kernels import allgather as allgather_module
from mkrt.kernels import gemm as gemm_module
from mkrt.kernels.launcher import KernelLaunch, Parameters, struct_size_assert
from mkrt.kernels.gathering import MAX_NODE_RANKS, FlagLayout, GatheringOp  # noqa: F401
from mkrt.kernels.op import CONTEXT_PARAMETERS, shared_op
from mkrt.kernels.schedule import find_stall
from mkrt.status import kernel_id


ALLGATHER_GEMM = cuda_source("allgather_gemm", r"""
using namespace mkrt;
typedef $CTYPE T;
typedef gemm::Config<T, $BLOCK_M, $BLOCK_N, $STAGES, $B_K_MAJOR, 0> Cfg;
constexpr int BM = Cfg::BM, BN = Cfg::BN;
constexpr int MAX_NODE_RANKS = $MAX_NODE_RANKS;

typedef GatheredFlags Layout;      // the flag words (mirror: FlagLayout)

struct Args {
    const T* input;             // A_r [rows, k]
    T* out;                     // C_r [m, n]
    T* gathered;                // this rank's gathered A [m, k] (symmetric)
    u64* flags;                 // this rank's flag words
    const u64* peer_flags;      // [G] node peers' flag words
    const u64* peer_gathered;   // [G] node peers' gathered buffers
    const Queue* queue;         // the proxy queue (several nodes)
    int m, n, k, rows;          // rows = m / world size: one block
    int group_m, me, node, G, N, compute_ctas;
    int gathered_region, flags_region;
    u64* board;                 // roles="search": the split comes from the role board (null: compute_ctas)
};
$ARGS_CHECKS

// The compute role's work: C's tiles in grouped raster order over tile rows taken block
// by block in arrival order (block_at; when blocks are not whole tile rows, rotated so the
// rows of this rank's block come first); ClaimedWork hands them out one at a time from the
// launch's queue (a counter flag), so a CTA that finished its copies takes the next tile.
// A tile row inside this rank's block reads A from the rank's input (run_tiles' second
// map) and waits for nothing; any other waits for the chunks of other ranks' blocks that
// hold its rows (and, for rows of this rank's block, for the whole block) in the gathered
// buffer.
// The i-th block a rank computes on: its node's blocks from its own (pushed by node peers),
// then each other node's in node order, first the block of the rank with its local index
// (put here through the proxy), then the others (forwarded by node peers). Mirror:
// block_at in Python.
__device__ __forceinline__ int block_at(int i, int node, int me, int G, int N) {
    return ((node + i / G) % N) * G + (me + i % G) % G;
}

struct GatheredWork {
    gemm::RasterWork raster;    // tiles_m, tiles_n, group_m (tile_at only)
    int shift;                  // first tile row of this rank's block
    int rows_in_tiles;          // tile rows per block when blocks are whole tile rows, else 0
    int node, me, G, N;
    int rows, m;
    const u64* flags;
    Layout L;
    u64 epoch;
    Context ctx;

    int own_first;              // this rank's block: rows own_first .. own_first + rows - 1
    int chunks;                 // chunks per block (gather_chunks of the host's split)
    u64 row_bytes;

    __device__ __forceinline__ gemm::Tile tile_at(int t) const {
        gemm::Tile tile = raster.tile_at(t);
        tile.m = rows_in_tiles
            ? block_at(tile.m / rows_in_tiles, node, me, G, N) * rows_in_tiles + tile.m % rows_in_tiles
            : (tile.m + shift) % raster.tiles_m;
        tile.index = tile.m * raster.tiles_n + tile.n;
        const int row0 = tile.m * BM;
        if (row0 >= own_first && min(row0 + BM, m) <= own_first + rows) {
            tile.a_map = 1;
            tile.a_row = row0 - own_first;
        }
        return tile;
    }
    __device__ __forceinline__ bool wait(const gemm::Tile& tile) const {
        if (tile.a_map) return true;     // the rank's own input, written before the launch
        const int row0 = tile.m * BM, row1 = min(row0 + BM, m) - 1;
        for (int b = row0 / rows; b <= row1 / rows; ++b) {
            const bool ok = wait_gathered_rows(flags, L, b, max(row0 - b * rows, 0),
                                               min(row1 - b * rows, rows - 1), row_bytes, rows, chunks,
                                               epoch, ctx, tile.index);
            if (!ok) return false;
        }
        fence_proxy_async_global();      // peers wrote the blocks with generic stores; TMA reads them
        return true;
    }
};

extern "C" __global__ void __launch_bounds__(Cfg::THREADS, 1)
allgather_gemm(const __grid_constant__ TmaDescriptor tma_a,
               const __grid_constant__ TmaDescriptor tma_b,
               const __grid_constant__ TmaDescriptor tma_own,
               const __grid_constant__ Args args, int muted_rank,
               u64* status, u64* host_flag, int slot, int rank, u64 timeout_ns) {
    extern __shared__ char dynamic_smem[];
    const Context ctx{status, host_flag, slot, rank, timeout_ns, $KERNEL_ID};
    const Args& a = args;
    const Layout L{a.G, a.N};
    const int tiles_m = (a.m + BM - 1) / BM, tiles_n = (a.n + BN - 1) / BN;
    // The split: the host's, or (roles="search") what the board's search measures next.
    const int compute_ctas = roles::split_for_launch(a.board, a.compute_ctas);
    const int comm_ctas = gridDim.x - compute_ctas;
    // chunks per block of A: from the host's split, the same on every rank (gather_chunks)
    const int chunks = gather_chunks((int)gridDim.x - a.compute_ctas);

    const GatherLaunch launch = GatherLaunch::begin(a.flags, L, comm_ctas);
    const u64 epoch = launch.epoch;

    // Communication CTAs copy first, then every CTA computes: the engine is entered from
    // this one place (a second entry would cost ptxas's register split between warpgroups),
    // and no SM idles once the copies are done.
    if ((int)blockIdx.x >= compute_ctas) {
        const GatherArgs gather = gather_args(a, a.input, (u64)a.rows * a.k * sizeof(T), nullptr, 0, chunks);
        gather_role(gather, epoch, ctx, blockIdx.x - compute_ctas, comm_ctas, launch.comm_all,
                    rank == muted_rank);
        __syncthreads();                 // the role's shared memory is the ring's and the engine's now
    }
    __shared__ roles::Ring ring;
    roles::ring_init<Cfg::CONSUMERS>(ring);
    const int mine = a.node * a.G + a.me;
    const GatheredWork tiles{{tiles_m, tiles_n, a.group_m, 0, 1}, (mine * a.rows) / BM,
                             a.rows % BM == 0 ? a.rows / BM : 0, a.node, a.me, a.G, a.N, a.rows, a.m,
                             a.flags, L, epoch, ctx, mine * a.rows, chunks,
                             (u64)a.k * sizeof(T)};
    const roles::ClaimedWork<GatheredWork, roles::CountedQueue> work{
        {a.flags + L.claims(), tiles_m * tiles_n}, tiles, &ring};
    const gemm::StoreEpilogue<T, BM, BN> store{a.out, a.m, a.n, a.n, (a.n % 2) == 0};
    gemm::run_tiles<Cfg>(&tma_a, &tma_b, a.k, work, store, dynamic_smem, &tma_own);
    launch.end(a.flags, L);
    roles::leave_launch(a.board);
}
""", requires=("gemm_tile", "gather_role", "roles"), register=False)

KERNEL_ID = kernel_id("allgather_gemm")
_CTYPES = {"bf16": "__nv_bfloat16", "f16": "__half"}
BLOCK_M, BLOCK_N = 128, 256

ARGS_DTYPE = np.dtype([
    ("input", "<u8"), ("out", "<u8"), ("gathered", "<u8"), ("flags", "<u8"),
    ("peer_flags", "<u8"), ("peer_gathered", "<u8"), ("queue", "<u8"),
    ("m", "<i4"), ("n", "<i4"), ("k", "<i4"), ("rows", "<i4"),
    ("group_m", "<i4"), ("me", "<i4"), ("node", "<i4"), ("G", "<i4"), ("N", "<i4"),
    ("compute_ctas", "<i4"), ("gathered_region", "<i4"), ("flags_region", "<i4"),
    ("board", "<u8"),
], align=True)

#: kernel parameters, in order (tensor maps 64-byte aligned)
LAUNCH_PARAMETERS = [("tma_a", 128, 64), ("tma_b", 128, 64), ("tma_own", 128, 64), ("args", ARGS_DTYPE, 8),
                     ("muted_rank", np.int32, 4), *CONTEXT_PARAMETERS]


@dataclasses.dataclass(frozen=True)
class AllGatherGemmSpec(gemm_module.OnEngine, KernelSpec):
    family = "allgather_gemm"
    entry_points = ("allgather_gemm",)

    dtype: str = "bf16"
    b_layout: str = "kn"
    block_m: int = dataclasses.field(default=BLOCK_M, metadata={"short": "bm"})
    block_n: int = dataclasses.field(default=BLOCK_N, metadata={"short": "bn"})
    stages: int = dataclasses.field(default=4, metadata={"short": "s"})

    def __post_init__(self):
        super().__post_init__()
        self.engine                   # the engine's own checks (dtype, layout, tile, smem)

    def template(self):
        return ALLGATHER_GEMM

    def params(self):
        return {"CTYPE": _CTYPES[self.dtype], "BLOCK_M": self.block_m, "BLOCK_N": self.block_n,
                "STAGES": self.stages, "B_K_MAJOR": self.b_layout == "nk",
                "MAX_NODE_RANKS": MAX_NODE_RANKS, "KERNEL_ID": f"{KERNEL_ID}ull",
                "ARGS_CHECKS": struct_size_assert("Args", ARGS_DTYPE)}


def default_specs() -> list[AllGatherGemmSpec]:
    stages = gemm_module.max_stages(BLOCK_M, BLOCK_N, "direct")
    return [AllGatherGemmSpec(dtype, layout, BLOCK_M, BLOCK_N, stages)
            for dtype in ("bf16", "f16") for layout in ("kn", "nk")]


# ---- the plan (pure Python) ----------------------------------------------------------------

def block_at(i: int, node: int, me: int, G: int, N: int) -> int:
    """The i-th block rank (node, me) computes on (the device's block_at): its node's blocks
    from its own, then each other node's, that node's rank with local index `me` first (its
    block is put straight here), the blocks forwarded by node peers after."""
    return ((node + i // G) % N) * G + (me + i % G) % G


@dataclasses.dataclass(frozen=True)
class Plan:
    """One call: shapes, world, the role split, and the order compute takes tile rows in."""

    m: int
    n: int
    k: int
    rows: int               # m / world size: one block of A
    nodes: int
    ranks_per_node: int
    ctas: int
    comm_ctas: int
    fused: bool
    reason: str
    dtype: str = "bf16"
    b_layout: str = "kn"
    block_m: int = BLOCK_M
    block_n: int = BLOCK_N

    @property
    def G(self) -> int:
        return self.ranks_per_node

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def tiles_m(self) -> int:
        return -(-self.m // self.block_m)

    @property
    def compute_ctas(self) -> int:
        return self.ctas - self.comm_ctas

    def tile_rows(self, rank: int) -> list[int]:
        """The order rank `rank` computes tile rows in (GatheredWork::tile_at): block by
        block in :func:`block_at` order when blocks are whole tile rows, else rotated so its
        own block's rows come first."""
        if self.rows % self.block_m == 0:
            per_block = self.rows // self.block_m
            node, me = divmod(rank, self.G)
            return [block_at(i // per_block, node, me, self.G, self.nodes) * per_block + i % per_block
                    for i in range(self.tiles_m)]
        shift = rank * self.rows // self.block_m
        return [(i + shift) % self.tiles_m for i in range(self.tiles_m)]

    def blocks_of(self, tile_row: int) -> list[int]:
        """Blocks of A whose rows tile row `tile_row` reads (the flags its producer waits for)."""
        row0 = tile_row * self.block_m
        row1 = min(row0 + self.block_m, self.m) - 1
        return list(range(row0 // self.rows, row1 // self.rows + 1))

    def schedule(self):
        """(workers, depends_on) of one call on every rank, for :func:`find_stall`: the
        communication role as mkrt.allgather moves data, then each rank's compute role
        taking tile rows in order, each after the blocks it reads are ready there."""
        workers, depends = {}, {}
        G, N = self.G, self.nodes
        for node in range(N):
            for local in range(G):
                rank = node * G + local
                tasks = [("arrive", rank)]
                for step in range(1, N):
                    other = (node + step) % N
                    send = ("put", rank, other * G + local)
                    tasks.append(send)
                    depends[send] = [("arrive", other * G + local)]
                for p in range(G):
                    push = ("ready", node * G + p, rank)          # block `rank` at peer p
                    tasks.append(push)
                    depends[push] = [("arrive", node * G + p)]
                for step in range(1, N):
                    other = (node + N - step) % N
                    block = other * G + local
                    for p in range(G):
                        if node * G + p == rank:
                            task = ("ready", rank, block)
                        else:
                            task = ("ready", node * G + p, block)
                        tasks.append(task)
                        depends[task] = [("put", block, rank)] + (
                            [("arrive", node * G + p)] if node * G + p != rank else [])
                workers[("comm", rank)] = tasks
                compute = []
                for tile_row in self.tile_rows(rank):
                    task = ("tile_row", rank, tile_row)
                    compute.append(task)
                    depends[task] = [("ready", rank, b) for b in self.blocks_of(tile_row)]
                workers[("compute", rank)] = compute
        return workers, depends

    def check(self) -> list[str]:
        """Problems (empty: fine): every block ready exactly once at every rank, each block
        crossing to each other node once, every tile row computed once, no wait cycle."""
        problems = []
        workers, depends = self.schedule()
        tasks = [t for ts in workers.values() for t in ts]
        for rank in range(self.world):
            ready = sorted(t[2] for t in tasks if t[0] == "ready" and t[1] == rank)
            if ready != list(range(self.world)):
                problems.append(f"rank {rank}: blocks not ready exactly once: {ready}")
            rows = sorted(t[2] for t in tasks if t[0] == "tile_row" and t[1] == rank)
            if rows != list(range(self.tiles_m)):
                problems.append(f"rank {rank}: tile rows not computed exactly once")
        for src_node in range(self.nodes):
            for dst_node in range(self.nodes):
                if src_node == dst_node:
                    continue
                crossing = [t for t in tasks if t[0] == "put" and t[1] // self.G == src_node
                            and t[2] // self.G == dst_node]
                if len(crossing) != self.G:         # each block of src_node, once
                    problems.append(f"node {src_node} -> {dst_node}: {len(crossing)} puts, "
                                    f"expected {self.G}")
        try:
            stall = find_stall(workers, depends)
        except ValueError as error:
            problems.append(str(error))
            return problems
        if stall:
            problems.append(f"wait cycle: {len(stall)} workers stuck, e.g. {stall[:3]}")
        return problems

    def traffic(self) -> dict[str, int]:
        block = self.rows * self.k * 2
        return {"network_per_node": block * self.G * (self.nodes - 1),
                "intra_per_rank": block * self.nodes * (self.G - 1)}


#: what the split rule assumes (fitted with the rule's other constants on
#: experiments/results/agg_split.jsonl at 54199cd, emulated 1x2 and 2x2 on the H200): bytes
#: a gathering CTA moves per second beside the GEMM, GEMM FLOP/s per compute CTA
GATHER_BYTES_PER_S_PER_CTA = 40e9
GEMM_FLOPS_PER_S_PER_CTA = 5.0e12


def gather_split(m: int, n: int, k: int, *, ctas: int, nodes: int, ranks_per_node: int) -> int:
    """Communication CTAs of the fused kernel: enough that the gathering role's copies take
    about as long as the GEMM of the rank's own rows (which read the rank's input and wait
    for nothing), so the other blocks are in when their tile rows come up; 30% over the
    balance, at least 2, at most half the CTAs. Since the communication CTAs join the
    compute role when their copies are done (02b9f9b), a generous split costs little: the
    CTA-time spent copying is about the same however many CTAs share it.

    Copied by SMs per rank: its block to every rank of its node, and with several nodes
    its block into its own buffer (for the put) and each other node's block it receives
    to the node's other ranks. Fitted (the bytes per CTA, the 30%, the cap) on the 10 shapes
    of experiments/agg_split.py at 54199cd (1x2, 2x2; static splits 2 to 24): the measured
    split nearest the pick is within 2.4% of the best on all 10 (the rule before, 50 GB/s
    and a 40% cap: within 7.8%). Not yet judged on other shapes."""
    G, N = ranks_per_node, nodes
    block = (m // (N * G)) * k * 2
    copied = block * (G + (N - 1) * (G - 1) + (N > 1))
    own_flops = 2.0 * (m // (N * G)) * n * k
    high = max(1, ctas // 2)
    best = high
    for c in range(1, high + 1):
        copy_s = copied / (c * GATHER_BYTES_PER_S_PER_CTA)
        gemm_s = own_flops / ((ctas - c) * GEMM_FLOPS_PER_S_PER_CTA)
        if copy_s <= gemm_s:
            best = c
            break
    return max(min(2, ctas - 1), min(high, math.ceil(1.3 * best)))


def plan(m: int, n: int, k: int, *, nodes: int, ranks_per_node: int, ctas: int,
         dtype: str = "bf16", b_layout: str = "kn", comm_ctas: int | None = None,
         fuse: bool | None = None) -> Plan:
    """Plan one call. ``m`` is the gathered rows (world size x rows per rank)."""
    area = "allgather_gemm"
    for name, value in (("m", m), ("n", n), ("k", k)):
        checks.integer(value, name, area, low=1, high=2**31 - 1)
    nodes = checks.integer(nodes, "nodes", area, low=1, high=32)
    ranks_per_node = checks.integer(ranks_per_node, "ranks_per_node", area, low=1,
                                    high=MAX_NODE_RANKS)
    ctas = checks.integer(ctas, "ctas", area, low=2)
    world = nodes * ranks_per_node
    if m % world:
        raise ValueError(f"mkrt.{area}: the gathered rows m={m} must be the world size {world} "
                         "times the rows per rank")
    if k % 8:
        raise ValueError(f"mkrt.{area}: k={k} must be a multiple of 8 (16-byte rows of A and B)")
    if b_layout == "kn" and n % 8:
        raise ValueError(f"mkrt.{area}: b_layout='kn' needs n % 8 == 0 (TMA rows of 16 bytes); "
                         f"got n={n}: pass B as [N, K] (b_layout='nk')")
    if comm_ctas is None:
        comm_ctas = gather_split(m, n, k, ctas=ctas, nodes=nodes, ranks_per_node=ranks_per_node)
    comm_ctas = checks.integer(comm_ctas, "comm_ctas", area, low=1, high=ctas - 1)
    if fuse is None:
        # Without measurements of this op yet, fuse when the GEMM has more tile rows than
        # blocks to wait for (enough work to hide the gather under); see the notes.
        fused = -(-m // BLOCK_M) >= 2 * world
        reason = ("fused: the GEMM has at least two tile rows per block of A" if fused else
                  "unfused: too few tile rows per block of A to hide the gather")
    else:
        fused, reason = bool(fuse), f"fuse={fuse} requested"
    return Plan(m, n, k, m // world, nodes, ranks_per_node, ctas, comm_ctas, fused, reason,
                dtype, b_layout)


# ---- reference ---------------------------------------------------------------------------

def reference(a_per_rank, b, *, b_layout: str = "kn", dtype=np.float64):
    """(all of A) @ b in float64: what a rank holding weight shard `b` should get."""
    import cupy
    xp = cupy if isinstance(a_per_rank[0], cupy.ndarray) else np
    a = xp.concatenate(list(a_per_rank), axis=0)
    return gemm_module.reference(a, b, b_layout=b_layout, dtype=dtype)


# ---- the op ----------------------------------------------------------------------------------

class AllGatherGemm(GatheringOp):
    """``c = op(a, b)``: every rank gets (A gathered over the world) @ b_r.

    a: per rank [R, K] (the rank's rows of A, world rank order; R equal on every rank);
    b: per rank [K, N_r] (``b_layout="kn"``) or [N_r, K] (``"nk"``); out: per rank
    [W * R, N_r]. ``gathered_out=``: per rank [W * R, K] arrays that receive A as well.
    ``ctas`` (default: the rank's SM share) and ``comm_ctas`` (the communication role's
    share; default :func:`gather_split`) split the CTAs; ``fuse=None`` or ``"measure"``
    (the default) times both paths once per size class and keeps the faster
    (mkrt/controller/fusion.py), ``"model"`` takes the plan's rule without timing
    (``op.last_plan.reason``).
    ``roles="search"`` (not yet measured on a GPU) starts from that split and, after four
    launches, finds it by launch time, per shape, on the GPU
    (:class:`mkrt.controller.rule.LaunchSearch`; :meth:`controller_state` shows it);
    ``"static"`` (default) keeps it.
    Launches of one op stay ordered on each rank's stream (as for every mkrt op).
    """

    name = "allgather_gemm"

    def __init__(self, world=None, *, b_layout: str = "kn", ctas: int | None = None,
                 comm_ctas: int | None = None, fuse: bool | None = None, group_m: int = 8,
                 timeout_ms: float | None = None, muted_rank: int | None = None,
                 roles: str = "static"):
        super().__init__(world, ctas=ctas, comm_ctas=comm_ctas, timeout_ms=timeout_ms,
                         muted_rank=muted_rank, roles=roles)
        if b_layout not in gemm_module.B_LAYOUTS:
            raise ValueError(f"mkrt.allgather_gemm: b_layout={b_layout!r}; expected 'kn' or 'nk'")
        area = self.name
        self.fuse = check_fuse(fuse, area)
        self.measured = MeasuredFusion()   # fuse="measure": the paths' times per size class
        self.group_m = checks.integer(group_m, "group_m", area, low=1, high=1 << 16)
        self.b_layout = b_layout
        self._gather_op = None
        self.last_plan: Plan | None = None

    # -- planning and buffers --
    def plan_for(self, m: int, n: int, k: int, dtype: str, mode_fuse=None) -> Plan:
        info = self.world.local[0]
        ctas = self.ctas or (self.world.sm_count(info.rank) if info.device is not None else 132)
        fuse = self.fuse if mode_fuse is None else mode_fuse
        return plan(m, n, k, nodes=self.world.nodes, ranks_per_node=self.world.ranks_per_node,
                    ctas=ctas, dtype=dtype, b_layout=self.b_layout, comm_ctas=self.comm_ctas,
                    fuse=None if fuse in ("measure", "model") else fuse)

    def _ensure_buffers(self, p: Plan) -> None:
        self._ensure_gathered(p.m * p.k * 2)

    def _args(self, p: Plan, info) -> np.ndarray:
        args = np.zeros((), ARGS_DTYPE)
        self._gather_args(args, info)
        args["m"], args["n"], args["k"], args["rows"] = p.m, p.n, p.k, p.rows
        args["group_m"], args["compute_ctas"] = self.group_m, p.compute_ctas
        return args

    # -- the call --
    def _prepared_call(self, a_list, b_list, outs, gathered_outs) -> "_PreparedCall":
        key = (a_list[0].shape, a_list[0].dtype, b_list[0].shape, b_list[0].dtype)
        call = self._prepared.get(key)
        if call is None:
            self.per_rank(a_list, "a")
            self.per_rank(b_list, "b")
            self.same_everywhere(a_list, "a")
            self.same_everywhere(b_list, "b")
            rows, n, k, dtype = gemm_module.check_operands(a_list[0].shape, b_list[0].shape,
                                                           a_list[0].dtype, b_list[0].dtype,
                                                           self.b_layout)
            m = rows * self.world.size
            p = self.plan_for(m, n, k, dtype)
            call = _PreparedCall(p, a_list[0].dtype, a_list[0].shape, b_list[0].shape, (m, n))
            self._prepared[key] = call
        self.check_arrays(a_list, "a", call.a_shape, call.dtype, aligned=True)
        self.check_arrays(b_list, "b", call.b_shape, call.dtype, aligned=True)
        if outs is not None:
            self.check_arrays(outs, "out", call.out_shape, call.dtype, aligned=True)
        if gathered_outs is not None:
            self.check_arrays(gathered_outs, "gathered_out", (call.plan.m, call.plan.k), call.dtype)
        return call

    def _begin(self, a, b, out, gathered_out):
        """The arguments as per-rank lists, checked, and the call's prepared state; the
        outputs made when not given. Both the op and its baseline start here."""
        a_list, as_list = self.arrays(a, "a")
        b_list, _ = self.arrays(b, "b")
        outs = self.arrays(out, "out")[0] if out is not None else None
        gathered = self.arrays(gathered_out, "gathered_out")[0] if gathered_out is not None else None
        call = self._prepared_call(a_list, b_list, outs, gathered)
        self.before_launch()
        if outs is None:
            outs = self.new_outputs(call.out_shape, call.dtype)
        return call, a_list, as_list, b_list, outs, gathered

    def __call__(self, a, b, out=None, *, gathered_out=None):
        call, a_list, as_list, b_list, outs, gathered = self._begin(a, b, out, gathered_out)
        if self.fuse == "measure" and not call.settled and self.world.size > 1:
            self._settle_fusion(call, a_list, b_list, outs)
        p = self.last_plan = call.plan
        if self.world.size == 1:
            gemm_module.gemm(a_list[0], b_list[0], out=outs[0], b_layout=self.b_layout)
            if gathered is not None:
                gathered[0][...] = a_list[0]
        elif p.fused:
            self._run(call, a_list, b_list, outs)
            if gathered is not None:
                self._copy_gathered(gathered, p)
        else:
            self._unfused(call, a_list, b_list, outs, gathered)
        self.after_launch()
        if out is not None:
            return out
        return outs if as_list else like_input(outs[0], a)

    def _settle_fusion(self, call: "_PreparedCall", a_list, b_list, outs) -> None:
        """``fuse="measure"``: this call's path, timed once per size class; the timed calls
        leave the caller's gathered copy of A alone."""
        self.measured.settle(self, call, lambda: self._run(call, a_list, b_list, outs),
                             lambda: self._unfused(call, a_list, b_list, outs, None))

    def _launches(self, call) -> list:
        if call.launches is not None and call.generation == self._generation:
            return call.launches
        p = call.plan
        self._ensure_buffers(p)       # a new generation when it (re)allocates the buffer
        spec = spec_for(p)
        launches = []
        for i, info in enumerate(self.world.local):
            function = spec.function("allgather_gemm", info.device, spec.smem_bytes)
            params = Parameters(LAUNCH_PARAMETERS)
            args = self._args(p, info)
            args["board"] = self._board_pointer(call, i, p.ctas, p.comm_ctas)
            params.set(args=args, muted_rank=self.muted_rank, **self.context_params(info.rank))
            launches.append(KernelLaunch(function, p.ctas, spec.threads, spec.smem_bytes, params))
        call.launches, call.generation = launches, self._generation
        call.words = [(launch.params.field_view("args", "input"),
                       launch.params.field_view("args", "out")) for launch in launches]
        call.b_pointers, call.own_pointers = {}, {}
        return launches

    def _call_shape(self, call) -> tuple:
        return (call.plan.m, call.plan.n, call.plan.k)

    def _run(self, call, a_list, b_list, outs) -> None:
        launches = self._launches(call)
        spec = spec_for(call.plan)
        p = call.plan
        for i, (info, launch) in enumerate(zip(self.world.local, launches)):
            pointer = b_list[i].data.ptr
            if call.b_pointers.get(i) != pointer:
                # A is read from the rank's gathered buffer, B from the caller's array.
                tma_a, tma_b = gemm_module.operand_descriptors(
                    spec.engine, self._gathered.local_ptr(info.rank), pointer, p.m, p.n, p.k)
                ctypes.memmove(launch.params.address("tma_a"), tma_a.address, 128)
                ctypes.memmove(launch.params.address("tma_b"), tma_b.address, 128)
                call.b_pointers[i] = pointer
            own = a_list[i].data.ptr
            if call.own_pointers.get(i) != own:
                # the tile rows of the rank's own block read its input: no wait for the copy
                tma_own = gemm_module.a_descriptor(spec.engine, own, p.rows, p.k)
                ctypes.memmove(launch.params.address("tma_own"), tma_own.address, 128)
                call.own_pointers[i] = own
            call.words[i][0][()] = a_list[i].data.ptr
            call.words[i][1][()] = outs[i].data.ptr
        self.launch(launches)

    def _copy_gathered(self, gathered, p: Plan) -> None:
        """A, from each rank's gathered buffer, on the caller's stream (after the ranks)."""
        for info, device, target in zip(self.world.local, self._local_devices, gathered):
            with self.on_device(device):
                target[...] = self._gathered.view(info.rank, target.dtype, (p.m, p.k))

    def _unfused(self, call, a_list, b_list, outs, gathered) -> None:
        """mkrt.allgather of A (world-wide), then cuBLAS per rank: the baseline."""
        import cupy
        if self._gather_op is None:
            self._gather_op = allgather_module.AllGather(self.world, timeout_ms=self.timeout_ms)
        full = gathered
        if full is None:
            full = self.kept_buffers("gathered", (call.plan.m, call.plan.k), call.dtype)
        views = [f.reshape(self.world.size, *a_list[0].shape) for f in full]
        self._gather_op(a_list, out=views)
        for device, f, b_r, out in zip(self._local_devices, full, b_list, outs):
            with self.on_device(device):
                cupy.matmul(f, b_r.T if self.b_layout == "nk" else b_r, out=out)

    def unfused(self, a, b, out=None, *, gathered_out=None):
        """The baseline: mkrt.allgather, then cuBLAS, not overlapped."""
        call, a_list, as_list, b_list, outs, gathered = self._begin(a, b, out, gathered_out)
        self._unfused(call, a_list, b_list, outs, gathered)
        self.after_launch()
        return out if out is not None else (outs if as_list else outs[0])

    def close(self) -> None:
        super().close()
        if self._gather_op is not None:
            self._gather_op.close()


def spec_for(p: Plan) -> AllGatherGemmSpec:
    return AllGatherGemmSpec(p.dtype, p.b_layout, p.block_m, p.block_n,
                             gemm_module.max_stages(p.block_m, p.block_n, "direct"))


@dataclasses.dataclass(eq=False)
class _PreparedCall:
    plan: Plan
    dtype: np.dtype
    a_shape: tuple
    b_shape: tuple
    out_shape: tuple
    launches: list | None = None
    generation: int = -1
    words: list | None = None
    b_pointers: dict = dataclasses.field(default_factory=dict)
    own_pointers: dict = dataclasses.field(default_factory=dict)   # A_r of each rank's own-rows map
    boards: list | None = None      # roles="search": per rank, the role board
    settled: bool = False           # fuse="measure": the path is chosen (plan.fused)


def allgather_gemm(a, b, *, world=None, out=None, b_layout: str = "kn", **options):
    """(A gathered over the world) @ b_r on every rank; see :class:`AllGatherGemm`."""
    return shared_op(AllGatherGemm, world, b_layout=b_layout, **options)(a, b, out=out)


def test_cases():
    """(layout, rows per rank, n, k, b_layout, dtype) the GPU tests run: blocks of whole
    tile rows (taken in arrival order) and not (rotated), one node and several."""
    return [("1x2", 256, 512, 128, "kn", "bf16"), ("1x2", 150, 520, 64, "nk", "bf16"),
            ("1x4", 300, 384, 136, "nk", "f16"), ("2x2", 256, 1000, 128, "nk", "bf16"),
            ("2x3", 100, 512, 200, "kn", "bf16"), ("2x3", 256, 392, 64, "nk", "bf16"),
            ("3x1", 200, 264, 64, "kn", "f16")]
