"""``mkrt.grouped_mlp``: every expert's gated MLP over its rows, in one persistent launch.

    out[o_g : o_g+1] = (SiLU(x W_gate^T) * (x W_up^T)) w2[g]^T,  x = x[o_g : o_g+1],
    [W_gate; W_up] = w1[g]                                        for g = 0 .. G-1

x [R, H] (rows of every group, group by group, as MoE's dispatch lands them), w1 [G, 2I, H]
(gate rows, then up rows), w2 [G, H, I], offsets [G + 1] int32 (group g's rows are
offsets[g] .. offsets[g+1]; a device array may come from an earlier kernel); out [R, H].
bf16, fp32 accumulation.

One launch of the GEMM engine (kernels/device/gemm_tile.py) with a work list of two GEMMs:

1. **first GEMM + SwiGLU**: every m-tile of every group against w1, each tile BN columns
   wide holding BN / 2 gate rows and the BN / 2 up rows of the same columns of I (the B
   tile is loaded in two halves). The epilogue computes SiLU(gate) * up from the fp32
   accumulators (both halves are in the same thread: wgmma's layout repeats every 8
   columns) and stores bf16 ``act`` [R, I]; it never writes the [R, 2I] product (the
   unfused path writes and reads it back: 6 x R x I bytes more).
   Each tile then adds one to its m-tile's counter.
2. **second GEMM**: act against w2, A and B from the engine's second maps. The producer
   waits (bounded) until its m-tile's counter shows every first-GEMM tile of those rows.

Every CTA walks its tiles in order (c, c + ctas, ...) and every first-GEMM tile comes before
every second-GEMM tile in the list, so a waiting tile only ever waits for tiles that run
without waiting: no wait cycle on any grid (``tile_order`` mirrors the list; a CPU test
replays it). A counter word is ``epoch << COUNT_BITS | tiles done``, started afresh by the
first tile of a launch that finds an older epoch in it, so nothing is reset between
calls (nor after a call that failed); the epoch is the launch count kept in the same words.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses

import numpy as np

from mkrt.arrays import as_cupy, bfloat16, dtype_name, is_torch, like_input
from mkrt.cuda import device_sm_count
from mkrt.jit import cuda_source
from mkrt.jit.spec import KernelSpec
from mkrt.kernels import gemm as gemm_module
from mkrt.kernels import grouped_gemm as grouped_module
from mkrt.kernels.launcher import KernelLaunch, Parameters, stream_workspace
from mkrt.kernels.op import CONTEXT_PARAMETERS
from mkrt.status import kernel_id

MAX_GROUPS = grouped_module.MAX_GROUPS
COUNT_BITS = 20
#: a launch's words (experts_tiles): the standalone kernel's bookkeeping (finished,
#: ctas_before, launches), the fused MoE launch's experts-done counter, the m-tile counters
FINISHED, CTAS_BEFORE, LAUNCHES, EXPERTS_DONE, COUNTERS = 0, 1, 2, 3, 4
#: static shared memory beside the engine's: the group prefix and the launch's two words
STATIC_SMEM_BYTES = grouped_module.STATIC_SMEM_BYTES + 16

EXPERTS_TILES = cuda_source("experts_tiles", r"""
namespace mkrt {
namespace experts {
using grouped::clamp_row;

// A launch's words: the standalone kernel's launch bookkeeping, the experts' done counter
// (MoE's fused launch), then one counter per m-tile. Mirror: the Python constants of
// mkrt/kernels/moe_experts.py (a CPU test compares them).
constexpr int COUNT_BITS = 20;
constexpr int FINISHED = 0, CTAS_BEFORE = 1, LAUNCHES = 2, EXPERTS_DONE = 3, COUNTERS = 4;

// One more arrival at a tagged counter in this launch (epoch): a word from an earlier
// launch starts again at epoch << COUNT_BITS. Readers wait for epoch << COUNT_BITS | n.
__device__ __forceinline__ void count_tagged(u64* word, u64 epoch) {
    const u64 base = epoch << COUNT_BITS;
    u64 seen = *reinterpret_cast<volatile u64*>(word);
    for (;;) {
        const u64 next = seen >= base ? seen + 1 : base + 1;
        const u64 got = atomicCAS(reinterpret_cast<unsigned long long*>(word), seen, next);
        if (got == seen) return;
        seen = got;
    }
}

// The two GEMMs' tiles in one list: units x tiles_n1 first-GEMM tiles, then units x tiles_n2
// second-GEMM tiles (units: m-tiles of all groups); CTA c takes c, c + ctas, ...
template <class Cfg>
struct ExpertsWork {
    grouped::GroupedWork<Cfg> groups;   // raster bands of the first GEMM (group_m)
    int group_m2, tiles_n1, tiles_n2, inter, hidden, k2_blocks;
    const u64* counters;
    u64 ready;                          // a counter once all tiles_n1 tiles of its m-tile are in
    Context ctx;

    __device__ __forceinline__ bool get(int i, gemm::Tile& tile) const {
        int t = groups.cta + i * groups.ctas;
        const int units = groups.units(), first = units * tiles_n1;
        if (t < first) {
            // gate rows g*2I + n*BN/2 .., then up rows I further, BN / 2 of each
            tile = groups.place(t, tiles_n1);
            tile.b_row = tile.group * 2 * inter + tile.n * (Cfg::BN / 2);
            tile.b_row2 = tile.b_row + inter;
            return true;
        }
        t -= first;
        if (t >= units * tiles_n2) return false;
        grouped::GroupedWork<Cfg> second = groups;
        second.group_m = group_m2;
        tile = second.place(t, tiles_n2);
        tile.index += first;
        tile.a_map = 1;                 // act
        tile.b_map = 1;                 // w2
        tile.b_row = tile.group * hidden + tile.n * Cfg::BN;
        tile.kb_end = k2_blocks;
        return true;
    }
    __device__ __forceinline__ bool wait(const gemm::Tile& tile) const {
        if (!tile.b_map) return true;
        if (!wait_at_least(counters + tile.m, ready, ctx, ROLE_COMPUTE, tile.index, COUNTERS + tile.m))
            return false;
        fence_proxy_async_global();     // act was written by generic stores; TMA reads it
        return true;
    }
};

template <class Cfg>
struct ExpertsEpilogue : gemm::PlainStores {
    typedef __nv_bfloat16 T;
    T* act;
    T* out;
    const int* offsets;
    u64* counters;
    u64 epoch;
    int rows, inter, hidden;

    template <class Acc, int CONSUMERS>
    __device__ __forceinline__ void operator()(const gemm::Tile& tile, const Acc& acc,
                                               const gemm::ConsumerThread<CONSUMERS>& who) const {
        const int rows_left = clamp_row(offsets[tile.group + 1], rows) - tile.a_row;
        if (tile.b_map) {
            // second GEMM: the engine's bounded store, moved to the group's rows
            const long long shift = (long long)(tile.a_row - tile.m * Cfg::BM) * hidden;
            const gemm::StoreEpilogue<T, Cfg::BM, Cfg::BN> store{
                out + shift, rows_left + tile.m * Cfg::BM, hidden, hidden, true};
            store(tile, acc, who);
            return;
        }
        // first GEMM: act = SiLU(gate) * up, columns n * BN/2 ..
        const int col0 = tile.n * (Cfg::BN / 2), cols_left = inter - col0;
        T* const base = act + (long long)tile.a_row * inter + col0;
        acc.for_each_gated_pair(who, [&](int r, int c, float g0, float g1, float u0, float u1) {
            if (r >= rows_left || c >= cols_left) return;     // inter is even: pairs stay whole
            const float a0 = g0 / (1.f + __expf(-g0)) * u0;
            const float a1 = g1 / (1.f + __expf(-g1)) * u1;
            *reinterpret_cast<__nv_bfloat162*>(base + (long long)r * inter + c) =
                __floats2bfloat162_rn(a0, a1);
        });
        __threadfence();
        who.sync();
        if (who.leader()) count_tagged(counters + tile.m, epoch);
    }
};

// The experts' part of a launch, every thread of the CTA (cta of ctas): the group scan, both
// GEMMs. words: COUNTERS + m-tile counters of this launch's epoch. dynamic_smem: the
// engine's; tile_prefix: MAX_GROUPS + 1 ints of shared memory.
template <class Cfg>
__device__ __forceinline__ void run_experts(
        const TmaDescriptor* tma_x, const TmaDescriptor* tma_w1, const TmaDescriptor* tma_act,
        const TmaDescriptor* tma_w2, __nv_bfloat16* act, __nv_bfloat16* out, const int* offsets,
        u64* words, int groups, int rows, int inter, int hidden, int group_m1, int group_m2,
        u64 epoch, int cta, int ctas, const Context& ctx, int* tile_prefix, char* dynamic_smem) {
    if (threadIdx.x < 32) grouped::scan_units<Cfg::BM, 1>(offsets, groups, rows, tile_prefix);
    __syncthreads();
    const int tiles_n1 = (inter + Cfg::BN / 2 - 1) / (Cfg::BN / 2);
    const ExpertsWork<Cfg> work{{offsets, tile_prefix, groups, rows, 0, 0, cta, ctas, group_m1, 0},
                                group_m2, tiles_n1, (hidden + Cfg::BN - 1) / Cfg::BN, inter, hidden,
                                (inter + Cfg::BK - 1) / Cfg::BK, words + COUNTERS,
                                (epoch << COUNT_BITS) + (u64)tiles_n1, ctx};
    const ExpertsEpilogue<Cfg> epilogue{{}, act, out, offsets, words + COUNTERS, epoch, rows, inter, hidden};
    gemm::run_tiles<Cfg>(tma_x, tma_w1, hidden, work, epilogue, dynamic_smem, tma_act, tma_w2);
}

}  // namespace experts
}  // namespace mkrt
""", requires=("gemm_tile", "grouped_tiles", "sync"), headers=("cuda_bf16.h",))

MOE_EXPERTS = cuda_source("moe_experts", r"""
using namespace mkrt;
typedef gemm::Config<__nv_bfloat16, $BLOCK_M, $BLOCK_N, $STAGES, true, 0, 1> Cfg;
constexpr int MAX_GROUPS = $MAX_GROUPS;
static_assert(Cfg::BN % 16 == 0, "the first GEMM's tiles are two halves of whole 8-column groups");

extern "C" __global__ void __launch_bounds__(Cfg::THREADS, 1)
moe_experts(const __grid_constant__ TmaDescriptor tma_x,      // x [rows, H], box 64 x BM
            const __grid_constant__ TmaDescriptor tma_w1,     // w1 [G * 2I, H], box 64 x BN/2
            const __grid_constant__ TmaDescriptor tma_act,    // act [rows, I], box 64 x BM
            const __grid_constant__ TmaDescriptor tma_w2,     // w2 [G * H, I], box 64 x BN
            __nv_bfloat16* act, __nv_bfloat16* out, const int* offsets, u64* words, int groups,
            int rows, int inter, int hidden, int group_m1, int group_m2,
            u64* status, u64* host_flag, int slot, int rank, u64 timeout_ns) {
    using namespace experts;
    extern __shared__ char dynamic_smem[];
    __shared__ int tile_prefix[MAX_GROUPS + 1];
    __shared__ u64 launch[2];           // this launch's epoch; CTAs of the launches before
    if (threadIdx.x == 32) {
        launch[0] = ld_acquire_gpu(words + LAUNCHES) + 1;
        launch[1] = ld_acquire_gpu(words + CTAS_BEFORE);
    }
    __syncthreads();
    const u64 epoch = launch[0];
    const Context ctx{status, host_flag, slot, rank, timeout_ns, $KERNEL_ID};
    run_experts<Cfg>(&tma_x, &tma_w1, &tma_act, &tma_w2, act, out, offsets, words, groups, rows,
                     inter, hidden, group_m1, group_m2, epoch, (int)blockIdx.x, (int)gridDim.x, ctx,
                     tile_prefix, dynamic_smem);
    __syncthreads();
    if (threadIdx.x == 0)
        finish_launch(words + FINISHED, words + CTAS_BEFORE, words + LAUNCHES, epoch,
                      launch[1] + gridDim.x);
}
""", requires=("experts_tiles",), headers=("cuda_bf16.h",), register=False)

KERNEL_ID = kernel_id("moe_experts")
BLOCK_NS = (128, 256)


@dataclasses.dataclass(frozen=True)
class MoeExpertsSpec(gemm_module.OnEngine, KernelSpec):
    """URI e.g. ``moe_experts_bf16_nk_bm128_bn256_s4_sm90a``: both GEMMs on one tile shape;
    the first GEMM's tiles are BN / 2 columns of I wide (gate and up halves)."""

    family = "moe_experts"
    entry_points = ("moe_experts",)

    dtype: str = "bf16"
    b_layout: str = "nk"
    block_m: int = dataclasses.field(default=128, metadata={"short": "bm"})
    block_n: int = dataclasses.field(default=256, metadata={"short": "bn"})
    stages: int = dataclasses.field(default=4, metadata={"short": "s"})

    def __post_init__(self):
        super().__post_init__()
        if self.dtype != "bf16" or self.b_layout != "nk":
            raise ValueError(f"mkrt.grouped_mlp: bf16 with [N, K] weights; got {self.dtype} "
                             f"{self.b_layout!r}")
        if self.block_n not in BLOCK_NS:
            raise ValueError(f"mkrt.grouped_mlp: block_n={self.block_n}; expected one of {BLOCK_NS}")
        self.engine                   # the engine's checks (tile, shared memory)
        if self.smem_bytes + STATIC_SMEM_BYTES > gemm_module.SMEM_LIMIT:
            raise ValueError(f"mkrt.grouped_mlp: {self.stages} stages of {self.block_m}x{self.block_n} "
                             f"tiles need {self.smem_bytes} + {STATIC_SMEM_BYTES} bytes of shared "
                             f"memory; at most {gemm_module.SMEM_LIMIT} (use spec_for)")

    def template(self):
        return MOE_EXPERTS

    def params(self):
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "STAGES": self.stages,
                "MAX_GROUPS": MAX_GROUPS, "KERNEL_ID": f"{KERNEL_ID}ull"}


def spec_for(block_m: int, block_n: int = 256) -> MoeExpertsSpec:
    return MoeExpertsSpec("bf16", "nk", block_m, block_n,
                          gemm_module.max_stages(block_m, block_n, "direct", STATIC_SMEM_BYTES))


def default_specs() -> list[MoeExpertsSpec]:
    return [spec_for(block_m, block_n) for block_m in (64, 128) for block_n in BLOCK_NS]


def choose_tile(rows: int, groups: int) -> tuple[int, int]:
    """(block_m, block_n): the grouped GEMM's rows rule (64 rows per tile when groups hold
    few rows each), 256 wide (128 columns of I per first-GEMM tile)."""
    return grouped_module.choose_block_m(rows, groups), 256


def counter_words(rows: int, groups: int, block_m: int) -> int:
    """Words a launch needs: its bookkeeping, then one counter per m-tile (at most
    ceil(rows / BM) + groups: each group's last m-tile may be partial)."""
    return COUNTERS + -(-rows // block_m) + groups


# ---- the work list, in Python ----------------------------------------------------------------

def tile_order(group_rows, inter: int, hidden: int, block_m: int, block_n: int,
               group_m1: int = 1, group_m2: int = 1):
    """The tiles ExpertsWork hands out, in list order: (gemm, group, m_tile, n, virtual_m),
    gemm 1 or 2, m_tile within the group, virtual_m the counter it counts into or waits on."""
    prefix = [0]
    for rows in group_rows:
        prefix.append(prefix[-1] + (-(-rows // block_m) if rows > 0 else 0))
    units = prefix[-1]
    out = []
    for gemm, columns, band in ((1, -(-inter // (block_n // 2)), group_m1),
                                (2, -(-hidden // block_n), group_m2)):
        for t in range(units * columns):
            virtual_m = t // columns
            g = max(i for i in range(len(group_rows)) if prefix[i] <= virtual_m)
            m_tiles = prefix[g + 1] - prefix[g]
            local = t - prefix[g] * columns
            per_band = band * columns
            first_m = local // per_band * band
            rows_in_band = min(band, m_tiles - first_m)
            inside = local - local // per_band * per_band
            m = first_m + inside % rows_in_band
            out.append((gemm, g, m, inside // rows_in_band, prefix[g] + m))
    return out


def replay(order, ctas: int) -> int:
    """Run the list on `ctas` CTAs, each taking positions c, c + ctas, ... in order, a tile
    one step, a second-GEMM tile only once every first-GEMM tile of its m-tile is done.
    Returns the steps taken; raises if the CTAs stop with tiles left (a wait cycle)."""
    first_tiles = collections.Counter(t[4] for t in order if t[0] == 1)
    done = collections.Counter()
    lists = [order[c::ctas] for c in range(ctas)]
    at = [0] * ctas
    steps = 0
    while any(a < len(tiles) for a, tiles in zip(at, lists)):
        finished = []
        for c, tiles in enumerate(lists):
            if at[c] == len(tiles):
                continue
            gemm, _, _, _, virtual_m = tiles[at[c]]
            if gemm == 2 and done[virtual_m] < first_tiles[virtual_m]:
                continue
            finished.append((c, tiles[at[c]]))
        if not finished:
            raise RuntimeError(f"mkrt.grouped_mlp: no CTA can go on after {steps} steps")
        for c, (gemm, _, _, _, virtual_m) in finished:
            at[c] += 1
            if gemm == 1:
                done[virtual_m] += 1
        steps += 1
    return steps


# ---- checks (pure Python) --------------------------------------------------------------------

def check_operands(x_shape, w1_shape, w2_shape, x_dtype, w1_dtype, w2_dtype,
                   area: str = "grouped_mlp") -> tuple[int, int, int, int]:
    """(rows, groups, hidden, inter) after checking shapes and dtypes."""
    for name, dtype in (("x", x_dtype), ("w1", w1_dtype), ("w2", w2_dtype)):
        if np.dtype(dtype) != bfloat16:
            raise TypeError(f"mkrt.{area}: {name} has dtype {dtype_name(dtype)}; expected bf16")
    if len(x_shape) != 2 or len(w1_shape) != 3 or len(w2_shape) != 3:
        raise ValueError(f"mkrt.{area}: x {tuple(x_shape)} must be [R, H], w1 {tuple(w1_shape)} "
                         f"[G, 2I, H] and w2 {tuple(w2_shape)} [G, H, I]")
    rows, hidden = (int(v) for v in x_shape)
    groups, two_inter, h1 = (int(v) for v in w1_shape)
    inter = two_inter // 2
    if h1 != hidden or two_inter % 2 or tuple(int(v) for v in w2_shape) != (groups, hidden, inter):
        raise ValueError(f"mkrt.{area}: x {tuple(x_shape)}, w1 {tuple(w1_shape)} and w2 "
                         f"{tuple(w2_shape)} disagree; expected w1 [G, 2I, {hidden}] and w2 "
                         f"[G, {hidden}, I]")
    for name, value in (("H", hidden), ("I", inter)):
        if value < 8 or value % 8:
            raise ValueError(f"mkrt.{area}: {name}={value} must be a positive multiple of 8 (TMA "
                             "needs 16-byte rows)")
    if not 1 <= groups <= MAX_GROUPS:
        raise ValueError(f"mkrt.{area}: {groups} groups; expected 1 to {MAX_GROUPS}")
    if rows >= 2**31 or groups * 2 * inter >= 2**31 or groups * hidden >= 2**31:
        raise ValueError(f"mkrt.{area}: x {tuple(x_shape)}, w1 {tuple(w1_shape)} exceed 2**31 rows")
    if -(-inter // 64) >= 1 << COUNT_BITS:
        raise ValueError(f"mkrt.{area}: I={inter} is too large for the tile counters")
    return rows, groups, hidden, inter


# ---- launcher -----------------------------------------------------------------------------

def write_maps(params, x_ptr: int, w1_ptr: int, w2_ptr: int, act_ptr: int, rows: int, groups: int,
               hidden: int, inter: int, tile: tuple[int, int]) -> None:
    """Encode the experts' four TMA maps into `params` (fields tma_x, tma_w1, tma_act, tma_w2;
    moe_experts and moe_fused alike): x [rows, H] and act [rows, I] in boxes of BM rows, w1 as
    [G * 2I, H] in halves of BN / 2 rows (gate, up), w2 as [G * H, I] in boxes of BN rows."""
    block_m, block_n = tile
    maps = {"tma_x": (x_ptr, hidden, rows, block_m),
            "tma_w1": (w1_ptr, hidden, groups * 2 * inter, block_n // 2),
            "tma_act": (act_ptr, inter, rows, block_m),
            "tma_w2": (w2_ptr, inter, groups * hidden, block_n)}
    for name, (pointer, inner, outer, box) in maps.items():
        descriptor = gemm_module.tma_descriptor_2d(pointer, "bf16", inner, outer, inner * 2, 64, box)
        ctypes.memmove(params.address(name), descriptor.address, 128)


class ExpertsLaunch:
    """The launch for one signature (device, rows, groups, H, I, tile, grid): its parameters,
    TMA maps (rebuilt when a pointer changes) and, per stream, its counter words."""

    def __init__(self, device: int, rows: int, groups: int, hidden: int, inter: int,
                 tile: tuple[int, int], grid: int):
        self.spec = spec_for(*tile)
        self.device, self.rows, self.groups, self.hidden, self.inter = device, rows, groups, hidden, inter
        params = Parameters([("tma_x", 128, 64), ("tma_w1", 128, 64), ("tma_act", 128, 64),
                             ("tma_w2", 128, 64), ("act", np.uint64, 8), ("out", np.uint64, 8),
                             ("offsets", np.uint64, 8), ("words", np.uint64, 8),
                             ("groups", np.int32, 4), ("rows", np.int32, 4), ("inter", np.int32, 4),
                             ("hidden", np.int32, 4), ("group_m1", np.int32, 4),
                             ("group_m2", np.int32, 4), *CONTEXT_PARAMETERS])
        params.set(groups=groups, rows=rows, inter=inter, hidden=hidden,
                   group_m1=grouped_module.band_m_tiles(2 * inter, hidden),
                   group_m2=grouped_module.band_m_tiles(hidden, inter))
        function = self.spec.function("moe_experts", device, self.spec.smem_bytes)
        self.launch = KernelLaunch(function, grid, self.spec.threads, self.spec.smem_bytes, params)
        self.words = counter_words(rows, groups, tile[0])
        self._workspaces: dict = {}
        self._bound_stream = None
        self._maps = None

    def patch(self, x_ptr: int, w1_ptr: int, w2_ptr: int, act_ptr: int, out_ptr: int,
              offsets_ptr: int, context: dict) -> None:
        params = self.launch.params
        if self._maps != (x_ptr, w1_ptr, w2_ptr, act_ptr):
            write_maps(params, x_ptr, w1_ptr, w2_ptr, act_ptr, self.rows, self.groups, self.hidden,
                       self.inter, (self.spec.block_m, self.spec.block_n))
            self._maps = (x_ptr, w1_ptr, w2_ptr, act_ptr)
        params.set(act=act_ptr, out=out_ptr, offsets=offsets_ptr, **context)

    def run(self, stream_ptr: int) -> None:
        """Launch on a stream; its counter words are the stream's own (zeroed once)."""
        if self._bound_stream != stream_ptr:
            import cupy
            workspace, kept = stream_workspace(self._workspaces, self.device, stream_ptr,
                                               lambda: (cupy.zeros(self.words, np.uint64),))
            self.launch.params.set(words=workspace[0].data.ptr)
            self._bound_stream = stream_ptr if kept else None
        self.launch(stream_ptr)


_LAUNCHES: "collections.OrderedDict[tuple, ExpertsLaunch]" = collections.OrderedDict()
_STATUS: dict = {}          # device -> StatusBlock of the function form's launches


def prepared(device: int, rows: int, groups: int, hidden: int, inter: int, sms: int,
             block_m: int | None = None, block_n: int | None = None) -> ExpertsLaunch:
    """The launch for this signature, built (compiled, loaded) on first use; keyed by the tile
    as asked for, so choose_tile runs once per signature, not per call."""
    key = (device, rows, groups, hidden, inter, block_m, block_n, sms)
    launch = _LAUNCHES.get(key)
    if launch is None:
        chosen = choose_tile(rows, groups)
        tile = (block_m or chosen[0], block_n or chosen[1])
        # never more CTAs than the tiles of the first GEMM at its fullest
        most_tiles = (-(-rows // tile[0]) + groups) * -(-inter // (tile[1] // 2))
        launch = _LAUNCHES[key] = ExpertsLaunch(device, rows, groups, hidden, inter, tile,
                                                max(1, min(sms, most_tiles)))
        if len(_LAUNCHES) > 64:
            _LAUNCHES.popitem(last=False)
    return launch


def _status(device: int):
    from mkrt.status import StatusBlock
    block = _STATUS.get(device)
    if block is None:
        block = _STATUS[device] = StatusBlock(device, 1, None)
    return block


def grouped_mlp(x, w1, w2, offsets, out=None, *, act=None, block_m: int | None = None,
                block_n: int | None = None, sms: int | None = None, stream=None,
                timeout_ms: float = 10_000.0):
    """Each group's SwiGLU MLP over its rows, in one launch: ``out[o_g:o_g+1] =
    w2[g] (SiLU(gate) * up)`` with ``[gate; up] = w1[g] x[o_g:o_g+1]``.

    x [R, H], w1 [G, 2I, H] (gate rows then up rows), w2 [G, H, I], bf16, C-contiguous;
    offsets G + 1 group boundaries (host sequence, checked; or a device int32 array, used
    as it is); out optional [R, H]; act optional [R, I] bf16 scratch (the SwiGLU rows; made
    per call if not given). Rows outside [offsets[0], offsets[G]) are left as they are.
    ``block_m`` 64 or 128, ``block_n`` 128 or 256 (default: :func:`choose_tile`'s), ``sms``
    the SMs it may use. A tile's wait for its rows' SwiGLU is bounded by ``timeout_ms``
    and ends in ``mkrt.CommTimeout`` (raised by the next call on the device if the launch
    was not synchronised). Returns out in the type of ``x``."""
    import cupy

    views = {name: grouped_module._view(a, name) for name, a in (("x", x), ("w1", w1), ("w2", w2),
                                                                 ("out", out), ("act", act))
             if a is not None}
    xv = views["x"]
    rows, groups, hidden, inter = check_operands(xv.shape, views["w1"].shape, views["w2"].shape,
                                                 xv.dtype, views["w1"].dtype, views["w2"].dtype)
    device = xv.data.device_id
    for name, a in views.items():
        if a.data.device_id != device:
            raise ValueError(f"mkrt.grouped_mlp: {name} is on GPU {a.data.device_id}, x on GPU {device}")
        if not a.flags.c_contiguous or a.data.ptr % 16:
            raise ValueError(f"mkrt.grouped_mlp: {name} must be C-contiguous and 16-byte aligned")
    for name, shape in (("out", (rows, hidden)), ("act", (rows, inter))):
        a = views.get(name)
        if a is not None and (tuple(a.shape) != shape or a.dtype != bfloat16):
            raise ValueError(f"mkrt.grouped_mlp: {name} is {tuple(a.shape)} {dtype_name(a.dtype)}; "
                             f"expected {shape} bf16")
    total_sms = device_sm_count(device)
    if sms is None:
        sms = total_sms
    elif isinstance(sms, bool) or not isinstance(sms, (int, np.integer)) or not 1 <= sms <= total_sms:
        raise ValueError(f"mkrt.grouped_mlp: sms={sms!r}; expected an integer in [1, {total_sms}]")
    if block_m not in (None, 64, 128) or block_n not in (None,) + BLOCK_NS:
        raise ValueError(f"mkrt.grouped_mlp: block_m={block_m!r}, block_n={block_n!r}; expected "
                         f"64 or 128, and one of {BLOCK_NS}")
    if not timeout_ms > 0:
        raise ValueError(f"mkrt.grouped_mlp: timeout_ms={timeout_ms!r} must be positive")
    offsets_view = grouped_module._device_offsets(offsets, groups, rows, device)
    out_as_given = out is not None and is_torch(out) == is_torch(x)
    if rows == 0:
        if out_as_given:
            return out
        return like_input(as_cupy(out, "out") if out is not None else cupy.empty((0, hidden), bfloat16), x)
    status = _status(device)
    status.raise_if_failed()            # an earlier launch's wait gave up
    status.timeout_ms[0] = timeout_ms
    launch = prepared(device, rows, groups, hidden, inter, int(sms), block_m, block_n)
    with cupy.cuda.Device(device):
        out_view = views.get("out")
        if out_view is None:
            out_view = cupy.empty((rows, hidden), bfloat16)
        act_view = views.get("act")
        if act_view is None:
            act_view = cupy.empty((rows, inter), bfloat16)
        context = {"status": status.device_ptr, "host_flag": status.host_flag_ptr, "slot": 0,
                   "rank": 0, "timeout_ns": int(timeout_ms * 1e6)}
        launch.patch(xv.data.ptr, views["w1"].data.ptr, views["w2"].data.ptr, act_view.data.ptr,
                     out_view.data.ptr, offsets_view.data.ptr, context)
        launch.run((stream or cupy.cuda.get_current_stream()).ptr)
    if out_as_given:
        return out
    return like_input(out_view if out is None else as_cupy(out, "out"), x)


def reference(x, w1, w2, offsets, dtype=np.float32):
    """The groups' MLPs in `dtype` (SwiGLU from the unrounded products; rows outside the
    groups are zero)."""
    xp = np if isinstance(x, np.ndarray) else __import__("cupy")
    x32 = gemm_module.to_float32(x).astype(dtype)
    w1_32, w2_32 = (gemm_module.to_float32(w).astype(dtype) for w in (w1, w2))
    offsets = [int(v) for v in (offsets.get() if hasattr(offsets, "get") else offsets)]
    inter = w1.shape[1] // 2
    out = xp.zeros((x.shape[0], w2.shape[1]), dtype=dtype)
    for g in range(w1.shape[0]):
        a, b = offsets[g], offsets[g + 1]
        if b > a:
            h = x32[a:b] @ w1_32[g].T
            gate, up = h[:, :inter], h[:, inter:]
            out[a:b] = (gate / (1 + xp.exp(-gate)) * up) @ w2_32[g].T
    return out


def test_cases():
    """(group rows, H, I) the GPU tests run: empty groups, one row, ragged groups, I not a
    multiple of the half tile (128), a hot group, several waves of tiles."""
    return [([128, 128], 256, 128), ([0, 1, 0, 300, 17], 136, 72), ([5] * 64, 128, 256),
            ([1000, 0, 3, 64], 512, 1000), ([33, 97, 130, 255, 256, 257], 264, 200),
            ([1300, 0, 129], 1024, 2048)]
