"""``mkrt.attention``: the Hopper attention engine as a world-free op (forward pass).

    O, LSE = mkrt.attention(q, k, v, causal=False, scale=None)

q [B, Sq, Hq, D], k and v [B, Sk, Hkv, D] (the layout torch users have: batch, sequence,
heads, head dim), bf16 or fp16, D 64 or 128, Hq a multiple of Hkv (GQA; MQA is Hkv = 1).
O is [B, Sq, Hq, D] in q's dtype, LSE [B, Hq, Sq] float32 (natural log of each row's
softmax denominator, scores scaled; -inf for a row that sees no key). ``causal``: query i
sees keys j <= i (torch's ``is_causal``, aligned top-left when Sq != Sk).

The device code is the shared engine ``mkrt::attention::run_tiles``
(kernels/device/attention_tile.py); this module adds the kernel that drives it with a
work list over (query block, batch, head) -- the query blocks with the most keys first,
so that causal work spreads evenly over the persistent CTAs -- and an epilogue that
stores O and LSE; the spec, the launcher and the reference.

Inputs may be strided views (q, k, v out of a packed QKV projection, say) as long as the
head dim is contiguous and the other strides are multiples of 16 bytes: the tensor maps
read them in place. Only dtype, head dim, key block and stages are compiled in; shapes,
strides, causal and scale are runtime arguments.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import heapq
import math

import numpy as np

from cupy_backends.cuda.api import runtime as _runtime

from mkrt.arrays import HALF_DTYPES, TorchView, as_cupy, dtype_name, is_torch, like_input
from mkrt.cuda import device_sm_count
from mkrt.jit import cuda_source
from mkrt.jit.spec import KernelSpec
from mkrt.kernels.device import attention_tile, tma, wgmma  # noqa: F401  (register the pieces)
from mkrt.kernels.gemm import SMEM_LIMIT, tma_descriptor, to_float32
from mkrt.kernels.launcher import KernelLaunch, Parameters, stream_workspace

ATTENTION = cuda_source("attention", r"""
typedef mkrt::attention::Config<$CTYPE, $HEAD_DIM, $BLOCK_KV, $STAGES, $PINGPONG, $CONSUMERS> Cfg;
typedef mkrt::attention::Tile Tile;
typedef mkrt::attention::KeyBlock KeyBlock;

// Every (query block, batch, head) of the problem in this order (mirror: tile_order),
// dealt out (the default) or, with CLAIMED, claimed from a counter. Dealt out: CTA c runs
// tiles c, c + ctas, ... or, where the host planned a deal for uneven tiles (causal:
// deal_tiles), row i of `deal` [rounds][ctas] (-1: no more; the last row is all -1).
// A fixed cyclic deal left the busiest CTA up to 18% over the mean at D 64 causal (CPU
// simulation, tile time = key blocks + 1); claiming balances at run time, but on an H100
// the claimed build ran about 5% slower where tiles are even (claim_bisect_6885d2f.log),
// and the planned deal gained 2-15% over the cyclic one (planned_deal_ddf93e3.log).
// The tiles go in bands of `band` (batch, key head) pairs, so the
// CTAs running at once read the K/V of a few heads, which stay in L2 (heads fastest over
// the whole problem made every tile read its K/V from memory: 4 x 4096 x 16 x 128 ran with
// L2 99% busy). Inside a band: query blocks from the last (the most keys when causal) to
// the first, then key heads, then the query heads that share a key head.
struct HeadWork {
    int batches, heads, group, q_blocks, kv_blocks, sq, sk, causal, cta, ctas, band;   // cta, ctas: the deal
    const int* deal;    // [rounds][ctas] tile positions planned on the host, or null: cyclic
    mkrt::roles::CountedQueue queue;
    // $CLAIMED: the spec's choice (AttentionSpec.claimed; can_claim says where it is
    // possible: claiming costs registers that three consumer warpgroups, and the
    // producer's 24 above 128-key blocks, do not have).
    static constexpr bool CLAIMED = $CLAIMED;
    static constexpr bool TRACE = false;       // (the ring's trace build counts waits)
    // every block through the engine's maps
    __device__ __forceinline__ const mkrt::TmaDescriptor* map_for(const mkrt::TmaDescriptor* map, bool,
                                                            const KeyBlock& block, int& source) const {
        source = block.source;
        return map;
    }
    static_assert(!CLAIMED || (Cfg::CONSUMERS == 2 && Cfg::BKV <= 128),
                  "claiming tiles needs two consumer warpgroups and blocks of at most 128 keys "
                  "(registers)");
    // claimed: the producer's claim (the engine hands it to the consumers)
    __device__ __forceinline__ int next_position(int) const {
        int left_because;
        return claim(queue, &left_because);     // found by argument-dependent lookup
    }
    // dealt out: the i-th tile of this CTA
    __device__ __forceinline__ bool get(int i, Tile& tile) const {
        int t;
        if (deal != nullptr) {
            t = __ldg(deal + i * ctas + cta);
            if (t < 0) return false;
        } else {
            t = cta + i * ctas;
            if (t >= q_blocks * batches * heads) return false;
        }
        tile_at(t, tile);
        return true;
    }
    // tile t of the order
    __device__ __forceinline__ void tile_at(int t, Tile& tile) const {
        const int kv_heads = heads / group;
        const int units = batches * kv_heads;               // (batch, key head) pairs
        const int per_band = q_blocks * band * group;
        const int b = t / per_band;
        const int width = min(band, units - b * band) * group;  // query heads in this band
        const int r = t - b * per_band;
        const int q_block = q_blocks - 1 - r / width;
        const int w = r - (r / width) * width;
        const int unit = b * band + w / group;
        tile.batch = unit / kv_heads;
        tile.kv_head = unit - tile.batch * kv_heads;
        tile.head = tile.kv_head * group + (w - (w / group) * group);
        tile.q_row = q_block * Cfg::BQ;
        tile.q_rows = min(Cfg::BQ, sq - tile.q_row);
        tile.q_position = tile.q_row;
        const int last_query = tile.q_row + tile.q_rows - 1;
        tile.blocks = causal ? min(kv_blocks, last_query / Cfg::BKV + 1) : kv_blocks;
        tile.causal = causal;
        tile.index = t;
    }
    // the tile's key blocks, one after another (the producer and the consumers alike)
    __device__ __forceinline__ KeyBlock first_block(const Tile&) const {
        KeyBlock block;
        block.count = min(Cfg::BKV, sk);
        return block;
    }
    template <bool PRODUCER>
    __device__ __forceinline__ void next_block(const Tile&, KeyBlock& block) const {
        block.row += Cfg::BKV;
        block.position = block.row;
        block.count = min(Cfg::BKV, sk - block.row);
    }
    __device__ __forceinline__ bool wait(const Tile&, const KeyBlock&) const { return true; }
};

// O [B, Sq, H, D] (contiguous) and LSE [B, H, Sq].
struct StoreOutput {
    $CTYPE* out;
    float* lse;
    int sq, heads;

    template <int CONSUMERS>
    __device__ __forceinline__ void operator()(const Tile& tile,
                                               const mkrt::attention::RowState<Cfg>& state,
                                               const mkrt::attention::ConsumerThread<CONSUMERS>& who) const {
        $CTYPE* const base = out + ((long long)tile.batch * sq * heads + tile.head) * Cfg::D;
        const long long row_stride = (long long)heads * Cfg::D;
        state.for_each_pair(who, [&](int r, int c, float v0, float v1) {
            if (r >= tile.q_rows) return;
            const int row = tile.q_row + r;
            *reinterpret_cast<mkrt::u32*>(base + row * row_stride + c) =
                mkrt::attention::pack_pair<$CTYPE>(v0, v1);
        });
        if ((who.lane() & 3) == 0) {
            float* const rows = lse + ((long long)tile.batch * heads + tile.head) * sq;
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = who.row() + 8 * h;
                if (r < tile.q_rows) rows[tile.q_row + r] = state.lse[h];
            }
        }
    }
};

// q: a 4-D tensor map over [B, S, H, D] (box 64 x 1 x 128 x 1, 128B swizzle); k, v: 5-D
// maps over [1][B, S, H, D] (box 64 x 1 x BKV x 1 x 1).
extern "C" __global__ void __launch_bounds__(Cfg::THREADS, 1)
attention_forward(const __grid_constant__ mkrt::TmaDescriptor tma_q,
                  const __grid_constant__ mkrt::TmaDescriptor tma_k,
                  const __grid_constant__ mkrt::TmaDescriptor tma_v,
                  $CTYPE* out, float* lse, int batches, int heads, int kv_heads, int sq, int sk,
                  int causal, float scale_log2, int band, mkrt::u64* counter,
                  const int* deal) {
    extern __shared__ char dynamic_smem[];
    const int q_blocks = (sq + Cfg::BQ - 1) / Cfg::BQ;
    const StoreOutput store{out, lse, sq, heads};
    const int kv_blocks = (sk + Cfg::BKV - 1) / Cfg::BKV;
    if constexpr (HeadWork::CLAIMED) {
        const HeadWork work{batches, heads, heads / kv_heads, q_blocks, kv_blocks, sq, sk, causal,
                            0, 0, band, nullptr, {counter, q_blocks * batches * heads}};
        mkrt::attention::run_tiles<Cfg>(&tma_q, &tma_k, &tma_v, scale_log2, work, store, dynamic_smem);
        mkrt::roles::reset_when_last_out(counter);   // counter = {next tile, CTAs out}: one per stream
    } else {
        const HeadWork work{batches, heads, heads / kv_heads, q_blocks, kv_blocks, sq, sk, causal,
                            (int)blockIdx.x, (int)gridDim.x, band, deal, {nullptr, 0}};
        mkrt::attention::run_tiles<Cfg>(&tma_q, &tma_k, &tma_v, scale_log2, work, store, dynamic_smem);
    }
}
""", requires=("attention_tile", "tile_queue"), register=False)

_CTYPES = {"bf16": "__nv_bfloat16", "f16": "__half"}
HEAD_DIMS = (64, 128)
BLOCK_Q = 128
#: keys per block: the widths of the wgmma shapes the device vocabulary generates
KEY_BLOCKS = wgmma.WIDTHS
#: K and V bytes the tiles running at once should read (HeadWork's bands): about 40% of
#: the 50 MB L2 of an H100 or H200, the rest left to Q, O and the other half's misses
KV_L2_BYTES = 20 << 20


@dataclasses.dataclass(frozen=True)
class AttentionSpec(KernelSpec):
    """Compile-time shape of one attention kernel (URI e.g.
    ``attention_bf16_d128_bkv128_s2_pp0_c2_q0_sm90a``).

    pingpong 1: the consumer warpgroups take turns on the tensor cores (one's softmax
    overlaps another's MMAs). consumers: 2 (128 query rows per tile) or 3 (192).
    claimed 1: the CTAs claim tiles from a counter (HeadWork; where :func:`can_claim`);
    0 (default, faster where tiles are even): CTA c runs tiles c, c + ctas, ..."""

    family = "attention"
    entry_points = ("attention_forward",)

    dtype: str = "bf16"
    head_dim: int = dataclasses.field(default=128, metadata={"short": "d"})
    block_kv: int = dataclasses.field(default=128, metadata={"short": "bkv"})
    stages: int = dataclasses.field(default=2, metadata={"short": "s"})
    pingpong: int = dataclasses.field(default=0, metadata={"short": "pp"})   # 0 or 1
    consumers: int = dataclasses.field(default=2, metadata={"short": "c"})   # 2 or 3
    claimed: int = dataclasses.field(default=0, metadata={"short": "q"})     # 0 or 1

    def __post_init__(self):
        super().__post_init__()
        if self.dtype not in _CTYPES:
            raise ValueError(f"mkrt.attention: dtype={self.dtype!r}; expected one of {sorted(_CTYPES)}")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"mkrt.attention: head dim {self.head_dim}; expected 64 or 128")
        if self.block_kv not in KEY_BLOCKS:
            raise ValueError(f"mkrt.attention: block_kv={self.block_kv}; expected one of {KEY_BLOCKS}")
        if self.stages < 2:
            raise ValueError(f"mkrt.attention: stages={self.stages}; at least 2")
        if self.pingpong not in (0, 1):
            raise ValueError(f"mkrt.attention: pingpong={self.pingpong}; expected 0 or 1")
        if self.consumers not in (2, 3):
            raise ValueError(f"mkrt.attention: consumers={self.consumers}; expected 2 or 3")
        if self.claimed not in (0, 1):
            raise ValueError(f"mkrt.attention: claimed={self.claimed}; expected 0 or 1")
        if self.claimed and not can_claim(self.block_kv, self.consumers):
            raise ValueError(f"mkrt.attention: claimed=1 needs 2 consumer warpgroups and at most "
                             f"128-key blocks (registers); got {self.consumers} consumers, "
                             f"{self.block_kv}-key blocks")
        if self.smem_bytes > SMEM_LIMIT:
            raise ValueError(f"mkrt.attention: {self.stages} stages of {self.block_kv} keys at head "
                             f"dim {self.head_dim} need {self.smem_bytes} bytes of shared memory; "
                             f"at most {SMEM_LIMIT}")

    @property
    def threads(self) -> int:
        return 128 * (1 + self.consumers)

    @property
    def block_q(self) -> int:
        """Query rows per tile: 64 per consumer warpgroup."""
        return 64 * self.consumers

    @property
    def smem_bytes(self) -> int:      # mirrors attention::Config::SMEM_BYTES
        q = self.block_q * self.head_dim * 2
        kv = self.block_kv * self.head_dim * 2
        return 1024 + q + 2 * self.stages * kv + (2 + 4 * self.stages) * 8 + 8

    def template(self):
        return ATTENTION

    def params(self):
        return {"CTYPE": _CTYPES[self.dtype], "HEAD_DIM": self.head_dim,
                "BLOCK_KV": self.block_kv, "STAGES": self.stages,
                "PINGPONG": "true" if self.pingpong else "false", "CONSUMERS": self.consumers,
                "CLAIMED": "true" if self.claimed else "false"}


def can_claim(block_kv: int, consumers: int) -> bool:
    """Whether a build can claim its tiles from a counter: the claim costs registers that
    three consumer warpgroups, and the producer's 24 above 128-key blocks, do not have
    (ptxas spilled; the shared-memory work list once used there instead is gone)."""
    return consumers == 2 and block_kv <= 128


def default_spec(dtype: str, head_dim: int, causal: bool = False) -> AttentionSpec:
    """Measured on an H100 against cuDNN, every configuration in the same run
    (experiments/results/attention_variants.jsonl, 32702df: B 4 x S 4096 and 12288 x 16
    heads, causal or not, and Llama-3 70B GQA at 8192). At head dim 128, non-causal:
    128-key blocks in 3 stages with pingpong (625 and 608 TFLOP/s, 0.96 and 1.01x cuDNN);
    causal: 128-key blocks in 2 stages with pingpong (544, 557 and 570: 0.996, 0.97, 1.02x),
    whose shorter rows gain less from a third stage.

    Tiles dealt out (claimed=0), causal ones by a deal planned on the host (deal_tiles):
    claiming them from a counter ran about 5% slower at head dim 128 on even tiles
    (claim_bisect_6885d2f.log, rotating rounds), and the planned deal ran 1.02-1.15x the
    cyclic one on causal shapes (planned_deal_ddf93e3.log). At head dim 64: three consumer
    warpgroups (192 query rows per tile; 128-key blocks, 3 stages, pingpong), 1.18x the
    two-consumer 192-key build non-causal at S 4096, 1.01 and 1.03x causal
    (attention_deal_e8812cc.log)."""
    if head_dim == 128:
        return AttentionSpec(dtype, 128, 128, 2 if causal else 3, 1)
    return AttentionSpec(dtype, head_dim, 128, 3, 1, 3)


def default_specs() -> list[AttentionSpec]:
    """The configurations ``mkrt.attention`` uses (``python -m mkrt compile --all``)."""
    return sorted({default_spec(dtype, d, causal) for dtype in _CTYPES for d in HEAD_DIMS
                   for causal in (False, True)}, key=lambda spec: spec.uri)


# ---- checks and planning (pure Python, testable without a GPU) ------------------------

@dataclasses.dataclass(frozen=True)
class AttentionProblem:
    batches: int
    sq: int
    sk: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    causal: bool

    def tiles(self, block_q: int = BLOCK_Q) -> int:
        return -(-self.sq // block_q) * self.batches * self.heads

    @property
    def band(self) -> int:
        """(batch, key head) pairs whose tiles run together (HeadWork)."""
        return kv_band(self.batches, self.kv_heads, self.head_dim, self.sk)

    @property
    def flops(self) -> float:
        """Multiply-adds of QK^T and PV counted as 2 each, causal counting the visible half
        (the convention of FlashAttention's and torch's benchmarks)."""
        full = 4.0 * self.batches * self.heads * self.sq * self.sk * self.head_dim
        if not self.causal:
            return full
        # query i sees min(i + 1, Sk) keys
        sq, sk = self.sq, self.sk
        visible = sq * (sq + 1) / 2 if sq <= sk else sk * (sk + 1) / 2 + (sq - sk) * sk
        return full * visible / (self.sq * self.sk)


def kv_band(batches: int, kv_heads: int, head_dim: int, rows: int, share: int = 1) -> int:
    """(batch, key head) pairs whose tiles run together: as many as have their K and V
    (`rows` keys of 2-byte elements) within KV_L2_BYTES / `share` (the kernels sharing the
    GPU's L2: the ranks of an emulated world on one GPU), at least one. mkrt.attention's
    and the ring's work lists deal tiles out in such bands."""
    per_head = 2 * rows * head_dim * 2
    return max(1, min(batches * kv_heads, KV_L2_BYTES // max(1, share) // per_head))


def tile_order(problem: AttentionProblem, block_q: int = BLOCK_Q) -> list[tuple[int, int, int]]:
    """(batch, query head, query block) of every tile in the order the CTAs claim them
    (HeadWork::get of queue positions 0, 1, ...), for tiles of `block_q` rows."""
    p = problem
    group, q_blocks = p.heads // p.kv_heads, -(-p.sq // block_q)
    units, order = p.batches * p.kv_heads, []
    for first in range(0, units, p.band):
        width = min(p.band, units - first)
        for q_block in reversed(range(q_blocks)):
            for unit in range(first, first + width):
                batch, kv_head = divmod(unit, p.kv_heads)
                order += [(batch, kv_head * group + g, q_block) for g in range(group)]
    return order


#: the last rounds of a planned deal (deal_tiles) go heaviest first: light tiles at the end
#: fill the CTAs' last gaps (CPU simulation: busiest CTA 1.009-1.011 x the mean at the suite's
#: causal shapes, against 1.046-1.050 sorting only the last round)
DEAL_SORTED_ROUNDS = 2
#: above this many rounds of tiles per CTA, deal_tiles leaves the cyclic deal
DEAL_MAX_ROUNDS = 64


def tile_blocks(problem: AttentionProblem, block_q: int, block_kv: int, q_block: int) -> int:
    """Key blocks a tile visits (HeadWork::get's `tile.blocks`)."""
    p = problem
    kv_blocks = -(-p.sk // block_kv)
    if not p.causal:
        return kv_blocks
    last_query = min(p.sq, (q_block + 1) * block_q) - 1
    return min(kv_blocks, last_query // block_kv + 1)


def deal_tiles(problem: AttentionProblem, block_q: int, block_kv: int, ctas: int):
    """The positions of :func:`tile_order` each CTA runs, as an int32 array [rounds, ctas]
    (-1: no more; the last row is all -1, where the kernel stops), or None where tiles are
    even (non-causal: CTA c runs c, c + ctas, ...).

    A CTA's time is modelled as the key blocks of its tiles plus one per tile (Q and the
    epilogue). The order stays :func:`tile_order`'s (bands of heads whose K/V fit L2),
    except that the tiles of the last DEAL_SORTED_ROUNDS rounds of work go heaviest
    first; each tile in turn goes to the CTA that the model frees first (lowest index on
    ties), which is what claiming from a counter would do, planned once per shape instead
    of at run time. Also None above DEAL_MAX_ROUNDS rounds of tiles, where the cyclic
    deal's last round is a small part of the work (and planning would cost the first call
    seconds of host time)."""
    if not problem.causal or problem.tiles(block_q) > DEAL_MAX_ROUNDS * ctas:
        return None
    order = tile_order(problem, block_q)
    cost = [tile_blocks(problem, block_q, block_kv, q) + 1 for _, _, q in order]
    tail_work = DEAL_SORTED_ROUNDS * ctas * sum(cost) / len(cost)
    cut, work = len(cost), 0
    while cut > 0 and work + cost[cut - 1] <= tail_work:
        cut -= 1
        work += cost[cut]
    positions = list(range(cut)) + sorted(range(cut, len(cost)), key=lambda t: (-cost[t], t))
    free = [(0, c) for c in range(ctas)]
    runs: list[list[int]] = [[] for _ in range(ctas)]
    for t in positions:
        time, cta = heapq.heappop(free)
        runs[cta].append(t)
        heapq.heappush(free, (time + cost[t], cta))
    deal = np.full((max(map(len, runs)) + 1, ctas), -1, dtype=np.int32)
    for cta, tiles in enumerate(runs):
        deal[:len(tiles), cta] = tiles
    return deal


def check_operands(q_shape, k_shape, v_shape, q_dtype, k_dtype, v_dtype, *, causal=False,
                   area: str = "attention") -> AttentionProblem:
    """The problem of valid operand shapes and dtypes; TypeError/ValueError naming the
    constraint otherwise."""
    for name, dtype in (("q", q_dtype), ("k", k_dtype), ("v", v_dtype)):
        if np.dtype(dtype) not in HALF_DTYPES:
            raise TypeError(f"mkrt.{area}: {name} has dtype {dtype_name(dtype)}; expected bf16 or f16")
    if not (np.dtype(q_dtype) == np.dtype(k_dtype) == np.dtype(v_dtype)):
        raise TypeError(f"mkrt.{area}: q, k, v have dtypes {dtype_name(q_dtype)}, "
                        f"{dtype_name(k_dtype)}, {dtype_name(v_dtype)}; expected one dtype")
    for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        if len(shape) != 4:
            raise ValueError(f"mkrt.{area}: {name} has shape {tuple(shape)}; expected 4 dimensions "
                             "[batch, sequence, heads, head_dim]")
    B, Sq, Hq, D = (int(x) for x in q_shape)
    if tuple(k_shape) != tuple(v_shape):
        raise ValueError(f"mkrt.{area}: k {tuple(k_shape)} and v {tuple(v_shape)} differ in shape")
    Bk, Sk, Hkv, Dk = (int(x) for x in k_shape)
    if Bk != B:
        raise ValueError(f"mkrt.{area}: q has batch {B}, k and v batch {Bk}")
    if Dk != D:
        raise ValueError(f"mkrt.{area}: q has head dim {D}, k and v {Dk}")
    if D not in HEAD_DIMS:
        raise ValueError(f"mkrt.{area}: head dim {D}; supported: 64, 128")
    if min(B, Sq, Hq, Sk, Hkv) < 1:
        raise ValueError(f"mkrt.{area}: empty operands q {tuple(q_shape)}, k {tuple(k_shape)}")
    if Hq % Hkv:
        raise ValueError(f"mkrt.{area}: {Hq} query heads are not a multiple of {Hkv} key/value "
                         "heads (GQA needs Hq = g x Hkv)")
    if max(B * Sq * Hq, B * Sk * Hkv) >= 2**31 or -(-Sq // BLOCK_Q) * B * Hq >= 2**31:
        raise ValueError(f"mkrt.{area}: q {tuple(q_shape)}, k {tuple(k_shape)} exceed 2**31 rows")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"mkrt.{area}: causal must be True or False; got {causal!r}")
    return AttentionProblem(B, Sq, Sk, Hq, Hkv, D, dtype_name(q_dtype), bool(causal))


def check_strides(name: str, shape, strides, itemsize: int, area: str = "attention") -> None:
    """TMA reads a [B, S, H, D] view in place if D is contiguous and the other strides are
    positive multiples of 16 bytes."""
    if strides[3] != itemsize:
        raise ValueError(f"mkrt.{area}: {name} (shape {tuple(shape)}, strides {tuple(strides)} bytes) "
                         "must have a contiguous head dim (its last stride equal to the element size)")
    for axis in range(3):
        if shape[axis] > 1 and (strides[axis] <= 0 or strides[axis] % 16):
            raise ValueError(f"mkrt.{area}: {name} (shape {tuple(shape)}, strides {tuple(strides)} "
                             f"bytes): stride of dimension {axis} must be a positive multiple of 16 "
                             "bytes for the tensor map")


def check_scale(scale, head_dim: int, area: str = "attention") -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"mkrt.{area}: scale must be a number; got {scale!r}")
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"mkrt.{area}: scale={scale}; expected a positive finite number")
    return scale


# ---- launcher ---------------------------------------------------------------------------

_LOG2E = 1.4426950408889634


class _PreparedAttention:
    """One signature of :func:`attention`: kernel, grid and packed parameters."""

    def __init__(self, problem: AttentionProblem, spec: AttentionSpec, device: int, sms: int,
                 scale: float, planned_deal: bool = True):
        self.problem, self.spec, self.device = problem, spec, device
        params = Parameters([("tma_q", 128, 64), ("tma_k", 128, 64), ("tma_v", 128, 64),
                             ("out", np.uint64, 8), ("lse", np.uint64, 8),
                             ("batches", np.int32, 4), ("heads", np.int32, 4),
                             ("kv_heads", np.int32, 4), ("sq", np.int32, 4), ("sk", np.int32, 4),
                             ("causal", np.int32, 4), ("scale_log2", np.float32, 4),
                             ("band", np.int32, 4), ("counter", np.uint64, 8),
                             ("deal", np.uint64, 8)])
        p = problem
        params.set(batches=p.batches, heads=p.heads, kv_heads=p.kv_heads, sq=p.sq, sk=p.sk,
                   causal=int(p.causal), scale_log2=scale * _LOG2E, band=p.band)
        function = spec.function("attention_forward", device, spec.smem_bytes)
        ctas = min(p.tiles(spec.block_q), sms)
        # planned_deal=False: the cyclic deal even for causal tiles (experiments compare them)
        deal = deal_tiles(p, spec.block_q, spec.block_kv, ctas) if planned_deal and not spec.claimed else None
        if deal is not None:
            params.set(deal=deal_on_device(deal, device))
        self.launch = KernelLaunch(function, ctas, spec.threads, spec.smem_bytes, params)
        self._out, self._lse = params.view("out"), params.view("lse")
        self._counter = params.view("counter")
        self._maps = None

    def patch(self, q, k, v, out, lse, stream_ptr: int) -> None:
        maps = (q.data.ptr, q.strides, k.data.ptr, k.strides, v.data.ptr, v.strides)
        if maps != self._maps:
            p, params = self.problem, self.launch.params
            for name, x in (("tma_q", q), ("tma_k", k), ("tma_v", v)):
                descriptor = head_major_map(x, p.dtype, self.spec.block_q if name == "tma_q" else self.spec.block_kv,
                                            sources=None if name == "tma_q" else 1)
                ctypes.memmove(params.address(name), descriptor.address, 128)
            self._maps = maps
        self._out[()] = out.data.ptr
        self._lse[()] = lse.data.ptr
        if self.spec.claimed:        # dealt-out builds never read it: no lookup per call
            self._counter[()] = tile_counter(self.device, stream_ptr)


#: (device, deal bytes) -> the deal on the device. Never freed: a launch captured into a
#: CUDA graph reads it at every replay, after its prepared call may have been evicted.
_DEALS: dict = {}


def deal_on_device(deal: np.ndarray, device: int) -> int:
    """Address of a copy of `deal` (int32) on `device`, one per distinct deal."""
    import cupy
    key = (device, deal.shape, deal.tobytes())
    copy = _DEALS.get(key)
    if copy is None:
        # on a stream of its own, waited for here: in place before any launch reads it, and
        # outside a capture that may be under way on the caller's stream (a first call
        # captured into a CUDA graph)
        with cupy.cuda.Device(device):
            upload = cupy.cuda.Stream(non_blocking=True)
            with upload:
                copy = cupy.asarray(deal)
            upload.synchronize()
            _DEALS[key] = copy
    return copy.data.ptr


#: device -> {stream: tile counter {next tile, CTAs out}} (launcher.stream_workspace):
#: launches on one stream run one after another, so each finds its counter zeroed by the
#: last CTA out of the launch before; two streams never share one, and a launch captured
#: into a CUDA graph gets its own, zeroed by its graph.
_COUNTERS: dict = {}


def tile_counter(device: int, stream_ptr: int) -> int:
    """Address of the tile counter for a launch on `stream_ptr` of `device`."""
    import cupy
    counter, _ = stream_workspace(_COUNTERS.setdefault(device, {}), device, stream_ptr,
                                  lambda: cupy.zeros(2, dtype=np.uint64))
    return counter.data.ptr


_PREPARED: "collections.OrderedDict[tuple, _PreparedAttention]" = collections.OrderedDict()


def head_major_map(x, dtype: str, rows: int, *, sources: int | None = None,
                   source_stride: int = 0):
    """Tensor map of a [B, S, H, D] view (strides in bytes from the array) read in boxes of
    `rows` rows of one head: 4-D (d, head, row, batch), or with `sources` a 5-D map whose
    outermost coordinate picks one of `sources` copies `source_stride` bytes apart."""
    B, S, H, D = x.shape
    # a dimension of size 1 may carry any stride (torch and DLPack differ): give it the
    # packed one, which the tensor map accepts
    head = x.strides[2] if H > 1 else D * x.itemsize
    row = x.strides[1] if S > 1 else H * head
    batch = x.strides[0] if B > 1 else S * row
    dims, strides, box = (D, H, S, B), (head, row, batch), (64, 1, rows, 1)
    if sources is not None:
        dims, box = dims + (sources,), box + (1,)
        strides = strides + (source_stride or B * batch,)
    return tma_descriptor(x.data.ptr, dtype, dims, strides, box)


def _check_arrays(q, k, v, out, lse, problem: AttentionProblem, area: str = "attention"):
    device = q.data.device_id
    for name, x in (("k", k), ("v", v), ("out", out), ("lse", lse)):
        if x is not None and x.data.device_id != device:
            raise ValueError(f"mkrt.{area}: {name} is on GPU {x.data.device_id} but q is on GPU {device}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_strides(name, x.shape, x.strides, x.itemsize, area)
        if x.data.ptr % 16:
            raise ValueError(f"mkrt.{area}: {name} starts at {x.data.ptr:#x}, not 16-byte aligned")
    p = problem
    if out is not None:
        want = (p.batches, p.sq, p.heads, p.head_dim)
        if tuple(out.shape) != want or out.dtype != q.dtype:
            raise ValueError(f"mkrt.{area}: out is {tuple(out.shape)} {dtype_name(out.dtype)}; "
                             f"expected {want} {dtype_name(q.dtype)}")
        if not out.flags.c_contiguous or out.data.ptr % 16:
            raise ValueError(f"mkrt.{area}: out must be C-contiguous and 16-byte aligned")
    if lse is not None:
        want = (p.batches, p.heads, p.sq)
        if tuple(lse.shape) != want or lse.dtype != np.float32:
            raise ValueError(f"mkrt.{area}: lse is {tuple(lse.shape)} {dtype_name(lse.dtype)}; "
                             f"expected {want} f32")
        if not lse.flags.c_contiguous or lse.data.ptr % 4:
            raise ValueError(f"mkrt.{area}: lse must be C-contiguous")
    return device


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, out=None, lse=None,
              sms: int | None = None, block_kv: int | None = None, stages: int | None = None,
              pingpong: int | None = None, consumers: int | None = None, claimed: int | None = None,
              stream=None):
    """(O, LSE) of softmax(scale q k^T) v, scale defaulting to 1/sqrt(D).

    q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] device arrays (CuPy, torch through DLPack, ...),
    bf16/f16, D in {64, 128}, Hq a multiple of Hkv. Optional ``out`` [B, Sq, Hq, D] and
    ``lse`` [B, Hq, Sq] float32 are written in place. ``sms`` caps the persistent grid;
    ``block_kv``, ``stages``, ``pingpong``, ``consumers``, ``claimed`` override the compiled
    configuration (for experiments: see :class:`AttentionSpec`; default :func:`default_spec`).
    Returns (out, lse) in the type of ``q`` (torch in, torch out).
    """
    import cupy

    if all(is_torch(x) for x in (q, k, v, out, lse) if x is not None):
        return _attention_torch(q, k, v, causal, scale, out, lse, sms,
                                (block_kv, stages, pingpong, consumers, claimed), stream)
    qv = q if type(q) is cupy.ndarray else as_cupy(q, "q")
    kv = k if type(k) is cupy.ndarray else as_cupy(k, "k")
    vv = v if type(v) is cupy.ndarray else as_cupy(v, "v")
    out_view = out if out is None or type(out) is cupy.ndarray else as_cupy(out, "out")
    lse_view = lse if lse is None or type(lse) is cupy.ndarray else as_cupy(lse, "lse")
    device = qv.data.device_id
    key = _signature(qv, kv, vv, out_view, lse_view, causal, scale, sms,
                     (block_kv, stages, pingpong, consumers, claimed), device)
    call = _PREPARED.get(key)
    if call is None or not _quick_checks(device, qv, kv, vv, out_view, lse_view):
        call = _prepare(key, qv, kv, vv, out_view, lse_view, causal, scale, sms,
                        (block_kv, stages, pingpong, consumers, claimed))
    problem = call.problem
    with cupy.cuda.Device(device):
        if out_view is None:
            out_view = cupy.empty((problem.batches, problem.sq, problem.heads, problem.head_dim),
                                  dtype=qv.dtype)
        if lse_view is None:
            lse_view = cupy.empty((problem.batches, problem.heads, problem.sq), dtype=np.float32)
        stream_ptr = (stream or cupy.cuda.get_current_stream()).ptr
        call.patch(qv, kv, vv, out_view, lse_view, stream_ptr)
        call.launch(stream_ptr)
    return like_input(out_view, q), like_input(lse_view, q)


def _signature(q, k, v, out, lse, causal, scale, sms, overrides, device) -> tuple:
    """Everything the checks look at except pointers and devices; the option values with
    their types, so that causal=1 after causal=True is checked (and refused) afresh."""
    return (q.shape, q.strides, q.dtype, k.shape, k.strides, k.dtype, v.shape, v.strides, v.dtype,
            None if out is None else (out.shape, out.strides, out.dtype),
            None if lse is None else (lse.shape, lse.strides, lse.dtype),
            type(causal), causal, type(scale), scale, type(sms), sms, *overrides, device)


def _attention_torch(q, k, v, causal, scale, out, lse, sms, overrides, stream):
    """torch in, torch out, on torch's current stream, without DLPack conversions."""
    import torch
    qv, kv, vv = TorchView(q, "q"), TorchView(k, "k"), TorchView(v, "v")
    out_view = None if out is None else TorchView(out, "out")
    lse_view = None if lse is None else TorchView(lse, "lse")
    device = qv.data.device_id
    key = _signature(qv, kv, vv, out_view, lse_view, causal, scale, sms, overrides, device)
    call = _PREPARED.get(key)
    if call is None or not _quick_checks(device, qv, kv, vv, out_view, lse_view):
        call = _prepare(key, qv, kv, vv, out_view, lse_view, causal, scale, sms, overrides)
    p = call.problem
    if out is None or lse is None:
        # allocated on the stream that writes them (torch's allocator reuses per stream)
        with torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr, device=q.device)
                               if stream is not None else torch.cuda.current_stream(device)):
            if out is None:
                out = torch.empty((p.batches, p.sq, p.heads, p.head_dim), dtype=q.dtype,
                                  device=q.device)
                out_view = TorchView(out, "out")
            if lse is None:
                lse = torch.empty((p.batches, p.heads, p.sq), dtype=torch.float32, device=q.device)
                lse_view = TorchView(lse, "lse")
    stream_ptr = stream.ptr if stream is not None else torch.cuda.current_stream(device).cuda_stream
    call.patch(qv, kv, vv, out_view, lse_view, stream_ptr)
    if _runtime.getDevice() == device:
        call.launch(stream_ptr)
    else:
        import cupy
        with cupy.cuda.Device(device):      # the kernel belongs to that device's context
            call.launch(stream_ptr)
    return out, lse


def _quick_checks(device, q, k, v, out, lse) -> bool:
    """What a prepared signature still checks per call: one GPU, aligned base pointers."""
    for x in (q, k, v, out):
        if x is not None and (x.data.device_id != device or x.data.ptr & 15):
            return False
    return lse is None or (lse.data.device_id == device and not lse.data.ptr & 3)


def _prepare(key, q, k, v, out, lse, causal, scale, sms, overrides) -> _PreparedAttention:
    """Every check of a signature (raising on the first that fails), then its launch."""
    problem = check_operands(q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, causal=causal)
    device = _check_arrays(q, k, v, out, lse, problem)
    scale = check_scale(scale, problem.head_dim)
    total_sms = device_sm_count(device)
    if sms is None:
        sms = total_sms
    elif isinstance(sms, bool) or not isinstance(sms, (int, np.integer)) or not 1 <= sms <= total_sms:
        raise ValueError(f"mkrt.attention: sms={sms!r}; expected an integer in [1, {total_sms}]")
    spec = default_spec(problem.dtype, problem.head_dim, problem.causal)
    block_kv, stages, pingpong, consumers, claimed = overrides
    if overrides != (None,) * 5:      # the spec checks the values
        # unset overrides come from one fixed base (128-key blocks, 2 stages at D 128, 3 at
        # D 64, no pingpong, 2 consumers, tiles dealt out), not from the default, which may
        # change with measurements
        spec = AttentionSpec(problem.dtype, problem.head_dim,
                             128 if block_kv is None else block_kv,
                             (2 if problem.head_dim == 128 else 3) if stages is None else stages,
                             0 if pingpong is None else pingpong,
                             2 if consumers is None else consumers,
                             0 if claimed is None else claimed)
    call = _PREPARED.get(key)
    if call is None:
        call = _PREPARED[key] = _PreparedAttention(problem, spec, device, int(sms), scale)
        if len(_PREPARED) > 256:
            _PREPARED.popitem(last=False)
    return call


# ---- reference --------------------------------------------------------------------------

def reference(q, k, v, *, causal: bool, scale: float | None = None, q_offset: int = 0,
              k_offset: int = 0, dtype=np.float32):
    """(O, LSE) in `dtype` (NumPy in, NumPy out; CuPy in, CuPy out): q [B, Sq, Hq, D], k/v
    [B, Sk, Hkv, D]; positions start at the offsets (causal: key position <= query
    position); rows that see no key give O = 0 and LSE = -inf."""
    xp = np if isinstance(q, np.ndarray) else __import__("cupy")
    q, k, v = (to_float32(x).astype(dtype) if x.dtype != dtype else x for x in (q, k, v))
    B, Sq, Hq, D = q.shape
    Hkv = k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"mkrt.attention: {Hq} query heads are not a multiple of {Hkv} key heads")
    k = xp.repeat(k, Hq // Hkv, axis=2)
    v = xp.repeat(v, Hq // Hkv, axis=2)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    scores = xp.einsum("bqhd,bkhd->bhqk", q, k) * dtype(scale)
    if causal:
        qpos = q_offset + xp.arange(Sq)[:, None]
        kpos = k_offset + xp.arange(k.shape[1])[None, :]
        scores = xp.where(kpos <= qpos, scores, -xp.inf)
    m = xp.max(scores, axis=-1, keepdims=True)
    m_safe = xp.where(xp.isfinite(m), m, 0.0)
    p = xp.exp(scores - m_safe)
    total = p.sum(axis=-1, keepdims=True)
    out = xp.einsum("bhqk,bkhd->bqhd", p / xp.where(total > 0, total, 1.0), v)
    seen = total[..., 0] > 0
    lse = xp.where(seen, xp.log(xp.where(seen, total[..., 0], 1.0)) + m_safe[..., 0], -xp.inf)
    return out.astype(dtype), lse.astype(dtype)


def test_cases():
    """(B, Sq, Sk, Hq, Hkv, D, causal, dtype) the GPU tests run: odd lengths, GQA/MQA,
    both head dims and dtypes, a query block shorter than the key block and vice versa."""
    cases = []
    for dtype in ("bf16", "f16"):
        for d in HEAD_DIMS:
            cases += [(1, 128, 128, 1, 1, d, False, dtype), (2, 257, 257, 4, 2, d, True, dtype),
                      (1, 1, 300, 2, 1, d, False, dtype), (1, 1000, 1000, 8, 1, d, True, dtype),
                      (2, 77, 513, 4, 4, d, False, dtype), (1, 513, 77, 2, 2, d, True, dtype)]
    return cases
