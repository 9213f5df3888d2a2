"""Ring attention: sequence-parallel attention, the whole ring in one persistent kernel.

Every rank holds two chunks of the sequence (the sequence is cut into 2W chunks of c
rows): causal attention shards them zigzag (rank r holds chunks r and 2W-1-r, so every
rank has the same work), non-causal attention contiguously (chunks 2r and 2r+1). A rank
passes its q [B, 2c, Hq, D] and k, v [B, 2c, Hkv, D] -- its two chunks back to back (see
:func:`shard`) -- and gets O [B, 2c, Hq, D] and LSE [B, Hq, 2c] of its queries attending
to the whole sequence.

One persistent kernel per rank, two roles (the plan: mkrt/kernels/ring_attention_plan.py):

* **communication** CTAs gather every rank's K and V into the rank's symmetric
  ``gathered`` buffer with the shared gathering role (``gather_role``, as AllGather+GEMM
  gathers A): each K/V block crosses to each other node once, through the proxy, to the
  rank with the same local index, which spreads it inside its node by peer stores, in 64
  chunks (K and V chunks alternating), each with a flag; a ``ready[source]`` flag says a
  source's K and V are all in place. Once their copies are done they join the compute.
* **compute**: every CTA claims the rank's query tiles from one counter, heaviest first,
  and runs the attention engine (kernels/device/attention_tile.py) on them. A tile visits
  its key blocks source by source in the plan's order -- its own K/V first, then its node
  peers', then other nodes' -- and the engine's producer waits for the chunks holding a
  block's rows (one load once the source is ready) before loading it. Chunk
  pairs that the causal mask hides entirely are never visited; the diagonal chunk only up
  to the tile's last query. Partial results never leave the registers: the online softmax
  merges source after source in fp32, so the error does not grow with the world size.

The gathered buffer holds every rank's K and V (W x the local K/V); it is reused by the
next call once every rank's launch has begun. ``RingAttention(slots=k)`` holds
k slots instead and visits the sources one step at a time, each tile's state carried from
step to step in fp32 (the kernel's SLOTS; mkrt/kernels/ring_slots_plan.py checks the
protocol). Epochs on the device, bounded waits
(mkrt.CommTimeout), CUDA-graph capturable, like the other fused kernels.
"""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np

from mkrt.arrays import like_input
from mkrt.jit import cuda_source
from mkrt.kernels import attention as attention_module
from mkrt.kernels import ring_attention_plan as ring_plan
from mkrt.kernels.device import attention_tile, gather  # noqa: F401  (register the pieces)
from mkrt.kernels.gemm import tma_descriptor
from mkrt.kernels.launcher import KernelLaunch, Parameters, struct_size_assert
from mkrt.kernels.gathering import GatheringOp, default_comm_ctas
from mkrt.kernels.op import CONTEXT_PARAMETERS, shared_op
from mkrt.status import kernel_id

RING_ATTENTION = cuda_source("ring_attention", r"""
using namespace mkrt;
typedef $CTYPE T;
typedef attention::Config<T, $HEAD_DIM, $BLOCK_KV, $STAGES, $PINGPONG> Cfg;
typedef attention::Tile Tile;
typedef attention::KeyBlock KeyBlock;
typedef GatheredFlags Layout;

struct Args {
    const T* k;                 // this rank's K and V [B, 2c, Hkv, D]
    const T* v;
    T* out;                     // O [B, 2c, Hq, D]
    float* lse;                 // LSE [B, Hq, 2c]
    T* gathered;                // [W][K | V] (symmetric)
    u64* flags;                 // this rank's flag words
    const u64* peer_flags;      // [G] node peers' flag words
    const u64* peer_gathered;   // [G] node peers' gathered buffers
    const Queue* queue;         // the proxy queue (several nodes)
    int batches, heads, kv_heads, chunk;
    int me, node, G, N, compute_ctas, causal;
    int gathered_region, flags_region;
    float scale_log2;
    int band;                   // (batch, key head) pairs whose tiles run together
    u64* board;                 // roles="search": the split comes from the role board (null: compute_ctas)
    u64* trace;                 // the trace build's per-CTA records [ctas][TRACE_WORDS]
    float* partial;             // SLOTS: a visit's unnormalised O [B, 2c, Hq, D] (fp32)
    float* partial_rows;        // SLOTS: its row maxima, then row sums [2][B, Hq, 2c]
    u64* partial_flags;         // SLOTS: [tiles per step][2 halves] visit done, then [W] visit
                                // counters and [W] forward counters per step
};
$ARGS_CHECKS

// The trace build ($TRACE: RingAttention(trace=True)) writes, per CTA, TRACE_WORDS words
// (mirror: TRACE_FIELDS): %globaltimer at entry, when its copies were done (communication
// CTAs), when its producer and its first consumer warpgroup were done; the cycles the
// producer waited for key blocks' flags, the tiles it claimed and the blocks it loaded;
// the cycles the first consumer warpgroup waited for loaded stages (no keys to work on);
// clock64 at entry and when the producer was done (to turn cycles into time); then, for
// sources below TRACE_SOURCES, when the producer first asked for a block of the source,
// and when it first saw the source whole (its ready flag: 0 if it never looked again).
constexpr bool RING_TRACE = $TRACE;
// $DIRECT_OWN: the compute reads the rank's own K/V from its inputs (tma_k_own, tma_v_own),
// without waiting for anything; false: from its copy in the gathered buffer, as until
// c526389 (on several nodes the whole copy came first: every CTA waited for it at the start).
constexpr bool DIRECT_OWN = $DIRECT_OWN;
// $SLOTS > 0 (RingAttention(slots=k)): a bounded ring of K/V slots instead of the gathered
// buffer. A rank visits its sources one step at a time, step s the source source_at(s):
// step 0 its own K/V (read from the inputs); a source another node puts here (steps G, 2G,
// .. with several nodes) from the landing region (index SLOTS), into which it is put once
// the previous one there was visited and forwarded to the node's other ranks; any other
// from visit slot region_of(s) (the visit slots taken in turn), into which a node peer
// pushes or forwards it once the step that last used the slot is done here
// (move_to_slots). A tile's online-softmax state goes from one visit to the next in fp32
// (partial), never rounded. Regions of the buffer: [SLOTS visit slots][landing][staged:
// the rank's own K/V for the proxy's puts] (the last two with several nodes).
constexpr int SLOTS = $SLOTS;
constexpr bool OWN_IN_INPUT = DIRECT_OWN || SLOTS > 0;
constexpr int PARTIAL_FLAG = -6;                  // mirror: mkrt.errors.SPECIAL_FLAGS
// Whether another node's rank puts our step `step`'s source here (we forward it on).
__device__ __forceinline__ bool put_here(int step, int G, int N) {
    return N > 1 && step >= G && step % G == 0;
}
// Steps 1.. that are not put here, counted (1, 2, ..) up to `step`, and back.
__device__ __forceinline__ int local_index(int step, int G, int N) { return N > 1 ? step - step / G : step; }
__device__ __forceinline__ int step_of_local(int index, int G, int N) {
    return N > 1 ? index + (index - 1) / (G - 1) : index;      // (N > 1 with local steps: G > 1)
}
// The buffer region step `step` >= 1 reads (mirror: mkrt.kernels.ring_attention.slot_region).
__device__ __forceinline__ int region_of(int step, int G, int N) {
    return put_here(step, G, N) ? SLOTS : (local_index(step, G, N) - 1) % (SLOTS > 0 ? SLOTS : 1);
}
constexpr int TRACE_SOURCES = $TRACE_SOURCES;
constexpr int TRACE_WORDS = $TRACE_WORDS;        // len(TRACE_FIELDS) + 2 TRACE_SOURCES

// Chunks per gathered block: fine enough that a key block waits for little more than its
// own rows (at most GATHER_MAX_CHUNKS; mirror: RING_CHUNKS below).
constexpr int RING_CHUNKS = 64;

// The trace build's counters, per thread (each thread has its own copy of the work list);
// nothing in other builds.
template <bool ON> struct RingCounters {
    static constexpr bool TRACE = false;
    __device__ __forceinline__ void count_claim(int) const {}
    __device__ __forceinline__ void attach(u64*) const {}
    __device__ __forceinline__ void count_block(int) const {}
    __device__ __forceinline__ void count_whole(int) const {}
    __device__ __forceinline__ long long now() const { return 0; }
    __device__ __forceinline__ void count_flag_wait(long long) const {}
    __device__ __forceinline__ void record(u64*) const {}
};
// The trace build's record of this CTA, in shared memory (a pointer kept in registers made
// the producer spill).
__shared__ u64* ring_trace_record;
template <> struct RingCounters<true> {
    static constexpr bool TRACE = true;
    mutable long long starved = 0;      // cycles (the engine adds to it in every consumer thread)
    __device__ __forceinline__ void attach(u64* record) const {
        if (threadIdx.x == 0) ring_trace_record = record;     // the producer reads it
    }
    // the producer's counts go straight to the record (kept in registers until the end, they
    // made the K/V-slots build spill)
    __device__ __forceinline__ void count_claim(int position) const {
        if (position >= 0) ++ring_trace_record[5];
    }
    // the producer asks for a block of `source`: the first time, stamp it
    __device__ __forceinline__ void count_block(int source) const {
        ++ring_trace_record[6];
        // (the word itself says whether it was stamped: no state in registers)
        u64* const stamp = ring_trace_record + TRACE_WORDS - 2 * TRACE_SOURCES + source;
        if (source < TRACE_SOURCES && *stamp == 0) *stamp = global_timer_ns();
    }
    // ... and sees it whole for the first time
    __device__ __forceinline__ void count_whole(int source) const {
        if (source < TRACE_SOURCES)
            ring_trace_record[TRACE_WORDS - TRACE_SOURCES + source] = global_timer_ns();
    }
    __device__ __forceinline__ long long now() const { return clock64(); }
    __device__ __forceinline__ void count_flag_wait(long long start) const {
        ring_trace_record[4] += clock64() - start;
    }
    // at the end: the producer's words (thread 0) or the first consumer warpgroup's (128)
    __device__ __forceinline__ void record(u64* words) const {
        if (threadIdx.x == 0) {
            words[2] = global_timer_ns();
            words[9] = clock64();
        } else if (threadIdx.x == 128) {
            words[3] = global_timer_ns();
            words[7] = starved;
        }
    }
};

// The compute role's tiles and key blocks (mirrors: tile_order, source_order, tile_blocks).
// Every CTA claims tiles from one counter in tile_at's order (the communication CTAs too,
// once their copies are done), so the order is the queue's, not a fixed deal per CTA.
// SLOTS: where the visits keep a tile's state between steps (Args); nothing in other builds
// (the work list lives in local memory: three more words there grew the default build's
// stack by 24 bytes).
template <bool ON> struct RingSlots {
    static constexpr float* partial = nullptr;
    static constexpr float* partial_rows = nullptr;
    static constexpr u64* partial_flags = nullptr;
    template <class A> __device__ static RingSlots make(const A&) { return {}; }
};
template <> struct RingSlots<true> {
    float* partial;
    float* partial_rows;
    u64* partial_flags;
    template <class A> __device__ static RingSlots make(const A& a) {
        return {a.partial, a.partial_rows, a.partial_flags};
    }
};

struct RingWork : RingCounters<RING_TRACE>, RingSlots<(SLOTS > 0)> {
    int batches, heads, group, chunk, q_blocks, kv_blocks;   // q/kv blocks per chunk
    int G, N, node, me, causal, band;
    const u64* flags;
    Layout L;
    u64 epoch;
    Context ctx;
    roles::CountedQueue queue;  // tile positions claimed this launch (the engine hands each to the consumers)
    int chunks;                 // chunk flags per gathered block (of the host's split)
    u64 row_bytes;              // one row of K (or V): Hkv x D elements
    const TmaDescriptor* own_k; // DIRECT_OWN: maps over this rank's inputs ([1][B, 2c, Hkv, D])
    const TmaDescriptor* own_v;
    // the producer's: sources (below 64) it has seen whole and fenced, so their blocks load
    // with no flag read and no fence (a system-scope load per block delayed the producer,
    // whose lead over the consumers is a stage or two)
    mutable u64 whole_sources = 0;

    __device__ __forceinline__ int world() const { return G * N; }
    __device__ __forceinline__ bool is_own(int source) const { return source == node * G + me; }
    // Global chunk id of slot 0 or 1 of rank r: zigzag when causal.
    __device__ __forceinline__ int chunk_of(int r, int slot) const {
        return causal ? (slot == 0 ? r : 2 * world() - 1 - r) : 2 * r + slot;
    }
    // The source rank (n, l) visits at `step`: its node peers from itself on, then the
    // other nodes.
    __device__ __forceinline__ int source_for(int n, int l, int step) const {
        if (step < G) return n * G + (l + step) % G;
        const int i = (step - G) / G + 1, j = (step - G) % G;
        return ((n + i) % N) * G + (l + j) % G;
    }
    __device__ __forceinline__ int source_at(int step) const { return source_for(node, me, step); }
    // Key blocks of chunk kc a tile of query chunk qc visits.
    __device__ __forceinline__ int blocks_of(const Tile& tile, int qc, int kc) const {
        if (!causal || kc < qc) return kv_blocks;
        if (kc > qc) return 0;
        const int last = tile.q_position + tile.q_rows - 1 - kc * chunk;   // diagonal
        return min(kv_blocks, last / Cfg::BKV + 1);
    }
    static constexpr bool CLAIMED = true;
    __device__ __forceinline__ int next_position(int) const {
        int left_because;
        const int position = roles::claim(queue, &left_because);
        count_claim(position);
        return position;
    }

    // ---- K/V slots (SLOTS > 0): a position is a visit, step * tiles_per_step() + tile; the
    // queue hands them out step by step, every tile at every step (a visit without keys,
    // causal, moves no data: it passes its tile's state on from one step to the next).
    static constexpr bool RESUMES = SLOTS > 0;
    __device__ __forceinline__ int tiles_per_step() const { return 2 * q_blocks * batches * heads; }
    // A visit resumes from its tile's previous visit (the step before) once that one's half
    // is done; the own keys (step 0) start from zeros. A visit without keys loads nothing
    // unless it is the tile's last (it then finishes the tile from the stored state).
    template <int CONSUMERS>
    __device__ __forceinline__ void resume(const Tile& tile, attention::RowState<Cfg>& state,
                                           const attention::ConsumerThread<CONSUMERS>& who) const {
        const int T = tiles_per_step(), step = tile.index / T;
        if (step > 0)
            wait_gathered_word(partial_flags, 2 * (tile.index - step * T) + who.warpgroup,
                               epoch * world() + step - 1, ctx, tile.index, PARTIAL_FLAG);
        const bool load = step > 0 && (tile.blocks > 0 || step == world() - 1);
        const float* o = kept_output(tile);
        const long long row_stride = (long long)heads * Cfg::D;
        const float* row_max = kept_row_max(tile);
        const float* row_sum = row_max + kept_sums_offset();
        const int row = who.row(), col = 2 * (who.lane() & 3);
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = row + 8 * h;
            const bool live = load && r < tile.q_rows;
            state.row_max[h] = live ? row_max[r] : attention::neg_inf();
            state.row_sum[h] = live && (who.lane() & 3) == 0 ? row_sum[r] : 0.f;
            #pragma unroll
            for (int j = 0; j < Cfg::D / 8; ++j) {
                float2 v = make_float2(0.f, 0.f);
                if (live) v = *reinterpret_cast<const float2*>(o + (tile.q_row + r) * row_stride + 8 * j + col);
                state.o[4 * j + 2 * h] = v.x;
                state.o[4 * j + 2 * h + 1] = v.y;
            }
        }
    }
    // Where a tile's kept state is: its fp32 O rows (row stride Hq x D), its row maxima, and
    // its row sums kept_sums_offset() further on.
    __device__ __forceinline__ float* kept_output(const Tile& tile) const {
        return partial + ((long long)tile.batch * 2 * chunk * heads + tile.head) * Cfg::D;
    }
    __device__ __forceinline__ float* kept_row_max(const Tile& tile) const {
        return partial_rows + ((long long)tile.batch * heads + tile.head) * 2 * chunk + tile.q_row;
    }
    __device__ __forceinline__ long long kept_sums_offset() const { return (long long)batches * heads * 2 * chunk; }
    // The last step's visit finishes the tile.
    __device__ __forceinline__ bool finishes(const Tile& tile) const {
        return tile.index / tiles_per_step() == world() - 1;
    }

    // Tile t: in bands of `band` (batch, key head) pairs whose gathered K/V stay in L2
    // together (as mkrt.attention's HeadWork); inside a band by `order`, then key heads,
    // then the query heads sharing one.
    __device__ __forceinline__ void tile_at(int position, Tile& tile) const {
        const int step = SLOTS > 0 ? position / tiles_per_step() : 0;
        const int t = SLOTS > 0 ? position - step * tiles_per_step() : position;
        const int kv_heads = heads / group;
        const int units = batches * kv_heads;
        const int per_band = 2 * q_blocks * band * group;
        const int b = t / per_band;
        const int width = min(band, units - b * band) * group;
        const int r = t - b * per_band;
        const int order = r / width;
        // heaviest first: causal, the later chunk (slot 1) before the earlier; last blocks first
        const int slot = causal ? (order < q_blocks ? 1 : 0) : order / q_blocks;
        const int q_block = q_blocks - 1 - order % q_blocks;
        const int w = r - order * width;
        const int unit = b * band + w / group;
        tile.batch = unit / kv_heads;
        tile.kv_head = unit - tile.batch * kv_heads;
        tile.head = tile.kv_head * group + (w - (w / group) * group);
        tile.q_row = slot * chunk + q_block * Cfg::BQ;
        tile.q_rows = min(Cfg::BQ, chunk - q_block * Cfg::BQ);
        const int qc = chunk_of(node * G + me, slot);
        tile.q_position = qc * chunk + q_block * Cfg::BQ;
        tile.causal = causal;
        tile.index = position;
        int blocks = 0;
        for (int s = SLOTS > 0 ? step : 0; s < (SLOTS > 0 ? step + 1 : world()); ++s) {
            const int source = source_at(s);
            blocks += blocks_of(tile, qc, chunk_of(source, 0)) + blocks_of(tile, qc, chunk_of(source, 1));
        }
        tile.blocks = blocks;
    }
    // The tile's key blocks, source by source (source_at's order), slot 0 then 1 of each,
    // the blocks of a chunk in order (mirror: tile_blocks), as a cursor: a block costs a
    // decrement and a few adds; only where a chunk ends does it walk to the next source
    // with blocks for the tile (a walk per block, key_block(j) before, cost the consumers'
    // softmax loop O(W) per block). The producer takes that walk out of
    // line (inlined, it spilled the producer's 56 registers); the consumers inline it (a
    // call does not fit their code's register allocation).
    __device__ __forceinline__ KeyBlock first_block(const Tile& tile) const {
        KeyBlock block;
        block.step = SLOTS > 0 ? tile.index / tiles_per_step() : 0;   // slots: the visit's step only
        block.part = -1;
        enter_next_chunk(tile, block);
        return block;
    }
    template <bool PRODUCER>
    __device__ __forceinline__ void next_block(const Tile& tile, KeyBlock& block) const {
        if (--block.left > 0) {
            block.row += Cfg::BKV;
            block.position += Cfg::BKV;
            block.count = min(Cfg::BKV, (block.part + 1) * chunk - block.row);
            return;
        }
        if constexpr (PRODUCER) enter_next_chunk_out_of_line(tile, block);
        else enter_next_chunk(tile, block);
    }
    __device__ __noinline__ void enter_next_chunk_out_of_line(const Tile& tile, KeyBlock& block) const {
        enter_next_chunk(tile, block);
    }
    // The first block of the next (step, slot) with blocks to visit (past the last one:
    // left 0, the tile has no more).
    __device__ __forceinline__ void enter_next_chunk(const Tile& tile, KeyBlock& block) const {
        const int qc = tile.q_position / chunk;
        while (true) {
            if (++block.part == 2) {
                if (SLOTS > 0) { block.left = 0; return; }
                block.part = 0;
                ++block.step;
            }
            if (block.step >= world()) { block.left = 0; return; }
            const int s = source_at(block.step);
            const int kc = chunk_of(s, block.part);
            const int n = blocks_of(tile, qc, kc);
            if (n > 0) {
                block.source = s;
                block.row = block.part * chunk;
                block.position = kc * chunk;
                block.count = min(Cfg::BKV, chunk);
                block.left = n;
                return;
            }
        }
    }
    // The map a block loads through: our own keys from the inputs (DIRECT_OWN).
    __device__ __forceinline__ const TmaDescriptor* map_for(const TmaDescriptor* map, bool values,
                                                            const KeyBlock& block, int& source) const {
        if (OWN_IN_INPUT && is_own(block.source)) {
            source = 0;
            return values ? own_v : own_k;
        }
        source = SLOTS > 0 ? region_of(block.step, G, N) : block.source;
        return map;
    }
    // Before loading a block: our own keys are in the inputs (DIRECT_OWN); others' rows of
    // K and V in our gathered buffer. A source whose whole block is in costs one load;
    // otherwise only the chunks holding the rows (K rows batch x 2c + row.., V the same
    // B x 2c rows further on).
    __device__ __forceinline__ bool wait(const Tile& tile, const KeyBlock& block) const {
        const u64 bit = block.source < 64 ? 1ull << block.source : 0ull;
        count_block(block.source);
        if (OWN_IN_INPUT && is_own(block.source)) return true;
        if constexpr (SLOTS > 0) {
            // the slot holds this step's source once all its chunks say epoch x W + step:
            // waited for once per step (whole_sources has a bit per step then)
            const u64 step_bit = 1ull << block.step;
            if (whole_sources & step_bit) return true;
            const long long start = now();
            const int region = region_of(block.step, G, N);
            for (int c = 0; c < chunks; ++c)
                if (!wait_gathered_word(flags, L.chunk(region, c), epoch * world() + block.step, ctx, tile.index))
                    return false;
            count_flag_wait(start);
            count_whole(block.source);
            whole_sources |= step_bit;
            fence_proxy_async_global();
            return true;
        }
        if (whole_sources & bit) return true;
        if (ld_acquire_sys(flags + L.ready(block.source)) >= epoch) {
            whole_sources |= bit;
            count_whole(block.source);
        } else {
            const long long start = now();
            const int rows = batches * 2 * chunk;
            const int row0 = tile.batch * 2 * chunk + block.row, row1 = row0 + block.count - 1;
            const bool ok =
                wait_gathered_rows(flags, L, block.source, row0, row1, row_bytes, 2 * rows, chunks,
                                   epoch, ctx, tile.index) &&
                wait_gathered_rows(flags, L, block.source, rows + row0, rows + row1, row_bytes,
                                   2 * rows, chunks, epoch, ctx, tile.index);
            count_flag_wait(start);
            if (!ok) return false;
        }
        fence_proxy_async_global();      // peers wrote it with generic stores; TMA reads it
        return true;
    }
};

// O and LSE rows of the rank's two chunks.
struct StoreRows {
    T* out;
    float* lse;
    int rows, heads;            // rows = 2c

    template <int CONSUMERS>
    __device__ __forceinline__ void operator()(const Tile& tile, const attention::RowState<Cfg>& state,
                                               const attention::ConsumerThread<CONSUMERS>& who) const {
        T* const base = out + ((long long)tile.batch * rows * heads + tile.head) * Cfg::D;
        const long long row_stride = (long long)heads * Cfg::D;
        state.for_each_pair(who, [&](int r, int c, float v0, float v1) {
            if (r >= tile.q_rows) return;
            *reinterpret_cast<u32*>(base + (tile.q_row + r) * row_stride + c) =
                attention::pack_pair<T>(v0, v1);
        });
        if ((who.lane() & 3) == 0) {
            float* const row_lse = lse + ((long long)tile.batch * heads + tile.head) * rows;
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = who.row() + 8 * h;
                if (r < tile.q_rows) row_lse[tile.q_row + r] = state.lse[h];
            }
        }
    }
};

// SLOTS: one count towards `target` in a per-launch counter (one thread); the last raises
// `flag` to the epoch and resets the counter (every count of this launch is in).
__device__ __forceinline__ void count_towards(u64* counter, u64 target, u64* flag, u64 epoch) {
    if (fetch_add_acq_rel_gpu(counter, 1) + 1 == target) {
        st_relaxed_sys(counter, 0);
        st_release_sys(flag, epoch);
    }
}
// SLOTS: a visit's rows: the tile's last visit stores O and LSE (StoreRows); an earlier one
// with keys keeps the state for the next (fp32 O as accumulated, row maxima and sums). Then each
// consumer half says its rows are kept (partial_flags) and counts itself in the step; the
// step's last half raises ready(step), freeing the step's region for its next use.
struct VisitRows {
    StoreRows final_rows;
    const RingWork& work;

    template <int CONSUMERS>
    __device__ __forceinline__ void operator()(const Tile& tile, const attention::RowState<Cfg>& state,
                                               const attention::ConsumerThread<CONSUMERS>& who) const {
        const RingWork& w = work;
        const int T = w.tiles_per_step(), step = tile.index / T, t = tile.index - step * T;
        if (w.finishes(tile)) {
            final_rows(tile, state, who);
        } else if (tile.blocks > 0) {           // (no keys: the stored state stands)
            float* const o = w.kept_output(tile);
            const long long row_stride = (long long)w.heads * Cfg::D;
            state.for_each_pair(who, [&](int r, int c, float v0, float v1) {
                if (r < tile.q_rows)
                    *reinterpret_cast<float2*>(o + (tile.q_row + r) * row_stride + c) = make_float2(v0, v1);
            });
            if ((who.lane() & 3) == 0) {
                float* const row_max = w.kept_row_max(tile);
                float* const row_sum = row_max + w.kept_sums_offset();
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = who.row() + 8 * h;
                    if (r < tile.q_rows) { row_max[r] = state.row_max[h]; row_sum[r] = state.row_sum[h]; }
                }
            }
        }
        asm volatile("bar.sync %0, 128;" :: "r"(8 + who.warpgroup) : "memory");
        if ((who.thread & 127) == 0) {
            __threadfence();
            st_release_gpu(w.partial_flags + 2 * (u64)t + who.warpgroup, w.epoch * w.world() + step);
            // the step's visits done: ready(step) (with the forwards out of it, if any, its
            // slot may take the next source)
            count_towards(w.partial_flags + 2 * (u64)T + step, 2 * (u64)T, (u64*)w.flags + w.L.ready(step),
                          w.epoch);
        }
    }
};

// SLOTS: what the communication CTAs move, each CTA its chunks chunk_at(comm),
// chunk_at(comm + comm_ctas), ... of every transfer, in whichever order transfers become
// possible (one that waits holds back no other: a stream per destination):
//   push     our K/V (inputs) -> node peer p's visit slot for the step at which p visits us;
//   put      our K/V (staged, registered for the proxy) -> the landing region of rank `me`
//            of node m, once m's credit says it is free for that step;
//   forward  what another node put in our landing region -> node peer p's visit slot for
//            p's step of it;
//   credit   (CTA 0) tell the source of each step put here that our landing region is free.
// A visit slot of rank p for its step s is free for its first SLOTS uses once p has
// arrived, later once p visited the step that used it last (ready); the landing region
// for step G i once the step put here before (G (i - 1)) was visited and forwarded on
// (forwarded_step). Visit slots wait for visits only, so no two ranks' forwards wait for
// each other (with forwards out of visit slots, 2x2 with one slot deadlocked:
// ring_slots_plan.kernel_schedule). A chunk's flag at the receiver says epoch x W + step.
// Bounded: a timeout names the first transfer still waited for.
__device__ __noinline__ void move_to_slots(const Args& a, u64 epoch, const Context& ctx, int comm,
                                           int comm_ctas, int chunks, int tiles, bool muted) {
    const Layout L{a.G, a.N};
    const int G = a.G, N = a.N, W = G * N, me = a.me, node = a.node, mine = node * G + me;
    const u64 half = (u64)a.batches * 2 * a.chunk * a.kv_heads * Cfg::D * sizeof(T);   // K (or V)
    const u64 nbytes = 2 * half;
    const bool pairs = chunks % 2 == 0;
    unsigned char* const landing = (unsigned char*)a.gathered + (u64)SLOTS * nbytes;
    unsigned char* const staged = landing + nbytes;
    u64* const forward_counters = a.partial_flags + 2 * (u64)tiles + W;   // per step put here
    __shared__ int open_kind, open_index, stop;
    enum { NONE = -1, PUSH = 0, PUT = 1, FORWARD = 2, CREDIT = 3 };

    // arrive: node peers may push into our visit slots for their first uses; rank `me` of
    // every other node may overwrite what it staged (its puts to us last call have landed)
    if (comm == 0 && threadIdx.x < G)
        st_release_sys((u64*)a.peer_flags[threadIdx.x] + L.arrive(me), epoch);
    if (N > 1 && comm == 0 && threadIdx.x == blockDim.x - 1) {
        const Queue q = *a.queue;
        for (int m = 0; m < N; ++m)
            if (m != node && post_signal(q, ctx, (unsigned)(m * G + me), (unsigned)a.flags_region,
                                         (u64)L.node_arrive(node) * 8, epoch, ROLE_INTER, mine) == POST_FAILED)
                break;
    }
    if (muted) return;
    // several nodes: stage our K/V for the proxy once every rank `me` elsewhere has arrived
    if (N > 1) {
        if (!cta_wait_words(a.flags, L.node_arrive(0), 1, N, node, epoch, ctx, ROLE_INTER, mine, 0, a.queue))
            return;
        for (int k = comm; k < chunks; k += comm_ctas)
            spread_chunk(&staged, 1, 0, (const unsigned char*)a.k, half, (const unsigned char*)a.v, nbytes,
                         chunk_at(k, chunks, pairs), chunks);
        __threadfence_system();
        __syncthreads();
    }

    u32 pushes = 0, puts = 0, credits = 0;  // still to do: node peers, other nodes, steps put here
    u64 forwards = 0;                       // bit (i - 1) * G + p: node i steps on, to peer p
    for (int p = 0; p < G; ++p)
        if (p != me) pushes |= 1u << p;
    for (int i = 1; i < N; ++i) {
        puts |= 1u << i;
        if (comm == 0) credits |= 1u << i;
        for (int p = 0; p < G; ++p)
            if (p != me) forwards |= 1ull << ((i - 1) * G + p);
    }
    u64 start = global_timer_ns();        // since the last transfer (the bound is per wait)
    u32 backoff = 0;
    // whether node rank p's visit slot for its step s (not put there) is free (one thread)
    auto slot_free = [&](int p, int s, int& word, u64& seen) {
        const int index = local_index(s, G, N);
        if (index <= SLOTS) {
            word = L.arrive(p);
            seen = ld_acquire_sys(a.flags + word);
        } else {
            word = L.ready(step_of_local(index - SLOTS, G, N));
            seen = ld_acquire_sys((const u64*)a.peer_flags[p] + word);
        }
        return seen >= epoch;
    };
    // whether our landing region is free for step G i (one thread)
    auto landing_free = [&](int i, int& word, u64& seen) {
        if (i == 1) {
            word = L.arrive(me);
            seen = ld_acquire_sys(a.flags + word);
            return seen >= epoch;
        }
        word = L.ready(G * (i - 1));
        seen = ld_acquire_sys(a.flags + word);
        if (seen < epoch || G == 1) return seen >= epoch;
        word = L.forwarded_step(G * (i - 1));
        seen = ld_acquire_sys(a.flags + word);
        return seen >= epoch;
    };
    while (pushes | puts | credits | forwards) {
        if (threadIdx.x == 0) {
            open_kind = NONE;
            stop = 0;
            int first_word = -1, first_task = -1, word = 0;
            u64 first_seen = 0, first_expected = 0, seen = 0;
            auto blocked = [&](int task, int w, u64 got, u64 want) {
                if (first_word < 0) { first_word = w; first_task = task; first_seen = got; first_expected = want; }
            };
            for (int p = 0; p < G && open_kind == NONE; ++p) {
                if (!(pushes >> p & 1)) continue;
                if (slot_free(p, (me - p + G) % G, word, seen)) { open_kind = PUSH; open_index = p; }
                else blocked(p, word, seen, epoch);
            }
            for (int i = 1; i < N && open_kind == NONE; ++i) {
                if (!(puts >> i & 1)) continue;
                const int m = (node + N - i) % N;       // we are node m's source i nodes on
                const u64 want = epoch * W + (u64)G * i;
                const u64 got = ld_acquire_sys(a.flags + L.credit(m));
                if (got >= want) { open_kind = PUT; open_index = i; }
                else blocked(G + i, L.credit(m), got, want);
            }
            for (int i = 1; i < N && open_kind == NONE; ++i) {
                if (!(credits >> i & 1)) continue;
                // node + i's rank `me` is our step G i
                if (landing_free(i, word, seen)) { open_kind = CREDIT; open_index = i; }
                else blocked(2 * G + i, word, seen, epoch);
            }
            for (int t = 0; t < 64 && open_kind == NONE; ++t) {
                if (!(forwards >> t & 1)) continue;
                const int i = t / G + 1, p = t % G, s = G * i;
                bool landed = true;
                for (int k = comm; k < chunks && landed; k += comm_ctas) {
                    const u64 want = epoch * W + s;
                    const int w = L.chunk(SLOTS, chunk_at(k, chunks, pairs));
                    const u64 got = ld_acquire_sys(a.flags + w);
                    if (got < want) { landed = false; blocked(3 * G + t, w, got, want); }
                }
                if (!landed) continue;
                if (slot_free(p, s + (me - p + G) % G, word, seen)) { open_kind = FORWARD; open_index = t; }
                else blocked(3 * G + t, word, seen, epoch);
            }
            if (open_kind == NONE) {
                if (aborted(ctx)) {
                    stop = 1;
                } else if (global_timer_ns() - start > ctx.timeout_ns) {
                    report_timeout(ctx, ROLE_INTRA, first_task, first_word, first_expected, first_seen);
                    stop = 1;
                } else {
                    backoff = backoff == 0 ? 32 : (backoff < 256 ? backoff << 1 : 256);
                    sleep_ns(backoff);
                }
            }
        }
        __syncthreads();
        const int kind = open_kind, index = open_index;
        const bool stopped = stop;
        __syncthreads();                  // open_kind, open_index and stop are rewritten next round
        if (stopped) return;
        if (kind == NONE) continue;
        backoff = 0;
        start = global_timer_ns();
        if (kind == PUSH) {
            const int p = index, step = (me - p + G) % G, region = region_of(step, G, N);
            unsigned char* const target = (unsigned char*)a.peer_gathered[p] + (u64)region * nbytes;
            for (int k = comm; k < chunks; k += comm_ctas) {
                const int c = chunk_at(k, chunks, pairs);
                spread_chunk(&target, 1, 0, (const unsigned char*)a.k, half, (const unsigned char*)a.v,
                             nbytes, c, chunks);
                __threadfence_system();
                __syncthreads();
                if (threadIdx.x == 0)
                    st_release_sys((u64*)a.peer_flags[p] + L.chunk(region, c), epoch * W + step);
            }
            pushes &= ~(1u << p);
        } else if (kind == PUT) {
            const int i = index, m = (node + N - i) % N, step = G * i;
            if (threadIdx.x == 0) {
                const Queue q = *a.queue;
                for (int k = comm; k < chunks; k += comm_ctas) {
                    const int c = chunk_at(k, chunks, pairs);
                    const u64 x0 = chunk_begin(nbytes, c, chunks), x1 = chunk_begin(nbytes, c + 1, chunks);
                    if (post_put_signal(q, ctx, (unsigned)(m * G + me), (unsigned)a.gathered_region,
                                        (u64)SLOTS * nbytes + x0, (unsigned)a.gathered_region,
                                        (u64)(SLOTS + 1) * nbytes + x0, x1 - x0, (unsigned)a.flags_region,
                                        (u64)L.chunk(SLOTS, c) * 8, epoch * W + step, ROLE_INTER,
                                        mine) == POST_FAILED)
                        break;
                }
            }
            puts &= ~(1u << i);
        } else if (kind == CREDIT) {
            const int i = index, source = ((node + i) % N) * G + me;
            if (threadIdx.x == 0) {
                const Queue q = *a.queue;
                post_signal(q, ctx, (unsigned)source, (unsigned)a.flags_region, (u64)L.credit(node) * 8,
                            epoch * W + (u64)G * i, ROLE_INTER, mine);
            }
            credits &= ~(1u << i);
        } else {                          // FORWARD
            const int t = index, i = t / G + 1, p = t % G, s = G * i;
            const int step = s + (me - p + G) % G;             // p's step of the same source
            const int region = region_of(step, G, N);
            unsigned char* const target = (unsigned char*)a.peer_gathered[p] + (u64)region * nbytes;
            for (int k = comm; k < chunks; k += comm_ctas) {
                const int c = chunk_at(k, chunks, pairs);
                spread_chunk(&target, 1, 0, landing, nbytes, nullptr, nbytes, c, chunks);
                __threadfence_system();
                __syncthreads();
                if (threadIdx.x == 0)
                    st_release_sys((u64*)a.peer_flags[p] + L.chunk(region, c), epoch * W + step);
            }
            // our landing region may take the next source once every forward out of it is done
            if (threadIdx.x == 0)
                count_towards(forward_counters + s, (u64)comm_ctas * (G - 1), a.flags + L.forwarded_step(s),
                              epoch);
            forwards &= ~(1ull << t);
        }
    }
}

// q: 4-D map over this rank's Q; k, v: 5-D maps over the gathered [W][K | V] (SLOTS: the
// visit slots and the landing region, [SLOTS + 1][K | V]).
extern "C" __global__ void __launch_bounds__(Cfg::THREADS, 1)
ring_attention(const __grid_constant__ TmaDescriptor tma_q,
               const __grid_constant__ TmaDescriptor tma_k,
               const __grid_constant__ TmaDescriptor tma_v,
               const __grid_constant__ TmaDescriptor tma_k_own,
               const __grid_constant__ TmaDescriptor tma_v_own,
               const __grid_constant__ Args args, int muted_rank,
               u64* status, u64* host_flag, int slot, int rank, u64 timeout_ns) {
    extern __shared__ char dynamic_smem[];
    const Context ctx{status, host_flag, slot, rank, timeout_ns, $KERNEL_ID};
    const Args& a = args;
    u64* const record = RING_TRACE ? a.trace + (u64)blockIdx.x * TRACE_WORDS : nullptr;
    if (RING_TRACE && threadIdx.x == 0) {
        record[0] = global_timer_ns();
        record[8] = clock64();
        record[1] = 0;                                  // (the producer, thread 0, writes the rest)
        record[4] = record[5] = record[6] = 0;          // the producer's counts
        for (int i = TRACE_WORDS - 2 * TRACE_SOURCES; i < TRACE_WORDS; ++i) record[i] = 0;
    }
    const Layout L{a.G, a.N};
    // The split: the host's, or (roles="search") what the board's search measures next.
    const int compute_ctas = roles::split_for_launch(a.board, a.compute_ctas);
    const int comm_ctas = gridDim.x - compute_ctas;
    // chunks per K/V block: from the host's split, the same on every rank (gather_chunks)
    const int chunks = gather_chunks((int)gridDim.x - a.compute_ctas, RING_CHUNKS);

    const GatherLaunch launch = GatherLaunch::begin(a.flags, L, comm_ctas);
    const u64 epoch = launch.epoch;

    // Communication CTAs copy first, then every CTA computes: the engine is entered from
    // this one place (a second entry would cost ptxas's register split between warpgroups),
    // and no SM idles once the copies are done.
    const u64 row_bytes = (u64)a.kv_heads * Cfg::D * sizeof(T);
    const int q_blocks = (a.chunk + Cfg::BQ - 1) / Cfg::BQ;
    const int tiles = 2 * q_blocks * a.batches * a.heads;      // per source (SLOTS: per step)
    if ((int)blockIdx.x >= compute_ctas) {
        if constexpr (SLOTS > 0) {
            move_to_slots(a, epoch, ctx, blockIdx.x - compute_ctas, comm_ctas, chunks, tiles,
                          rank == muted_rank);
        } else {
            const u64 kv_bytes = (u64)a.batches * 2 * a.chunk * row_bytes;
            GatherArgs gather = gather_args(a, a.k, kv_bytes, a.v, kv_bytes, chunks);
            gather.own_in_input = DIRECT_OWN;
            gather_role(gather, epoch, ctx, blockIdx.x - compute_ctas, comm_ctas, launch.comm_all,
                        rank == muted_rank);
        }
        __syncthreads();                 // the role's shared memory is the engine's now
        if (RING_TRACE && threadIdx.x == 0) record[1] = global_timer_ns();
    }
    const RingWork work{{}, RingSlots<(SLOTS > 0)>::make(a), a.batches, a.heads, a.heads / a.kv_heads, a.chunk, q_blocks,
                        (a.chunk + Cfg::BKV - 1) / Cfg::BKV, a.G, a.N, a.node, a.me, a.causal,
                        a.band, a.flags, L, epoch, ctx,
                        {a.flags + L.claims(), (SLOTS > 0 ? a.G * a.N : 1) * tiles},
                        chunks, row_bytes, &tma_k_own, &tma_v_own};
    work.attach(record);
    const StoreRows store{a.out, a.lse, 2 * a.chunk, a.heads};
    if constexpr (SLOTS > 0) {
        attention::run_tiles<Cfg>(&tma_q, &tma_k, &tma_v, a.scale_log2, work, VisitRows{store, work},
                                  dynamic_smem);
    } else {
        attention::run_tiles<Cfg>(&tma_q, &tma_k, &tma_v, a.scale_log2, work, store, dynamic_smem);
    }
    work.record(record);
    launch.end(a.flags, L);
    roles::leave_launch(a.board);
}
""", requires=("attention_tile", "gather_role", "roles"), register=False)

KERNEL_ID = kernel_id("ring_attention")
#: chunks per gathered K/V block (the kernel's RING_CHUNKS; at most GATHER_MAX_CHUNKS)
RING_CHUNKS = 64
#: most K/V slots (RingAttention(slots=)): a node's peers but one (more would be the gathered
#: buffer again); the push keeps the peers still to serve in one 32-bit mask
MAX_SLOTS = 31
#: most ranks of a world with slots (a step is a bit of a 64-bit mask)
MAX_SLOT_WORLD = 64

ARGS_DTYPE = np.dtype([
    ("k", "<u8"), ("v", "<u8"), ("out", "<u8"), ("lse", "<u8"), ("gathered", "<u8"),
    ("flags", "<u8"), ("peer_flags", "<u8"), ("peer_gathered", "<u8"), ("queue", "<u8"),
    ("batches", "<i4"), ("heads", "<i4"), ("kv_heads", "<i4"), ("chunk", "<i4"),
    ("me", "<i4"), ("node", "<i4"), ("G", "<i4"), ("N", "<i4"), ("compute_ctas", "<i4"),
    ("causal", "<i4"), ("gathered_region", "<i4"), ("flags_region", "<i4"),
    ("scale_log2", "<f4"), ("band", "<i4"), ("board", "<u8"), ("trace", "<u8"),
    ("partial", "<u8"), ("partial_rows", "<u8"), ("partial_flags", "<u8"),
], align=True)

#: sources whose first request and first whole sighting the trace build stamps
TRACE_SOURCES = 16
#: the trace build's scalar words per CTA, in order (then TRACE_SOURCES words of
#: ``source_reached_ns``, TRACE_SOURCES of ``source_whole_ns``)
TRACE_FIELDS = ("start_ns", "copies_done_ns", "producer_done_ns", "consumer_done_ns",
                "flag_wait_cycles", "tiles", "blocks", "starved_cycles", "start_cycles",
                "producer_done_cycles")

#: kernel parameters, in order (tensor maps 64-byte aligned)
LAUNCH_PARAMETERS = [("tma_q", 128, 64), ("tma_k", 128, 64), ("tma_v", 128, 64),
                     ("tma_k_own", 128, 64), ("tma_v_own", 128, 64),
                     ("args", ARGS_DTYPE, 8), ("muted_rank", np.int32, 4), *CONTEXT_PARAMETERS]


#: the trace build's words per CTA (the kernel's TRACE_WORDS)
TRACE_WORDS = len(TRACE_FIELDS) + 2 * TRACE_SOURCES


def kv_map(pointer: int, problem, sources: int, source_stride: int, block_kv: int):
    """Tensor map of `sources` K (or V) arrays [B, 2c, Hkv, D], `source_stride` bytes apart
    (the gathered buffer's [W][K | V], or one rank's input with sources 1), in the engine's
    key-block boxes: 64 x 1 x block_kv x 1 x 1."""
    p = problem
    head, row = p.head_dim * 2, p.kv_heads * p.head_dim * 2      # strides in bytes
    return tma_descriptor(pointer, p.dtype, (p.head_dim, p.kv_heads, p.sk, p.batches, sources),
                          (head, row, p.sk * row, source_stride), (64, 1, block_kv, 1, 1))


@dataclasses.dataclass(frozen=True)
class RingAttentionSpec(attention_module.AttentionSpec):
    """The attention engine's configuration, in the ring kernel (URI e.g.
    ``ring_attention_bf16_d128_bkv128_s2_pp0_c2_q1_t0_o0_k0_sm90a``)."""

    family = "ring_attention"
    entry_points = ("ring_attention",)

    claimed: int = dataclasses.field(default=1, metadata={"short": "q"})     # RingWork claims
    trace: int = dataclasses.field(default=0, metadata={"short": "t"})       # 1: per-CTA records
    direct_own: int = dataclasses.field(default=0, metadata={"short": "o"})  # 1: own K/V from the inputs
    slots: int = dataclasses.field(default=0, metadata={"short": "k"})       # K/V slots (0: gathered)

    def __post_init__(self):
        # before the engine's checks, whose claim check would name the consumers otherwise
        if self.consumers != 2:       # the ring's roles use named barriers 6 and 7
            raise ValueError(f"mkrt.ring_attention: consumers={self.consumers}; the ring runs 2")
        super().__post_init__()
        if not self.claimed:          # RingWork always claims
            raise ValueError("mkrt.ring_attention: claimed=0; the ring's CTAs always claim tiles")
        if self.trace not in (0, 1):
            raise ValueError(f"mkrt.ring_attention: trace={self.trace}; expected 0 or 1")
        if self.direct_own not in (0, 1):
            raise ValueError(f"mkrt.ring_attention: direct_own={self.direct_own}; expected 0 or 1")
        if not 0 <= self.slots <= MAX_SLOTS:
            raise ValueError(f"mkrt.ring_attention: slots={self.slots}; expected 0 (the gathered "
                             f"buffer) to {MAX_SLOTS}")

    def template(self):
        return RING_ATTENTION

    def params(self):
        return {**super().params(), "KERNEL_ID": f"{KERNEL_ID}ull",
                "TRACE": "true" if self.trace else "false", "TRACE_SOURCES": TRACE_SOURCES,
                "TRACE_WORDS": TRACE_WORDS,
                "DIRECT_OWN": "true" if self.direct_own else "false", "SLOTS": self.slots,
                "ARGS_CHECKS": struct_size_assert("Args", ARGS_DTYPE)}


def spec_for(dtype: str, head_dim: int, causal: bool = False) -> RingAttentionSpec:
    """mkrt.attention's default configuration (attention.default_spec) in the ring kernel,
    but at most 128-key blocks: above that the producer keeps 24 registers, and the ring's
    producer spills there; head dim 64 takes 128-key
    blocks in 3 stages with pingpong instead (2-3% slower alone, attention_variants.jsonl,
    32702df). The ring ran 128-key blocks in 2 (D 64: 3) stages without pingpong until
    93a5fd8."""
    base = attention_module.default_spec(dtype, head_dim, causal)
    if base.block_kv > 128:
        return RingAttentionSpec(dtype, head_dim, 128, 3, 1)
    return RingAttentionSpec(dtype, head_dim, base.block_kv, base.stages, base.pingpong)


def default_specs() -> list[RingAttentionSpec]:
    """The default builds, and the same with two K/V slots (slots=2, the issue's double
    buffering), so that `python -m mkrt compile --all` checks both for spills."""
    specs = {spec_for(dtype, d, causal) for dtype in ("bf16", "f16")
             for d in attention_module.HEAD_DIMS for causal in (False, True)}
    specs |= {dataclasses.replace(spec, slots=2) for spec in specs}
    return sorted(specs, key=lambda spec: spec.uri)


# ---- what the kernel does, in Python (mirrors of RingWork, checked on the CPU) -----------

def source_order(node: int, me: int, G: int, N: int) -> list[int]:
    """The sources rank (node, me) visits, in order (RingWork::source_at)."""
    order = [node * G + (me + step) % G for step in range(G)]
    order += [((node + i) % N) * G + (me + j) % G for i in range(1, N) for j in range(G)]
    return order


def tile_order(batches: int, heads: int, kv_heads: int, chunk: int, band: int, causal: bool,
               block_q: int = attention_module.BLOCK_Q) -> list[tuple[int, int, int]]:
    """(batch, query head, first query row of the rank's two chunks) of every compute tile,
    in the order the CTAs claim them (RingWork::tile_at of positions 0, 1, ...): bands of
    `band` (batch, key head) pairs; inside a band the later chunk's (causal: the heavier)
    last query blocks first, then key heads, then the query heads sharing one."""
    group, q_blocks, units = heads // kv_heads, -(-chunk // block_q), batches * kv_heads
    order = []
    for first in range(0, units, band):
        for rank_order in range(2 * q_blocks):
            slot = (1 if rank_order < q_blocks else 0) if causal else rank_order // q_blocks
            q_row = slot * chunk + (q_blocks - 1 - rank_order % q_blocks) * block_q
            for unit in range(first, min(first + band, units)):
                batch, kv_head = divmod(unit, kv_heads)
                order += [(batch, kv_head * group + g, q_row) for g in range(group)]
    return order


def tile_blocks(rank: int, G: int, N: int, chunk: int, q_row: int, q_rows: int, causal: bool,
                block_kv: int = 128) -> list[tuple[int, int, int, int]]:
    """The key blocks (source, row, position, count) the tile of query rows
    [q_row, q_row + q_rows) of `rank` visits (RingWork's cursor: first_block, then
    next_block; tests/test_ring_attention.py steps a line-for-line copy of it)."""
    W = G * N
    slot = q_row // chunk
    qc = ring_plan.chunks_of(rank, W, causal)[slot]
    q_position = qc * chunk + (q_row - slot * chunk)
    kv_blocks = -(-chunk // block_kv)
    blocks = []
    for s in source_order(rank // G, rank % G, G, N):
        for kslot, kc in enumerate(ring_plan.chunks_of(s, W, causal)):
            if not causal or kc < qc:
                n = kv_blocks
            elif kc > qc:
                n = 0
            else:
                n = min(kv_blocks, (q_position + q_rows - 1 - kc * chunk) // block_kv + 1)
            blocks += [(s, kslot * chunk + j * block_kv, kc * chunk + j * block_kv,
                        min(block_kv, chunk - j * block_kv)) for j in range(n)]
    return blocks


def block_chunks(batch: int, row: int, count: int, batches: int, chunk: int, row_bytes: int,
                 comm_ctas: int) -> list[int]:
    """The chunk flags of a source's gathered block that a key block (rows [row, row +
    count) of the source's 2c, batch `batch`) waits for before the source is ready: those
    holding its K rows, then those holding its V rows (RingWork::wait; the block is
    [K | V], each [B, 2c, Hkv, D], in rows of `row_bytes`)."""
    from mkrt.kernels.gathering import chunk_holding, gather_chunks
    chunks = gather_chunks(comm_ctas, RING_CHUNKS)
    rows = batches * 2 * chunk
    nbytes = 2 * rows * row_bytes
    row0 = batch * 2 * chunk + row
    row1 = row0 + count - 1
    waited = []
    for first, last in ((row0, row1), (rows + row0, rows + row1)):
        end = chunk_holding(nbytes, (last + 1) * row_bytes - 1, chunks)
        waited += range(chunk_holding(nbytes, first * row_bytes, chunks), end + 1)
    return waited


def slot_region(step: int, per_node: int, nodes: int, slots: int) -> int:
    """The buffer region a rank's step `step` >= 1 reads with K/V slots (the kernel's
    region_of): a source another node puts here (steps G, 2G, .. with several nodes) is
    in the landing region (index `slots`); the others take the visit slots in turn."""
    G, N = per_node, nodes
    if N > 1 and step >= G and step % G == 0:
        return slots
    local = step - step // G if N > 1 else step
    return (local - 1) % slots


def shard(x, rank: int, world: int, *, causal: bool):
    """Rank `rank`'s two chunks of a full-sequence [B, S, H, D] array, back to back (what
    it passes to ring attention); S must be a multiple of 2 x world."""
    S = x.shape[1]
    if S % (2 * world):
        raise ValueError(f"mkrt.ring_attention: sequence {S} is not a multiple of 2 x world "
                         f"({2 * world})")
    c = S // (2 * world)
    xp = np if isinstance(x, np.ndarray) else __import__("cupy")
    return xp.ascontiguousarray(xp.concatenate(
        [x[:, i * c:(i + 1) * c] for i in ring_plan.chunks_of(rank, world, causal)], axis=1))


def unshard(parts, *, causal: bool, axis: int = 1):
    """The full sequence back from every rank's two chunks (rank order), along `axis`
    (1 for O [B, 2c, H, D], 2 for LSE [B, H, 2c])."""
    world = len(parts)
    xp = np if isinstance(parts[0], np.ndarray) else __import__("cupy")
    c = parts[0].shape[axis] // 2
    chunks = [None] * (2 * world)
    for rank, part in enumerate(parts):
        for slot, i in enumerate(ring_plan.chunks_of(rank, world, causal)):
            index = [slice(None)] * part.ndim
            index[axis] = slice(slot * c, (slot + 1) * c)
            chunks[i] = part[tuple(index)]
    return xp.concatenate(chunks, axis=axis)


# ---- the op --------------------------------------------------------------------------------

def ring_comm_ctas(ctas: int, nodes: int, ranks_per_node: int) -> int:
    """Communication CTAs of a rank's ring kernel: a quarter of its CTAs (at least the
    gathering default). They join the compute once their copies are done, so many cost
    little, and the compute's first key blocks wait for the copies: with 2 of 66 CTAs
    copying (about 40 GB/s each) a 1x2 ring at 3072 rows per rank spent about half its
    time waiting for K/V (ring_attention.jsonl, 25c42d9)."""
    return max(default_comm_ctas(ctas, nodes, ranks_per_node), min(ctas // 4, ctas - 1))


class RingAttention(GatheringOp):
    """``out, lse = op(q, k, v, causal=...)``: each rank's queries attend to the whole
    sequence, whose K and V are spread over the world.

    Per rank: q [B, 2c, Hq, D], k and v [B, 2c, Hkv, D] -- its two chunks of the sequence
    back to back, zigzag when causal (:func:`shard` cuts them from a full sequence);
    bf16/f16, D 64 or 128, Hq a multiple of Hkv. Returns per rank O [B, 2c, Hq, D] and
    LSE [B, Hq, 2c] (fp32, natural log). ``scale`` defaults to 1/sqrt(D). ``ctas``
    (default: the rank's SM share) and ``comm_ctas`` split the CTAs between the roles;
    ``roles="search"`` (not yet measured on a GPU) starts from that split and, after four
    launches, finds it by launch time per shape on the GPU
    (:class:`mkrt.controller.rule.LaunchSearch`; :meth:`controller_state`); ``"static"``
    (default) keeps it. ``band``: (batch, key head) pairs whose tiles run together (default
    :meth:`band_for`: as many as keep their K/V in the rank's share of the L2).
    ``stages``: K/V stages of the engine's pipeline (default :func:`spec_for`'s: those of
    mkrt.attention's configuration). ``trace=True`` runs the trace build, whose CTAs record
    when they started and finished and how long they waited (:meth:`trace`).
    ``direct_own=True``: each rank's compute reads its own K/V from its inputs (no wait for
    them; on one node no copy of them into the rank's own slot); not yet run on a GPU, so
    off by default: False reads them from the rank's copy in the gathered buffer.

    ``slots=k`` (worlds of at most 64 ranks; not yet run on a GPU): instead of gathering
    every rank's K/V (W x the local K/V per rank), each rank holds k slots of other ranks'
    K/V (the issue's double buffering is k=2), so memory does not grow with the world: k x
    the local K/V (two more on several nodes: where other nodes' K/V land, and its own,
    staged for the proxy) plus an fp32 state of its queries' output (2 x the size of O,
    and two floats per query row). The rank then visits its sources one step at a time (own K/V first, read in place), every
    tile once per step, carrying each tile's online-softmax state from step to step in
    fp32; a source's K/V go into a slot once the step that last used the slot is done
    (another node's into the landing region once the previous ones there were visited and
    forwarded to the node's other ranks). k >= W - N means a slot for every source that
    takes one (all but the rank's own and the N - 1 that land from other nodes).
    """

    name = "ring_attention"

    def __init__(self, world=None, *, ctas: int | None = None, comm_ctas: int | None = None,
                 timeout_ms: float | None = None, muted_rank: int | None = None,
                 roles: str = "static", band: int | None = None, stages: int | None = None,
                 trace: bool = False, direct_own: bool = False, slots: int | None = None):
        for name, value in (("trace", trace), ("direct_own", direct_own)):
            if not isinstance(value, (bool, np.bool_)):
                raise ValueError(f"mkrt.ring_attention: {name}={value!r}; expected True or False")
        if stages is not None and (isinstance(stages, bool) or not isinstance(stages, (int, np.integer))
                                   or stages < 2):
            raise ValueError(f"mkrt.ring_attention: stages={stages!r}; expected an integer of at "
                             "least 2 (K/V stages of the engine's pipeline) or None")
        if band is not None and (isinstance(band, bool) or not isinstance(band, (int, np.integer))
                                 or band < 1):
            raise ValueError(f"mkrt.ring_attention: band={band!r}; expected a positive integer "
                             "((batch, key head) pairs whose tiles run together) or None")
        if slots is not None and (isinstance(slots, bool) or not isinstance(slots, (int, np.integer))
                                  or not 1 <= slots <= MAX_SLOTS):
            raise ValueError(f"mkrt.ring_attention: slots={slots!r}; expected an integer in "
                             f"[1, {MAX_SLOTS}] (K/V slots per rank) or None (gather every rank's K/V)")
        super().__init__(world, ctas=ctas, comm_ctas=comm_ctas, timeout_ms=timeout_ms,
                         muted_rank=muted_rank, roles=roles)
        if slots is not None and self.world.size > MAX_SLOT_WORLD:
            raise ValueError(f"mkrt.ring_attention: slots= runs on worlds of at most "
                             f"{MAX_SLOT_WORLD} ranks; this one has {self.world.size} (leave "
                             "slots=None: every rank's K/V gathered)")
        # more visit slots than sources that use them would stay empty (with several nodes
        # one source per other node lands in a region of its own)
        self.slots = 0 if slots is None else min(int(slots), max(1, self.world.size - self.world.nodes))
        self.band = None if band is None else int(band)
        self.stages = None if stages is None else int(stages)
        self.tracing = bool(trace)
        self.direct_own = bool(direct_own)

    def spec(self, problem) -> "RingAttentionSpec":
        """The engine configuration of the ring's kernel for `problem` (:func:`spec_for`,
        with ``stages`` if given)."""
        spec = spec_for(problem.dtype, problem.head_dim, problem.causal)
        if self.stages is not None:
            spec = dataclasses.replace(spec, stages=self.stages)
        return dataclasses.replace(spec, trace=int(self.tracing), direct_own=int(self.direct_own),
                                   slots=self.slots)

    def band_for(self, problem, rank: int) -> int:
        """(batch, key head) pairs whose tiles run together on `rank`: ``band``, or as many
        as keep their gathered K/V (every rank's keys) in the rank's share of the L2."""
        if self.band is not None:
            return min(self.band, problem.batches * problem.kv_heads)
        # with slots a step's tiles read one source's keys
        sources = 1 if self.slots else self.world.size
        return attention_module.kv_band(problem.batches, problem.kv_heads, problem.head_dim,
                                        sources * problem.sk, share=self.world.device_sharing(rank))

    def split(self) -> tuple[int, int]:
        """(CTAs per rank, communication CTAs among them)."""
        info = self.world.local[0]
        ctas = self.ctas or (self.world.sm_count(info.rank) if info.device is not None else 132)
        if self.comm_ctas is not None:
            comm = self.comm_ctas
        elif self.slots:
            # slots: the copies run beside the whole launch (a step's K/V at a time), so the
            # copying CTAs rarely join the compute: the gathering default (2-6), not a quarter
            comm = default_comm_ctas(ctas, self.world.nodes, self.world.ranks_per_node)
        else:
            comm = ring_comm_ctas(ctas, self.world.nodes, self.world.ranks_per_node)
        if not 1 <= comm < ctas:
            raise ValueError(f"mkrt.ring_attention: comm_ctas={comm} must be in [1, {ctas - 1}]")
        return ctas, comm

    # -- the call --
    def _prepared_call(self, q_list, k_list, v_list, causal, scale):
        key = (q_list[0].shape, q_list[0].dtype, k_list[0].shape, v_list[0].shape,
               type(causal), causal, type(scale), scale)
        call = self._prepared.get(key)
        if call is None:
            for arrays, name in ((q_list, "q"), (k_list, "k"), (v_list, "v")):
                self.per_rank(arrays, name)
                self.same_everywhere(arrays, name)
            problem = attention_module.check_operands(
                q_list[0].shape, k_list[0].shape, v_list[0].shape, q_list[0].dtype,
                k_list[0].dtype, v_list[0].dtype, causal=causal, area=self.name)
            if problem.sq != problem.sk:
                raise ValueError(f"mkrt.ring_attention: q has {problem.sq} rows per rank, k and v "
                                 f"{problem.sk}; every rank holds the same chunks of all three")
            if problem.sq % 2:
                raise ValueError(f"mkrt.ring_attention: {problem.sq} rows per rank; a rank holds two "
                                 "chunks of equal length (2c rows)")
            scale = attention_module.check_scale(scale, problem.head_dim, self.name)
            ctas, comm = self.split()
            call = _PreparedCall(problem, scale, ctas, comm, q_list[0].dtype,
                                 tuple(q_list[0].shape), tuple(k_list[0].shape))
            self._prepared[key] = call
        for arrays, name, shape in ((q_list, "q", call.q_shape), (k_list, "k", call.kv_shape),
                                    (v_list, "v", call.kv_shape)):
            self.check_arrays(arrays, name, shape, call.dtype, aligned=True)
        return call

    def __call__(self, q, k, v, *, causal: bool = False, scale: float | None = None,
                 out=None, lse=None):
        q_list, as_list = self.arrays(q, "q")
        k_list, _ = self.arrays(k, "k")
        v_list, _ = self.arrays(v, "v")
        call = self._prepared_call(q_list, k_list, v_list, causal, scale)
        p = call.problem
        outs = self.arrays(out, "out")[0] if out is not None else None
        lses = self.arrays(lse, "lse")[0] if lse is not None else None
        if outs is not None:
            self.check_arrays(outs, "out", call.q_shape, call.dtype, aligned=True)
        if lses is not None:
            self.check_arrays(lses, "lse", (p.batches, p.heads, p.sq), np.dtype(np.float32))
        self.before_launch()
        if outs is None:
            outs = self.new_outputs(call.q_shape, call.dtype)
        if lses is None:
            lses = self.new_outputs((p.batches, p.heads, p.sq), np.float32)
        if self.world.size == 1:
            # one rank holds the whole sequence in order: the engine alone
            spec = self.spec(p)         # the ring's engine configuration
            attention_module.attention(q_list[0], k_list[0], v_list[0], causal=p.causal,
                                       scale=call.scale, out=outs[0], lse=lses[0],
                                       block_kv=spec.block_kv, stages=spec.stages,
                                       pingpong=spec.pingpong)
        else:
            self._run(call, q_list, k_list, v_list, outs, lses)
        self.after_launch()
        if as_list:
            return outs, lses
        return like_input(outs[0], q), like_input(lses[0], q)

    def _launches(self, call) -> list:
        if call.launches is not None and call.generation == self._generation:
            return call.launches
        # [sources][K | V] (slots on several nodes: the visit slots and the landing region,
        # then one more region, the rank's own K/V staged for the proxy)
        several = self.slots and self.world.nodes > 1
        sources = self.slots + several if self.slots else self.world.size
        self._ensure_gathered((sources + several) * 2 * call.kv_bytes)
        p = call.problem
        spec = self.spec(p)
        call.block_kv = spec.block_kv
        launches, words = [], []
        if self.slots and call.partials is None:
            self._allocate_partials(call)
        if self.tracing:
            # allocated while nothing is in flight (an allocation may wait for the device)
            self.world.synchronize()
            import cupy
            call.traces = []
            for info in self.world.local:
                with self.on_device(info.device):
                    call.traces.append(cupy.zeros((call.ctas, TRACE_WORDS), np.uint64))
        for i, info in enumerate(self.world.local):
            function = spec.function("ring_attention", info.device, spec.smem_bytes)
            params = Parameters(LAUNCH_PARAMETERS)
            args = self._args(call, info)
            args["board"] = self._board_pointer(call, i, call.ctas, call.comm_ctas)
            args["trace"] = call.traces[i].data.ptr if self.tracing else 0
            if self.slots:
                args["partial"], args["partial_rows"], args["partial_flags"] = (
                    x.data.ptr for x in call.partials[i])
            params.set(args=args, muted_rank=self.muted_rank, **self.context_params(info.rank))
            base = self._gathered.local_ptr(info.rank)
            for name, offset in (("tma_k", 0), ("tma_v", call.kv_bytes)):
                # [W][K | V]: source s's K at s * 2 kv_bytes, its V kv_bytes after
                descriptor = kv_map(base + offset, p, sources, 2 * call.kv_bytes, spec.block_kv)
                ctypes.memmove(params.address(name), descriptor.address, 128)
            launches.append(KernelLaunch(function, call.ctas, spec.threads, spec.smem_bytes, params))
            words.append(tuple(params.field_view("args", f) for f in ("k", "v", "out", "lse")))
        call.launches, call.generation, call.words = launches, self._generation, words
        call.q_pointers, call.kv_pointers = {}, {}
        return launches

    def _allocate_partials(self, call) -> None:
        """slots: per local rank, the visits' fp32 state (O [B, 2c, Hq, D], row maxima and
        sums [2][B, Hq, 2c]) and its flags (per tile two halves, then a counter per step;
        zeros: the flags grow with the launches from there)."""
        import cupy
        p = call.problem
        tiles = 2 * -(-(p.sq // 2) // attention_module.BLOCK_Q) * p.batches * p.heads
        self.world.synchronize()        # an allocation may wait for the device
        call.partials = []
        for device in self._local_devices:
            with self.on_device(device):
                call.partials.append((cupy.empty((p.batches, p.sq, p.heads, p.head_dim), np.float32),
                                      cupy.empty((2, p.batches, p.heads, p.sq), np.float32),
                                      cupy.zeros(2 * tiles + 2 * self.world.size, np.uint64)))

    def _args(self, call, info) -> np.ndarray:
        p = call.problem
        args = np.zeros((), ARGS_DTYPE)
        self._gather_args(args, info)
        args["batches"], args["heads"], args["kv_heads"] = p.batches, p.heads, p.kv_heads
        args["chunk"] = p.sq // 2
        args["compute_ctas"] = call.ctas - call.comm_ctas
        args["causal"] = int(p.causal)
        args["scale_log2"] = call.scale * 1.4426950408889634
        args["band"] = self.band_for(p, info.rank)
        return args

    def trace(self) -> list[dict]:
        """The trace build's records of the last call, per local rank (waits for the
        device): a dict of per-CTA arrays (CTA order: compute CTAs, then communication
        CTAs), one per TRACE_FIELDS name, plus ``ns_per_cycle`` (per CTA, from its
        producer's span) and ``flag_wait_ns`` and ``starved_ns`` converted with it, and
        ``source_reached_ns`` and ``source_whole_ns`` [CTAs, TRACE_SOURCES] (0: not
        stamped): when the CTA's producer first asked for a block of each source and first
        saw the source whole."""
        if not self.tracing:
            raise ValueError("mkrt.ring_attention: trace() needs RingAttention(trace=True)")
        call = getattr(self, "_traced_call", None)
        if call is None:
            raise ValueError("mkrt.ring_attention: trace() before any multi-rank call")
        self.world.synchronize()
        records = []
        for buffer in call.traces:
            raw = buffer.get().astype(np.int64)
            record = {name: raw[:, i] for i, name in enumerate(TRACE_FIELDS)}
            first = len(TRACE_FIELDS)
            record["source_reached_ns"] = raw[:, first:first + TRACE_SOURCES]
            record["source_whole_ns"] = raw[:, first + TRACE_SOURCES:first + 2 * TRACE_SOURCES]
            span_ns = record["producer_done_ns"] - record["start_ns"]
            span_cycles = record["producer_done_cycles"] - record["start_cycles"]
            record["ns_per_cycle"] = span_ns / np.maximum(span_cycles, 1)
            record["flag_wait_ns"] = record["flag_wait_cycles"] * record["ns_per_cycle"]
            record["starved_ns"] = record["starved_cycles"] * record["ns_per_cycle"]
            records.append(record)
        return records

    def trace_summary(self) -> tuple[float, list[dict]]:
        """(span in us, per-rank summaries) of the last call's trace records
        (:func:`mkrt.kernels.ring_trace.summarise`)."""
        from mkrt.kernels.ring_trace import summarise
        ctas, comm = self.split()
        return summarise(self.trace(), ctas - comm, self.world.ranks_per_node, self.world.nodes)

    def _call_shape(self, call) -> tuple:
        return call.q_shape

    def _run(self, call, q_list, k_list, v_list, outs, lses) -> None:
        launches = self._launches(call)
        if self.tracing:
            self._traced_call = call
        p = call.problem
        for i, launch in enumerate(launches):
            q = q_list[i]
            if call.q_pointers.get(i) != q.data.ptr:
                descriptor = attention_module.head_major_map(q, p.dtype, attention_module.BLOCK_Q)
                ctypes.memmove(launch.params.address("tma_q"), descriptor.address, 128)
                call.q_pointers[i] = q.data.ptr
            if (self.direct_own or self.slots) and \
                    call.kv_pointers.get(i) != (k_list[i].data.ptr, v_list[i].data.ptr):
                # the kernel reads the rank's own K/V through maps over its inputs
                for name, x in (("tma_k_own", k_list[i]), ("tma_v_own", v_list[i])):
                    descriptor = kv_map(x.data.ptr, p, 1, call.kv_bytes, call.block_kv)
                    ctypes.memmove(launch.params.address(name), descriptor.address, 128)
                call.kv_pointers[i] = (k_list[i].data.ptr, v_list[i].data.ptr)
            for word, x in zip(call.words[i], (k_list[i], v_list[i], outs[i], lses[i])):
                word[()] = x.data.ptr
        self.launch(launches)



@dataclasses.dataclass(eq=False)
class _PreparedCall:
    problem: attention_module.AttentionProblem
    scale: float
    ctas: int
    comm_ctas: int
    dtype: np.dtype
    q_shape: tuple
    kv_shape: tuple
    launches: list | None = None
    generation: int = -1
    words: list | None = None
    q_pointers: dict = dataclasses.field(default_factory=dict)
    kv_pointers: dict = dataclasses.field(default_factory=dict)
    block_kv: int = 128             # the spec's key block (the own maps' box)
    boards: list | None = None      # roles="search": per rank, the role board
    traces: list | None = None      # trace=True: per rank, the CTAs' records
    partials: list | None = None    # slots: per rank, (state, row state, flags) of the visits

    @property
    def kv_bytes(self) -> int:
        return int(np.prod(self.kv_shape)) * 2


def ring_attention(q, k, v, *, causal: bool = False, scale: float | None = None, world=None,
                   out=None, lse=None, **options):
    """Each rank's (O, LSE) of its queries over the whole sequence; see :class:`RingAttention`."""
    return shared_op(RingAttention, world, **options)(q, k, v, causal=causal, scale=scale,
                                                      out=out, lse=lse)


def test_cases():
    """(layout, B, rows per chunk, Hq, Hkv, D, causal, dtype) the GPU tests run."""
    return [("1x2", 1, 256, 2, 2, 128, False, "bf16"), ("1x2", 2, 200, 4, 2, 64, True, "bf16"),
            ("1x4", 1, 384, 4, 1, 128, True, "bf16"), ("2x2", 1, 256, 2, 2, 128, True, "f16"),
            ("2x2", 2, 130, 4, 4, 64, False, "bf16"), ("3x1", 1, 128, 2, 1, 128, True, "bf16"),
            ("1x3", 2, 192, 4, 2, 128, True, "bf16"), ("1x3", 1, 300, 2, 2, 64, False, "f16")]
