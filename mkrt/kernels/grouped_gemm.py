"""``mkrt.grouped_gemm``: one GEMM per group of rows, in one persistent launch (MoE's experts).

    out[o_g : o_g+1] = x[o_g : o_g+1] @ w[g]^T      for g = 0 .. G-1

x [R, K] (rows of every group, group by group), w [G, N, K] (each group's weight in the
``nn.Linear`` layout, [N, K]: what an MoE layer holds per expert), offsets [G + 1] int32
(group g's rows are offsets[g] .. offsets[g+1]); out [R, N]. Rows outside
[offsets[0], offsets[G]) are left as they are. bf16/fp16 in and out, fp32 accumulation.

The device code is the GEMM engine (kernels/device/gemm_tile.py) with a work list over
every group's tiles: group g has ceil(rows_g / BM) x ceil(N / BN) tiles, its m-tiles
starting at its first row (not at a multiple of BM: the engine loads A from ``a_row`` and
B from ``b_row``, and the store clips at the group's last row). The m-tiles per group are
summed once per CTA into shared memory (a warp scan of ``offsets``), so ``offsets`` may be
written by an earlier kernel on the device (MoE's dispatch) with no host round trip;
offsets out of [0, R] are clamped, empty groups have no tiles. Device offsets must be
nondecreasing (overlapping groups would write the same rows from two CTAs): host offsets
are checked for it.

Offsets given as a host sequence are checked (nondecreasing, within [0, R]) and uploaded
once per distinct value; a device int32 array is used as it is (checked for dtype, shape
and device only: its values live on the GPU).
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import math

import numpy as np

from mkrt.arrays import HALF_DTYPES, TorchView, as_cupy, dtype_name, is_torch, like_input
from mkrt.cuda import device_sm_count
from mkrt.jit import cuda_source
from mkrt.jit.spec import KernelSpec
from mkrt.kernels import gemm as gemm_module
from mkrt.kernels.launcher import KernelLaunch, Parameters, stream_workspace

MAX_GROUPS = 1024
#: the kernel's static shared memory beside the engine's dynamic share: tile_prefix and a
#: few words the engine adds (4,112 bytes in ptxas's report; 4,160 with stream-K's state),
#: with room to spare
STATIC_SMEM_BYTES = (MAX_GROUPS + 1) * 4 + 96

GROUPED_GEMM = cuda_source("grouped_gemm", r"""
using namespace mkrt;
typedef $CTYPE T;
constexpr bool TMA_STORE = $TMA_STORE;
constexpr bool STREAM_K = $STREAM_K;
typedef gemm::Config<T, $BLOCK_M, $BLOCK_N, $STAGES, true, TMA_STORE ? $BLOCK_M * $BLOCK_N * 2 : 0,
                     $CLUSTER_M> Cfg;
constexpr int MAX_GROUPS = $MAX_GROUPS;

using grouped::clamp_row;
typedef grouped::GroupedWork<Cfg> GroupedWork;

// Stream-K on the last, partial wave (STREAM_K, one CTA per tile): the full waves of the
// work list run whole, CTA c taking c, c + ctas, ...; the k-block iterations of the tiles
// after them are shared out over `sharing` CTAs (gemm::StreamKShare): at most max_parts
// per tail tile, so few long tiles are not cut into more parts than their adding-up
// repays. The tile count lives on the device (offsets may come from an earlier kernel),
// so the share is worked out here, once per CTA (plan), into shared memory: the
// StreamKShare state, then the parts' slot width (most parts of any tail tile) and
// tiles_n, which get() reads there (a register fewer held across the consumers' loop,
// where 256-wide tiles' accumulators leave none to spare).
struct GroupedStreamKWork {
    GroupedWork tiles;
    gemm::StreamKShare share;
    int k_blocks;
    enum { SPLITS = gemm::StreamKShare::STATE, TILES_N, STATE };

    __device__ static void plan(int* state, const GroupedWork& tiles, int k_blocks, int max_parts) {
        const int all = tiles.tiles(), ctas = tiles.ctas;
        const int whole = all / ctas * ctas, tail = all - whole;
        // every sharing CTA gets at least one iteration
        const int sharing = max(1, min(min(ctas, tail * max_parts), tail * k_blocks));
        gemm::StreamKShare::plan(state, all, whole, k_blocks, sharing, tiles.cta, ctas);
        state[SPLITS] = stream_k_splits(tail, k_blocks, sharing);
        state[TILES_N] = tiles.tiles_n;
    }
    // Most CTAs covering one tile of k_blocks when each of `sharing` CTAs takes at least
    // q = tail k_blocks / sharing iterations (the host sizes the workspace by the same bound)
    __device__ static int stream_k_splits(int tail, int k_blocks, int sharing) {
        if (tail == 0) return 1;
        const int q = tail * k_blocks / sharing;
        return (k_blocks + q - 1) / q + 1;
    }
    __device__ __forceinline__ bool get(int i, gemm::Tile& tile) const {
        return share.get(i, k_blocks, [&](int t) { return tiles.tile_at(t, share.state[TILES_N]); },
                         tile);
    }
    __device__ __forceinline__ bool wait(const gemm::Tile&) const { return true; }
};

// Tail tiles' parts in [slot][splits] (slot: the tile's place after the full waves);
// only the rows inside the tile's group are written and read back (a group's ragged last
// tile moves a fraction of a tile).
struct GroupedSlots {
    static constexpr bool LOAD_FIRST_PART = true;     // fits beside 256-wide direct stores
    const int* offsets;
    int* arrivals;
    const int* state;                   // GroupedStreamKWork's, in shared memory
    int rows;
    __device__ __forceinline__ long long first_part(const gemm::Tile& t) const {
        return (long long)t.slot * state[GroupedStreamKWork::SPLITS];
    }
    __device__ __forceinline__ int parts(const gemm::Tile& t) const { return t.parts; }
    __device__ __forceinline__ int* arrival(const gemm::Tile& t) const { return arrivals + t.slot; }
    __device__ __forceinline__ int rows_left(const gemm::Tile& t) const {
        return clamp_row(offsets[t.group + 1], rows) - t.a_row;
    }
};

// The engine's bounded store, moved to the tile's group: rows from a_row up to the group's
// end, columns up to n. TMA_STORE: a tile whose rows all lie in its group goes out by TMA
// stores from shared memory (they overlap the next tile's k-loop); a tile that crosses
// the group's end keeps the bounded direct stores (a TMA box would write the next
// group's rows).
struct GroupedStore {
    T* out;
    const int* offsets;
    int rows, n;
    bool pairs_aligned;
    gemm::TmaStoreEpilogue<T, Cfg::BM, Cfg::BN> whole_tiles;

    template <int CONSUMERS>
    __device__ __forceinline__ void finish(const gemm::ConsumerThread<CONSUMERS>& who) const {
        if constexpr (TMA_STORE) whole_tiles.finish(who);
    }
    template <int CONSUMERS>
    __device__ __forceinline__ void complete(const gemm::ConsumerThread<CONSUMERS>& who) const {
        if constexpr (TMA_STORE) whole_tiles.complete(who);
    }

    template <class Acc, int CONSUMERS>
    __device__ __forceinline__ void operator()(const gemm::Tile& tile, const Acc& acc,
                                               const gemm::ConsumerThread<CONSUMERS>& who) const {
        const int end = clamp_row(offsets[tile.group + 1], rows);
        if constexpr (TMA_STORE) {
            if (tile.a_row + Cfg::BM <= end) {
                whole_tiles.store_at(tile.a_row, tile.n * Cfg::BN, acc, who);
                return;
            }
        }
        // StoreEpilogue puts tile row 0 at m * BM: shift the matrix so it lands at a_row
        const long long shift = (long long)(tile.a_row - tile.m * Cfg::BM) * n;
        const gemm::StoreEpilogue<T, Cfg::BM, Cfg::BN> store{
            out + shift, end - tile.a_row + tile.m * Cfg::BM, n, n, pairs_aligned};
        store(tile, acc, who);
    }
};

extern "C" __global__ void $CLUSTER_DIMS __launch_bounds__(Cfg::THREADS, 1)
grouped_gemm(const __grid_constant__ TmaDescriptor tma_a,
             const __grid_constant__ TmaDescriptor tma_b,
             const __grid_constant__ TmaDescriptor tma_out,     // TMA_STORE only
             T* out, const int* offsets, int groups, int rows, int n, int k, int group_m,
             float* partials, int* arrivals, int max_parts) {       // STREAM_K only
    extern __shared__ char dynamic_smem[];
    __shared__ int tile_prefix[MAX_GROUPS + 1];
    if (threadIdx.x < 32) grouped::scan_units<Cfg::BM, Cfg::CLUSTER_M>(offsets, groups, rows, tile_prefix);
    __syncthreads();
    const int rank = Cfg::CLUSTER_M == 2 ? (int)cluster_rank() : 0;
    const GroupedWork work{offsets, tile_prefix, groups, rows, n, (n + Cfg::BN - 1) / Cfg::BN,
                           (int)blockIdx.x / Cfg::CLUSTER_M, (int)gridDim.x / Cfg::CLUSTER_M,
                           group_m, rank};
    const GroupedStore store{out, offsets, rows, n, (n % 2) == 0, {&tma_out}};
    if constexpr (STREAM_K) {
        __shared__ int stream_k_state[GroupedStreamKWork::STATE];
        const int k_blocks = (k + Cfg::BK - 1) / Cfg::BK;
        if (threadIdx.x == 0) GroupedStreamKWork::plan(stream_k_state, work, k_blocks, max_parts);
        __syncthreads();
        const GroupedStreamKWork shared_work{work, {stream_k_state}, k_blocks};
        const gemm::PartialSumEpilogue<GroupedStore, GroupedSlots> parts{
            store, {offsets, arrivals, stream_k_state, rows}, partials};
        gemm::run_tiles<Cfg>(&tma_a, &tma_b, k, shared_work, parts, dynamic_smem);
    } else {
        gemm::run_tiles<Cfg>(&tma_a, &tma_b, k, work, store, dynamic_smem);
    }
}
""", requires=("gemm_tile", "grouped_tiles", "partial_sums"), register=False)

_CTYPES = {"bf16": "__nv_bfloat16", "f16": "__half"}


@dataclasses.dataclass(frozen=True)
class GroupedGemmSpec(gemm_module.OnEngine, KernelSpec):
    """URI e.g. ``grouped_gemm_bf16_nk_bm128_bn256_s4_direct_sm90a`` (B is always [N, K] per
    group). epilogue "direct": every tile by bounded stores from registers; "tma": tiles
    whose rows lie in one group by TMA stores (needs N % 8 == 0), the rest direct.
    cluster "m2": clusters of two CTAs on pairs of one group's m-tiles, each loading half
    of the weight tile they share (TMA multicast); "": one CTA per tile. split "streamk":
    the tiles after the full waves are shared out by k-blocks (one CTA per tile)."""

    family = "grouped_gemm"
    entry_points = ("grouped_gemm",)

    dtype: str = "bf16"
    b_layout: str = "nk"
    block_m: int = dataclasses.field(default=128, metadata={"short": "bm"})
    block_n: int = dataclasses.field(default=256, metadata={"short": "bn"})
    stages: int = dataclasses.field(default=4, metadata={"short": "s"})
    epilogue: str = "direct"
    cluster: str = ""
    split: str = ""

    def __post_init__(self):
        super().__post_init__()
        if self.cluster not in CLUSTERS:
            raise ValueError(f"mkrt.grouped_gemm: cluster={self.cluster!r}; expected one of {CLUSTERS}")
        if self.epilogue not in EPILOGUES:
            raise ValueError(f"mkrt.grouped_gemm: epilogue={self.epilogue!r}; expected one of {EPILOGUES}")
        if self.split not in SPLITS:
            raise ValueError(f"mkrt.grouped_gemm: split={self.split!r}; expected one of {SPLITS}")
        if self.split and self.cluster:
            raise ValueError("mkrt.grouped_gemm: stream-K runs one CTA per tile; it takes cluster=''")
        if self.b_layout != "nk":
            raise ValueError("mkrt.grouped_gemm: weights are [G, N, K] (b_layout 'nk'); "
                             f"got {self.b_layout!r}")
        self.engine                   # the engine's checks (dtype, tile, shared memory)
        if self.smem_bytes + STATIC_SMEM_BYTES > gemm_module.SMEM_LIMIT:
            raise ValueError(f"mkrt.grouped_gemm: {self.stages} stages of {self.block_m}x{self.block_n} "
                             f"tiles need {self.smem_bytes} + {STATIC_SMEM_BYTES} bytes of shared memory; "
                             f"at most {gemm_module.SMEM_LIMIT} (use spec_for)")

    def template(self):
        return GROUPED_GEMM

    def params(self):
        return {"CTYPE": _CTYPES[self.dtype], "BLOCK_M": self.block_m, "BLOCK_N": self.block_n,
                "STAGES": self.stages, "MAX_GROUPS": MAX_GROUPS,
                "TMA_STORE": self.epilogue == "tma", "CLUSTER_M": self.cluster_m,
                "STREAM_K": self.split == "streamk",
                "CLUSTER_DIMS": "__cluster_dims__(2, 1, 1)" if self.cluster_m == 2 else ""}

    @property
    def cluster_m(self) -> int:
        return 2 if self.cluster == "m2" else 1


EPILOGUES = ("direct", "tma")
CLUSTERS = ("", "m2")
SPLITS = ("", "streamk")


def spec_for(dtype: str, block_m: int, block_n: int = 256, epilogue: str = "direct",
             cluster: str = "", split: str = "") -> GroupedGemmSpec:
    return GroupedGemmSpec(dtype, "nk", block_m, block_n,
                           gemm_module.max_stages(block_m, block_n, epilogue, STATIC_SMEM_BYTES),
                           epilogue, cluster, split)


def default_specs() -> list[GroupedGemmSpec]:
    return [spec_for(dtype, *tile, epilogue, cluster, split) for dtype in _CTYPES
            for tile in TILE_EFFICIENCY for epilogue in EPILOGUES for cluster in CLUSTERS
            for split in SPLITS if not (cluster and split)]


# ---- stream-K on the last wave -----------------------------------------------------------

#: most parts a tail tile is cut into (GroupedStreamKWork): the CTAs sharing the tail are
#: at most this many per tail tile
STREAM_K_MAX_PARTS = 16


def stream_k_share(tiles: int, ctas: int, k_blocks: int, max_parts: int) -> tuple[int, int, int]:
    """(whole, sharing, splits) of GroupedStreamKWork::plan, in Python: tiles [0, whole) run
    whole (the full waves), the rest's k-blocks go to `sharing` CTAs, and a tail tile has
    at most `splits` parts."""
    whole = tiles // ctas * ctas
    tail = tiles - whole
    sharing = max(1, min(ctas, tail * max_parts, tail * k_blocks))
    if tail == 0:
        return whole, sharing, 1
    q = tail * k_blocks // sharing
    return whole, sharing, -(-k_blocks // q) + 1


def stream_k_slots(ctas: int, k_blocks: int, max_parts: int, most_tiles: int) -> int:
    """Parts the workspace must hold for any tile count the device may find (up to
    most_tiles): the most of tail tiles x splits over every tail size."""
    return max((tail * stream_k_share(tail, ctas, k_blocks, max_parts)[2]
                for tail in range(1, min(ctas - 1, most_tiles) + 1)), default=0)


def choose_block_m(rows: int, groups: int) -> int:
    """64-row tiles when groups average fewer than 128 rows (MoE decode, many experts):
    less of each group's last tile is padding. (The rule before choose_tile; kept for
    callers that fix block_n and for the comparison in experiments/grouped_tiles_fit.py.)"""
    return 64 if rows < 128 * groups else 128


#: work per unit time of each tile shape against a 128x256 tile's, fitted on the expert-GEMM
#: suite's sweep (experiments/grouped_tiles_fit.py on grouped_gemm_tiles.jsonl at 51fa866):
#: the fit set leaves 64x256 in [0.95, 0.975], 128x128 in [0.975, 1.0] and 64x128 anywhere
#: in [0.4, 0.925] (never the fastest there); the middle of each range is taken
TILE_EFFICIENCY = {(128, 256): 1.0, (64, 256): 0.9625, (128, 128): 0.9875, (64, 128): 0.6625}


def expected_m_tiles(rows: int, groups: int, block_m: int) -> float:
    """Row tiles of `rows` rows in `groups` groups whose sizes the host does not know (device
    offsets): every group with rows takes at least one, and a group's last tile is half
    padding on average."""
    occupied = min(groups, rows)
    return max(occupied, -(-rows // block_m) + occupied / 2)


def choose_tile(rows: int, groups: int, n: int, sms: int,
                efficiency: dict | None = None) -> tuple[int, int]:
    """(block_m, block_n) with the least expected time: whole waves of tiles over the grid,
    each as long as its share of a 128x256 tile's work over its efficiency. The waves are
    what the old rule missed: Mixtral's w2 (2 experts of about 1024 rows, N 4096) makes 272
    128x256 tiles, a third wave of 8 on 132 SMs; 64x256 tiles make 528, four full waves
    (1.46x faster, 51fa866)."""
    efficiency = efficiency or TILE_EFFICIENCY
    if rows == 0:
        return (choose_block_m(rows, groups), 256)

    def expected_time(tile):
        block_m, block_n = tile
        tiles = expected_m_tiles(rows, groups, block_m) * -(-n // block_n)
        waves = math.ceil(tiles / min(sms, math.ceil(tiles)))
        return waves * (block_m * block_n / (128 * 256)) / efficiency[tile]
    return min(efficiency, key=expected_time)


def tile_order(group_rows, n: int, block_m: int, block_n: int, group_m: int,
               cluster_m: int = 1) -> list[tuple]:
    """The tiles GroupedWork hands out, in order, in Python (a CPU test checks them): for
    units t = 0, 1, ... and, with clusters of two, ranks 0 and 1 of each: (group, m-tile
    within the group, n-tile, first row of x). With clusters a group of an odd m-tile
    count ends with a tile past its rows (its stores are clipped)."""
    offsets = np.concatenate([[0], np.cumsum(group_rows)]).astype(int)
    units_m = [-(-(-(-int(r) // block_m)) // cluster_m) for r in group_rows]
    prefix = np.concatenate([[0], np.cumsum(units_m)]).astype(int)
    tiles_n = -(-n // block_n)
    order = []
    for t in range(int(prefix[-1]) * tiles_n):
        virtual_m = t // tiles_n
        group = int(np.searchsorted(prefix, virtual_m, side="right")) - 1   # last g: prefix[g] <= virtual_m
        local = t - int(prefix[group]) * tiles_n
        rows_in_group = int(prefix[group + 1] - prefix[group])
        band = local // (group_m * tiles_n)                    # gemm::RasterWork::tile_at
        first_m = band * group_m
        band_rows = min(group_m, rows_in_group - first_m)
        within = local - band * group_m * tiles_n
        unit_m, n_tile = first_m + within % band_rows, within // band_rows
        for rank in range(cluster_m):
            m_tile = unit_m * cluster_m + rank
            order.append((group, m_tile, n_tile, int(offsets[group]) + m_tile * block_m))
    return order


# ---- checks ------------------------------------------------------------------------------

#: bytes of one group's weight above which its tiles go in bands of 8 m-tiles: a quarter of
#: the H200's 50 MB L2 (the rows of x and the other groups' tiles share it)
BAND_WEIGHT_BYTES = 12 << 20


def band_m_tiles(n: int, k: int, itemsize: int = 2) -> int:
    """m-tiles per raster band inside a group (GroupedWork): 1 (m-tile-major) while a
    group's weight fits comfortably in L2, where it is read from memory once however the
    m-tiles go by; 8 above that, so concurrent CTAs share weight tiles instead of
    streaming the weight once per m-tile. Measured on experiments/grouped_gemm.py's suite:
    bands of 8 took Mixtral's w1 (235 MB per expert) from 0.72x to 0.91x of torch and
    DeepSeek's w1 from 1.08x to 1.34x (54199cd). Qwen3's small experts (6 and 3 MB) ran
    about as slowly with bands of 8 (54199cd) as m-tile-major (932f011), both below
    9c5fb11's figures: their 0.1-0.2 ms calls are timed with host time included, so the
    threshold rests on the L2 argument, not on those two."""
    return 8 if n * k * itemsize > BAND_WEIGHT_BYTES else 1


def check_operands(x_shape, w_shape, x_dtype, w_dtype, groups_from_offsets: int | None = None):
    """(rows, n, k, groups, dtype) of valid operands; TypeError/ValueError otherwise."""
    for name, dtype in (("x", x_dtype), ("w", w_dtype)):
        if np.dtype(dtype) not in HALF_DTYPES:
            raise TypeError(f"mkrt.grouped_gemm: {name} has dtype {dtype_name(dtype)}; expected bf16 or f16")
    if np.dtype(x_dtype) != np.dtype(w_dtype):
        raise TypeError(f"mkrt.grouped_gemm: x is {dtype_name(x_dtype)}, w {dtype_name(w_dtype)}; "
                        "expected one dtype")
    if len(x_shape) != 2 or len(w_shape) != 3:
        raise ValueError(f"mkrt.grouped_gemm: x {tuple(x_shape)} must be [R, K] and w {tuple(w_shape)} "
                         "[G, N, K]")
    rows, k = (int(v) for v in x_shape)
    groups, n, kw = (int(v) for v in w_shape)
    if kw != k:
        raise ValueError(f"mkrt.grouped_gemm: x has K={k}, w has K={kw}")
    if k < 8 or k % 8:
        raise ValueError(f"mkrt.grouped_gemm: K={k} must be a positive multiple of 8 (TMA needs "
                         "16-byte rows)")
    if rows < 0:
        raise ValueError(f"mkrt.grouped_gemm: x {tuple(x_shape)} has a negative row count")
    if n < 1 or groups < 1:
        raise ValueError(f"mkrt.grouped_gemm: w {tuple(w_shape)} has no groups or no columns")
    if groups > MAX_GROUPS:
        raise ValueError(f"mkrt.grouped_gemm: {groups} groups; at most {MAX_GROUPS}")
    if groups_from_offsets is not None and groups_from_offsets != groups:
        raise ValueError(f"mkrt.grouped_gemm: offsets name {groups_from_offsets} groups, w has {groups}")
    if rows >= 2**31 or groups * n >= 2**31:
        raise ValueError(f"mkrt.grouped_gemm: x {tuple(x_shape)}, w {tuple(w_shape)} exceed 2**31 rows")
    return rows, n, k, groups, dtype_name(x_dtype)


def check_host_offsets(offsets, groups: int, rows: int) -> np.ndarray:
    """Host offsets as int32, after checking length, order and range."""
    array = np.asarray(offsets)
    if array.ndim != 1 or array.shape[0] != groups + 1:
        raise ValueError(f"mkrt.grouped_gemm: offsets must be {groups + 1} values (group g's rows "
                         f"are offsets[g] .. offsets[g+1]); got shape {array.shape}")
    if not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"mkrt.grouped_gemm: offsets must be integers; got {array.dtype}")
    if np.any(np.diff(array) < 0) or array[0] < 0 or array[-1] > rows:
        raise ValueError(f"mkrt.grouped_gemm: offsets must be nondecreasing within [0, {rows}]; "
                         f"got {array.tolist()[:8]}{'...' if len(array) > 8 else ''}")
    return array.astype(np.int32)


# ---- launcher ----------------------------------------------------------------------------

class _Prepared:
    def __init__(self, spec: GroupedGemmSpec, device: int, grid: int, rows: int, n: int, k: int,
                 groups: int, most_tiles: int = 0):
        self.spec, self.rows, self.n, self.k, self.groups = spec, rows, n, k, groups
        self.device = device
        params = Parameters([("tma_a", 128, 64), ("tma_b", 128, 64), ("tma_out", 128, 64),
                             ("out", np.uint64, 8),
                             ("offsets", np.uint64, 8), ("groups", np.int32, 4),
                             ("rows", np.int32, 4), ("n", np.int32, 4), ("k", np.int32, 4),
                             ("group_m", np.int32, 4), ("partials", np.uint64, 8),
                             ("arrivals", np.uint64, 8), ("max_parts", np.int32, 4)])
        # bands of m-tiles, in the work list's units (pairs of m-tiles with clusters)
        params.set(groups=groups, rows=rows, n=n, k=k,
                   group_m=max(1, band_m_tiles(n, k) // spec.cluster_m),
                   max_parts=STREAM_K_MAX_PARTS)
        # stream-K: parts of tail tiles, whatever tile count the device finds
        self.stream_k_parts = stream_k_slots(grid, -(-k // 64), STREAM_K_MAX_PARTS, most_tiles) \
            if spec.split == "streamk" else 0
        self._workspaces: dict = {}     # stream -> (partials, arrivals)
        self._bound_stream = None
        function = spec.function("grouped_gemm", device, spec.smem_bytes)
        if spec.cluster_m > 1:
            grid = gemm_module.cluster_grid(spec, function, grid, device)
        self.launch = KernelLaunch(function, grid, spec.threads, spec.smem_bytes, params)
        self._out, self._offsets = params.view("out"), params.view("offsets")
        self._pointers = None
        self._out_pointer = None

    def patch(self, x_ptr: int, w_ptr: int, out_ptr: int, offsets_ptr: int) -> None:
        spec, params = self.spec, self.launch.params
        if self._pointers != (x_ptr, w_ptr):
            tma_a = gemm_module.tma_descriptor_2d(x_ptr, spec.dtype, self.k, self.rows, self.k * 2,
                                                  64, spec.block_m)
            # with clusters each CTA of a pair loads (and multicasts) half of the tile's rows
            tma_b = gemm_module.tma_descriptor_2d(w_ptr, spec.dtype, self.k, self.groups * self.n,
                                                  self.k * 2, 64, spec.block_n // spec.cluster_m)
            ctypes.memmove(params.address("tma_a"), tma_a.address, 128)
            ctypes.memmove(params.address("tma_b"), tma_b.address, 128)
            self._pointers = (x_ptr, w_ptr)
        if spec.epilogue == "tma" and self._out_pointer != out_ptr:
            tma_out = gemm_module.tma_descriptor_2d(out_ptr, spec.dtype, self.n, self.rows,
                                                    self.n * 2, 64, 64)
            ctypes.memmove(params.address("tma_out"), tma_out.address, 128)
            self._out_pointer = out_ptr
        self._out[()] = out_ptr
        self._offsets[()] = offsets_ptr

    def run(self, stream_ptr: int) -> None:
        """Launch on a stream. Stream-K's parts meet in a workspace of their own per stream
        (two streams running one signature at once must not add each other's parts)."""
        if self.stream_k_parts and self._bound_stream != stream_ptr:
            import cupy
            # fp32 parts, and per tail tile (fewer than the grid) a counter that is zero
            # between calls (zeroed on this stream, before its first launch)
            workspace, kept = stream_workspace(self._workspaces, self.device, stream_ptr, lambda: (
                cupy.empty(self.stream_k_parts * self.spec.block_m * self.spec.block_n, dtype=np.float32),
                cupy.zeros(self.launch.grid, dtype=np.int32)))
            self.launch.params.set(partials=workspace[0].data.ptr, arrivals=workspace[1].data.ptr)
            self._bound_stream = stream_ptr if kept else None
        self.launch(stream_ptr)


_PREPARED: "collections.OrderedDict[tuple, _Prepared]" = collections.OrderedDict()
_HOST_OFFSETS: "collections.OrderedDict[tuple, object]" = collections.OrderedDict()


def _view(a, name: str):
    """What the launch reads of a device array (shape, dtype, pointer, device, layout): the
    CuPy array itself, a TorchView of a torch tensor (no DLPack round trip: the conversions
    cost more host time than a small grouped GEMM's kernel), or a CuPy view of anything else."""
    import cupy
    if type(a) is cupy.ndarray:
        return a
    return TorchView(a, name) if is_torch(a) else as_cupy(a, name)


def _device_offsets(offsets, groups: int, rows: int, device: int):
    """A device int32 array of `offsets` (host values checked and uploaded once)."""
    import cupy
    if isinstance(offsets, cupy.ndarray) or hasattr(offsets, "__cuda_array_interface__") \
            or (hasattr(offsets, "__dlpack__") and not isinstance(offsets, np.ndarray)):
        view = _view(offsets, "offsets")
        if view.dtype != np.int32 or view.shape != (groups + 1,) or not view.flags.c_contiguous:
            raise ValueError(f"mkrt.grouped_gemm: device offsets must be a contiguous int32 "
                             f"array of {groups + 1}; got {view.shape} {dtype_name(view.dtype)}")
        if view.data.device_id != device:
            raise ValueError(f"mkrt.grouped_gemm: offsets are on GPU {view.data.device_id}, x on "
                             f"GPU {device}")
        return view
    host = check_host_offsets(offsets, groups, rows)
    key = (host.tobytes(), device)
    uploaded = _HOST_OFFSETS.get(key)
    if uploaded is None:
        with cupy.cuda.Device(device):
            if len(_HOST_OFFSETS) >= 64:
                # an evicted array may still be read by a launch on another stream
                cupy.cuda.Device(device).synchronize()
                _HOST_OFFSETS.popitem(last=False)
            uploaded = _HOST_OFFSETS[key] = cupy.asarray(host)
            # landed before any stream's launch reads it (once per distinct value)
            cupy.cuda.get_current_stream().synchronize()
    return uploaded


def _tile(rows: int, groups: int, n: int, sms: int, block_m: int | None,
          block_n: int | None) -> tuple[int, int]:
    """The tile a call uses: choose_tile's when neither side is given, else the given
    side(s), block_m by choose_block_m and block_n 256 otherwise."""
    if block_m is None and block_n is None:
        return choose_tile(rows, groups, n, sms)
    return (choose_block_m(rows, groups) if block_m is None else block_m,
            256 if block_n is None else block_n)


#: average rows per group from which tiles go out by TMA stores. On the expert-GEMM suite
#: (experiments/grouped_gemm.py, 4b502a3, timed in turns) groups of about 128 rows ran
#: 1-6% slower with TMA stores (DeepSeek: more tiles cross a group's end and are stored
#: directly anyway, and the staging area costs a pipeline stage), groups of 512 and more
#: 2-22% faster (Qwen3, Mixtral); the threshold is the geometric middle of the two. On the
#: 11 held-out expert GEMMs the rule's epilogue takes 1.010x the faster one's time
#: (geomean; worst 1.046x), direct stores everywhere 1.059x (worst 1.363x), TMA stores
#: everywhere 1.016x (worst 1.057x).
TMA_STORE_ROWS_PER_GROUP = 256


def choose_epilogue(rows: int, groups: int, n: int) -> str:
    """"tma" where groups average TMA_STORE_ROWS_PER_GROUP rows or more (and N % 8 == 0),
    else "direct"."""
    return "tma" if n % 8 == 0 and rows >= TMA_STORE_ROWS_PER_GROUP * groups else "direct"


def _epilogue(epilogue: str | None, rows: int, groups: int, n: int) -> str:
    """The epilogue a call uses: the one asked for ("tma" needs N % 8 == 0), else
    choose_epilogue's."""
    if epilogue is None:
        return choose_epilogue(rows, groups, n)
    if epilogue not in EPILOGUES:
        raise ValueError(f"mkrt.grouped_gemm: epilogue={epilogue!r}; expected one of {EPILOGUES}")
    if epilogue == "tma" and n % 8:
        raise ValueError(f"mkrt.grouped_gemm: epilogue='tma' needs N % 8 == 0 (16-byte rows of "
                         f"out); N={n}")
    return epilogue


def choose_cluster(rows: int, groups: int, n: int) -> str:
    """One CTA per tile (""), for every call: with the rule's tile and epilogue, pairs of
    m-tiles sharing each weight load ran slower than single CTAs on all 7 suite cases
    (0.743-0.992x torch against 0.873-1.437x) and on 10 of the 11 held-out expert GEMMs,
    tying on the eleventh (Mixtral w2, 8192 rows: 1.001 against 1.000;
    grouped_gemm_cluster.jsonl, 308fa51). ``cluster="m2"`` stays an option."""
    return ""


def _cluster(cluster: str | None, rows: int, groups: int, n: int) -> str:
    if cluster is None:
        return choose_cluster(rows, groups, n)
    if cluster not in CLUSTERS:
        raise ValueError(f"mkrt.grouped_gemm: cluster={cluster!r}; expected one of {CLUSTERS}")
    return cluster


def choose_stream_k(rows: int, groups: int, n: int, k: int, sms: int, tile: tuple[int, int],
                    cluster: str) -> bool:
    """Whether the last wave's tiles are shared out by k-blocks: never by default. Measured
    (grouped_gemm_stream_k.jsonl, 6888eda; experiments/grouped_stream_k_fit.py): the best
    rule fitted on the suite gained 0.4% there and lost up to 1.48x on held-out expert GEMMs
    (Llama-4 Scout w2 at 1024 rows); `stream_k=True` stays available."""
    return False


def _stream_k(stream_k, rows: int, groups: int, n: int, k: int, sms: int, tile, cluster: str) -> bool:
    if stream_k is None:
        return choose_stream_k(rows, groups, n, k, sms, tile, cluster) and \
            _stream_k_fits(sms, k)
    if not isinstance(stream_k, (bool, np.bool_)):
        raise ValueError(f"mkrt.grouped_gemm: stream_k={stream_k!r} must be True, False or None")
    if stream_k and cluster:
        raise ValueError("mkrt.grouped_gemm: stream_k=True runs one CTA per tile; it takes "
                         "cluster='' (or None)")
    if stream_k and not _stream_k_fits(sms, k):
        raise ValueError(f"mkrt.grouped_gemm: stream_k=True with K={k} on {sms} SMs passes the "
                         "kernel's 32-bit iteration index")
    return bool(stream_k)


def _stream_k_fits(sms: int, k: int) -> bool:
    """The device's share arithmetic (tail k-blocks x sharing CTAs) stays in 32 bits."""
    return sms * sms * -(-k // 64) < 2**31


def build(rows: int, groups: int, n: int, dtype: str, device: int, sms: int | None = None,
          block_m: int | None = None, block_n: int | None = None,
          epilogue: str | None = None, cluster: str | None = None,
          stream_k: bool | None = None, k: int | None = None) -> None:
    """Compile and load the kernel :func:`grouped_gemm` will launch for `rows` rows in
    `groups` groups of `n` columns on `sms` SMs (callers that launch kernels waiting for
    each other, such as MoE's ranks, build first: a compile between two ranks' launches
    stalls the first one). ``stream_k=None`` (the rule's) needs ``k``."""
    sms = device_sm_count(device) if sms is None else sms
    tile, cluster = _tile(rows, groups, n, sms, block_m, block_n), _cluster(cluster, rows, groups, n)
    if stream_k is None and k is None:
        raise ValueError("mkrt.grouped_gemm.build: stream_k=None (the rule's) needs k")
    split = "streamk" if _stream_k(stream_k, rows, groups, n, k or 64, sms, tile, cluster) else ""
    spec = spec_for(dtype, *tile, _epilogue(epilogue, rows, groups, n), cluster, split)
    spec.function("grouped_gemm", device, spec.smem_bytes)


def grouped_gemm(x, w, offsets, out=None, *, block_m: int | None = None, block_n: int | None = None,
                 sms: int | None = None, epilogue: str | None = None, cluster: str | None = None,
                 stream_k: bool | None = None, stream=None):
    """``out[offsets[g]:offsets[g+1]] = x[offsets[g]:offsets[g+1]] @ w[g].T`` for every g.

    x: [R, K] device array; w: [G, N, K] (each group's weight as nn.Linear holds it);
    offsets: G + 1 group boundaries (a host sequence, checked; or a device int32 array,
    used as it is); out: optional [R, N]. ``block_m`` 64 or 128, ``block_n`` 128 or 256
    (default: :func:`choose_tile`'s, from the rows, groups, N and SMs). ``sms``: the SMs
    the kernel may use (default all). ``epilogue`` "direct" or "tma": tiles whose rows lie in
    one group stored by TMA (N % 8 == 0); default: :func:`choose_epilogue`'s, from the rows
    per group. ``cluster`` "m2": clusters of two CTAs on pairs of a group's m-tiles share
    each weight load (TMA multicast); "": one CTA per tile; default: :func:`choose_cluster`'s.
    ``stream_k=True``: the tiles after the full waves (as many as the device finds from the
    offsets) are shared out by k-blocks over the grid, each tile's parts added up in a
    fixed order (bit-identical between calls; one CTA per tile, a float32 workspace per
    stream); default: :func:`choose_stream_k`'s. Returns out in the type of ``x``.
    """
    import cupy

    xv, wv = _view(x, "x"), _view(w, "w")
    out_view = None if out is None else _view(out, "out")
    # out given in x's kind (torch or not) is returned as it is; otherwise in x's kind
    out_as_given = out is not None and is_torch(out) == is_torch(x)
    rows, n, k, groups, dtype = check_operands(xv.shape, wv.shape, xv.dtype, wv.dtype)
    device = xv.data.device_id
    for name, a in (("x", xv), ("w", wv), ("out", out_view)):
        if a is None:
            continue
        if a.data.device_id != device:
            raise ValueError(f"mkrt.grouped_gemm: {name} is on GPU {a.data.device_id}, x on GPU {device}")
        if not a.flags.c_contiguous or a.data.ptr % 16:
            raise ValueError(f"mkrt.grouped_gemm: {name} must be C-contiguous and 16-byte aligned")
    if out_view is not None and (tuple(out_view.shape) != (rows, n) or out_view.dtype != xv.dtype):
        raise ValueError(f"mkrt.grouped_gemm: out is {tuple(out_view.shape)} {dtype_name(out_view.dtype)}; "
                         f"expected {(rows, n)} {dtype}")
    total_sms = device_sm_count(device)
    if sms is None:
        sms = total_sms
    elif isinstance(sms, bool) or not isinstance(sms, (int, np.integer)) or not 1 <= sms <= total_sms:
        raise ValueError(f"mkrt.grouped_gemm: sms={sms!r}; expected an integer in [1, {total_sms}]")
    if block_m not in (None, 64, 128):
        raise ValueError(f"mkrt.grouped_gemm: block_m={block_m!r}; expected 64 or 128")
    if block_n not in (None, 128, 256):
        raise ValueError(f"mkrt.grouped_gemm: block_n={block_n!r}; expected 128 or 256")
    if not (stream_k is None or isinstance(stream_k, (bool, np.bool_))):
        raise ValueError(f"mkrt.grouped_gemm: stream_k={stream_k!r} must be True, False or None")
    epilogue = _epilogue(epilogue, rows, groups, n)
    if stream_k is True and cluster is None:
        cluster = ""
    cluster = _cluster(cluster, rows, groups, n)
    offsets_view = _device_offsets(offsets, groups, rows, device)
    if rows == 0:
        if out_as_given:
            return out
        return like_input(as_cupy(out, "out") if out is not None else cupy.empty((0, n), xv.dtype), x)
    # keyed by the tile as asked for: choose_tile runs once per signature, not per call
    key = (rows, n, k, groups, dtype, block_m, block_n, int(sms), epilogue, cluster, stream_k,
           STREAM_K_MAX_PARTS, device)
    call = _PREPARED.get(key)
    if call is None:
        block_m, block_n = _tile(rows, groups, n, int(sms), block_m, block_n)
        split = "streamk" if _stream_k(stream_k, rows, groups, n, k, int(sms), (block_m, block_n),
                                       cluster) else ""
        # the grid: every SM, or fewer when even full groups could not fill them (stream-K:
        # every SM, the tail's k-blocks go round)
        most_tiles = (-(-rows // block_m) + groups) * -(-n // block_n)
        spec = spec_for(dtype, block_m, block_n, epilogue, cluster, split)
        # clusters: whole pairs, their pair units (a group's last pair may hold one tile)
        units = ((-(-rows // block_m) + 1) // spec.cluster_m + groups) * -(-n // block_n)
        grid = int(sms) if split else min(int(sms), most_tiles) if spec.cluster_m == 1 else \
            2 * min(int(sms) // 2, units)
        if grid < 1:
            raise ValueError(f"mkrt.grouped_gemm: cluster='m2' needs sms >= 2; got {sms}")
        call = _PREPARED[key] = _Prepared(spec, device, grid, rows, n, k, groups, most_tiles)
        if len(_PREPARED) > 256:
            _PREPARED.popitem(last=False)
    with cupy.cuda.Device(device):
        if out_view is None:
            out_view = cupy.empty((rows, n), dtype=xv.dtype)
        call.patch(xv.data.ptr, wv.data.ptr, out_view.data.ptr, offsets_view.data.ptr)
        call.run((stream or cupy.cuda.get_current_stream()).ptr)
    if out_as_given:
        return out
    return like_input(out_view if out is None else as_cupy(out, "out"), x)


def reference(x, w, offsets, dtype=np.float32):
    """The groups' products in `dtype` (rows outside the groups are zero)."""
    xp = np if isinstance(x, np.ndarray) else __import__("cupy")
    x32 = gemm_module.to_float32(x).astype(dtype)
    w32 = gemm_module.to_float32(w).astype(dtype)
    offsets = [int(v) for v in (offsets.get() if hasattr(offsets, "get") else offsets)]
    out = xp.zeros((x.shape[0], w.shape[1]), dtype=dtype)
    for g in range(w.shape[0]):
        a, b = offsets[g], offsets[g + 1]
        if b > a:
            out[a:b] = x32[a:b] @ w32[g].T
    return out


def test_cases():
    """(group rows, n, k, dtype) the GPU tests run: empty groups, one row, ragged, a hot group,
    and weights past BAND_WEIGHT_BYTES (bands of 8 m-tiles, a band cut short)."""
    return [([128, 128], 256, 64, "bf16"), ([0, 1, 0, 300, 17], 520, 72, "bf16"),
            ([5] * 64, 384, 128, "f16"), ([1000, 0, 3, 64], 1000, 2048, "bf16"),
            ([33, 97, 130, 255, 256, 257], 136, 200, "bf16"),
            ([1300, 0, 129], 1608, 4104, "bf16")]
