"""The attention engine: FlashAttention's forward pass as a persistent, warp-specialised
tile loop on TMA + wgmma (sm_90a).

Every attention-bearing kernel of mkrt computes its query tiles with
``mkrt::attention::run_tiles``:

    O[q] = sum_k softmax_k(scale * Q[q] . K[k]) V[k],   LSE[q] = log sum_k e^(scale Q[q].K[k])

for one (batch, query head) at a time, over the keys of one (batch, key head) (GQA: several
query heads read the same key head).

One CTA = one producer warpgroup + two (or three) consumer warpgroups; a tile is 64 query
rows per consumer (``BQ``: 128 or 192) against the keys in blocks of ``BKV``.

* **producer** (warpgroup 0, one thread): per tile, loads Q once (when the consumers have
  released the previous tile's Q), then streams K and V blocks through ``STAGES``
  shared-memory stages. K and V have barriers of their own, full and empty: a K stage is
  free again as soon as its block's scores are done, a V stage only after its P V, so the
  producer loads K of block j+1 before V of block j (K runs a block ahead of V) and the
  next block's scores do not wait for the slower V release.
* **consumers**: per key block, S = Q K^T (wgmma, A and B from shared memory), the online
  softmax in fp32 registers (running row maximum and sum, in log2 units), and
  O += P V (wgmma with P straight from registers: the accumulator layout of S is the
  register layout of wgmma's A operand). The QK^T of block j+1 is issued before the PV
  of block j, so the tensor cores work while the softmax of the next block waits for its
  scores.

A tile visits ``tile.blocks`` key blocks, in the order its work list gives them: block j is
a ``KeyBlock`` -- which source tensor (the outermost coordinate of the K/V maps: one for
plain attention, the rank a chunk came from for ring attention), its first row there, the
sequence position of that row, and how many of its BKV rows are keys of the block (the
rest are masked). Key at position p is visible to the query at position P iff it is one
of the counted rows and (not causal, or p <= P). Online softmax does not care about the
order, so blocks may come in the order they arrive. A row that sees no key gets O = 0
and LSE = -inf.

Plugging in (what a kernel supplies), as for the GEMM engine:

* a **work list**: either a fixed deal, ``static constexpr bool CLAIMED = false`` and
  ``__device__ bool get(int i, Tile& tile) const`` (the i-th tile of this CTA, false past
  the end), which producer and consumers each call; or tiles claimed at run time,
  ``CLAIMED = true``, ``__device__ int next_position(int i) const`` (the producer's claim
  of its i-th tile, -1 past the end) and ``__device__ void tile_at(int position, Tile&)
  const``: the producer claims one tile ahead and hands each position, with the one
  after it, to the consumers in shared memory beside Q, published by Q's own barrier (no
  barrier of its own), so the consumers decode their next tile before its Q is in. (Handed
  over alone, the consumers decoded after Q's barrier and the claimed build ran about 5%
  slower than the dealt-out one on even tiles: experiments/attention_claim_probe.py.)
  After a -1 the producer claims no more; a cursor over the tile's key blocks,
  ``__device__ KeyBlock first_block(const Tile&) const`` and ``template <bool PRODUCER>
  __device__ void next_block(const Tile&, KeyBlock&) const`` (O(1) per block: the
  consumers step it in their softmax's loop; producer and consumers walk it
  independently, and PRODUCER says which: the producer's 56 registers cannot hold a
  long step inlined, and the consumers' code cannot hold a call); and
  ``__device__ bool wait(const Tile&, const KeyBlock&) const``, which the producer calls
  before loading a block (a ring waits there for the block's source to arrive); false
  releases the block's stage unloaded, and the host raises the timeout; and
  ``static constexpr bool TRACE`` (true: the consumers add the cycles they wait for a
  loaded stage to a ``mutable long long starved`` member; each thread has its own copy);
  and ``__device__ const TmaDescriptor* map_for(const TmaDescriptor* map, bool values,
  const KeyBlock&, int& source) const``: the map a block's K (values: V) loads through, of
  the engine's own (``map``) or another, and its source coordinate there.
  Optionally, ``static constexpr bool RESUMES = true`` for a tile visited in several
  parts (ring attention with a bounded ring of K/V slots visits it once per source):
  ``__device__ void resume(const Tile&, RowState<Cfg>&, const ConsumerThread&) const``
  sets the state a visit starts from (instead of zeros), and ``__device__ bool
  finishes(const Tile&) const`` says whether the visit is the tile's last: if not, the
  epilogue gets the state unnormalised (``o`` as accumulated, ``row_max``, and in
  ``row_sum`` the row's whole sum in every thread of its quad; no ``lse``).
* an **epilogue**: ``__device__ void operator()(const Tile&, const RowState<Cfg>&,
  const ConsumerThread&) const``, called by every consumer thread once per tile with the
  *normalised* output fragment and the rows' LSE (natural log).

The kernel is launched with ``Config::THREADS`` threads and ``Config::SMEM_BYTES`` of
dynamic shared memory, declared ``__launch_bounds__(Config::THREADS, 1)``.
"""

from mkrt.jit.render import cuda_source

ATTENTION_TILE = cuda_source("attention_tile", r"""
namespace mkrt {
namespace attention {

// Compile-time shape. T: __nv_bfloat16 or __half; D: head dim (64 or 128).
// PINGPONG: the consumers take turns issuing their MMAs (named barriers 4 .. 3 + CONSUMERS,
// round robin), so that one's softmax runs while another's MMAs occupy the tensor cores.
// The turns pair up only because every consumer runs the same tiles with the same block
// counts (the engine's work list is shared): a work list that split them would deadlock.
// CONSUMERS: 2, or 3 (192 query rows per tile, 512 threads; a third issuer of MMAs where
// the softmax is large against them, head dim 64). Kernels that use named barriers of their
// own (the ring's 6 and 7) keep 2.
template <class T_, int D_, int BKV_, int STAGES_, bool PINGPONG_ = false, int CONSUMERS_ = 2>
struct Config {
    typedef T_ T;
    static constexpr int D = D_;
    static constexpr int CONSUMERS = CONSUMERS_;
    static constexpr int BQ = 64 * CONSUMERS;       // query rows per tile, 64 per consumer
    static constexpr int BKV = BKV_;                // keys per block (= wgmma N of QK^T)
    static constexpr int STAGES = STAGES_;
    static constexpr bool PINGPONG = PINGPONG_;
    static constexpr int THREADS = 128 * (1 + CONSUMERS);
    static constexpr int CHUNKS = D / 64;           // 64-column boxes (one 128-byte swizzle row)
    static constexpr int Q_BYTES = BQ * D * 2;
    static constexpr int KV_BYTES = BKV * D * 2;    // K or V of one stage
    // 1024 of slack to align the tiles (128B swizzle), then barriers: q full/empty,
    // and per stage k full, v full, k empty, v empty.
    // ... and the claimed tiles' positions (two ints, next to the barriers)
    static constexpr int SMEM_BYTES = 1024 + Q_BYTES + 2 * STAGES * KV_BYTES + (2 + 4 * STAGES) * 8 + 8;
    // setmaxnreg moves registers inside the CTA's launch share (SHARE per thread: 168 at 384
    // threads, 128 at 512): producer + consumers must stay within it, or an increase waits
    // forever. Blocks of more than 128 keys hold more scores (BKV / 2 + BKV / 4 registers
    // per thread): at head dim 128 the producer gives up all it can (24, too few to claim
    // tiles), at 64 (half the output registers) it keeps 32 for the planned deal's lookup.
    // At 128 keys or less the ring's producer (its cursor walks the sources where a chunk
    // ends) needs 56 to run without spills. Three consumers get 160, the producer the 32
    // left (24 spilled with the deal's lookup).
    static constexpr int SHARE = 65536 / THREADS / 8 * 8;
    static constexpr int PRODUCER_REGISTERS = CONSUMERS == 3 ? 32 : BKV <= 128 ? 56 : D == 64 ? 32 : 24;
    static constexpr int CONSUMER_REGISTERS = CONSUMERS == 3 ? 160 : BKV <= 128 ? 224 : D == 64 ? 232 : 240;
    static_assert(PRODUCER_REGISTERS + CONSUMERS * CONSUMER_REGISTERS <= (1 + CONSUMERS) * SHARE,
                  "the register split exceeds the CTA's share");
    static_assert(CONSUMERS == 2 || CONSUMERS == 3, "two or three consumer warpgroups");
    static_assert(D == 64 || D == 128, "head dim 64 or 128");
    static_assert(BKV % 16 == 0 && BKV >= 64 && BKV <= 256, "BKV is a wgmma width (wgmma.WIDTHS)");
};

// One query tile: up to BQ query rows of one (batch, head) against `blocks` key blocks.
struct Tile {
    int batch = 0, head = 0, kv_head = 0;
    int q_row = 0;          // first query row of the tile (in the Q tensor)
    int q_rows = 0;         // rows of the tile that are queries of it (the epilogue stores these)
    int q_position = 0;     // sequence position of row q_row (causal masking)
    int blocks = 0;         // key blocks the tile visits
    int causal = 0;
    int index = 0;          // the tile's id (for flags and epilogues)
};

// One block of keys: BKV rows of source `source` of the K/V maps from row `row`, the first
// at sequence position `position`; rows past `count` are not keys of the block. `step`,
// `part`, `left`: where the work list's cursor stands (its own bookkeeping: a ring's
// source step, chunk slot and blocks left there).
struct KeyBlock {
    int source = 0, row = 0, position = 0, count = 0;
    int step = 0, part = 0, left = 0;
};

template <int CONSUMERS>
struct ConsumerThread {
    int warpgroup;   // 0 .. CONSUMERS-1: which 64-row slice of the tile
    int thread;      // 0 .. 128*CONSUMERS-1
    __device__ __forceinline__ int lane() const { return thread & 31; }
    // First of this thread's two rows inside the tile (the other is row + 8).
    __device__ __forceinline__ int row() const {
        return warpgroup * 64 + ((thread >> 5) & 3) * 16 + (lane() >> 2);
    }
};

// A consumer thread's share of its warpgroup's 64 x D output and of its two rows' softmax
// state. o[4j + r]: row row() + 8 (r / 2), column 8j + 2 (lane % 4) + r % 2.
template <class Cfg>
struct RowState {
    float o[Cfg::D / 2];
    float row_max[2];       // running maximum of scale * log2(e) * score; -inf: none yet
    float row_sum[2];       // this thread's part of the sum until the end, then the row's
    float lse[2];           // natural log, set at the end

    // f(row, col, v0, v1) for each pair of adjacent outputs this thread holds.
    template <int CONSUMERS, class F>
    __device__ __forceinline__ void for_each_pair(const ConsumerThread<CONSUMERS>& who, F&& f) const {
        const int row = who.row(), col = 2 * (who.lane() & 3);
        #pragma unroll
        for (int j = 0; j < Cfg::D / 8; ++j) {
            f(row, 8 * j + col, o[4 * j], o[4 * j + 1]);
            f(row + 8, 8 * j + col, o[4 * j + 2], o[4 * j + 3]);
        }
    }
};

// v as a value ptxas knows is the same in every lane (lane 0's; every lane must call it).
// A tile read from memory (a claimed position in shared memory, a planned deal in global
// memory) is the same in every lane, but ptxas cannot tell, so the loop over its key
// blocks, with every wgmma in it, would be compiled as possibly divergent.
__device__ __forceinline__ int warp_uniform(int v) { return __shfl_sync(0xffffffffu, v, 0); }

__device__ __forceinline__ void make_warp_uniform(Tile& tile) {
    tile.batch = warp_uniform(tile.batch);
    tile.head = warp_uniform(tile.head);
    tile.kv_head = warp_uniform(tile.kv_head);
    tile.q_row = warp_uniform(tile.q_row);
    tile.q_rows = warp_uniform(tile.q_rows);
    tile.q_position = warp_uniform(tile.q_position);
    tile.blocks = warp_uniform(tile.blocks);
    tile.causal = warp_uniform(tile.causal);
    tile.index = warp_uniform(tile.index);
}

// -inf (NVRTC has no INFINITY macro)
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

template <class T> __device__ __forceinline__ u32 pack_pair(float a, float b);
template <> __device__ __forceinline__ u32 pack_pair<__nv_bfloat16>(float a, float b) {
    __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<u32*>(&v);
}
template <> __device__ __forceinline__ u32 pack_pair<__half>(float a, float b) {
    __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<u32*>(&v);
}

// Shared memory of the pipeline, carved from the kernel's dynamic shared memory.
// Each tile is CHUNKS boxes of [rows][64 columns], 128B-swizzled as TMA writes them.
template <class Cfg>
struct Pipeline {
    char* q;        // [CHUNKS][BQ][64]
    char* k;        // STAGES x [CHUNKS][BKV][64]
    char* v;        // STAGES x [CHUNKS][BKV][64]
    u64* q_full;
    u64* q_empty;
    u64* k_full;    // [STAGES]
    u64* v_full;    // [STAGES]
    u64* k_empty;   // [STAGES]: every consumer's scores of the stage's K are done
    u64* v_empty;   // [STAGES]: every consumer's P V of the stage's V is done
    int* position;  // claimed work lists: [0] the queue position of the tile whose Q is
                    // loading, [1] the tile after it (-1: none)

    __device__ __forceinline__ explicit Pipeline(char* dynamic_smem) {
        char* base = reinterpret_cast<char*>(
            (reinterpret_cast<unsigned long long>(dynamic_smem) + 1023) & ~1023ull);
        q = base;
        k = q + Cfg::Q_BYTES;
        v = k + Cfg::STAGES * Cfg::KV_BYTES;
        q_full = reinterpret_cast<u64*>(v + Cfg::STAGES * Cfg::KV_BYTES);
        q_empty = q_full + 1;
        k_full = q_empty + 1;
        v_full = k_full + Cfg::STAGES;
        k_empty = v_full + Cfg::STAGES;
        v_empty = k_empty + Cfg::STAGES;
        position = reinterpret_cast<int*>(v_empty + Cfg::STAGES);
    }
    __device__ __forceinline__ char* k_stage(int s) const { return k + s * Cfg::KV_BYTES; }
    __device__ __forceinline__ char* v_stage(int s) const { return v + s * Cfg::KV_BYTES; }
};

// K or V of one block into its stage, once the consumers have released the stage. A block
// whose keys never came (a bounded wait gave up) is released unloaded so the consumers
// drain; the host raises the timeout.
// The work list picks the map and its source coordinate (Work::map_for: a ring reads its
// own keys from its inputs, the others' from the gathered buffer).
template <class Cfg, class Work>
__device__ __forceinline__ void load_block(char* destination, u64* full, u64* empty,
                                           const TmaDescriptor* map, const Work& work, bool values,
                                           const Tile& tile, const KeyBlock& block, bool ready,
                                           u32 phase) {
    mbarrier_wait(empty, phase ^ 1);
    if (ready) {
        int source;
        const TmaDescriptor* const chosen = work.map_for(map, values, block, source);
        mbarrier_arrive_expect_tx(full, Cfg::KV_BYTES);
        #pragma unroll
        for (int c = 0; c < Cfg::CHUNKS; ++c)
            tma_load_5d(destination + c * Cfg::BKV * 128, chosen, c * 64, tile.kv_head, block.row,
                        tile.batch, source, full);
    } else {
        mbarrier_arrive(full);
    }
}

// Producer: one thread walks the work list. Q is a 4-D map over [B, S, H, D] (coordinates
// d, head, row, batch; box 64 x 1 x BQ x 1); K and V are 5-D maps over [sources][B, S, H, D]
// (box 64 x 1 x BKV x 1 x 1). Inside a tile the loads go K0, K1, V0, K2, V1, ...: V of a
// block is loaded after K of the next one, since its stage is released later.
template <class Cfg, class Work>
__device__ __forceinline__ void produce(const Pipeline<Cfg>& pipe, const TmaDescriptor* tma_q,
                                        const TmaDescriptor* tma_k, const TmaDescriptor* tma_v,
                                        const Work& work) {
    int stage = 0;
    u32 phase = 0, q_phase = 0;
    Tile tile;
    // claimed: tiles are claimed one ahead, so each hand-over names the tile after it too
    // and the consumers decode their next tile before its Q is in, as dealt-out ones do
    // (decoding after Q's barrier cost the claimed build about 5%: attention_claim_probe)
    int following = 0;
    if constexpr (Work::CLAIMED) following = work.next_position(0);
    for (int i = 0;; ++i) {
        int position = 0;
        if constexpr (Work::CLAIMED) {
            position = following;
            if (position < 0 && i > 0) break;       // the last hand-over said so
            if (position >= 0) {
                following = work.next_position(i + 1);
                work.tile_at(position, tile);
            }
        } else if (!work.get(i, tile)) {
            break;
        }
        mbarrier_wait(pipe.q_empty, q_phase ^ 1);
        q_phase ^= 1;
        if constexpr (Work::CLAIMED) {
            // the positions go out with Q's barrier: the consumers read them once Q is in
            pipe.position[0] = position;
            pipe.position[1] = following;
            if (position < 0) { mbarrier_arrive(pipe.q_full); break; }     // no tile at all
        }
        mbarrier_arrive_expect_tx(pipe.q_full, Cfg::Q_BYTES);
        #pragma unroll
        for (int c = 0; c < Cfg::CHUNKS; ++c)
            tma_load_4d(pipe.q + c * Cfg::BQ * 128, tma_q, c * 64, tile.head, tile.q_row,
                        tile.batch, pipe.q_full);
        // V of the previous block is held back until this block's K is on its way; it
        // sits in the stage before this one
        KeyBlock previous;
        bool previous_ready = false;
        auto load_previous_values = [&]() {
            const int s = stage == 0 ? Cfg::STAGES - 1 : stage - 1;
            load_block<Cfg>(pipe.v_stage(s), &pipe.v_full[s], &pipe.v_empty[s], tma_v, work, true, tile,
                            previous, previous_ready, stage == 0 ? phase ^ 1 : phase);
        };
        KeyBlock block = work.first_block(tile);
        for (int j = 0; j < tile.blocks; ++j) {
            if (j > 0) work.template next_block<true>(tile, block);
            const bool ready = work.wait(tile, block);
            load_block<Cfg>(pipe.k_stage(stage), &pipe.k_full[stage], &pipe.k_empty[stage], tma_k, work, false,
                            tile, block, ready, phase);
            if (j > 0) load_previous_values();
            previous = block;
            previous_ready = ready;
            if (++stage == Cfg::STAGES) { stage = 0; phase ^= 1; }
        }
        if (tile.blocks > 0) load_previous_values();
    }
}

// Pingpong turns: wait for this warpgroup's turn before issuing MMAs, pass it on after.
template <class Cfg, int CONSUMERS>
__device__ __forceinline__ void turn_wait(const ConsumerThread<CONSUMERS>& who) {
    if constexpr (Cfg::PINGPONG) asm volatile("bar.sync %0, 256;" :: "r"(4 + who.warpgroup) : "memory");
}
template <class Cfg, int CONSUMERS>
__device__ __forceinline__ void turn_pass(const ConsumerThread<CONSUMERS>& who) {
    if constexpr (Cfg::PINGPONG)
        asm volatile("bar.arrive %0, 256;" :: "r"(4 + (who.warpgroup + 1) % CONSUMERS) : "memory");
}

// S = Q K^T for this warpgroup's 64 rows against one key block (issued, not waited).
template <class Cfg>
__device__ __forceinline__ void issue_scores(float (&s)[Cfg::BKV / 2], u32 q_address, u32 k_address) {
    #pragma unroll
    for (int kk = 0; kk < Cfg::D / 16; ++kk) {
        const u32 chunk = kk / 4, step = (kk % 4) * 32;
        const u64 da = smem_descriptor_sw128(q_address + chunk * Cfg::BQ * 128 + step, 16, 1024);
        const u64 db = smem_descriptor_sw128(k_address + chunk * Cfg::BKV * 128 + step, 16, 1024);
        Mma64<typename Cfg::T, Cfg::BKV, 0>::run(s, da, db, kk != 0);
    }
}

// O += P V with P from registers (p[4kk..4kk+3]: keys 16kk..16kk+15). V is [keys][D]:
// MN-major for this product, 64-column chunks BKV * 128 bytes apart.
template <class Cfg>
__device__ __forceinline__ void issue_values(float (&o)[Cfg::D / 2], const u32 (&p)[Cfg::BKV / 4],
                                             u32 v_address) {
    #pragma unroll
    for (int kk = 0; kk < Cfg::BKV / 16; ++kk) {
        const u64 db = smem_descriptor_sw128(v_address + kk * 16 * 128, Cfg::BKV * 128, 1024);
        const u32 a[4] = {p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3]};
        MmaRegA64<typename Cfg::T, Cfg::D, 1>::run(o, a, db, 1);
    }
}

// The online softmax of one block of scores, in place: s becomes the unnormalised
// probabilities exp2(scale_log2 * s - row_max); returns through `rescale` the factor the
// output accumulated so far must be multiplied by (the row maximum moved).
template <class Cfg, int CONSUMERS>
__device__ __forceinline__ void softmax_block(float (&s)[Cfg::BKV / 2], RowState<Cfg>& state,
                                              float (&rescale)[2], const Tile& tile,
                                              const KeyBlock& block, float scale_log2,
                                              const ConsumerThread<CONSUMERS>& who) {
    // positions relative to the block's first key: key k of the block is visible to this
    // thread's query q iff k < count and (not causal, or k <= q_position + row - position)
    const int reach = tile.q_position + who.row() - block.position;
    const bool mask = block.count < Cfg::BKV
                      || (tile.causal && block.position + Cfg::BKV - 1 > tile.q_position);
    if (mask) {
        const int col0 = 2 * (who.lane() & 3);
        #pragma unroll
        for (int j = 0; j < Cfg::BKV / 8; ++j)
            #pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int key = 8 * j + col0 + (r & 1);
                if (key >= block.count || (tile.causal && key > reach + 8 * (r >> 1)))
                    s[4 * j + r] = neg_inf();
            }
    }
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        float block_max = neg_inf();
        #pragma unroll
        for (int j = 0; j < Cfg::BKV / 8; ++j)
            block_max = fmaxf(block_max, fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
        block_max = quad_max(block_max) * scale_log2;
        const float old_max = state.row_max[h];
        const float new_max = fmaxf(old_max, block_max);
        // -inf - -inf is NaN: a row that has seen no key yet has nothing to rescale.
        const float base = new_max == neg_inf() ? 0.f : new_max;
        rescale[h] = old_max == neg_inf() ? 0.f : fast_exp2(old_max - base);
        state.row_max[h] = new_max;
        float sum = 0.f;
        #pragma unroll
        for (int j = 0; j < Cfg::BKV / 8; ++j) {
            const float p0 = fast_exp2(fmaf(s[4 * j + 2 * h], scale_log2, -base));
            const float p1 = fast_exp2(fmaf(s[4 * j + 2 * h + 1], scale_log2, -base));
            s[4 * j + 2 * h] = p0;
            s[4 * j + 2 * h + 1] = p1;
            sum += p0 + p1;
        }
        state.row_sum[h] = state.row_sum[h] * rescale[h] + sum;
    }
}

template <class Cfg>
__device__ __forceinline__ void to_operand(const float (&s)[Cfg::BKV / 2], u32 (&p)[Cfg::BKV / 4]) {
    #pragma unroll
    for (int i = 0; i < Cfg::BKV / 4; ++i) p[i] = pack_pair<typename Cfg::T>(s[2 * i], s[2 * i + 1]);
}

template <class Cfg>
__device__ __forceinline__ void rescale_output(RowState<Cfg>& state, const float (&rescale)[2]) {
    #pragma unroll
    for (int j = 0; j < Cfg::D / 8; ++j) {
        state.o[4 * j] *= rescale[0];
        state.o[4 * j + 1] *= rescale[0];
        state.o[4 * j + 2] *= rescale[1];
        state.o[4 * j + 3] *= rescale[1];
    }
}

// A consumer's wait for a loaded stage. A tracing work list (Work::TRACE, the ring's trace
// build) adds the cycles it waited to its `starved` counter: time the tensor cores had no
// keys to work on.
template <class Work>
__device__ __forceinline__ void wait_loaded(const Work& work, u64* full, u32 phase) {
    if constexpr (Work::TRACE) {
        const long long start = clock64();
        mbarrier_wait(full, phase);
        work.starved += clock64() - start;
    } else {
        mbarrier_wait(full, phase);
    }
}

// Whether a work list's tiles resume from an earlier visit's state (Work::RESUMES).
template <class W, class = void> struct Resumes { static constexpr bool value = false; };
template <class W> struct Resumes<W, decltype(void(W::RESUMES))> {
    static constexpr bool value = W::RESUMES;
};

// One tile for one consumer warpgroup: every key block, then the normalised output.
template <class Cfg, class Work, int CONSUMERS>
__device__ __forceinline__ void consume_tile(const Pipeline<Cfg>& pipe, const Work& work, const Tile& tile,
                                             float scale_log2, RowState<Cfg>& state,
                                             const ConsumerThread<CONSUMERS>& who,
                                             int& stage, u32& phase, u32& q_phase, int& following) {
    const bool warp_leader = who.lane() == 0;
    const u32 q_address = smem_address(pipe.q) + who.warpgroup * 64 * 128;
    if constexpr (Resumes<Work>::value) {
        work.resume(tile, state, who);      // a visit that goes on from an earlier one's state
    } else {
        #pragma unroll
        for (int i = 0; i < Cfg::D / 2; ++i) state.o[i] = 0.f;
        #pragma unroll
        for (int h = 0; h < 2; ++h) { state.row_max[h] = neg_inf(); state.row_sum[h] = 0.f; }
    }
    float s[Cfg::BKV / 2];
    u32 p[Cfg::BKV / 4];
    float rescale[2];

    mbarrier_wait(pipe.q_full, q_phase);
    q_phase ^= 1;
    // claimed: the next tile, handed over with this one's Q (read before this warpgroup
    // releases Q, after which the producer writes the next hand-over)
    if constexpr (Work::CLAIMED) following = warp_uniform(pipe.position[1]);
    const int blocks = tile.blocks;
    if (blocks == 0) {
        if (warp_leader) mbarrier_arrive(pipe.q_empty);
    } else {
        // first block: scores, softmax
        wait_loaded(work, &pipe.k_full[stage], phase);
        turn_wait<Cfg>(who);
        wgmma_fence();
        issue_scores<Cfg>(s, q_address, smem_address(pipe.k_stage(stage)));
        wgmma_commit();
        turn_pass<Cfg>(who);
        wgmma_wait<0>();
        fence_accumulators(s);
        if (warp_leader) mbarrier_arrive(&pipe.k_empty[stage]);
        if (blocks == 1 && warp_leader) mbarrier_arrive(pipe.q_empty);
        KeyBlock block = work.first_block(tile);
        softmax_block<Cfg>(s, state, rescale, tile, block, scale_log2, who);
        // A resumed visit's O was summed against the kept row maxima: bring it to this
        // block's (the loop below rescales only what this visit adds; a fresh tile's O is 0).
        if constexpr (Resumes<Work>::value) rescale_output<Cfg>(state, rescale);
        for (int j = 1; j < blocks; ++j) {
            const int previous = stage;
            const u32 previous_phase = phase;
            if (++stage == Cfg::STAGES) { stage = 0; phase ^= 1; }
            work.template next_block<false>(tile, block);   // block j: a few adds (a walk where a chunk ends)
            to_operand<Cfg>(s, p);
            wait_loaded(work, &pipe.k_full[stage], phase);
            // scores of this block, then the previous block's P V: the tensor cores run
            // while this block's softmax waits for its scores
            wait_loaded(work, &pipe.v_full[previous], previous_phase);
            turn_wait<Cfg>(who);
            fence_accumulators(state.o);
            wgmma_fence();
            issue_scores<Cfg>(s, q_address, smem_address(pipe.k_stage(stage)));
            wgmma_commit();
            issue_values<Cfg>(state.o, p, smem_address(pipe.v_stage(previous)));
            wgmma_commit();
            turn_pass<Cfg>(who);
            wgmma_wait<1>();
            fence_accumulators(s);
            if (warp_leader) mbarrier_arrive(&pipe.k_empty[stage]);
            if (j + 1 == blocks && warp_leader) mbarrier_arrive(pipe.q_empty);
            softmax_block<Cfg>(s, state, rescale, tile, block, scale_log2, who);
            wgmma_wait<0>();
            fence_accumulators(state.o);
            if (warp_leader) mbarrier_arrive(&pipe.v_empty[previous]);
            rescale_output<Cfg>(state, rescale);
        }
        // the last block's P V
        to_operand<Cfg>(s, p);
        wait_loaded(work, &pipe.v_full[stage], phase);
        turn_wait<Cfg>(who);
        fence_accumulators(state.o);
        wgmma_fence();
        issue_values<Cfg>(state.o, p, smem_address(pipe.v_stage(stage)));
        wgmma_commit();
        turn_pass<Cfg>(who);
        wgmma_wait<0>();
        fence_accumulators(state.o);
        if (warp_leader) mbarrier_arrive(&pipe.v_empty[stage]);
        if (++stage == Cfg::STAGES) { stage = 0; phase ^= 1; }
    }
    if constexpr (Resumes<Work>::value) {
        if (!work.finishes(tile)) {         // more visits follow: the state as it stands
            #pragma unroll
            for (int h = 0; h < 2; ++h) state.row_sum[h] = quad_sum(state.row_sum[h]);
            return;
        }
    }
    // normalise: the rows' sums over the quad of threads that share them
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float total = quad_sum(state.row_sum[h]);
        state.row_sum[h] = total;
        const float inverse = total > 0.f ? 1.f / total : 0.f;
        state.lse[h] = total > 0.f ? (state.row_max[h] + __log2f(total)) * 0.6931471805599453f
                                   : neg_inf();
        #pragma unroll
        for (int j = 0; j < Cfg::D / 8; ++j) {
            state.o[4 * j + 2 * h] *= inverse;
            state.o[4 * j + 2 * h + 1] *= inverse;
        }
    }
}

// The whole engine for one CTA. Every thread of the CTA calls it (Cfg::THREADS of them).
// scale_log2: the softmax scale times log2(e).
template <class Cfg, class Work, class Epilogue>
__device__ __forceinline__ void run_tiles(const TmaDescriptor* tma_q, const TmaDescriptor* tma_k,
                                          const TmaDescriptor* tma_v, float scale_log2,
                                          const Work& work, const Epilogue& epilogue,
                                          char* dynamic_smem) {
    const Pipeline<Cfg> pipe(dynamic_smem);
    const int warpgroup = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        mbarrier_init(pipe.q_full, 1);
        mbarrier_init(pipe.q_empty, Cfg::CONSUMERS * 4);
        for (int s = 0; s < Cfg::STAGES; ++s) {
            mbarrier_init(&pipe.k_full[s], 1);
            mbarrier_init(&pipe.v_full[s], 1);
            mbarrier_init(&pipe.k_empty[s], Cfg::CONSUMERS * 4);
            mbarrier_init(&pipe.v_empty[s], Cfg::CONSUMERS * 4);
        }
        mbarrier_init_fence();
        tma_prefetch_descriptor(tma_q);
        tma_prefetch_descriptor(tma_k);
        tma_prefetch_descriptor(tma_v);
    }
    __syncthreads();

    if (warpgroup == 0) {
        warpgroup_registers_decrease<Cfg::PRODUCER_REGISTERS>();
        if (threadIdx.x == 0) produce<Cfg>(pipe, tma_q, tma_k, tma_v, work);
    } else {
        warpgroup_registers_increase<Cfg::CONSUMER_REGISTERS>();
        ConsumerThread<Cfg::CONSUMERS> who;
        who.warpgroup = warpgroup - 1;
        who.thread = threadIdx.x - 128;
        RowState<Cfg> state;
        // the first turn is the first consumer's
        if (Cfg::PINGPONG && who.warpgroup == Cfg::CONSUMERS - 1) asm volatile("bar.arrive 4, 256;" ::: "memory");
        int stage = 0;
        u32 phase = 0, q_phase = 0;
        Tile tile;
        int following = -1;
        if constexpr (Work::CLAIMED) {
            // the first hand-over (consume_tile's own wait for Q then finds the phase
            // complete); each tile's hand-over names the next, decoded while Q loads
            mbarrier_wait(pipe.q_full, q_phase);
            for (int position = warp_uniform(pipe.position[0]); position >= 0; position = following) {
                work.tile_at(position, tile);
                make_warp_uniform(tile);
                consume_tile<Cfg>(pipe, work, tile, scale_log2, state, who, stage, phase, q_phase,
                                  following);
                epilogue(tile, state, who);
            }
        } else {
            for (int i = 0; work.get(i, tile); ++i) {
                make_warp_uniform(tile);        // a planned deal's tile comes from memory
                consume_tile<Cfg>(pipe, work, tile, scale_log2, state, who, stage, phase, q_phase,
                                  following);
                epilogue(tile, state, who);
            }
        }
    }
}

}  // namespace attention
}  // namespace mkrt
""", requires=("tma", "wgmma", "base"), headers=("cuda_bf16.h", "cuda_fp16.h"))
