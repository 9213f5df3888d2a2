"""Split tiles added up in a fixed order: the epilogue of split-K and stream-K.

A tile whose k-blocks several CTAs cover (a *split* tile: ``tile.slot >= 0``) is computed
in parts; each part's CTA stores its fp32 partial, and the CTA of the last part to arrive
reads every part back, in part order 0, 1, ... (the sum does not depend on which part came
last: bit-identical between calls), and stores the tile through the whole tiles'
epilogue. Where the parts live is the kernel's choice, a ``Slots`` type with

    long long first_part(const Tile&) const              // part 0's place, in parts (the
                                                         // tile's parts follow it)
    int parts(const Tile&) const                         // the tile's part count
    int* arrival(const Tile&) const                      // its counter, zero between calls
    int rows_left(const Tile&) const                     // tile rows inside the output

(``mkrt.gemm`` and ``mkrt.grouped_gemm``: ``[slot][splits]``, ``splits`` the most parts
of any tile). Only rows inside the output are written and read back: a 16-row
problem in 64-row tiles, or a group's ragged last tile, moves a fraction of a tile.
"""

from mkrt.jit.render import cuda_source

PARTIAL_SUMS = cuda_source("partial_sums", r"""
namespace mkrt {
namespace gemm {

// How the parts are read back: one body selecting load or sum per value (the default), or
// (Slots::LOAD_FIRST_PART) part 0 loaded and the rest added in two bodies. The sums are
// the same; which form fits in registers beside a 256-wide tile's accumulators depends on
// the kernel (ptxas spills one or the other: mkrt.gemm fits the first, grouped_gemm the
// second).
template <class S, class = void> struct load_first_part { static constexpr bool value = false; };
template <class S> struct load_first_part<S, decltype(void(S::LOAD_FIRST_PART))> {
    static constexpr bool value = S::LOAD_FIRST_PART;
};

// Whole tiles (slot < 0) go straight to `whole`. A part stores its partial: every
// consumer thread its own fragment words, THREADS apart (coalesced); the last part to
// arrive adds the parts up in order (a part's loads are all in flight at once), stores
// through `whole` and re-arms the tile's counter for the next call. Rows past rows_left
// were never written and are not read: their accumulators hold this part's values,
// clipped by the whole tiles' store.
template <class Whole, class Slots>
struct PartialSumEpilogue {
    Whole whole;
    Slots slots;
    float* partials;

    template <int CONSUMERS>
    __device__ __forceinline__ void finish(const ConsumerThread<CONSUMERS>& who) const {
        whole.finish(who);
    }
    template <int CONSUMERS>
    __device__ __forceinline__ void complete(const ConsumerThread<CONSUMERS>& who) const {
        whole.complete(who);
    }

    // acc is the engine's accumulator, free to overwrite: the next tile's first MMA
    // does not read it.
    template <class Acc, int CONSUMERS>
    __device__ __forceinline__ void operator()(const Tile& tile, Acc& acc,
                                               const ConsumerThread<CONSUMERS>& who) const {
        if (tile.slot < 0) {
            whole(tile, acc, who);
            return;
        }
        constexpr int THREADS = 128 * CONSUMERS;
        constexpr long long PART = (long long)Acc::COUNT * THREADS;
        const int parts = slots.parts(tile);
        const int rows_left = slots.rows_left(tile);
        float* const tile_parts = partials + slots.first_part(tile) * PART + who.thread;
        float* const mine = tile_parts + tile.split * PART;
        Acc::each_pair_slot(who, [&](int row, int, int i) {
            if (row >= rows_left) return;
            mine[i * THREADS] = acc.d[i];
            mine[(i + 1) * THREADS] = acc.d[i + 1];
        });
        __shared__ int last_part;
        __threadfence();                                     // the partial, before the count
        who.sync();
        if (who.thread == 0) last_part = atomicAdd(slots.arrival(tile), 1) == parts - 1;
        who.sync();
        if (!last_part) return;
        __threadfence();
        for (int part = 0; part < parts; ++part) {
            const float* p = tile_parts + part * PART;
            if constexpr (load_first_part<Slots>::value) {
                // the same sums, part 0 loaded and the next ones added in two bodies
                if (part == 0) {
                    Acc::each_pair_slot(who, [&](int row, int, int i) {
                        if (row >= rows_left) return;
                        acc.d[i] = __ldcg(p + i * THREADS);
                        acc.d[i + 1] = __ldcg(p + (i + 1) * THREADS);
                    });
                } else {
                    Acc::each_pair_slot(who, [&](int row, int, int i) {
                        if (row >= rows_left) return;
                        acc.d[i] += __ldcg(p + i * THREADS);
                        acc.d[i + 1] += __ldcg(p + (i + 1) * THREADS);
                    });
                }
            } else {
                Acc::each_pair_slot(who, [&](int row, int, int i) {
                    if (row >= rows_left) return;
                    const float v0 = __ldcg(p + i * THREADS), v1 = __ldcg(p + (i + 1) * THREADS);
                    acc.d[i] = part == 0 ? v0 : acc.d[i] + v0;
                    acc.d[i + 1] = part == 0 ? v1 : acc.d[i + 1] + v1;
                });
            }
        }
        whole(tile, acc, who);
        if (who.thread == 0) *slots.arrival(tile) = 0;
    }
};

// Stream-K's share of a tail: tiles [0, whole) run whole, CTA c of ctas taking c, c + ctas,
// ...; the k-block iterations of the tiles after them, I = (tiles - whole) x k_blocks, go
// to the first `sharing` CTAs, CTA c taking [c I / sharing, (c + 1) I / sharing): pieces
// of consecutive tiles. A tile inside one CTA's share runs whole on it; a tile that
// several CTAs cover is split (tile.split: its part, tile.parts, tile.slot: its place
// after `whole`). plan() works a CTA's share out once, into shared memory (kept out of
// registers: the consumers hold a tile's accumulators; and get() divides by nothing).
struct StreamKShare {
    enum { WHOLE, CTA, CTAS, WHOLE_EACH, BEGIN, END, FIRST_TILE, LAST_TILE, FIRST_TILE_CTA,
           LAST_TILE_CTA, STATE };
    const int* state;

    // 32-bit: the host keeps iterations x sharing below 2**31.
    // the CTA of `sharing` whose iterations include iteration x of `iterations`
    __device__ static int cta_of(int x, int iterations, int sharing) {
        return ((x + 1) * sharing - 1) / iterations;
    }
    // the first iteration of CTA c's share
    __device__ static int begin_of(int c, int iterations, int sharing) {
        return c * iterations / sharing;
    }

    __device__ static void plan(int* state, int tiles, int whole, int k_blocks, int sharing,
                                int cta, int ctas) {
        const int iterations = (tiles - whole) * k_blocks;
        const bool shares = cta < sharing && iterations > 0;
        const int begin = shares ? begin_of(cta, iterations, sharing) : iterations;
        const int end = shares ? begin_of(cta + 1, iterations, sharing) : iterations;
        const int first_tile = begin / k_blocks;
        const int last_tile = end > begin ? (end - 1) / k_blocks : first_tile - 1;
        state[WHOLE] = whole;
        state[CTA] = cta;
        state[CTAS] = ctas;
        state[WHOLE_EACH] = whole / ctas;
        state[BEGIN] = begin;
        state[END] = end;
        state[FIRST_TILE] = first_tile;
        state[LAST_TILE] = last_tile;
        state[FIRST_TILE_CTA] = end > begin ? cta_of(first_tile * k_blocks, iterations, sharing) : cta;
        state[LAST_TILE_CTA] = end > begin ? cta_of((last_tile + 1) * k_blocks - 1, iterations, sharing) : cta;
    }

    // The i-th work item of this CTA into `tile`: tile_at(linear index) (whole tiles
    // first, then the shared tail's, `whole` + t), with its part's k-range where several
    // CTAs share it. False past the end.
    template <class TileAt>
    __device__ __forceinline__ bool get(int i, int k_blocks, const TileAt& tile_at, Tile& tile) const {
        const int whole_each = state[WHOLE_EACH], cta = state[CTA];
        if (i < whole_each) {
            tile = tile_at(cta + i * state[CTAS]);
            return true;
        }
        const int t = state[FIRST_TILE] + (i - whole_each);          // after `whole`
        if (t > state[LAST_TILE]) return false;
        tile = tile_at(state[WHOLE] + t);
        const int first_cta = t == state[FIRST_TILE] ? state[FIRST_TILE_CTA] : cta;
        const int last_cta = t == state[LAST_TILE] ? state[LAST_TILE_CTA] : cta;
        if (first_cta == last_cta) return true;                      // this CTA's alone
        const int first = t * k_blocks;
        tile.kb_begin = max(state[BEGIN], first) - first;
        tile.kb_end = min(state[END], first + k_blocks) - first;
        tile.split = cta - first_cta;
        tile.parts = last_cta - first_cta + 1;
        tile.slot = t;
        return true;
    }
};

}  // namespace gemm
}  // namespace mkrt
""", requires=("gemm_tile",))
