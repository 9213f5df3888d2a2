"""MoE expert parallelism inside a node: routed dispatch, grouped GEMMs, combine.

    y = mkrt.MoE(world, experts=E, capacity=T_max)(x, topk_ids, topk_weights, w1, w2)

Per rank: x [T, H] (bf16), topk_ids [T, k] int32 (global expert ids; rank w holds experts
w*E/W .. (w+1)*E/W - 1), topk_weights [T, k] float32, w1 [E/W, 2I, H] (gate rows then up
rows) and w2 [E/W, H, I]. Every rank gets y [T, H] = sum over its k experts of
weight * w2_e (SiLU(gate) * up), [gate; up] = w1_e x. T may differ between ranks (0 too).

Each call runs five launches per rank on the rank's stream, none waiting for the host:

1. ``moe_dispatch`` (a few CTAs): one warp ranks the rank's (token, choice) entries per
   expert in token order and counts them; the counts go to every rank (peer stores);
   every CTA then computes where each expert's rows land at every rank -- expert-major,
   inside an expert by (source rank, token): the order mkrt/kernels/moe_plan.py plans --
   and copies each routed row once to the rank holding its expert, with (source, entry)
   beside it; the launch ends once every rank's rows for this rank are in.
2. ``mkrt.grouped_gemm`` of the received rows with w1 (group offsets from step 1, on the
   device), 3. SwiGLU, 4. ``mkrt.grouped_gemm`` with w2,
5. ``moe_combine``: each result row goes back to its source's slot (token, choice); once
   every rank has sent its rows back, each rank adds its tokens' k rows weighted in fp32
   in choice order (bit-identical between calls) and rounds once.

Buffers live in symmetric memory sized by ``capacity`` (tokens per rank) and
``receive_rows`` (rows a rank may receive; default 2 x capacity x 8, the average load of
top-8 routing twice over): a call whose routing sends a rank more rows fails on the device with a
CommTimeout record naming the overflow (flag -5), before any row is written past the end.
Every wait is bounded; flags are epochs (graph-capturable for a fixed routing capacity).

Worlds of one node (1xG, emulated or under mpiexec on one host). Across nodes (each token
crossing to a node once, through the proxy) is not built yet: such worlds are refused.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mkrt import checks
from mkrt.arrays import bfloat16, dtype_name, like_input
from mkrt.jit import cuda_source
from mkrt.jit.spec import KernelSpec
from mkrt.kernels import grouped_gemm as grouped_module
from mkrt.kernels.device import gather  # noqa: F401  (register the pieces)
from mkrt.kernels.launcher import KernelLaunch, Parameters, struct_size_assert
from mkrt.kernels.op import CONTEXT_PARAMETERS, Op, shared_op
from mkrt.memory import SymmetricBuffer, flags as flag_buffer
from mkrt.status import kernel_id

MAX_EXPERTS = 1024
MAX_RANKS = 32

MOE = cuda_source("moe", r"""
using namespace mkrt;
typedef __nv_bfloat16 T;
constexpr int MAX_EXPERTS = $MAX_EXPERTS;
constexpr int MAX_RANKS = $MAX_RANKS;
constexpr int BAD_EXPERT = -4, OVER_CAPACITY = -5;      // mkrt.errors.SPECIAL_FLAGS

// A rank's flag words (mirror: MoeFlags in Python).
struct Flags {
    int W;
    __device__ int arrive(int s) const { return s; }               // rank s's call began
    __device__ int counts_ready(int s) const { return W + s; }     // rank s's counts are here
    __device__ int rows_ready(int s) const { return 2 * W + s; }   // rank s's rows are here
    __device__ int back_ready(int s) const { return 3 * W + s; }   // rank s sent our rows back
    __device__ int dispatched() const { return 4 * W; }            // CTA counters
    __device__ int combined() const { return 4 * W + 1; }
    __device__ int launch_words(int kernel) const { return 4 * W + 2 + 3 * kernel; }  // finished, ctas_before, launches
};

struct Args {
    const T* x;                 // [tokens, H]
    const int* ids;             // [tokens, k]
    const float* weights;       // [tokens, k]
    T* y;                       // [tokens, H]
    int* entry_rank;            // [capacity * k]: an entry's place among this rank's entries of its expert
    int* offsets;               // [experts_per_rank + 1]: this rank's received rows per local expert
    const T* results;           // [receive_rows, H]: the w2 GEMM's rows (combine)
    int* counts;                // symmetric [W][E]: counts[s][e] = rank s's entries for expert e
    T* received;                // symmetric [receive_rows, H]
    int* sources;               // symmetric [receive_rows, 2]: (source rank, entry)
    T* back;                    // symmetric [capacity * k, H]: results of this rank's entries
    u64* flags;
    const u64* peer_flags;      // [W] tables of the node's ranks' pointers
    const u64* peer_counts;
    const u64* peer_received;
    const u64* peer_sources;
    const u64* peer_back;
    int tokens, k, hidden, experts, per_rank, me, W, receive_rows;
};
$ARGS_CHECKS

// The CTA waits until flags[word0 + s] >= epoch for every rank s (thread s polls word s).
__device__ bool wait_all(const Args& a, int word0, u64 epoch, const Context& ctx, int role) {
    return cta_wait_words(a.flags, word0, 1, a.W, -1, epoch, ctx, role, 0, 1, nullptr);
}

// Launch bookkeeping of kernel `kernel` (0 dispatch, 1 combine): this launch's epoch.
__device__ u64 begin_launch(const Args& a, const Flags& L, int kernel) {
    __shared__ u64 epoch;
    if (threadIdx.x == 0) epoch = ld_acquire_gpu(a.flags + L.launch_words(kernel) + 2) + 1;
    __syncthreads();
    return epoch;
}
__device__ void end_launch(const Args& a, const Flags& L, int kernel, u64 epoch) {
    __shared__ u64 before;
    if (threadIdx.x == 0) before = ld_acquire_gpu(a.flags + L.launch_words(kernel) + 1);
    __syncthreads();
    const u64 all = before + gridDim.x;
    __syncthreads();
    if (threadIdx.x == 0) {
        u64* words = a.flags + L.launch_words(kernel);
        finish_launch(words, words + 1, words + 2, epoch, all);
    }
}

// Copy `bytes` (a multiple of 16) with the 32 lanes of a warp.
__device__ __forceinline__ void warp_copy(void* dst, const void* src, int bytes) {
    const int lane = threadIdx.x & 31;
    for (int v = lane; v < bytes / 16; v += 32)
        reinterpret_cast<uint4*>(dst)[v] = reinterpret_cast<const uint4*>(src)[v];
}

extern "C" __global__ void __launch_bounds__(256)
moe_dispatch(const __grid_constant__ Args a, u64* status, u64* host_flag, int slot, int rank,
             u64 timeout_ns) {
    const Context ctx{status, host_flag, slot, rank, timeout_ns, $KERNEL_ID};
    const Flags L{a.W};
    __shared__ int counts[MAX_EXPERTS];      // CTA 0: this rank's; then: where rows land
    const u64 epoch = begin_launch(a, L, 0);
    const int entries = a.tokens * a.k;

    if (blockIdx.x == 0) {
        // 1. our call began: ranks may write into our buffers (our last combine is done)
        if (threadIdx.x < a.W) st_release_sys((u64*)a.peer_flags[threadIdx.x] + L.arrive(a.me), epoch);
        for (int e = threadIdx.x; e < a.experts; e += blockDim.x) counts[e] = 0;
        __syncthreads();
        // 2. one warp ranks the entries per expert, in entry (token) order
        if (threadIdx.x < 32) {
            const int lane = threadIdx.x;
            const unsigned below = (1u << lane) - 1;
            for (int base = 0; base < entries; base += 32) {
                const int entry = base + lane;
                int e = entry < entries ? a.ids[entry] : -1;
                if (entry < entries && (e < 0 || e >= a.experts)) {
                    report_timeout(ctx, ROLE_INTRA, entry, BAD_EXPERT, (u64)a.experts, (u64)(i64)e);
                    e = -1;
                }
                const unsigned same = __match_any_sync(0xffffffffu, e);
                if (e >= 0) {
                    const int leader = __ffs(same) - 1;
                    const int place = counts[e] + __popc(same & below);
                    a.entry_rank[entry] = place;
                    __syncwarp(same);
                    if (lane == leader) counts[e] += __popc(same);
                }
                __syncwarp();
            }
        }
        __syncthreads();
        // 3. the counts to every rank once it has begun this call
        if (!wait_all(a, L.arrive(0), epoch, ctx, ROLE_INTRA)) return;
        for (int s = 0; s < a.W; ++s) {
            int* target = (int*)a.peer_counts[s] + a.me * a.experts;
            for (int e = threadIdx.x; e < a.experts; e += blockDim.x) target[e] = counts[e];
        }
        __threadfence_system();
        __syncthreads();
        if (threadIdx.x < a.W) st_release_sys((u64*)a.peer_flags[threadIdx.x] + L.counts_ready(a.me), epoch);
        // (an entry with a bad id was reported and is skipped below; going on keeps the
        // CTA counters and the ranks' flags in step, so only this rank's record fails)
    }

    // 4. every rank's counts in: where each expert's rows land at its rank (expert-major,
    // then source rank, then token), and this rank's group offsets
    if (!wait_all(a, L.counts_ready(0), epoch, ctx, ROLE_INTRA)) return;
    __syncthreads();
    for (int e = threadIdx.x; e < a.experts; e += blockDim.x) {
        const int first = (e / a.per_rank) * a.per_rank;
        int place = 0;
        for (int s = 0; s < a.W; ++s) {
            const int* row = a.counts + s * a.experts;
            for (int f = first; f < e; ++f) place += row[f];
            if (s < a.me) place += row[e];
        }
        counts[e] = place;
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        int total = 0;
        a.offsets[0] = 0;
        for (int j = 0; j < a.per_rank; ++j) {
            for (int s = 0; s < a.W; ++s) total += a.counts[s * a.experts + a.me * a.per_rank + j];
            a.offsets[j + 1] = min(total, a.receive_rows);
        }
        if (total > a.receive_rows) report_timeout(ctx, ROLE_INTRA, -1, OVER_CAPACITY, (u64)a.receive_rows, (u64)total);
    }
    __syncthreads();

    // 5. each routed row, once, to the rank holding its expert (a warp per row)
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int warps = (gridDim.x * blockDim.x) >> 5;
    const int row_bytes = a.hidden * (int)sizeof(T);
    for (int entry = warp; entry < entries; entry += warps) {
        const int e = a.ids[entry];
        if (e < 0 || e >= a.experts) continue;
        const int holder = e / a.per_rank;
        const int row = counts[e] + a.entry_rank[entry];
        if (row >= a.receive_rows) continue;          // reported by the holder (step 4)
        warp_copy((T*)a.peer_received[holder] + (long long)row * a.hidden,
                  a.x + (long long)(entry / a.k) * a.hidden, row_bytes);
        if ((threadIdx.x & 31) == 0) {
            int* source = (int*)a.peer_sources[holder] + 2 * row;
            source[0] = a.me;
            source[1] = entry;
        }
    }
    if (last_cta_done(a.flags + L.dispatched(), ld_acquire_gpu(a.flags + L.launch_words(0) + 1) + gridDim.x)) {
        for (int s = 0; s < a.W; ++s) st_release_sys((u64*)a.peer_flags[s] + L.rows_ready(a.me), epoch);
    }
    // 6. every rank's rows for us are in before the GEMMs read them
    if (wait_all(a, L.rows_ready(0), epoch, ctx, ROLE_INTRA)) end_launch(a, L, 0, epoch);
}

// SwiGLU of the rows the w1 GEMM wrote: act[r, c] = silu(h[r, c]) * h[r, inter + c], for
// the rows this rank received (offsets[per_rank] of them).
extern "C" __global__ void moe_swiglu(const T* h, T* act, const int* offsets, int per_rank,
                                      int inter) {
    const long long rows = offsets[per_rank];
    const long long total = rows * inter;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / inter, c = i - r * inter;
        const float gate = __bfloat162float(h[r * 2 * inter + c]);
        const float up = __bfloat162float(h[r * 2 * inter + inter + c]);
        act[i] = __float2bfloat16_rn(gate / (1.f + __expf(-gate)) * up);
    }
}

extern "C" __global__ void __launch_bounds__(256)
moe_combine(const __grid_constant__ Args a, u64* status, u64* host_flag, int slot, int rank,
            u64 timeout_ns) {
    const Context ctx{status, host_flag, slot, rank, timeout_ns, $KERNEL_ID};
    const Flags L{a.W};
    const u64 epoch = begin_launch(a, L, 1);
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int warps = (gridDim.x * blockDim.x) >> 5;
    const int row_bytes = a.hidden * (int)sizeof(T);
    // 1. each result row back to its source's slot (token, choice)
    const int rows = a.offsets[a.per_rank];
    for (int r = warp; r < rows; r += warps) {
        const int* source = a.sources + 2 * r;
        warp_copy((T*)a.peer_back[source[0]] + (long long)source[1] * a.hidden,
                  a.results + (long long)r * a.hidden, row_bytes);
    }
    if (last_cta_done(a.flags + L.combined(), ld_acquire_gpu(a.flags + L.launch_words(1) + 1) + gridDim.x)) {
        for (int s = 0; s < a.W; ++s) st_release_sys((u64*)a.peer_flags[s] + L.back_ready(a.me), epoch);
    }
    // 2. every rank sent its rows back: y[t] = sum_i w[t, i] * back[t, i] in fp32, i in order
    if (!wait_all(a, L.back_ready(0), epoch, ctx, ROLE_REDUCE)) return;
    const int pairs = a.hidden / 2;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (long long)a.tokens * pairs;
         i += (long long)gridDim.x * blockDim.x) {
        const int t = (int)(i / pairs), c = 2 * (int)(i - (long long)t * pairs);
        float s0 = 0.f, s1 = 0.f;
        for (int j = 0; j < a.k; ++j) {
            const float w = a.weights[t * a.k + j];
            const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(
                a.back + ((long long)t * a.k + j) * a.hidden + c);
            s0 = fmaf(w, __bfloat162float(v.x), s0);
            s1 = fmaf(w, __bfloat162float(v.y), s1);
        }
        *reinterpret_cast<__nv_bfloat162*>(a.y + (long long)t * a.hidden + c) = __floats2bfloat162_rn(s0, s1);
    }
    end_launch(a, L, 1, epoch);
}
""", requires=("gather",), headers=("cuda_bf16.h",), register=False)

KERNEL_ID = kernel_id("moe")

ARGS_DTYPE = np.dtype([
    ("x", "<u8"), ("ids", "<u8"), ("weights", "<u8"), ("y", "<u8"), ("entry_rank", "<u8"),
    ("offsets", "<u8"), ("results", "<u8"), ("counts", "<u8"), ("received", "<u8"),
    ("sources", "<u8"), ("back", "<u8"), ("flags", "<u8"), ("peer_flags", "<u8"),
    ("peer_counts", "<u8"), ("peer_received", "<u8"), ("peer_sources", "<u8"),
    ("peer_back", "<u8"),
    ("tokens", "<i4"), ("k", "<i4"), ("hidden", "<i4"), ("experts", "<i4"),
    ("per_rank", "<i4"), ("me", "<i4"), ("W", "<i4"), ("receive_rows", "<i4"),
], align=True)

LAUNCH_PARAMETERS = [("args", ARGS_DTYPE, 8), *CONTEXT_PARAMETERS]


@dataclasses.dataclass(frozen=True)
class MoeFlags:
    """Index of every flag word of a rank (mirrors the template's struct Flags)."""

    W: int

    def arrive(self, s): return s
    def counts_ready(self, s): return self.W + s
    def rows_ready(self, s): return 2 * self.W + s
    def back_ready(self, s): return 3 * self.W + s

    @property
    def words(self) -> int:
        return 4 * self.W + 2 + 6


@dataclasses.dataclass(frozen=True)
class MoeSpec(KernelSpec):
    """The dispatch, SwiGLU and combine kernels (bf16; URI ``moe_sm90a``)."""

    family = "moe"
    entry_points = ("moe_dispatch", "moe_swiglu", "moe_combine")

    def template(self):
        return MOE

    def params(self):
        return {"MAX_EXPERTS": MAX_EXPERTS, "MAX_RANKS": MAX_RANKS, "KERNEL_ID": f"{KERNEL_ID}ull",
                "ARGS_CHECKS": struct_size_assert("Args", ARGS_DTYPE)}


def default_specs() -> list[MoeSpec]:
    return [MoeSpec()]


# ---- checks (pure Python) ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MoeShape:
    tokens: int
    k: int
    hidden: int
    inter: int
    per_rank: int


def check_routing(x, ids, area: str = "moe") -> tuple[int, int, int]:
    """(tokens, k, hidden) of one rank's x and topk_ids ((shape, dtype) pairs)."""
    (xs, xd), (ids_s, ids_d) = x, ids
    if np.dtype(xd) != bfloat16:
        raise TypeError(f"mkrt.{area}: x must be bf16; got {dtype_name(xd)}")
    if np.dtype(ids_d) != np.int32:
        raise TypeError(f"mkrt.{area}: topk_ids must be int32; got {dtype_name(ids_d)}")
    if len(xs) != 2 or len(ids_s) != 2 or ids_s[0] != xs[0]:
        raise ValueError(f"mkrt.{area}: x {tuple(xs)} must be [T, H] and topk_ids {tuple(ids_s)} [T, k]")
    tokens, hidden = (int(v) for v in xs)
    k = int(ids_s[1])
    if not 1 <= k <= 8:
        raise ValueError(f"mkrt.{area}: k={k}; expected 1 to 8 experts per token")
    if hidden % 8 or hidden < 8:
        raise ValueError(f"mkrt.{area}: H={hidden} must be a positive multiple of 8")
    return tokens, k, hidden


def check_operands(x, ids, weights, w1, w2, *, experts_per_rank: int, area: str = "moe") -> MoeShape:
    """Shapes and dtypes of one rank's arguments ((shape, dtype) pairs)."""
    (xs, xd), (ids_s, ids_d), (ws, wd), (w1s, w1d), (w2s, w2d) = x, ids, weights, w1, w2
    if np.dtype(xd) != bfloat16 or np.dtype(w1d) != bfloat16 or np.dtype(w2d) != bfloat16:
        raise TypeError(f"mkrt.{area}: x, w1, w2 must be bf16; got {dtype_name(xd)}, "
                        f"{dtype_name(w1d)}, {dtype_name(w2d)}")
    if np.dtype(ids_d) != np.int32:
        raise TypeError(f"mkrt.{area}: topk_ids must be int32; got {dtype_name(ids_d)}")
    if np.dtype(wd) != np.float32:
        raise TypeError(f"mkrt.{area}: topk_weights must be float32; got {dtype_name(wd)}")
    if len(xs) != 2 or len(ids_s) != 2 or tuple(ws) != tuple(ids_s) or ids_s[0] != xs[0]:
        raise ValueError(f"mkrt.{area}: x {tuple(xs)} must be [T, H], topk_ids {tuple(ids_s)} and "
                         f"topk_weights {tuple(ws)} [T, k]")
    tokens, hidden = (int(v) for v in xs)
    k = int(ids_s[1])
    if not 1 <= k <= 8:
        raise ValueError(f"mkrt.{area}: k={k}; expected 1 to 8 experts per token")
    if len(w1s) != 3 or len(w2s) != 3:
        raise ValueError(f"mkrt.{area}: w1 {tuple(w1s)} must be [E_local, 2I, H], w2 {tuple(w2s)} "
                         "[E_local, H, I]")
    per_rank, two_inter, h1 = (int(v) for v in w1s)
    per2, h2, inter = (int(v) for v in w2s)
    if per_rank != experts_per_rank or per2 != experts_per_rank:
        raise ValueError(f"mkrt.{area}: w1 and w2 hold {per_rank} and {per2} experts; this world "
                         f"gives each rank {experts_per_rank}")
    if h1 != hidden or h2 != hidden or two_inter != 2 * inter:
        raise ValueError(f"mkrt.{area}: x has H={hidden}; w1 is {tuple(w1s)}, w2 {tuple(w2s)}: "
                         "expected w1 [E_local, 2I, H] and w2 [E_local, H, I]")
    if hidden % 8 or inter % 8 or hidden < 8 or inter < 8:
        raise ValueError(f"mkrt.{area}: H={hidden} and I={inter} must be positive multiples of 8")
    return MoeShape(tokens, k, hidden, inter, per_rank)


def landing(topk_ids: list, experts: int) -> list[list[tuple[int, int]]]:
    """What each rank receives, row by row, as the dispatch kernel places it: (source rank,
    entry = token * k + choice), rows of an expert at counts of the experts before it (at
    that rank, from every source), plus the counts of the sources before, plus the entry's
    place among its source's entries of that expert (token order)."""
    W = len(topk_ids)
    per_rank = experts // W
    counts = np.zeros((W, experts), np.int64)
    for s, ids in enumerate(topk_ids):
        np.add.at(counts[s], np.asarray(ids).reshape(-1), 1)
    received = [[None] * int(counts[:, d * per_rank:(d + 1) * per_rank].sum()) for d in range(W)]
    for s, ids in enumerate(topk_ids):
        seen = np.zeros(experts, np.int64)
        for entry, e in enumerate(np.asarray(ids).reshape(-1)):
            d = e // per_rank
            place = counts[:, d * per_rank:e].sum() + counts[:s, e].sum() + seen[e]
            seen[e] += 1
            received[d][place] = (s, entry)
    return received


# ---- the op --------------------------------------------------------------------------------

class MoE(Op):
    """``y = op(x, topk_ids, topk_weights, w1, w2)``: routed experts over a one-node world.

    ``experts``: E in the world (a multiple of the world size, at most 1024); ``capacity``:
    most tokens a rank passes per call; ``receive_rows``: most rows a rank may receive
    (default 2 x capacity x k_max with k_max = 8, or as given). ``ctas``: CTAs of the
    dispatch and combine kernels (default 16)."""

    name = "moe"

    def __init__(self, world=None, *, experts: int, capacity: int, receive_rows: int | None = None,
                 ctas: int = 16, timeout_ms: float | None = None, validate: bool = True):
        super().__init__(world, timeout_ms=timeout_ms)
        area = self.name
        W = self.world.size
        if self.world.nodes != 1:
            raise ValueError(f"mkrt.moe: worlds of one node for now; this world is "
                             f"{self.world.layout} (across nodes, routed through the proxy, is "
                             "not built yet)")
        if W > MAX_RANKS:
            raise ValueError(f"mkrt.moe: at most {MAX_RANKS} ranks; this world has {W}")
        self.experts = checks.integer(experts, "experts", area, low=1, high=MAX_EXPERTS)
        if self.experts % W:
            raise ValueError(f"mkrt.moe: {self.experts} experts do not split over {W} ranks")
        self.capacity = checks.integer(capacity, "capacity", area, low=1, high=1 << 24)
        self.receive_rows = checks.integer(receive_rows if receive_rows is not None
                                           else min(2 * self.capacity * 8, 1 << 26),
                                           "receive_rows", area, low=1, high=1 << 26)
        self.ctas = checks.integer(ctas, "ctas", area, low=1, high=64)
        self.validate = checks.flag(validate, "validate", area)
        self.experts_per_rank = self.experts // W
        self.layout = MoeFlags(W)
        self._buffers: dict = {}
        self._prepared: dict = {}
        self._streams: dict = {}

    # -- buffers --
    def _ensure_buffers(self, shape: MoeShape) -> None:
        key = (shape.hidden, shape.k)
        if self._buffers.get("key") == key:
            return
        self.world.synchronize()       # allocations wait for the device (DESIGN.md)
        self.close()
        W, rows, H = self.world.size, self.receive_rows, shape.hidden
        b = self._buffers
        b["flags"] = flag_buffer(self.world, self.layout.words, name="moe.flags")
        b["counts"] = SymmetricBuffer(self.world, W * self.experts * 4, name="moe.counts")
        b["received"] = SymmetricBuffer(self.world, rows * H * 2, name="moe.received", zero=False)
        b["sources"] = SymmetricBuffer(self.world, rows * 8, name="moe.sources", zero=False)
        b["back"] = SymmetricBuffer(self.world, self.capacity * shape.k * H * 2, name="moe.back",
                                    zero=False)
        b["key"] = key
        self._prepared.clear()

    def _routing_buffers(self, shape: MoeShape) -> list:
        """Per rank: entry places, group offsets, the expert results combine reads."""
        return [self.kept_buffers(name, shp, dtype) for name, shp, dtype in (
            ("entry_rank", (self.capacity * shape.k,), np.int32),
            ("offsets", (self.experts_per_rank + 1,), np.int32),
            ("results", (self.receive_rows, shape.hidden), bfloat16))]

    def _expert_buffers(self, shape: MoeShape) -> list:
        """Per rank: the w1 GEMM's rows and SwiGLU's."""
        return [self.kept_buffers(name, shp, bfloat16) for name, shp in (
            ("h", (self.receive_rows, 2 * shape.inter)), ("act", (self.receive_rows, shape.inter)))]

    # -- checks shared by the call, dispatch and combine --
    def _routing(self, x, topk_ids):
        """Per rank x and topk_ids, checked (shapes, dtypes, alignment, capacity, k agreed
        between processes, ids in range); (xs, ids, as_list, (tokens, k, hidden) per rank)."""
        import cupy
        xs, as_list = self.per_rank(x, "x")
        ids, _ = self.per_rank(topk_ids, "topk_ids")
        dims = [check_routing((a.shape, a.dtype), (i.shape, i.dtype)) for a, i in zip(xs, ids)]
        if len({d[1:] for d in dims}) != 1:
            raise ValueError("mkrt.moe: ranks disagree on k or H")
        for a in xs:
            if a.data.ptr % 16:
                raise ValueError(f"mkrt.moe: x starts at {a.data.ptr:#x}, not 16-byte aligned")
        self._check_capacity(dims)
        signature = ("k, H", dims[0][1:])
        if self.world.comm is not None and signature not in self._signatures:
            # buffers are sized by k and H on every rank: all processes must agree before a
            # collective reallocation
            if len(set(self.world.comm.allgather(signature))) != 1:
                raise ValueError("mkrt.moe: processes pass different k or H")
            self._signatures.add(signature)
        if self.validate and not cupy.cuda.get_current_stream().is_capturing():
            for i, arr in enumerate(ids):
                if arr.size:
                    low, high = (int(v) for v in cupy.stack([arr.min(), arr.max()]).get())  # waits
                    if low < 0 or high >= self.experts:
                        raise ValueError(f"mkrt.moe: topk_ids[{i}] has ids {low}..{high}; "
                                         f"expected 0..{self.experts - 1}")
        return xs, ids, as_list, dims

    def _check_capacity(self, dims) -> None:
        for tokens, _, _ in dims:
            if tokens > self.capacity:
                raise ValueError(f"mkrt.moe: {tokens} tokens on a rank; this op's capacity is "
                                 f"{self.capacity} (build it with a larger capacity=)")

    def _weights_and_out(self, weights, out, dims):
        """Checks per-rank topk_weights (already converted) against `dims`; returns the
        per-rank out, checked, or None."""
        for w, (tokens, k, _) in zip(weights, dims):
            if w.shape != (tokens, k) or w.dtype != np.float32:
                raise ValueError(f"mkrt.moe: topk_weights is {w.shape} {dtype_name(w.dtype)}; "
                                 f"expected {(tokens, k)} float32")
        outs = self.per_rank(out, "out")[0] if out is not None else None
        if outs is not None:
            for o, (tokens, _, hidden) in zip(outs, dims):
                if o.shape != (tokens, hidden) or o.dtype != bfloat16 or o.data.ptr % 16:
                    raise ValueError(f"mkrt.moe: out is {o.shape} {dtype_name(o.dtype)}; expected "
                                     f"{(tokens, hidden)} bf16, 16-byte aligned")
        return outs

    def _new_outs(self, dims) -> list:
        import cupy
        outs = []
        for info, (tokens, _, hidden) in zip(self.world.local, dims):
            with self.on_device(info.device):
                outs.append(cupy.empty((tokens, hidden), bfloat16))
        return outs

    # -- the call --
    def __call__(self, x, topk_ids, topk_weights, w1, w2, out=None):
        xs, ids, as_list, dims = self._routing(x, topk_ids)
        weights, _ = self.per_rank(topk_weights, "topk_weights")
        outs = self._weights_and_out(weights, out, dims)
        w1s, _ = self.per_rank(w1, "w1")
        w2s, _ = self.per_rank(w2, "w2")
        self.same_everywhere(w1s, "w1")
        self.same_everywhere(w2s, "w2")
        shape = check_operands((xs[0].shape, xs[0].dtype), (ids[0].shape, ids[0].dtype),
                               (weights[0].shape, weights[0].dtype), (w1s[0].shape, w1s[0].dtype),
                               (w2s[0].shape, w2s[0].dtype), experts_per_rank=self.experts_per_rank)
        self.before_launch()
        self._ensure_buffers(shape)
        outs = outs if outs is not None else self._new_outs(dims)
        self._run(shape, dims, xs, ids, weights, outs, experts=(w1s, w2s))
        self.after_launch()
        if out is not None:
            return out
        return outs if as_list else like_input(outs[0], x)

    def dispatch(self, x, topk_ids):
        """The dispatch alone: per rank (received [receive_rows, H] bf16 -- this rank's
        rows, expert-major, then by source rank and token; only the first offsets[-1] are
        this call's --, offsets [E_local + 1] int32 on the device, sources
        [receive_rows, 2] int32: (source rank, token * k + choice) of each row). The views
        are the op's buffers: valid until its next call. Run experts on the rows, then
        :meth:`combine` (every rank calls both, in the same order)."""
        xs, ids, as_list, dims = self._routing(x, topk_ids)
        tokens, k, hidden = dims[0]
        shape = MoeShape(tokens, k, hidden, 0, self.experts_per_rank)
        self.before_launch()
        self._ensure_buffers(shape)
        self._run(shape, dims, xs, ids, None, None, stages=("dispatch",))
        self.after_launch()
        offsets = self._routing_buffers(shape)[1]
        out = []
        for i, info in enumerate(self.world.local):
            out.append((self._buffers["received"].view(info.rank, bfloat16, (self.receive_rows, hidden)),
                        offsets[i],
                        self._buffers["sources"].view(info.rank, np.int32, (self.receive_rows, 2))))
        return out if as_list else out[0]

    def combine(self, results, topk_weights, out=None):
        """The combine alone, after :meth:`dispatch`: results per rank [receive_rows, H]
        bf16 (one row per received row, in its order); y [T, H] = the weighted sum of each
        token's k rows (fp32, choice order)."""
        results_list, as_list = self.per_rank(results, "results")
        shape = self._buffers.get("key")
        if shape is None:
            raise ValueError("mkrt.moe: combine() needs a dispatch() of this op first")
        hidden, k = shape
        for r in results_list:
            if r.shape != (self.receive_rows, hidden) or r.dtype != bfloat16 or r.data.ptr % 16:
                raise ValueError(f"mkrt.moe: results is {r.shape} {dtype_name(r.dtype)}; expected "
                                 f"{(self.receive_rows, hidden)} bf16, 16-byte aligned")
        weights_list, _ = self.per_rank(topk_weights, "topk_weights")
        dims = [(w.shape[0], k, hidden) for w in weights_list]
        self._check_capacity(dims)
        weights, outs = weights_list, self._weights_and_out(weights_list, out, dims)
        self.before_launch()
        outs = outs if outs is not None else self._new_outs(dims)
        shape = MoeShape(dims[0][0], k, hidden, 0, self.experts_per_rank)
        self._run(shape, dims, None, None, weights, outs, stages=("combine",), results=results_list)
        self.after_launch()
        if out is not None:
            return out
        return outs if as_list else like_input(outs[0], results)

    def _args(self, info, shape: MoeShape, scratch) -> np.ndarray:
        b, rank = self._buffers, info.rank
        args = np.zeros((), ARGS_DTYPE)
        entry_rank, offsets = (s[self.world.local.index(info)] for s in scratch[:2])  # routing buffers
        args["entry_rank"], args["offsets"] = entry_rank.data.ptr, offsets.data.ptr
        for name in ("counts", "received", "sources", "back", "flags"):
            args[name] = b[name].local_ptr(rank)
            args[f"peer_{name}"] = b[name].peer_table(rank).data.ptr
        args["k"], args["hidden"], args["experts"] = shape.k, shape.hidden, self.experts
        args["per_rank"], args["me"], args["W"] = self.experts_per_rank, rank, self.world.size
        args["receive_rows"] = self.receive_rows
        return args

    def _prepared_launches(self, i, info, shape, scratch):
        """Rank i's dispatch and combine launches (per k and H: the rest is patched per
        call) and the fields patched: x, ids, weights, y, tokens, results."""
        key = (info.rank, shape.k, shape.hidden)
        prepared = self._prepared.get(key)
        if prepared is None:
            spec = MoeSpec()
            launches = []
            for entry in ("moe_dispatch", "moe_combine"):
                params = Parameters(LAUNCH_PARAMETERS)
                params.set(args=self._args(info, shape, scratch), **self.context_params(info.rank))
                launches.append(KernelLaunch(spec.function(entry, info.device), self.ctas, 256, 0,
                                             params))
            fields = ("x", "ids", "weights", "y", "tokens", "results")
            words = [tuple(launch.params.field_view("args", f) for f in fields) for launch in launches]
            prepared = self._prepared[key] = (launches, words, spec.function("moe_swiglu", info.device))
        return prepared

    def _run(self, shape, dims, xs, ids, weights, outs, *, experts=None,
             stages=("dispatch", "experts", "combine"), results=None) -> None:
        """Launch `stages` on every local rank's stream ("experts": both grouped GEMMs and
        SwiGLU on the op's own buffers; combine then reads them, unless `results` is given)."""
        import cupy
        scratch = self._routing_buffers(shape)
        expert_scratch = self._expert_buffers(shape) if "experts" in stages else None
        # Build every kernel of every rank before the first launch: a rank's dispatch waits
        # for the other ranks' dispatches, and a compile between two ranks' launches (the
        # grouped GEMM's, on a first call) could outlast its bounded wait.
        prepared = [self._prepared_launches(i, info, shape, scratch)
                    for i, info in enumerate(self.world.local)]
        if "experts" in stages:
            for info in self.world.local:
                grouped_module.build(self.receive_rows, self.experts_per_rank, "bf16", info.device)
        streams = self._launch_streams()
        for i, (info, stream_ptr) in enumerate(zip(self.world.local, streams)):
            launches, words, swiglu = prepared[i]
            entry_rank, offsets, own_results = (s[i] for s in scratch)
            pointers = (xs[i].data.ptr if xs is not None else 0, ids[i].data.ptr if ids is not None else 0,
                        weights[i].data.ptr if weights is not None else 0,
                        outs[i].data.ptr if outs is not None else 0, dims[i][0],
                        (results[i] if results is not None else own_results).data.ptr)
            for word in words:
                for field, value in zip(word, pointers):
                    field[()] = value
            with self.on_device(info.device):
                if "dispatch" in stages:
                    launches[0](stream_ptr)
                if "experts" in stages:
                    stream = self._streams.get(stream_ptr)
                    if stream is None:
                        stream = self._streams[stream_ptr] = cupy.cuda.ExternalStream(stream_ptr)
                    sms = self.world.sm_count(info.rank)
                    received = self._buffers["received"].view(info.rank, bfloat16,
                                                               (self.receive_rows, shape.hidden))
                    w1s, w2s = experts
                    h, act = (s[i] for s in expert_scratch)
                    grouped_module.grouped_gemm(received, w1s[i], offsets, out=h, sms=sms, stream=stream)
                    with stream:
                        swiglu((sms,), (256,), (h, act, offsets, np.int32(self.experts_per_rank),
                                                np.int32(shape.inter)))
                    grouped_module.grouped_gemm(act, w2s[i], offsets, out=own_results, sms=sms,
                                                stream=stream)
                if "combine" in stages:
                    launches[1](stream_ptr)
        if self._local_count != 1:
            self.release_to_caller_stream()

    def close(self) -> None:
        for name, buffer in list(self._buffers.items()):
            if name != "key":
                buffer.close()
        self._buffers = {}
        self._prepared = {}


def moe(x, topk_ids, topk_weights, w1, w2, *, experts: int, capacity: int, world=None, out=None,
        **options):
    """y per rank; see :class:`MoE`."""
    return shared_op(MoE, world, experts=experts, capacity=capacity, **options)(
        x, topk_ids, topk_weights, w1, w2, out=out)


def moe_dispatch(x, topk_ids, *, experts: int, capacity: int, world=None, **options):
    """Each rank's received rows, group offsets and sources; see :meth:`MoE.dispatch`. Pass
    the same experts, capacity and options to :func:`moe_combine` (they share one op)."""
    return shared_op(MoE, world, experts=experts, capacity=capacity, **options).dispatch(x, topk_ids)


def moe_combine(results, topk_weights, *, experts: int, capacity: int, world=None, out=None,
                **options):
    """Each rank's y from its expert results; see :meth:`MoE.combine`."""
    return shared_op(MoE, world, experts=experts, capacity=capacity, **options).combine(
        results, topk_weights, out=out)


def test_cases():
    """(layout, tokens per rank, k, H, I, experts, routing) the GPU tests run."""
    return [("1x2", [64, 64], 2, 256, 128, 4, "uniform"), ("1x2", [0, 100], 2, 128, 64, 8, "uniform"),
            ("1x4", [50, 7, 128, 1], 4, 256, 128, 16, "zipf"), ("1x4", [96] * 4, 2, 128, 128, 8, "hot"),
            ("1x3", [40, 40, 40], 8, 64, 64, 12, "uniform")]


def random_routing(rng, tokens: int, k: int, experts: int, kind: str = "uniform"):
    """[tokens, k] int32 distinct expert ids per token: "uniform", "zipf" (popular experts
    first) or "hot" (expert 0 gets 80% of the choices)."""
    if kind == "hot":
        p = np.full(experts, 0.2 / (experts - 1))
        p[0] = 0.8
    elif kind == "zipf":
        p = 1.0 / np.arange(1, experts + 1) ** 1.2
    else:
        p = np.ones(experts)
    p = p / p.sum()
    if tokens == 0:
        return np.zeros((0, k), np.int32)
    return np.stack([rng.choice(experts, size=k, replace=False, p=p) for _ in range(tokens)]
                    ).astype(np.int32).reshape(tokens, k)


def random_problem(ranks: int, tokens: list, k: int, hidden: int, inter: int, experts: int,
                   kind: str = "uniform", seed: int = 0):
    """A random MoE problem on the current GPU for tests and checks: (device arrays per
    rank -- dict of x, ids, weights, w1, w2 -- and each rank's float64 reference y)."""
    import cupy

    from mkrt.kernels import moe_plan
    from mkrt.kernels.gemm import from_float32, to_float32
    rng = np.random.default_rng(seed)
    per = experts // ranks
    ids = [random_routing(rng, t, k, experts, kind) for t in tokens]
    weights = [rng.random((t, k), dtype=np.float32) for t in tokens]
    x = [rng.standard_normal((t, hidden), dtype=np.float32) for t in tokens]
    w1 = [rng.standard_normal((per, 2 * inter, hidden), dtype=np.float32) / np.sqrt(hidden)
          for _ in range(ranks)]
    w2 = [rng.standard_normal((per, hidden, inter), dtype=np.float32) / np.sqrt(inter)
          for _ in range(ranks)]
    bf = lambda a: from_float32(cupy.asarray(a), bfloat16)          # noqa: E731
    dev = dict(x=[bf(a) for a in x], ids=[cupy.asarray(a) for a in ids],
               weights=[cupy.asarray(a) for a in weights], w1=[bf(a) for a in w1],
               w2=[bf(a) for a in w2])
    host = [[to_float32(a).get() for a in dev[name]] for name in ("x", "w1", "w2")]
    return dev, moe_plan.reference(host[0], ids, weights, host[1], host[2])
