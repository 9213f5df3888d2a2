"""The GEMM engine: a persistent, warp-specialised tile loop on TMA + wgmma (sm_90a).

Every GEMM-bearing kernel of mkrt computes its tiles with ``mkrt::gemm::run_tiles``:

    C[m, n] = sum_k A[m, k] * B[k, n]      A row-major [M, K]; B [K, N] or [N, K]

One CTA = one producer warpgroup + ``BM / 64`` consumer warpgroups. With
``Config::CLUSTER_M == 2`` two CTAs (a cluster) compute tiles m and m + 1 of one column:
each loads its own A box and half of the B tile they share, multicast to both, so B
crosses from L2 once per pair (``PairedRasterWork``; the kernel declares
``__cluster_dims__(2, 1, 1)`` and its grid is even).

* **producer** (warpgroup 0, one thread): for each tile of the CTA's work list, for each
  64-wide k-block, waits until a shared-memory stage is *empty*, announces its bytes on
  the stage's *full* barrier and issues the TMA loads of the A and B boxes.
* **consumers** (warpgroups 1..): wait until a stage is *full*, issue four
  ``wgmma m64nBNk16`` (64 rows each, fp32 accumulators in registers), keep one batch in
  flight, and mark the stage before it *empty*. After the last k-block of a tile they
  hand the accumulators to the **epilogue**, while the producer already loads the next
  tile's stages.

Plugging in (what a fused kernel supplies):

* a **work list**: any type with ``__device__ bool get(int i, Tile& tile) const`` giving
  the i-th tile of *this* CTA (false past the end). Producer and consumers walk it
  independently, so it must be a pure function of ``i``. It also has
  ``__device__ bool wait(const Tile&) const``, which the producer calls before loading a
  tile's operands: a fused kernel waits there for operands other ranks write (and fences
  them for TMA); false (a wait that gave up) makes the producer release the tile's stages
  without loading, so the consumers finish instead of waiting forever. Provided:
  ``RasterWork`` (tiles in grouped raster order, CTA c takes c, c + ctas, ...) and
  ``ListWork`` (explicit tile ids per CTA from a planner's arrays); both never wait.
* an **epilogue**: any type with
  ``template <class Acc> __device__ void operator()(const Tile&, const Acc&, const ConsumerThread&)``
  called by every consumer thread once per tile. ``Acc`` is ``Accumulator<BN>``:
  ``acc.for_each_pair(thread, f)`` calls ``f(row, col, v0, v1)`` with tile-relative row
  and column of two adjacent outputs; the epilogue also has ``finish(who)``, called
  once after the last tile. Provided: ``StoreEpilogue<T>`` (store with bounds,
  to local or peer memory), ``TmaStoreEpilogue<T>`` (stage in shared memory, TMA store;
  overlaps the next tile), ``AddEpilogue<T>`` (atomic add, e.g. into a peer buffer) and
  ``FlagEpilogue<Inner>`` (run Inner, wait for all consumer threads, then one thread
  release-stores ``epoch`` into ``flags[tile.index]``, system scope).

The caller kernel is launched with ``Config::THREADS`` threads, ``Config::SMEM_BYTES`` of
dynamic shared memory, and declared ``__launch_bounds__(Config::THREADS, 1)`` (so that
``setmaxnreg`` takes effect). Named barrier 1 is used by the consumers; use others.
"""

from mkrt.jit.render import cuda_source

GEMM_TILE = cuda_source("gemm_tile", r"""
namespace mkrt {
namespace gemm {

// Compile-time shape of the engine. T: __nv_bfloat16 or __half.
// EPILOGUE_BYTES_: shared memory reserved for the epilogue (ConsumerThread::smem).
// CLUSTER_M_: 2 = clusters of two CTAs on tile rows m and m + 1 of one column, each
// loading half of the B tile they share and multicasting it to both (PairedRasterWork).
template <class T_, int BM_, int BN_, int STAGES_, bool B_K_MAJOR_, int EPILOGUE_BYTES_ = 0,
          int CLUSTER_M_ = 1>
struct Config {
    typedef T_ T;
    static constexpr int BM = BM_;            // tile rows (64 per consumer warpgroup)
    static constexpr int BN = BN_;            // tile columns (= wgmma N)
    static constexpr int BK = 64;             // 64 two-byte elements = one 128-byte swizzle row
    static constexpr int STAGES = STAGES_;
    static constexpr bool B_K_MAJOR = B_K_MAJOR_;   // B stored [N, K] (true) or [K, N]
    // Consumer warpgroups, and the rows each takes: 64 (one m64 MMA per k16 step), or
    // 128 for 256-row tiles (two, on the upper and lower 64 rows of its slice).
    static constexpr int CONSUMERS = BM == 256 ? 2 : BM / 64;
    static constexpr int CONSUMER_ROWS = BM / CONSUMERS;
    static constexpr int SUBTILES = CONSUMER_ROWS / 64;
    static constexpr int THREADS = 128 * (1 + CONSUMERS);
    static constexpr int A_STAGE_BYTES = BM * BK * 2;
    static constexpr int B_STAGE_BYTES = BN * BK * 2;
    static constexpr int STAGE_BYTES = A_STAGE_BYTES + B_STAGE_BYTES;
    static constexpr int EPILOGUE_BYTES = EPILOGUE_BYTES_;
    static constexpr int CLUSTER_M = CLUSTER_M_;
    static_assert(CLUSTER_M == 1 || CLUSTER_M == 2, "clusters of 1 or 2 CTAs along M");
    // [N, K]: each CTA of a pair loads BN / 2 rows, a whole number of 1024-byte swizzle
    // atoms; [K, N]: the pair splits the 64-column chunks (an odd count: rank 0 one more)
    static_assert(CLUSTER_M == 1 || !B_K_MAJOR || (BN / 2) % 8 == 0,
                  "each CTA of a pair loads whole 8-row swizzle atoms of the B tile");
    // 1024 of slack to align the stages (128B swizzle), the epilogue's staging area
    // (1024-aligned too), then 2 barriers per stage.
    static constexpr int SMEM_BYTES = 1024 + STAGES * STAGE_BYTES + EPILOGUE_BYTES + 2 * STAGES * 8;
    static_assert(EPILOGUE_BYTES % 1024 == 0, "epilogue staging keeps 1024-byte alignment");
    static constexpr int PRODUCER_REGISTERS = 40;
    static constexpr int CONSUMER_REGISTERS = CONSUMERS == 1 ? 240 : 232;
    static_assert(BM == 64 || BM == 128 || BM == 256, "BM is 64, 128 or 256");
    static_assert(SUBTILES * BN <= 256, "at most 128 fp32 accumulators per consumer thread");
    // B [K, N] is loaded in 64-column chunks; B [N, K] in rows, so its tiles may also be
    // trimmed to a multiple of 16 (a pair multicasts half each: whole 8-row atoms)
    static_assert(BN <= 256 && (BN % 64 == 0 || (B_K_MAJOR && BN % 16 == 0)),
                  "BN is a multiple of 64 (or of 16 with B [N, K]), at most 256");
};

// One output tile: its coordinates in tiles, and its index in the tile grid
// (m * tiles_n + n), which fused kernels use to name flags.
// A work item: an output tile, and which of its k-blocks (kb_end < 0: all of them; split:
// which part of a split-K tile this is; slot >= 0 only for split-K parts).
// a_row / b_row >= 0: the first row of A / of B ([N, K] storage) the tile reads, where it
// is not m * BM / n * BN (a grouped GEMM's tiles start where their group does).
struct Tile {
    int m = 0, n = 0, index = 0;
    int kb_begin = 0, kb_end = -1, split = 0;
    int a_row = -1, b_row = -1;
    int group = -1;                                  // a grouped GEMM's group
    int a_map = 0;                                   // 1: A from run_tiles' second map (tma_a2)
    int b_map = 0;                                   // 1: B from run_tiles' second map (tma_b2)
    int b_row2 = -1;                                 // >= 0: B [N, K] in two halves, the second from here
    int slot = -1;                                   // split-K: the tile's partial-sum slot
    int parts = 0;                                   // stream-K: this tile's parts (0: the launch's)
    __device__ __forceinline__ int k_first() const { return kb_begin; }
    __device__ __forceinline__ int k_last(int k_blocks) const { return kb_end < 0 ? k_blocks : kb_end; }
    __device__ __forceinline__ int a_first(int bm) const { return a_row >= 0 ? a_row : m * bm; }
    __device__ __forceinline__ int b_first(int bn) const { return b_row >= 0 ? b_row : n * bn; }
};

// ---- work lists ----------------------------------------------------------------------

// All tiles of a tiles_m x tiles_n grid in grouped raster order (group_m tile rows at a
// time, column by column inside the group, for L2 reuse); CTA `cta` of `ctas` takes
// tiles cta, cta + ctas, ...
struct RasterWork {
    int tiles_m, tiles_n, group_m, cta, ctas;

    __device__ __forceinline__ Tile tile_at(int t) const {
        const int per_group = group_m * tiles_n;
        const int group = t / per_group;
        const int first_m = group * group_m;
        const int rows = min(group_m, tiles_m - first_m);
        const int local = t - group * per_group;
        Tile tile;
        tile.m = first_m + local % rows;
        tile.n = local / rows;
        tile.index = tile.m * tiles_n + tile.n;
        return tile;
    }
    __device__ __forceinline__ bool get(int i, Tile& tile) const {
        const int t = cta + i * ctas;
        if (t >= tiles_m * tiles_n) return false;
        tile = tile_at(t);
        return true;
    }
    __device__ __forceinline__ bool wait(const Tile&) const { return true; }
};

// For clusters of two CTAs along M (Config::CLUSTER_M == 2): pairs of tile rows walked as
// RasterWork walks tile rows; cluster `cluster` of `clusters` takes pair tiles cluster,
// cluster + clusters, ..., and its CTA of rank r computes row 2 * pair_m + r. Both CTAs
// of a cluster get the same number of tiles with the same n and k-blocks (they share
// every B load); with an odd tiles_m the last pair's second tile lies past M: its A
// loads arrive as zeros and its stores are clipped, so it only keeps its partner fed.
struct PairedRasterWork {
    RasterWork pairs;     // over (tiles_m + 1) / 2 pair rows; cta/ctas count clusters
    int tiles_n, rank;

    __device__ __forceinline__ bool get(int i, Tile& tile) const {
        if (!pairs.get(i, tile)) return false;
        tile.m = 2 * tile.m + rank;
        tile.index = tile.m * tiles_n + tile.n;
        return true;
    }
    __device__ __forceinline__ bool wait(const Tile&) const { return true; }
};

// Explicit per-CTA lists: CTA `cta` computes tiles[offsets[cta] .. offsets[cta + 1]),
// each a tile index m * tiles_n + n (a planner's output, uploaded once).
struct ListWork {
    const int* tiles;
    const int* offsets;
    int tiles_n, cta;

    __device__ __forceinline__ bool get(int i, Tile& tile) const {
        const int position = offsets[cta] + i;
        if (position >= offsets[cta + 1]) return false;
        const int index = tiles[position];
        tile.m = index / tiles_n;
        tile.n = index - tile.m * tiles_n;
        tile.index = index;
        return true;
    }
    __device__ __forceinline__ bool wait(const Tile&) const { return true; }
};

// ---- consumers and their accumulators ------------------------------------------------

// Who a consumer thread is, for epilogues.
template <int CONSUMERS>
struct ConsumerThread {
    int warpgroup;   // 0 .. CONSUMERS-1: which slice of the tile (64 rows; 128 in 256-row tiles)
    int thread;      // 0 .. 128*CONSUMERS-1 among all consumer threads
    char* smem;      // the epilogue's staging area (Config::EPILOGUE_BYTES, 1024-aligned)
    static constexpr int COUNT = 128 * CONSUMERS;
    // All consumer threads of the CTA (named barrier 1; the producer does not take part).
    __device__ __forceinline__ void sync() const {
        asm volatile("bar.sync 1, %0;" :: "n"(COUNT) : "memory");
    }
    // The 128 threads of this consumer warpgroup (named barriers 2, 3).
    __device__ __forceinline__ void sync_warpgroup() const {
        asm volatile("bar.sync %0, 128;" :: "r"(2 + warpgroup) : "memory");
    }
    __device__ __forceinline__ bool leader() const { return thread == 0; }
    __device__ __forceinline__ bool warpgroup_leader() const { return (thread & 127) == 0; }
};

// A consumer warpgroup's slice of the tile, fp32 (wgmma's register layout): SUB blocks of
// 64 x BN (SUB = 2 for the 128-row slices of 256-row tiles), block s in d[s * PART ..].
template <int BN, int SUB = 1>
struct Accumulator {
    static constexpr int PART = BN / 2;
    static constexpr int COUNT = SUB * PART;
    float d[COUNT];

    // Block s as the array a 64-row MMA writes.
    __device__ __forceinline__ float (&part(int s))[PART] {
        return *reinterpret_cast<float (*)[PART]>(d + s * PART);
    }

    // g(row, col, i) for each pair of adjacent outputs this thread holds, d[i] and d[i + 1];
    // row and col are relative to the tile (row in 0..BM-1, col even, in 0..BN-1).
    template <int CONSUMERS, class G>
    static __device__ __forceinline__ void each_pair_slot(const ConsumerThread<CONSUMERS>& who, G&& g) {
        const int lane = who.thread & 31;
        const int first = who.warpgroup * SUB * 64 + ((who.thread >> 5) & 3) * 16 + (lane >> 2);
        const int col = 2 * (lane & 3);
        #pragma unroll
        for (int s = 0; s < SUB; ++s) {
            const int row = first + s * 64;
            #pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
                g(row, 8 * j + col, s * PART + 4 * j + 0);
                g(row + 8, 8 * j + col, s * PART + 4 * j + 2);
            }
        }
    }

    // f(row, col, v0, v1) for each pair of adjacent outputs this thread holds.
    template <int CONSUMERS, class F>
    __device__ __forceinline__ void for_each_pair(const ConsumerThread<CONSUMERS>& who, F&& f) const {
        each_pair_slot(who, [&](int row, int col, int i) { f(row, col, d[i], d[i + 1]); });
    }

    // f(row, col, a0, a1, b0, b1) for each pair of adjacent outputs this thread holds in the
    // left half of the tile (col < BN / 2), a, with the pair BN / 2 columns to its right, b:
    // wgmma's layout repeats every 8 columns, so both are this thread's (b is d[i + BN / 4]).
    // A tile whose B rows are a gated MLP's gate rows, then its up rows (moe_experts).
    template <int CONSUMERS, class F>
    __device__ __forceinline__ void for_each_gated_pair(const ConsumerThread<CONSUMERS>& who, F&& f) const {
        static_assert(BN % 16 == 0, "halves of whole 8-column groups");
        const int lane = who.thread & 31;
        const int first = who.warpgroup * SUB * 64 + ((who.thread >> 5) & 3) * 16 + (lane >> 2);
        const int col = 2 * (lane & 3);
        #pragma unroll
        for (int s = 0; s < SUB; ++s) {
            const int row = first + s * 64;
            #pragma unroll
            for (int j = 0; j < BN / 16; ++j) {
                const int i = s * PART + 4 * j, h = BN / 4;
                f(row, 8 * j + col, d[i], d[i + 1], d[i + h], d[i + h + 1]);
                f(row + 8, 8 * j + col, d[i + 2], d[i + 3], d[i + h + 2], d[i + h + 3]);
            }
        }
    }
};

template <class T> struct Pack;
template <> struct Pack<__nv_bfloat16> {
    typedef __nv_bfloat162 Pair;
    __device__ static __forceinline__ Pair pair(float a, float b) { return __floats2bfloat162_rn(a, b); }
    __device__ static __forceinline__ __nv_bfloat16 one(float a) { return __float2bfloat16_rn(a); }
};
template <> struct Pack<__half> {
    typedef __half2 Pair;
    __device__ static __forceinline__ Pair pair(float a, float b) { return __floats2half2_rn(a, b); }
    __device__ static __forceinline__ __half one(float a) { return __float2half_rn(a); }
};

// ---- epilogues -----------------------------------------------------------------------

// Store the tile into a row-major [rows, cols] matrix (leading dimension ld) at `out`,
// which may be local or a peer's memory. Clips partial edge tiles.
// Every epilogue also has finish(who), called once by each consumer thread after its
// last tile (drain asynchronous stores, say), and complete(who): after it returns, this
// thread's writes of the current tile are done (FlagEpilogue calls it before the flag).

// An epilogue whose stores are plain (nothing to drain): finish and complete do nothing.
// (Epilogues may inherit these; aggregate initialisation then starts with {} for the base.)
struct PlainStores {
    template <int CONSUMERS>
    __device__ __forceinline__ void finish(const ConsumerThread<CONSUMERS>&) const {}
    template <int CONSUMERS>
    __device__ __forceinline__ void complete(const ConsumerThread<CONSUMERS>&) const {}
};

template <class T, int BM, int BN>
struct StoreEpilogue {
    T* out;
    int rows, cols, ld;
    bool pairs_aligned;   // ld and out allow 4-byte stores of column pairs

    template <int CONSUMERS>
    __device__ __forceinline__ void finish(const ConsumerThread<CONSUMERS>&) const {}
    template <int CONSUMERS>
    __device__ __forceinline__ void complete(const ConsumerThread<CONSUMERS>&) const {}

    template <class Acc, int CONSUMERS>
    __device__ __forceinline__ void operator()(const Tile& tile, const Acc& acc,
                                               const ConsumerThread<CONSUMERS>& who) const {
        const int row0 = tile.m * BM, col0 = tile.n * BN;
        T* const base = out + (long long)row0 * ld + col0;
        const int rows_left = rows - row0, cols_left = cols - col0;
        if (pairs_aligned && rows_left >= BM && cols_left >= BN) {
            acc.for_each_pair(who, [&](int r, int c, float v0, float v1) {
                *reinterpret_cast<typename Pack<T>::Pair*>(base + (long long)r * ld + c) =
                    Pack<T>::pair(v0, v1);
            });
        } else {
            acc.for_each_pair(who, [&](int r, int c, float v0, float v1) {
                if (r >= rows_left) return;
                T* p = base + (long long)r * ld + c;
                if (pairs_aligned && c + 1 < cols_left) {
                    *reinterpret_cast<typename Pack<T>::Pair*>(p) = Pack<T>::pair(v0, v1);
                } else {
                    if (c < cols_left) p[0] = Pack<T>::one(v0);
                    if (c + 1 < cols_left) p[1] = Pack<T>::one(v1);
                }
            });
        }
    }
};

// Add the tile into a row-major matrix with atomics (for example a peer's reduction
// buffer). bf16x2 / f16x2 vector atomics need 4-byte alignment (pairs_aligned).
template <class T, int BM, int BN>
struct AddEpilogue {
    T* out;
    int rows, cols, ld;
    bool pairs_aligned;

    template <int CONSUMERS>
    __device__ __forceinline__ void finish(const ConsumerThread<CONSUMERS>&) const {}
    template <int CONSUMERS>
    __device__ __forceinline__ void complete(const ConsumerThread<CONSUMERS>&) const {}

    template <class Acc, int CONSUMERS>
    __device__ __forceinline__ void operator()(const Tile& tile, const Acc& acc,
                                               const ConsumerThread<CONSUMERS>& who) const {
        const int row0 = tile.m * BM, col0 = tile.n * BN;
        T* const base = out + (long long)row0 * ld + col0;
        const int rows_left = rows - row0, cols_left = cols - col0;
        acc.for_each_pair(who, [&](int r, int c, float v0, float v1) {
            if (r >= rows_left) return;
            T* p = base + (long long)r * ld + c;
            if (pairs_aligned && c + 1 < cols_left) {
                atomicAdd(reinterpret_cast<typename Pack<T>::Pair*>(p), Pack<T>::pair(v0, v1));
            } else {
                if (c < cols_left) atomicAdd(p, Pack<T>::one(v0));
                if (c + 1 < cols_left) atomicAdd(p + 1, Pack<T>::one(v1));
            }
        });
    }
};

// Run `inner`, then publish the tile: every consumer thread fences its stores (system
// scope: a peer or the host may read them), all consumers meet, and one thread
// release-stores `epoch` into flags[tile.index]. Readers acquire-load the flag with
// mkrt::wait_at_least.
template <class Inner>
struct FlagEpilogue {
    Inner inner;
    u64* flags;
    u64 epoch;

    template <int CONSUMERS>
    __device__ __forceinline__ void finish(const ConsumerThread<CONSUMERS>& who) const { inner.finish(who); }
    template <int CONSUMERS>
    __device__ __forceinline__ void complete(const ConsumerThread<CONSUMERS>& who) const { inner.complete(who); }

    template <class Acc, int CONSUMERS>
    __device__ __forceinline__ void operator()(const Tile& tile, const Acc& acc,
                                               const ConsumerThread<CONSUMERS>& who) const {
        inner(tile, acc, who);
        inner.complete(who);
        __threadfence_system();
        who.sync();
        if (who.leader()) st_release_sys(flags + tile.index, epoch);
    }
};

// Stage the tile in shared memory (128B-swizzled, as TMA reads it) and write it with TMA
// stores: the consumers spend a few shared-memory stores per value instead of many
// narrow global stores, and the copy engine writes full lines in the background while
// the next tile's MMAs run. Each consumer warpgroup stores its own rows (64, or 128 in
// 256-row tiles) as boxes of 64 columns x 64 rows (tma_out: box 64 x 64, 128B swizzle); needs
// Config::EPILOGUE_BYTES = BM * BN * 2 and an output whose rows are 16-byte multiples.
// tma_out may describe a peer's buffer (the map only needs an address the GPU can write).
template <class T, int BM, int BN>
struct TmaStoreEpilogue {
    // BN a multiple of 64 (the boxes); its users assert it where they choose TMA stores (a
    // kernel choosing by `if constexpr` instantiates this type either way)
    const TmaDescriptor* tma_out;
    static constexpr int BOX_BYTES = 64 * 128;        // 64 rows x 64 columns

    template <class Acc, int CONSUMERS>
    __device__ __forceinline__ void operator()(const Tile& tile, const Acc& acc,
                                               const ConsumerThread<CONSUMERS>& who) const {
        store_at(tile.m * BM, tile.n * BN, acc, who);
    }

    // The tile with its first element at (row0, col0) of the map's matrix (a grouped
    // GEMM's tiles start at their group's rows, not at multiples of BM).
    template <class Acc, int CONSUMERS>
    __device__ __forceinline__ void store_at(int row0, int col0, const Acc& acc,
                                             const ConsumerThread<CONSUMERS>& who) const {
        constexpr int ROWS = BM / CONSUMERS;          // this warpgroup's rows (64 or 128)
        constexpr int BLOCK_BYTES = 64 * BN * 2;      // 64 of them: BN / 64 boxes
        char* const slice = who.smem + who.warpgroup * (ROWS / 64) * BLOCK_BYTES;
        // The previous tile's stores must have finished reading the staging area.
        if (who.warpgroup_leader()) tma_store_wait_read<0>();
        who.sync_warpgroup();
        const u32 base = smem_address(slice);
        acc.for_each_pair(who, [&](int r, int c, float v0, float v1) {
            const int row = r & (ROWS - 1);                          // row inside the slice
            const int unit = ((c & 63) >> 3) ^ (row & 7);             // 128B swizzle
            const u32 address = base + (row >> 6) * BLOCK_BYTES + (c >> 6) * BOX_BYTES
                              + (row & 63) * 128 + unit * 16 + (c & 7) * 2;
            const typename Pack<T>::Pair pair = Pack<T>::pair(v0, v1);
            asm volatile("st.shared.b32 [%0], %1;"
                         :: "r"(address), "r"(*reinterpret_cast<const u32*>(&pair)) : "memory");
        });
        fence_proxy_async_shared();
        who.sync_warpgroup();
        if (who.warpgroup_leader()) {
            #pragma unroll
            for (int block = 0; block < ROWS / 64; ++block) {
                #pragma unroll
                for (int box = 0; box < BN / 64; ++box)
                    tma_store_2d(tma_out, slice + block * BLOCK_BYTES + box * BOX_BYTES,
                                 col0 + box * 64, row0 + who.warpgroup * ROWS + block * 64);
            }
            tma_store_commit();
        }
    }

    template <int CONSUMERS>
    __device__ __forceinline__ void finish(const ConsumerThread<CONSUMERS>& who) const {
        if (who.warpgroup_leader()) tma_store_wait<0>();
    }
    // The stores of this tile have landed in global memory (not only left shared memory).
    template <int CONSUMERS>
    __device__ __forceinline__ void complete(const ConsumerThread<CONSUMERS>& who) const {
        if (who.warpgroup_leader()) tma_store_wait<0>();
    }
};

// ---- the engine ----------------------------------------------------------------------

// Shared memory of the pipeline, carved from the kernel's dynamic shared memory.
template <class Cfg>
struct Pipeline {
    char* a;        // STAGES x [BM rows][64 k] (128B swizzle)
    char* b;        // STAGES x [BN rows][64 k] (K-major) or [BN/64 chunks][64 k][64 n]
    char* epilogue; // Config::EPILOGUE_BYTES for the epilogue
    u64* full;      // stage loaded (TMA bytes landed)
    u64* empty;     // stage consumed (one arrival per consumer warp)

    __device__ __forceinline__ explicit Pipeline(char* dynamic_smem) {
        char* base = reinterpret_cast<char*>(
            (reinterpret_cast<unsigned long long>(dynamic_smem) + 1023) & ~1023ull);
        a = base;
        b = base + Cfg::STAGES * Cfg::A_STAGE_BYTES;
        epilogue = b + Cfg::STAGES * Cfg::B_STAGE_BYTES;
        full = reinterpret_cast<u64*>(epilogue + Cfg::EPILOGUE_BYTES);
        empty = full + Cfg::STAGES;
    }
    __device__ __forceinline__ char* a_stage(int s) const { return a + s * Cfg::A_STAGE_BYTES; }
    __device__ __forceinline__ char* b_stage(int s) const { return b + s * Cfg::B_STAGE_BYTES; }
};

// Producer: one thread walks the work list and keeps the stages filled.
template <class Cfg, class Work>
__device__ __forceinline__ void produce(const Pipeline<Cfg>& pipe, const TmaDescriptor* tma_a,
                                        const TmaDescriptor* tma_b, int k_blocks,
                                        const Work& work, const TmaDescriptor* tma_a2,
                                        const TmaDescriptor* tma_b2) {
    int stage = 0;
    u32 phase = 0;
    Tile tile;
    for (int i = 0; work.get(i, tile); ++i) {
        const bool ready = work.wait(tile);
        const int kb_last = tile.k_last(k_blocks);
        for (int kb = tile.k_first(); kb < kb_last; ++kb) {
            mbarrier_wait(&pipe.empty[stage], phase ^ 1);
            if (!ready) {
                // The operands never came (a bounded wait gave up): release the stage
                // unloaded so the consumers drain; the host raises the timeout.
                mbarrier_arrive(&pipe.full[stage]);
            } else {
                mbarrier_arrive_expect_tx(&pipe.full[stage], Cfg::STAGE_BYTES);
                const int k = kb * Cfg::BK;
                tma_load_2d(pipe.a_stage(stage), tile.a_map ? tma_a2 : tma_a, k, tile.a_first(Cfg::BM),
                            &pipe.full[stage]);
                if (Cfg::CLUSTER_M == 2) {
                    // This CTA's half of the shared B tile, to both CTAs of the pair (the
                    // stage is free in both: every consumer warp of the pair released it).
                    const u32 half = cluster_rank();
                    if (Cfg::B_K_MAJOR) {
                        tma_load_2d_multicast(pipe.b_stage(stage) + half * (Cfg::BN / 2) * Cfg::BK * 2,
                                              tma_b, k, tile.b_first(Cfg::BN) + half * (Cfg::BN / 2),
                                              &pipe.full[stage], 0x3);
                    } else {
                        #pragma unroll
                        for (int chunk = half; chunk < Cfg::BN / 64; chunk += 2)
                            tma_load_2d_multicast(pipe.b_stage(stage) + chunk * 64 * Cfg::BK * 2, tma_b,
                                                  tile.n * Cfg::BN + chunk * 64, k, &pipe.full[stage], 0x3);
                    }
                } else if (Cfg::B_K_MAJOR) {
                    const TmaDescriptor* map_b = tile.b_map ? tma_b2 : tma_b;
                    tma_load_2d(pipe.b_stage(stage), map_b, k, tile.b_first(Cfg::BN), &pipe.full[stage]);
                    // a tile in two halves of BN / 2 rows (the map's box): a gated MLP's gate
                    // and up rows side by side in one tile (moe_experts)
                    if (tile.b_row2 >= 0)
                        tma_load_2d(pipe.b_stage(stage) + (Cfg::BN / 2) * Cfg::BK * 2, map_b, k,
                                    tile.b_row2, &pipe.full[stage]);
                } else {
                    // [K, N] storage: boxes of 64 n x 64 k, one per 64-column chunk.
                    #pragma unroll
                    for (int chunk = 0; chunk < Cfg::BN / 64; ++chunk)
                        tma_load_2d(pipe.b_stage(stage) + chunk * 64 * Cfg::BK * 2, tma_b,
                                    tile.n * Cfg::BN + chunk * 64, k, &pipe.full[stage]);
                }
            }
            if (++stage == Cfg::STAGES) { stage = 0; phase ^= 1; }
        }
    }
}

// A consumer warp is done reading `stage`: tell its producer, and with clusters the
// partner's producer too (whose multicast also writes this CTA's copy of the stage).
template <class Cfg>
__device__ __forceinline__ void release_stage(const Pipeline<Cfg>& pipe, int stage) {
    if (Cfg::CLUSTER_M == 1) {
        mbarrier_arrive(&pipe.empty[stage]);
    } else {
        #pragma unroll
        for (u32 cta = 0; cta < (u32)Cfg::CLUSTER_M; ++cta) mbarrier_arrive_cluster(&pipe.empty[stage], cta);
    }
}

// Consumer warpgroup `group`: the k-loop of one tile into `acc`.
template <class Cfg>
__device__ __forceinline__ void consume_tile(const Pipeline<Cfg>& pipe, int group, int kb_first,
                                             int kb_last, Accumulator<Cfg::BN, Cfg::SUBTILES>& acc,
                                             int& stage, u32& phase) {
    typedef typename Cfg::T T;
    constexpr int TRANSPOSE_B = Cfg::B_K_MAJOR ? 0 : 1;
    // B's leading offset matters only MN-major: the distance between 64-wide N chunks.
    constexpr u32 B_LEADING = Cfg::B_K_MAJOR ? 16 : 64 * Cfg::BK * 2;
    // k16 step inside a 64-wide k-block: 32 bytes along a K-major row; 16 rows of 128
    // bytes in an MN-major tile.
    constexpr u32 B_K_STEP = Cfg::B_K_MAJOR ? 32 : 16 * 128;
    const bool lane_leader = (threadIdx.x & 31) == 0;
    int previous = -1;
    for (int kb = kb_first; kb < kb_last; ++kb) {
        mbarrier_wait(&pipe.full[stage], phase);
        const u32 a_address = smem_address(pipe.a_stage(stage)) + group * Cfg::CONSUMER_ROWS * 128;
        const u32 b_address = smem_address(pipe.b_stage(stage));
        fence_accumulators(acc.d);
        wgmma_fence();
        #pragma unroll
        for (int kk = 0; kk < Cfg::BK / 16; ++kk) {
            if constexpr (Cfg::SUBTILES == 1) {
                const u64 da = smem_descriptor_sw128(a_address + kk * 32, 16, 1024);
                const u64 db = smem_descriptor_sw128(b_address + kk * B_K_STEP, B_LEADING, 1024);
                Mma64<T, Cfg::BN, TRANSPOSE_B>::run(acc.d, da, db, kb != kb_first || kk != 0);
            } else {
                const u64 db = smem_descriptor_sw128(b_address + kk * B_K_STEP, B_LEADING, 1024);
                #pragma unroll
                for (int s = 0; s < Cfg::SUBTILES; ++s) {   // 64-row blocks of the slice
                    const u64 da = smem_descriptor_sw128(a_address + s * 64 * 128 + kk * 32, 16, 1024);
                    Mma64<T, Cfg::BN, TRANSPOSE_B>::run(acc.part(s), da, db, kb != kb_first || kk != 0);
                }
            }
        }
        wgmma_commit();
        fence_accumulators(acc.d);
        // The batch before this one has finished reading its stage: hand it back.
        wgmma_wait<1>();
        if (previous >= 0 && lane_leader) release_stage<Cfg>(pipe, previous);
        previous = stage;
        if (++stage == Cfg::STAGES) { stage = 0; phase ^= 1; }
    }
    wgmma_wait<0>();
    fence_accumulators(acc.d);
    if (previous >= 0 && lane_leader) release_stage<Cfg>(pipe, previous);
}

// The whole engine for one CTA. Every thread of the CTA calls it (Cfg::THREADS of them).
// tma_a: A [M, K] as a 2-D map (inner K, box 64 x BM); tma_b: B [N, K] (inner K, box
// 64 x BN) or B [K, N] (inner N, box 64 x 64); both 128B-swizzled, zero fill. tma_a2: a
// second map of A like tma_a, for tiles whose work item sets a_map (AllGather+GEMM reads
// a rank's own rows from its input there, not from the gathered buffer); tma_b2 the same
// for B and b_map ([N, K] storage, one CTA per tile: two GEMMs in one work list, as in
// moe_experts). A tile with b_row2 >= 0 loads B in two boxes of BN / 2 rows, from b_row
// and b_row2 (the map's box is then BN / 2 rows).
template <class Cfg, class Work, class Epilogue>
__device__ __forceinline__ void run_tiles(const TmaDescriptor* tma_a, const TmaDescriptor* tma_b,
                                          int k, const Work& work, const Epilogue& epilogue,
                                          char* dynamic_smem, const TmaDescriptor* tma_a2 = nullptr,
                                          const TmaDescriptor* tma_b2 = nullptr) {
    const Pipeline<Cfg> pipe(dynamic_smem);
    const int warpgroup = threadIdx.x / 128;
    const int k_blocks = (k + Cfg::BK - 1) / Cfg::BK;
    if (threadIdx.x == 0) {
        for (int s = 0; s < Cfg::STAGES; ++s) {
            mbarrier_init(&pipe.full[s], 1);
            mbarrier_init(&pipe.empty[s], Cfg::CONSUMERS * 4 * Cfg::CLUSTER_M);
        }
        mbarrier_init_fence();
        tma_prefetch_descriptor(tma_a);
        tma_prefetch_descriptor(tma_b);
        if (tma_a2 != nullptr) tma_prefetch_descriptor(tma_a2);
        if (tma_b2 != nullptr) tma_prefetch_descriptor(tma_b2);
    }
    // With clusters, the partner's barriers must be initialised before this CTA's first
    // multicast or remote arrival reaches them.
    if (Cfg::CLUSTER_M > 1) cluster_sync(); else __syncthreads();
    // Launched as a programmatic dependent (KernelLaunch(programmatic=True)), the set-up
    // above overlaps the previous kernel's tail; nothing is loaded or stored before that
    // kernel has finished. Launched plainly, this returns at once.
    grid_dependency_wait();

    if (warpgroup == 0) {
        warpgroup_registers_decrease<Cfg::PRODUCER_REGISTERS>();
        if (threadIdx.x == 0) produce<Cfg>(pipe, tma_a, tma_b, k_blocks, work, tma_a2, tma_b2);
    } else {
        warpgroup_registers_increase<Cfg::CONSUMER_REGISTERS>();
        ConsumerThread<Cfg::CONSUMERS> who;
        who.warpgroup = warpgroup - 1;
        who.thread = threadIdx.x - 128;
        who.smem = pipe.epilogue;
        Accumulator<Cfg::BN, Cfg::SUBTILES> acc;
        int stage = 0;
        u32 phase = 0;
        Tile tile;
        for (int i = 0; work.get(i, tile); ++i) {
            consume_tile<Cfg>(pipe, who.warpgroup, tile.k_first(), tile.k_last(k_blocks), acc,
                              stage, phase);
            epilogue(tile, acc, who);
        }
        epilogue.finish(who);
    }
    // Neither CTA of a cluster leaves while its partner may still multicast into its
    // shared memory or arrive on its barriers.
    if (Cfg::CLUSTER_M > 1) cluster_sync();
}

}  // namespace gemm
}  // namespace mkrt
""", requires=("tma", "wgmma", "base"))
