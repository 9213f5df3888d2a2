"""``mkrt.gemm``: the Hopper GEMM engine as a world-free op.

C[M, N] = A[M, K] @ B, with A row-major [M, K] and B either row-major [K, N]
(``b_layout="kn"``) or [N, K] (``b_layout="nk"``, the ``nn.Linear`` weight layout).
bf16 or fp16 in and out, fp32 accumulation.

The device code is the shared engine ``mkrt::gemm::run_tiles`` (kernels/device/gemm_tile.py);
this module adds the kernel that drives it with a raster work list and a store epilogue,
the TMA descriptors (built on the host with the driver's ``cuTensorMapEncodeTiled``
through ctypes, loaded lazily, so importing this module needs no GPU), the spec, the
launcher and the reference.

Shape requirements (checked, ``ValueError`` naming the values):
* any M >= 1, N >= 1; K >= 8 and a multiple of 8 (TMA needs 16-byte row strides);
* ``b_layout="kn"`` with N not a multiple of 8 works through a padded copy of B (slower);
* A, B, out contiguous, 16-byte aligned base pointers.

Only the code-changing values are in the spec (dtype, B layout, tile, stages); M, N, K,
the grid size and the raster group are runtime arguments, so one compiled kernel serves
every shape.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import functools

import numpy as np

from mkrt.arrays import HALF_DTYPES, as_cupy, bfloat16, dtype_name, like_input
from mkrt.jit import cuda_source
from mkrt.kernels.device import gemm_tile, partial_sums, tma, wgmma  # noqa: F401  (register the pieces)
from mkrt.cuda import device_sm_count
from mkrt.jit.spec import KernelSpec
from mkrt.kernels.launcher import KernelLaunch, Parameters, function_handle, stream_workspace

GEMM = cuda_source("gemm", r"""
constexpr bool TMA_STORE = $TMA_STORE;
constexpr bool SPLIT_K = $SPLIT_K;
constexpr bool STREAM_K = $STREAM_K;
typedef mkrt::gemm::Config<$CTYPE, $BLOCK_M, $BLOCK_N, $STAGES, $B_K_MAJOR,
                           TMA_STORE ? $BLOCK_M * $BLOCK_N * 2 : 0, $CLUSTER_M> Cfg;
static_assert(!TMA_STORE || Cfg::BN % 64 == 0, "TMA stores go out in boxes of 64 columns");

// Split-K. Raster units (tiles; with clusters, pairs of tile rows) [0, whole) run whole;
// every unit after them is cut into `splits` parts of its k-blocks: unit whole + j is
// (tile whole + j / splits, part j % splits). whole = 0 splits every tile; whole = the
// units of the full waves splits only the last, partial wave's tiles (the "tail"), which
// would otherwise leave SMs idle. CTA c takes units c, c + grid, ... (a tile's parts run
// side by side); both CTAs of a cluster take the same unit, and the CTA of rank r
// computes tile row 2 * pair + r.
struct SplitKWork {
    mkrt::gemm::RasterWork units;
    int whole, splits, k_blocks, rank;
    __device__ __forceinline__ bool get(int i, mkrt::gemm::Tile& tile) const {
        const int u = units.cta + i * units.ctas;
        const int all = units.tiles_m * units.tiles_n;
        if (u >= whole + (all - whole) * splits) return false;
        const int t = u < whole ? u : whole + (u - whole) / splits;
        tile = units.tile_at(t);
        if (Cfg::CLUSTER_M == 2) {
            tile.m = 2 * tile.m + rank;
            tile.index = tile.m * units.tiles_n + tile.n;
        }
        if (u >= whole) {
            const int part = (u - whole) % splits;
            tile.split = part;
            tile.slot = (t - whole) * Cfg::CLUSTER_M + rank;
            tile.kb_begin = part * k_blocks / splits;      // splits <= k_blocks: never empty
            tile.kb_end = (part + 1) * k_blocks / splits;
        }
        return true;
    }
    __device__ __forceinline__ bool wait(const mkrt::gemm::Tile&) const { return true; }
};

// Stream-K. Tiles [0, whole) run whole (whole: the full waves of the grid); the k-block
// iterations of the tiles after them are shared out evenly over the grid
// (gemm::StreamKShare); a tile that several CTAs cover is added up by the split-K slots.
struct StreamKWork {
    mkrt::gemm::RasterWork units;
    mkrt::gemm::StreamKShare share;
    int k_blocks;
    __device__ __forceinline__ bool get(int i, mkrt::gemm::Tile& tile) const {
        return share.get(i, k_blocks, [&](int t) { return units.tile_at(t); }, tile);
    }
    __device__ __forceinline__ bool wait(const mkrt::gemm::Tile&) const { return true; }
};

// Split tiles' parts (split-K or stream-K) in [slot][splits] (the host sizes the slots
// `splits` parts wide: split-K's split count, or stream-K's most parts of a tile).
struct SlotGrid {
    int* arrivals;
    int splits, rows;
    __device__ __forceinline__ long long first_part(const mkrt::gemm::Tile& t) const {
        return (long long)t.slot * splits;
    }
    __device__ __forceinline__ int parts(const mkrt::gemm::Tile& t) const { return t.parts > 0 ? t.parts : splits; }
    __device__ __forceinline__ int* arrival(const mkrt::gemm::Tile& t) const { return arrivals + t.slot; }
    __device__ __forceinline__ int rows_left(const mkrt::gemm::Tile& t) const { return rows - t.m * Cfg::BM; }
};

// Run the engine over the units with whole tiles stored by `whole` (and, SPLIT_K or
// STREAM_K, the split parts added up by gemm::PartialSumEpilogue, then stored by `whole`).
template <class Whole>
__device__ __forceinline__ void run_units(const mkrt::TmaDescriptor* tma_a, const mkrt::TmaDescriptor* tma_b,
                                          int k, const mkrt::gemm::RasterWork& units, int rank,
                                          const Whole& whole, int m, float* partials, int* arrivals,
                                          int whole_units, int splits, char* dynamic_smem) {
    if constexpr (SPLIT_K) {
        const SplitKWork work{units, whole_units, splits, (k + Cfg::BK - 1) / Cfg::BK, rank};
        const mkrt::gemm::PartialSumEpilogue<Whole, SlotGrid> store{whole, {arrivals, splits, m}, partials};
        mkrt::gemm::run_tiles<Cfg>(tma_a, tma_b, k, work, store, dynamic_smem);
    } else if constexpr (STREAM_K) {
        // written before run_tiles' first barrier, read after it
        __shared__ int stream_k_state[mkrt::gemm::StreamKShare::STATE];
        const int k_blocks = (k + Cfg::BK - 1) / Cfg::BK;
        if (threadIdx.x == 0)
            mkrt::gemm::StreamKShare::plan(stream_k_state, units.tiles_m * units.tiles_n, whole_units,
                                           k_blocks, units.ctas, units.cta, units.ctas);
        const StreamKWork work{units, {stream_k_state}, k_blocks};
        const mkrt::gemm::PartialSumEpilogue<Whole, SlotGrid> store{whole, {arrivals, splits, m}, partials};
        mkrt::gemm::run_tiles<Cfg>(tma_a, tma_b, k, work, store, dynamic_smem);
    } else if constexpr (Cfg::CLUSTER_M == 2) {
        const mkrt::gemm::PairedRasterWork pairs{units, units.tiles_n, rank};
        mkrt::gemm::run_tiles<Cfg>(tma_a, tma_b, k, pairs, whole, dynamic_smem);
    } else {
        mkrt::gemm::run_tiles<Cfg>(tma_a, tma_b, k, units, whole, dynamic_smem);
    }
}

// C = A @ B over the whole tile grid; CTA c of gridDim.x computes units c, c + grid, ...
// (with clusters, cluster c of gridDim.x / 2). tma_out (box 64 x 64) is used by the
// TMA-store epilogue only; partials, arrivals, whole_units and splits by split-K only.
extern "C" __global__ void $CLUSTER_DIMS __launch_bounds__(Cfg::THREADS, 1)
gemm(const __grid_constant__ mkrt::TmaDescriptor tma_a,
     const __grid_constant__ mkrt::TmaDescriptor tma_b,
     const __grid_constant__ mkrt::TmaDescriptor tma_out,
     $CTYPE* out, int m, int n, int k, int ld_out, int group_m, int pairs_aligned,
     float* partials, int* arrivals, int whole_units, int splits) {
    extern __shared__ char dynamic_smem[];
    const int tiles_m = (m + Cfg::BM - 1) / Cfg::BM;
    const int tiles_n = (n + Cfg::BN - 1) / Cfg::BN;
    const int rank = Cfg::CLUSTER_M == 2 ? (int)mkrt::cluster_rank() : 0;
    const mkrt::gemm::RasterWork units{(tiles_m + Cfg::CLUSTER_M - 1) / Cfg::CLUSTER_M, tiles_n, group_m,
                                       (int)blockIdx.x / Cfg::CLUSTER_M, (int)gridDim.x / Cfg::CLUSTER_M};
    if constexpr (TMA_STORE) {
        const mkrt::gemm::TmaStoreEpilogue<$CTYPE, Cfg::BM, Cfg::BN> store{&tma_out};
        run_units(&tma_a, &tma_b, k, units, rank, store, m, partials, arrivals, whole_units, splits,
                  dynamic_smem);
    } else {
        const mkrt::gemm::StoreEpilogue<$CTYPE, Cfg::BM, Cfg::BN> store{out, m, n, ld_out, pairs_aligned != 0};
        run_units(&tma_a, &tma_b, k, units, rank, store, m, partials, arrivals, whole_units, splits,
                  dynamic_smem);
    }
}
""", requires=("gemm_tile", "partial_sums"), register=False)

_CTYPES = {"bf16": "__nv_bfloat16", "f16": "__half"}
B_LAYOUTS = ("kn", "nk")
EPILOGUES = ("tma", "direct")
SPLITS = ("", "splitk", "streamk")
CLUSTERS = ("", "m2")
SMEM_LIMIT = 232448          # 227 KiB per block (opt-in), sm_90


def max_stages(block_m: int, block_n: int, epilogue: str, reserved: int = 0) -> int:
    """Most pipeline stages that fit next to the epilogue's staging area and `reserved`
    bytes of the kernel's own (static) shared memory."""
    staging = block_m * block_n * 2 if epilogue == "tma" else 0
    return (SMEM_LIMIT - 1024 - staging - reserved) // ((block_m + block_n) * 128 + 16)


@dataclasses.dataclass(frozen=True)
class GemmSpec(KernelSpec):
    """Compile-time shape of one GEMM kernel (URI e.g. ``gemm_bf16_nk_bm128_bn256_s3_tma_sm90a``).

    epilogue "tma": whole tiles staged in shared memory, written by TMA stores that overlap
    the next tile (needs N % 8 == 0); "direct": bf16x2 stores from registers, any N.
    block_n: 64, 128, 192 or 256; or, with B [N, K], direct stores and whole tiles, a trimmed
    width (a multiple of 16 between them, e.g. 240: as many waves as 256-wide tiles on
    N = 5000, less work per tile; gemm_rule.trimmed_width).
    split "splitk": the kernel also runs split-K parts (the plan says which tiles are split:
    all of them, or only the last partial wave's), added in a fixed order and stored by the
    whole tiles' epilogue. "streamk": the tiles after the full waves are shared out by
    k-block iterations, evenly over the grid (one CTA per tile, no clusters).
    """

    family = "gemm"
    entry_points = ("gemm",)

    dtype: str = "bf16"                    # "bf16" or "f16", inputs and output
    b_layout: str = "nk"                   # "kn": B is [K, N]; "nk": B is [N, K]
    block_m: int = dataclasses.field(default=128, metadata={"short": "bm"})
    block_n: int = dataclasses.field(default=256, metadata={"short": "bn"})
    stages: int = dataclasses.field(default=3, metadata={"short": "s"})
    epilogue: str = "tma"
    cluster: str = ""                      # "": one CTA per tile; "m2": clusters of two CTAs
                                           # on adjacent tile rows sharing B (multicast)
    split: str = ""                        # "": whole tiles only; "splitk": split-K parts
                                           # too; "streamk": the last wave shared out

    def __post_init__(self):
        super().__post_init__()
        if self.dtype not in _CTYPES:
            raise ValueError(f"mkrt.gemm: dtype={self.dtype!r}; expected one of {sorted(_CTYPES)}")
        if self.b_layout not in B_LAYOUTS:
            raise ValueError(f"mkrt.gemm: b_layout={self.b_layout!r}; expected 'kn' or 'nk'")
        if self.block_m not in (64, 128, 256):
            raise ValueError(f"mkrt.gemm: block_m={self.block_m}; expected 64, 128 or 256")
        if self.block_m == 256 and self.block_n > 128:
            raise ValueError(f"mkrt.gemm: a {self.block_m}x{self.block_n} tile needs more than 128 "
                             "accumulators per consumer thread; 256-row tiles take block_n <= 128")
        if self.block_n % 16 or not 64 <= self.block_n <= 256:
            raise ValueError(f"mkrt.gemm: block_n={self.block_n}; expected a multiple of 16 in "
                             "[64, 256] (64, 128, 192 or 256 with every layout and epilogue)")
        if self.block_n % 64 and (self.b_layout != "nk" or self.epilogue != "direct" or self.split):
            raise ValueError(f"mkrt.gemm: block_n={self.block_n} (a trimmed width, not a multiple "
                             f"of 64) needs b_layout='nk', epilogue='direct' and whole tiles; got "
                             f"b_layout={self.b_layout!r}, epilogue={self.epilogue!r}, "
                             f"split={self.split!r} (B [K, N] loads and TMA stores go in "
                             "64-column boxes; split parts of some widths spill registers)")
        if self.epilogue not in EPILOGUES:
            raise ValueError(f"mkrt.gemm: epilogue={self.epilogue!r}; expected 'tma' or 'direct'")
        if self.split not in SPLITS:
            raise ValueError(f"mkrt.gemm: split={self.split!r}; expected '', 'splitk' or 'streamk'")
        if self.smem_bytes > SMEM_LIMIT:
            raise ValueError(f"mkrt.gemm: {self.stages} stages of {self.block_m}x{self.block_n} "
                             f"with the {self.epilogue} epilogue need {self.smem_bytes} bytes of "
                             f"shared memory; at most {SMEM_LIMIT}")
        if self.stages < 2:
            raise ValueError(f"mkrt.gemm: stages={self.stages}; at least 2")
        if self.cluster not in CLUSTERS:
            raise ValueError(f"mkrt.gemm: cluster={self.cluster!r}; expected '' or 'm2'")
        if self.split == "streamk" and self.cluster:
            raise ValueError("mkrt.gemm: stream-K runs one CTA per tile; it takes cluster=''")

    # -- what the host needs to know about the compiled kernel (mirrors gemm::Config) --
    @property
    def threads(self) -> int:
        """Producer warpgroup + consumers (mirrors gemm::Config: 256-row tiles have two
        consumers of 128 rows each)."""
        return 128 * (1 + min(self.block_m // 64, 2))

    @property
    def cluster_m(self) -> int:
        return 2 if self.cluster == "m2" else 1

    @property
    def smem_bytes(self) -> int:
        stage = (self.block_m + self.block_n) * 64 * 2
        staging = self.block_m * self.block_n * 2 if self.epilogue == "tma" else 0
        return 1024 + self.stages * stage + staging + 2 * self.stages * 8

    def template(self):
        return GEMM

    def params(self):
        return {"CTYPE": _CTYPES[self.dtype], "BLOCK_M": self.block_m, "BLOCK_N": self.block_n,
                "STAGES": self.stages, "B_K_MAJOR": self.b_layout == "nk",
                "TMA_STORE": self.epilogue == "tma", "SPLIT_K": self.split == "splitk",
                "STREAM_K": self.split == "streamk",
                "CLUSTER_M": self.cluster_m,
                "CLUSTER_DIMS": "__cluster_dims__(2, 1, 1)" if self.cluster_m == 2 else ""}


class OnEngine:
    """For the spec of a fused kernel whose compute role is this engine: with fields
    ``dtype``, ``b_layout``, ``block_m``, ``block_n``, ``stages`` (and ``epilogue``, if it
    has one; else direct stores), it gets the engine's spec (and so its checks), threads
    and shared memory."""

    @property
    def engine(self) -> GemmSpec:
        if self.block_n % 64:
            raise ValueError(f"mkrt.{self.family}: block_n={self.block_n}; the fused kernels build "
                             "tile widths that are multiples of 64 (trimmed widths are mkrt.gemm's)")
        return GemmSpec(self.dtype, self.b_layout, self.block_m, self.block_n, self.stages,
                        getattr(self, "epilogue", "direct"))

    @property
    def threads(self) -> int:
        return self.engine.threads

    @property
    def smem_bytes(self) -> int:
        return self.engine.smem_bytes


def default_specs() -> list[GemmSpec]:
    """The configurations ``mkrt.gemm`` may use (compiled ahead by ``python -m mkrt compile
    --all``): every tile the rule chooses from, every epilogue, with and without clusters
    of two and split-K."""
    from mkrt.kernels.gemm_rule import TILES, TRIM_WIDTHS
    specs = []
    for dtype in ("bf16", "f16"):
        for layout in B_LAYOUTS:
            tiles = list(TILES) + [(128, width) for width in TRIM_WIDTHS if layout == "nk"]
            for block_m, block_n in tiles:
                for epilogue in EPILOGUES if block_n % 64 == 0 else ("direct",):
                    stages = max_stages(block_m, block_n, epilogue)
                    for cluster in CLUSTERS:
                        for split in SPLITS if block_n % 64 == 0 else ("",):
                            if split == "streamk" and cluster:
                                continue
                            specs.append(GemmSpec(dtype, layout, block_m, block_n, stages,
                                                  epilogue, cluster, split))
    return specs


# ---- planning (pure Python, testable without a GPU) ----------------------------------

@dataclasses.dataclass(frozen=True)
class GemmPlan:
    spec: GemmSpec
    m: int
    n: int
    k: int
    tiles_m: int
    tiles_n: int
    grid: int
    group_m: int
    pad_n: int        # kn layout only: columns of B after padding to a multiple of 8
    splits: int = 1   # split-K parts per split tile (spec.split "splitk"; stream-K: the most)
    split_tail: bool = False   # split only the tiles of the last, partial wave
    stream_k: bool = False     # the tiles after the full waves shared out by iterations

    @property
    def tiles(self) -> int:
        return self.tiles_m * self.tiles_n

    @property
    def units(self) -> int:
        """Raster units: tiles, or with clusters of two, pairs of tile rows."""
        return -(-self.tiles_m // self.spec.cluster_m) * self.tiles_n

    @property
    def whole_units(self) -> int:
        """Units run whole before the split ones: none when every tile is split, those of
        the full waves of the grid when only the tail is (all of them without split-K)."""
        if self.stream_k:
            return self.tiles // self.grid * self.grid
        if self.splits == 1:
            return self.units
        if not self.split_tail:
            return 0
        per_wave = self.grid // self.spec.cluster_m
        return self.units // per_wave * per_wave

    @property
    def split_slots(self) -> int:
        """Split tiles (the partial-sum slots of split-K): per split unit, one per CTA of it."""
        return (self.units - self.whole_units) * self.spec.cluster_m

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


def plan(m: int, n: int, k: int, *, dtype: str = "bf16", b_layout: str = "nk",
         sms: int = 132, block_m: int = 128, block_n: int = 256, stages: int | None = None,
         group_m: int = 8, epilogue: str = "auto", split_k: int = 1, split_tail: bool = False,
         cluster: str = "", stream_k: bool = False) -> GemmPlan:
    """Spec and launch shape for one problem; raises ValueError on shapes the engine refuses.
    ``split_k`` > 1: a tile's K in that many parts (at most one per 64-wide k-block), run
    by different CTAs and added in a fixed order; every tile, or with ``split_tail`` only
    the tiles of the last, partial wave (the full waves run whole tiles), which fills the
    SMs that wave would leave idle. ``cluster="m2"``: clusters of two CTAs on adjacent tile
    rows share each B load (TMA multicast); the grid is even. ``stream_k``: the tiles after
    the full waves (every tile, below one wave) are shared out evenly by k-blocks, a tile
    that several CTAs cover added up in a fixed order (:func:`stream_k_items`)."""
    for name, value in (("m", m), ("n", n), ("k", k)):
        if not isinstance(value, (int, np.integer)) or value < 1 or value >= 2**31:
            raise ValueError(f"mkrt.gemm: {name}={value!r} must be an integer in [1, 2**31)")
    if k % 8:
        raise ValueError(f"mkrt.gemm: k={k} must be a multiple of 8 "
                         "(TMA needs 16-byte row strides); pad K with zeros")
    if not isinstance(sms, (int, np.integer)) or sms < 1:
        raise ValueError(f"mkrt.gemm: sms={sms!r} must be a positive integer")
    if not isinstance(group_m, (int, np.integer)) or group_m < 1:
        raise ValueError(f"mkrt.gemm: group_m={group_m!r} must be a positive integer")
    if not isinstance(split_k, (int, np.integer)) or isinstance(split_k, bool) or not 1 <= split_k <= 64:
        raise ValueError(f"mkrt.gemm: split_k={split_k!r} must be an integer in [1, 64]")
    if not isinstance(split_tail, (bool, np.bool_)):
        raise ValueError(f"mkrt.gemm: split_tail={split_tail!r} must be True or False")
    if split_tail and split_k == 1:
        raise ValueError("mkrt.gemm: split_tail=True splits the last wave's tiles in split_k "
                         "parts; it needs split_k > 1")
    if not isinstance(stream_k, (bool, np.bool_)):
        raise ValueError(f"mkrt.gemm: stream_k={stream_k!r} must be True or False")
    if stream_k and (split_k > 1 or cluster):
        raise ValueError("mkrt.gemm: stream_k=True shares out the last wave by k-blocks on one "
                         f"CTA per tile; it takes split_k=1 and cluster=''; got split_k={split_k}, "
                         f"cluster={cluster!r}")
    if epilogue == "auto":   # TMA stores need 16-byte rows of C and 64-column boxes; split-K
                             # of every tile takes the direct stores (their staging area
                             # would cost stages)
        epilogue = "tma" if n % 8 == 0 and (split_k == 1 or split_tail) and block_n % 64 == 0 \
            else "direct"
    elif epilogue == "tma" and n % 8:
        raise ValueError(f"mkrt.gemm: epilogue='tma' needs n % 8 == 0; got n={n}")
    if epilogue not in EPILOGUES:
        raise ValueError(f"mkrt.gemm: epilogue={epilogue!r}; expected 'auto', 'tma' or 'direct'")
    if stages is None:
        stages = max_stages(block_m, block_n, epilogue)
    # the spec's checks (tile, stages, cluster) before anything divides by the tile
    spec = GemmSpec(dtype, b_layout, block_m, block_n, stages, epilogue, cluster)
    cluster_m = spec.cluster_m
    tiles_m = -(-m // block_m)
    tiles_n = -(-n // block_n)
    units = -(-tiles_m // cluster_m) * tiles_n
    pad_n = n if b_layout == "nk" else -(-n // 8) * 8
    splits = int(min(split_k, -(-k // 64)))           # every part gets a k-block
    if cluster_m == 2 and sms < 2:
        raise ValueError(f"mkrt.gemm: cluster='m2' needs sms >= 2; got {sms}")
    per_wave = sms // cluster_m
    if split_tail and units % per_wave == 0 and units >= per_wave:
        splits = 1                                    # whole waves: no tail to split
    work_units = units * splits if not split_tail else \
        units // per_wave * per_wave + units % per_wave * splits
    if stream_k:
        k_blocks = -(-k // 64)
        grid = min(sms, tiles_m * tiles_n * k_blocks)     # every CTA at least one k-block
        shared = (tiles_m * tiles_n - tiles_m * tiles_n // grid * grid) * k_blocks
        if (shared + 1) * grid >= 2**31:                  # the kernel's 32-bit arithmetic
            raise ValueError(f"mkrt.gemm: stream_k=True with k={k} on {grid} CTAs shares out "
                             f"{shared} k-blocks, past the kernel's 32-bit index; use split_k")
        parts = max((item[4] for items in stream_k_items(tiles_m * tiles_n, k_blocks, grid)
                     for item in items), default=1)
        if parts > 1:                                     # else whole waves: nothing to share
            return GemmPlan(dataclasses.replace(spec, split="streamk"), int(m), int(n), int(k),
                            tiles_m, tiles_n, int(grid), int(group_m), pad_n, parts,
                            stream_k=True)
    if splits > 1:
        spec = dataclasses.replace(spec, split="splitk")
    grid = cluster_m * min(per_wave, work_units)      # whole clusters
    return GemmPlan(spec, int(m), int(n), int(k), tiles_m, tiles_n, int(grid), int(group_m),
                    pad_n, splits, bool(split_tail and splits > 1))


def stream_k_items(tiles: int, k_blocks: int, grid: int, sharing: int | None = None,
                   whole: int | None = None) -> list[list[tuple]]:
    """Per CTA of `grid`, the work items gemm::StreamKShare hands it, in order: (tile in
    raster order, first k-block, end k-block, part, parts); parts 1 is a whole tile. Tiles
    [0, whole) (default: the full waves) run whole, CTA c taking c, c + grid, ...; the
    k-block iterations of the rest are shared out over the first `sharing` CTAs (default
    all), CTA c taking [c I / sharing, (c + 1) I / sharing); a tile's parts are numbered in
    CTA order. A CPU test checks that every k-block of every tile is computed exactly once."""
    whole = tiles // grid * grid if whole is None else whole
    sharing = grid if sharing is None else sharing
    iterations = (tiles - whole) * k_blocks

    def cta_of(x):
        return ((x + 1) * sharing - 1) // iterations
    per_cta = []
    for c in range(grid):
        items = [(c + i * grid, 0, k_blocks, 0, 1) for i in range(whole // grid)]
        shares = c < sharing and iterations > 0
        begin = c * iterations // sharing if shares else iterations
        end = (c + 1) * iterations // sharing if shares else iterations
        t = begin // k_blocks
        while begin < end:
            first = t * k_blocks
            lo, hi = max(begin, first), min(end, first + k_blocks)
            if lo >= hi:
                break
            first_cta, last_cta = cta_of(first), cta_of(first + k_blocks - 1)
            if first_cta == last_cta:
                items.append((whole + t, 0, k_blocks, 0, 1))
            else:
                items.append((whole + t, lo - first, hi - first, c - first_cta,
                              last_cta - first_cta + 1))
            t += 1
        per_cta.append(items)
    return per_cta


def check_operands(a_shape, b_shape, a_dtype, b_dtype, b_layout, out_shape=None, out_dtype=None):
    """(m, n, k, dtype name) of a valid problem; TypeError/ValueError otherwise."""
    if b_layout not in B_LAYOUTS:
        raise ValueError(f"mkrt.gemm: b_layout={b_layout!r}; expected 'kn' ([K, N]) or 'nk' ([N, K])")
    for name, dtype in (("a", a_dtype), ("b", b_dtype)):
        if np.dtype(dtype) not in HALF_DTYPES:
            raise TypeError(f"mkrt.gemm: {name} has dtype {dtype_name(dtype)}; expected bf16 or f16")
    if np.dtype(a_dtype) != np.dtype(b_dtype):
        raise TypeError(f"mkrt.gemm: a is {dtype_name(a_dtype)} but b is {dtype_name(b_dtype)}; "
                        "they must match")
    if len(a_shape) != 2 or len(b_shape) != 2:
        raise ValueError(f"mkrt.gemm: a and b must be 2-D; got a.shape={tuple(a_shape)}, "
                         f"b.shape={tuple(b_shape)}")
    m, k = a_shape
    n, kb = (b_shape[1], b_shape[0]) if b_layout == "kn" else (b_shape[0], b_shape[1])
    if kb != k:
        raise ValueError(f"mkrt.gemm: a.shape={tuple(a_shape)} and b.shape={tuple(b_shape)} "
                         f"(b_layout={b_layout!r}) disagree on K: {k} != {kb}")
    if out_shape is not None and tuple(out_shape) != (m, n):
        raise ValueError(f"mkrt.gemm: out.shape={tuple(out_shape)}; expected {(m, n)}")
    if out_dtype is not None and np.dtype(out_dtype) != np.dtype(a_dtype):
        raise TypeError(f"mkrt.gemm: out has dtype {dtype_name(out_dtype)}; expected "
                        f"{dtype_name(a_dtype)}")
    return m, n, k, dtype_name(a_dtype)


# ---- TMA descriptors (driver, through ctypes) ----------------------------------------

_TMA_DTYPE = {"f16": 6, "bf16": 9}     # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / _BFLOAT16
_SWIZZLE_128B = 3
#: L2 promotion of the tensor maps' loads (CU_TENSOR_MAP_L2_PROMOTION_: 0 none, 1 64 B,
#: 2 128 B, 3 256 B), or None for l2_promotion's rule; read when a map is made
#: (experiments/gemm_probe.py's l2 probe sets each in turn)
L2_PROMOTION = None


def l2_promotion(strides) -> int:
    """The L2 promotion of a map with these row strides (bytes): 256 B, but 128 B where rows
    start an odd multiple of 16 bytes off a 32-byte sector (a stride of 16 mod 32: K = 8
    mod 16 for A and B [N, K]). There, 256-byte promotion took 1.10-1.15x the time of 128
    (3000x5000x7000: 128x192 pairs 370 against 328 us, 0.89 against 1.005x torch); on
    aligned rows the two are within 0.6% (gemm_l2_promotion.jsonl, 87377dd)."""
    if L2_PROMOTION is not None:
        return L2_PROMOTION
    return 2 if any(stride % 32 == 16 for stride in strides) else 3


@functools.cache
def _libcuda():
    lib = ctypes.CDLL("libcuda.so.1")
    f = lib.cuTensorMapEncodeTiled
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                  ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                  ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                  ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return lib


class TmaDescriptor:
    """A 128-byte CUtensorMap in 64-byte aligned host memory; ``.argument`` is the launch arg."""

    def __init__(self):
        self._buffer = (ctypes.c_uint8 * 192)()
        self.address = (ctypes.addressof(self._buffer) + 63) & ~63

    @property
    def argument(self):
        from cupy.cuda.function import CPointer
        return CPointer(self.address)

    def words(self) -> list[int]:
        return list((ctypes.c_uint64 * 16).from_address(self.address))


_DESCRIPTORS: "collections.OrderedDict[tuple, TmaDescriptor]" = collections.OrderedDict()


def tma_descriptor_2d(pointer: int, dtype: str, inner: int, outer: int, row_bytes: int,
                      box_inner: int, box_outer: int) -> TmaDescriptor:
    """Tensor map of a row-major [outer, inner] matrix, 128B swizzle, zeros outside (cached)."""
    return tma_descriptor(pointer, dtype, (inner, outer), (row_bytes,), (box_inner, box_outer))


def tma_descriptor(pointer: int, dtype: str, dims: tuple, strides: tuple,
                   box: tuple) -> TmaDescriptor:
    """Tensor map of an up-to-5-D tensor: ``dims`` innermost first (the innermost
    contiguous), ``strides`` in bytes of dims 1.. (multiples of 16), ``box`` the elements
    one load brings (innermost 64 two-byte elements = one 128-byte swizzle row); 128B
    swizzle, zeros outside, L2 promotion by :func:`l2_promotion`. Cached by its arguments."""
    promotion = l2_promotion(strides)
    key = (pointer, dtype, tuple(dims), tuple(strides), tuple(box), promotion)
    descriptor = _DESCRIPTORS.get(key)
    if descriptor is not None:
        _DESCRIPTORS.move_to_end(key)
        return descriptor
    rank = len(dims)
    descriptor = TmaDescriptor()
    c_dims = (ctypes.c_uint64 * rank)(*dims)
    c_strides = (ctypes.c_uint64 * max(rank - 1, 1))(*strides)
    c_box = (ctypes.c_uint32 * rank)(*box)
    element_strides = (ctypes.c_uint32 * rank)(*([1] * rank))
    result = _libcuda().cuTensorMapEncodeTiled(
        descriptor.address, _TMA_DTYPE[dtype], rank, pointer, c_dims, c_strides, c_box,
        element_strides, 0, _SWIZZLE_128B, promotion, 0)
    if result != 0:
        raise RuntimeError(f"mkrt: cuTensorMapEncodeTiled failed with CUresult {result} "
                           f"for {pointer=:#x}, {dtype=}, {dims=}, strides={strides}, {box=}")
    _DESCRIPTORS[key] = descriptor
    if len(_DESCRIPTORS) > 512:
        _DESCRIPTORS.popitem(last=False)
    return descriptor


def a_descriptor(spec: GemmSpec, a_pointer: int, m: int, k: int):
    """Tensor map of A [M, K] as the engine loads it: BM x 64 boxes."""
    return tma_descriptor_2d(a_pointer, spec.dtype, k, m, k * 2, 64, spec.block_m)


def operand_descriptors(spec: GemmSpec, a_pointer: int, b_pointer: int, m: int, n: int, k: int,
                        *, b_columns: int | None = None):
    """Tensor maps of A [M, K] and B ([N, K], or [K, b_columns] for "kn") as the engine loads
    them: A in BM x 64 boxes, B in BN x 64 (nk; BN / 2 x 64 for clusters of two) or 64 x 64
    (kn) boxes."""
    tma_a = a_descriptor(spec, a_pointer, m, k)
    if spec.b_layout == "nk":
        # with clusters each CTA of a pair loads (and multicasts) half of the B tile's rows
        rows = spec.block_n // getattr(spec, "cluster_m", 1)
        return tma_a, tma_descriptor_2d(b_pointer, spec.dtype, k, n, k * 2, 64, rows)
    columns = n if b_columns is None else b_columns
    return tma_a, tma_descriptor_2d(b_pointer, spec.dtype, columns, k, columns * 2, 64, 64)


# ---- launcher ------------------------------------------------------------------------

def gemm(a, b, out=None, *, b_layout: str = "kn", sms: int | None = None, group_m: int = 8,
         block_m: int | None = None, block_n: int | None = None, stages: int | None = None,
         epilogue: str = "auto", split_k: int | None = None, split_tail: bool | None = None,
         cluster: str | None = None, stream_k: bool | None = None, stream=None):
    """C = A @ B (``b_layout="kn"``: B is [K, N]) or A @ B.T (``"nk"``: B is [N, K]).

    a: [M, K] bf16/f16 device array (CuPy, torch through DLPack, ...); b as b_layout says;
    out: optional [M, N] of the same dtype (written in place and returned). ``sms`` caps the
    grid (default: every SM), ``group_m`` is the raster group (tile rows walked together),
    ``block_m`` x ``block_n`` the output tile (64 or 128 x 64, 128, 192 or 256, and 256 x 64
    or 128; with ``b_layout="nk"`` and direct stores also 128 x a trimmed width, a multiple
    of 16 such as 240; default:
    :func:`mkrt.kernels.gemm_rule.choose_tile`, a tuned table or the rule),
    ``epilogue`` "tma" (default when N % 8 == 0 and the tile's width a multiple of 64) or
    "direct", ``stages`` the pipeline
    depth (default: as many as fit), ``split_k`` > 1 (default: the rule's): a tile's K in that
    many parts on different CTAs, added in a fixed order (results identical between calls;
    uses a float32 workspace of split tiles x parts x tile), for every tile, or with
    ``split_tail=True`` only for the tiles of the last, partial wave (the waves before it
    run whole tiles; this fills the SMs that wave would leave idle).
    ``cluster="m2"``: clusters of two CTAs on adjacent tile rows load the B tile they
    share once, by TMA multicast; ``""``: one CTA per tile; default: the rule's, when the
    rule also chose the tile. ``stream_k=True``: the tiles after the full waves (every
    tile, below one wave) are shared out evenly over the grid by k-blocks, a tile that
    several CTAs cover added up in a fixed order (one CTA per tile, no split-K; a float32
    workspace of those tiles' parts); default: the rule's (``gemm_rule.stream_k_pays``),
    when the rule also chose the tile, split-K and cluster.
    Returns out in the type of ``a`` (torch in, torch out).

    The first call of a signature (shapes, dtypes, options, GPU) checks everything and
    prepares the launch; later calls check each array's GPU, layout and alignment, patch
    the pointers that changed and launch.
    """
    import cupy

    a_view = a if type(a) is cupy.ndarray else as_cupy(a, "a")
    b_view = b if type(b) is cupy.ndarray else as_cupy(b, "b")
    out_view = out if out is None or type(out) is cupy.ndarray else as_cupy(out, "out")
    device = a_view.data.device_id
    key = (a_view.shape, a_view.dtype, b_view.shape, b_view.dtype,
           None if out_view is None else (out_view.shape, out_view.dtype),
           b_layout, sms, group_m, block_m, block_n, stages, epilogue, split_k, split_tail,
           cluster, stream_k, device)
    call = _PREPARED.get(key)
    if call is None or not _quick_checks(device, a_view, b_view, out_view):
        p = _gemm_plan(a_view, b_view, out_view, b_layout=b_layout, sms=sms, group_m=group_m,
                       block_m=block_m, block_n=block_n, stages=stages, epilogue=epilogue,
                       split_k=split_k, split_tail=split_tail, cluster=cluster,
                       stream_k=stream_k)
        if p.spec.b_layout == "kn" and p.pad_n != p.n:
            return _gemm_padded(a, a_view, b_view, out_view, p, stream)
        call = _prepared_gemm(key, p, device)
    previous = cupy.cuda.runtime.getDevice()
    switch = previous != device
    if switch:
        cupy.cuda.runtime.setDevice(device)
    try:
        if out_view is None:
            out_view = cupy.empty(call.out_shape, dtype=a_view.dtype)
        call.patch(a_view.data.ptr, b_view.data.ptr, out_view.data.ptr)
        call.run((stream or cupy.cuda.get_current_stream()).ptr)
    finally:
        if switch:
            cupy.cuda.runtime.setDevice(previous)
    return out_view if type(a) is cupy.ndarray else like_input(out_view, a)


def call_plan(a, b, out=None, *, b_layout: str = "kn", sms: int | None = None, group_m: int = 8,
              block_m: int | None = None, block_n: int | None = None, stages: int | None = None,
              epilogue: str = "auto", split_k: int | None = None, split_tail: bool | None = None,
              cluster: str | None = None, stream_k: bool | None = None) -> GemmPlan:
    """The plan :func:`gemm` runs for these arguments (the tile the rule chooses where none
    is given, split-K, the grid), after the same checks; launches nothing."""
    return _gemm_plan(as_cupy(a, "a"), as_cupy(b, "b"), None if out is None else as_cupy(out, "out"),
                      b_layout=b_layout, sms=sms, group_m=group_m, block_m=block_m,
                      block_n=block_n, stages=stages, epilogue=epilogue, split_k=split_k,
                      split_tail=split_tail, cluster=cluster, stream_k=stream_k)


def _quick_checks(device, *arrays) -> bool:
    """What a prepared signature still checks per call: same GPU, row-major, 16-byte base."""
    for x in arrays:
        if x is not None and (x.data.device_id != device or not x._c_contiguous
                              or x.data.ptr & 15):
            return False
    return True


#: mkrt.gemm launches as a programmatic dependent of the stream's previous kernel (read when
#: a signature is prepared): its set-up overlaps that kernel's tail, and it loads nothing
#: before that kernel has finished (the engine's grid_dependency_wait). Back to back, the
#: prepared launch took 0.7-1.0 us less per call than plain launches on six shapes of a wave
#: or less (1536^3: 15.8 against 16.6 us), the same in CUDA graphs; its ctypes launch costs
#: the host 0.3-0.5 us more (gemm_small.jsonl, 356c5e6).
PROGRAMMATIC_LAUNCH = True


class _PreparedGemm:
    """One signature of :func:`gemm`: its plan, kernel and packed parameters. With clusters
    the grid is cut to the clusters the device holds at once (:func:`cluster_grid`)."""

    def __init__(self, p: GemmPlan, function, device: int = 0):
        if p.spec.cluster_m > 1:
            p = dataclasses.replace(p, grid=cluster_grid(p.spec, function, p.grid, device))
        self.plan = p
        self.out_shape = (p.m, p.n)
        params = Parameters([("tma_a", 128, 64), ("tma_b", 128, 64), ("tma_out", 128, 64),
                             ("out", np.uint64, 8), ("m", np.int32, 4), ("n", np.int32, 4),
                             ("k", np.int32, 4), ("ld_out", np.int32, 4),
                             ("group_m", np.int32, 4), ("pairs_aligned", np.int32, 4),
                             ("partials", np.uint64, 8), ("arrivals", np.uint64, 8),
                             ("whole_units", np.int32, 4), ("splits", np.int32, 4)])
        params.set(m=p.m, n=p.n, k=p.k, ld_out=p.n, group_m=p.group_m,
                   pairs_aligned=int(p.n % 2 == 0), whole_units=p.whole_units, splits=p.splits)
        self.device = device
        self._split = p.split_slots > 0  # a property of several: read once, not per call
        self._workspaces: dict = {}     # split-K: stream -> (partials, arrivals)
        self._bound_stream = None
        self.launch = KernelLaunch(function, p.grid, p.spec.threads, p.spec.smem_bytes, params,
                                   programmatic=PROGRAMMATIC_LAUNCH)
        self._out = params.view("out")
        self._pointers = None

    def run(self, stream_ptr: int) -> None:
        """Launch on a stream. Split-K parts meet in a workspace of their own per stream:
        two streams running the same signature at once (an emulated world's ranks on one
        GPU) must not add each other's parts."""
        if self._split and self._bound_stream != stream_ptr:
            import cupy
            p = self.plan
            # float32 parts of every split tile, and per split tile a counter that is zero
            # between calls (zeroed on this stream, before its first launch)
            workspace, kept = stream_workspace(self._workspaces, self.device, stream_ptr, lambda: (
                cupy.empty(p.split_slots * p.splits * p.spec.block_m * p.spec.block_n, dtype=np.float32),
                cupy.zeros(p.split_slots, dtype=np.int32)))
            self.launch.params.set(partials=workspace[0].data.ptr, arrivals=workspace[1].data.ptr)
            self._bound_stream = stream_ptr if kept else None
        self.launch(stream_ptr)

    def patch(self, a_ptr: int, b_ptr: int, out_ptr: int) -> None:
        if self._pointers == (a_ptr, b_ptr, out_ptr):
            return
        p, params = self.plan, self.launch.params
        tma_a, tma_b = operand_descriptors(p.spec, a_ptr, b_ptr, p.m, p.n, p.k, b_columns=p.pad_n)
        ctypes.memmove(params.address("tma_a"), tma_a.address, 128)
        ctypes.memmove(params.address("tma_b"), tma_b.address, 128)
        if p.spec.epilogue == "tma":
            tma_out = tma_descriptor_2d(out_ptr, p.spec.dtype, p.n, p.m, p.n * 2, 64, 64)
            ctypes.memmove(params.address("tma_out"), tma_out.address, 128)
        self._out[()] = out_ptr
        self._pointers = (a_ptr, b_ptr, out_ptr)


_PREPARED: "collections.OrderedDict[tuple, _PreparedGemm]" = collections.OrderedDict()


def _full_checks(a_view, b_view, out_view, b_layout):
    m, n, k, dtype = check_operands(a_view.shape, b_view.shape, a_view.dtype, b_view.dtype,
                                    b_layout, None if out_view is None else out_view.shape,
                                    None if out_view is None else out_view.dtype)
    device = a_view.device.id
    for name, x in (("a", a_view), ("b", b_view), ("out", out_view)):
        if x is None:
            continue
        if x.device.id != device:
            raise ValueError(f"mkrt.gemm: {name} is on GPU {x.device.id} but a is on GPU {device}")
        if not x.flags.c_contiguous:
            raise ValueError(f"mkrt.gemm: {name} with shape {x.shape} and strides {x.strides} is "
                             "not C-contiguous (row-major); pass a contiguous array")
        if x.data.ptr % 16:
            raise ValueError(f"mkrt.gemm: {name} starts at {x.data.ptr:#x}, not 16-byte aligned")
    return m, n, k, dtype, device


def _gemm_plan(a_view, b_view, out_view, *, b_layout, sms, group_m, block_m, block_n, stages,
               epilogue, split_k=None, split_tail=None, cluster=None, stream_k=None):
    """Every check of a signature, and its plan."""
    m, n, k, dtype, device = _full_checks(a_view, b_view, out_view, b_layout)
    total_sms = device_sm_count(device)
    if stream_k is True:           # one CTA per tile, whole K: the rule's tile, not its rest
        cluster = "" if cluster is None else cluster
        split_k = 1 if split_k is None else split_k
    rule_stream_k = False
    if block_m is None or block_n is None or split_k is None or cluster is None:
        from mkrt.kernels.gemm_rule import choose_tile
        rule, _ = choose_tile(m, n, k, sms=total_sms if sms is None else sms, dtype=dtype,
                              b_layout=b_layout)
        rule_tile = block_m is None and block_n is None
        block_m = rule.block_m if block_m is None else block_m
        if block_n is None:
            # a trimmed width stores directly: asked for TMA stores, its family's 256
            block_n = rule.block_n if rule.block_n % 64 == 0 or epilogue != "tma" else 256
        # the rule's cluster goes with its tile; its split-K with its tile and cluster and
        # the automatic epilogue
        if cluster is None:
            cluster = rule.cluster if rule_tile else ""
        if split_k is None:
            rule_split = rule_tile and epilogue == "auto" and cluster == rule.cluster
            split_k = rule.split_k if rule_split else 1
            if split_tail is None and rule_split:
                split_tail = rule.split_tail
            # the rule's stream-K goes with its tile, its (absent) split and its cluster
            rule_stream_k = rule_split and rule.stream_k and split_k == 1 and not split_tail
    options = dict(dtype=dtype, b_layout=b_layout, sms=total_sms if sms is None else sms,
                   block_m=block_m, block_n=block_n, stages=stages, group_m=group_m,
                   epilogue=epilogue, split_k=split_k,
                   split_tail=False if split_tail is None else split_tail, cluster=cluster)
    if stream_k is None and rule_stream_k:
        try:
            p = plan(m, n, k, stream_k=True, **options)
        except ValueError:      # past the kernel's 32-bit k-block index: whole tiles then
            p = plan(m, n, k, stream_k=False, **options)
    else:
        p = plan(m, n, k, stream_k=bool(stream_k), **options)
    if sms is not None and sms > total_sms:
        raise ValueError(f"mkrt.gemm: sms={sms} but GPU {device} has {total_sms}")
    return p


def cluster_grid(spec, function, grid: int, device: int) -> int:
    """`grid` cut to the clusters of `spec.cluster_m` CTAs the device can hold at once
    (whole clusters), for a kernel on the engine with compile-time cluster dimensions
    (`spec`: its threads, shared memory, family and URI; mkrt.gemm's and grouped_gemm's)."""
    import cupy

    from mkrt.cuda import max_active_clusters
    with cupy.cuda.Device(device):                 # the occupancy query uses the current context
        clusters = max_active_clusters(function_handle(function), grid, spec.threads,
                                       spec.smem_bytes)
    if clusters < 1:
        raise ValueError(f"mkrt.{spec.family}: {spec.uri} fits no cluster of {spec.cluster_m} "
                         "CTAs on this GPU")
    return min(grid, clusters * spec.cluster_m)


def _prepared_gemm(key, p: GemmPlan, device: int) -> _PreparedGemm:
    """The prepared launch of a checked signature (kept for the next 256 signatures)."""
    call = _PREPARED.get(key)
    if call is None:
        function = p.spec.function("gemm", device, p.spec.smem_bytes)
        call = _PREPARED[key] = _PreparedGemm(p, function, device)
        if len(_PREPARED) > 256:
            _PREPARED.popitem(last=False)
    return call


def _gemm_padded(a, a_view, b_view, out_view, p: GemmPlan, stream):
    """b_layout="kn" with N % 8 != 0: TMA needs 16-byte rows, so B is copied padded."""
    import cupy
    device = a_view.data.device_id
    spec, m, n, k = p.spec, p.m, p.n, p.k
    with cupy.cuda.Device(device):
        if out_view is None:
            out_view = cupy.empty((m, n), dtype=a_view.dtype)
        b_rows = cupy.zeros((k, p.pad_n), dtype=b_view.dtype)
        b_rows[:, :n] = b_view
        call = _PreparedGemm(p, spec.function("gemm", device, spec.smem_bytes), device)
        call.patch(a_view.data.ptr, b_rows.data.ptr, out_view.data.ptr)
        call.run((stream or cupy.cuda.get_current_stream()).ptr)
        # keep the padded copy alive until the kernel has read it
        (stream or cupy.cuda.get_current_stream()).synchronize()
    return like_input(out_view, a)


def _xp(x):
    if isinstance(x, np.ndarray):
        return np
    import cupy
    return cupy


def to_float32(x):
    """float32 copy of a bf16/f16/float array (bf16 through its bits: no bf16 kernels needed)."""
    xp = _xp(x)
    if bfloat16 is not None and x.dtype == bfloat16:
        return (x.view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)
    return x.astype(xp.float32)


def from_float32(x, dtype):
    """float32 array -> dtype (bf16 rounded to nearest even through its bits)."""
    xp = _xp(x)
    if bfloat16 is not None and np.dtype(dtype) == bfloat16:
        bits = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
        rounded = (bits + xp.uint32(0x7FFF) + ((bits >> 16) & xp.uint32(1))) >> 16
        return rounded.astype(xp.uint16).view(bfloat16)
    return x.astype(dtype)


def poison(x):
    """Fill a bf16/f16 array with NaN in place (through its bits)."""
    nan_bits = 0x7FC0 if (bfloat16 is not None and x.dtype == bfloat16) else 0x7E00
    x.view(_xp(x).uint16).fill(nan_bits)
    return x


def reference(a, b, *, b_layout: str = "kn", dtype=np.float32):
    """A @ B in float32 (or float64) with the same layout convention, as a CuPy/NumPy array."""
    if b_layout not in B_LAYOUTS:
        raise ValueError(f"mkrt.gemm: b_layout={b_layout!r}; expected 'kn' or 'nk'")
    if not isinstance(a, np.ndarray):
        a, b = as_cupy(a, "a"), as_cupy(b, "b")
    a32 = to_float32(a).astype(dtype)
    b32 = to_float32(b).astype(dtype)
    return a32 @ (b32.T if b_layout == "nk" else b32)


def test_cases():
    """(m, n, k, b_layout, dtype) the GPU tests run: odd edges, small K, both layouts."""
    cases = []
    for dtype in ("bf16", "f16"):
        for layout in B_LAYOUTS:
            cases += [(128, 256, 64, layout, dtype), (257, 513, 72, layout, dtype),
                      (1000, 777, 8, layout, dtype), (1, 300, 128, layout, dtype),
                      (333, 1, 200, layout, dtype), (2048, 2048, 1024, layout, dtype),
                      (517, 1029, 520, layout, dtype)]
    return cases


def bench_cases():
    """(m, n, k) of the issue's suite."""
    return [(8192, 8192, 8192), (4096, 4096, 4096), (16384, 16384, 1024), (8192, 8192, 512),
            (2048, 8192, 8192), (8192, 1024, 8192), (8000, 7936, 4096)]
