"""Tiles of a grouped GEMM (one GEMM per group of rows: MoE's experts), shared by
``mkrt.grouped_gemm`` and the MoE experts kernel.

Group g's rows are offsets[g] .. offsets[g + 1] of the A matrix; its m-tiles start at its
first row (not at a multiple of BM), so the engine loads A from ``a_row`` and the store
clips at the group's end. ``scan_units`` sums the m-tiles (pairs of them with clusters of
two) per group into ``tile_prefix`` in shared memory, once per CTA, from offsets that may
have been written on the device by an earlier kernel; out-of-range offsets are clamped and
empty groups have no tiles.
"""

from mkrt.jit.render import cuda_source

GROUPED_TILES = cuda_source("grouped_tiles", r"""
namespace mkrt {
namespace grouped {

__device__ __forceinline__ int clamp_row(int v, int rows) { return min(max(v, 0), rows); }

// tile_prefix[g]: units (m-tiles of BM rows, or pairs of them with CLUSTER_M = 2) before
// group g; tile_prefix[groups]: all of them. Called by the 32 threads of warp 0: lane l sums
// a run of groups, the runs are scanned across the warp, then each lane writes its run's
// prefixes. The caller syncs before reading.
template <int BM, int CLUSTER_M>
__device__ __forceinline__ void scan_units(const int* offsets, int groups, int rows, int* tile_prefix) {
    const int lane = threadIdx.x, per = (groups + 31) / 32;
    const int g0 = min(groups, lane * per), g1 = min(groups, g0 + per);
    auto units = [&](int g) {
        const int count = clamp_row(offsets[g + 1], rows) - clamp_row(offsets[g], rows);
        const int tiles = count > 0 ? (count + BM - 1) / BM : 0;
        return (tiles + CLUSTER_M - 1) / CLUSTER_M;
    };
    int local = 0;
    for (int g = g0; g < g1; ++g) local += units(g);
    int inclusive = local;
    #pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (lane >= d) inclusive += v;
    }
    int running = inclusive - local;
    for (int g = g0; g < g1; ++g) { tile_prefix[g] = running; running += units(g); }
    if (lane == 31) tile_prefix[groups] = inclusive;
}

// Every group's tiles, group after group; inside a group in raster order by bands of
// group_m m-tiles, column by column inside a band (gemm::RasterWork). group_m = 1 is
// m-tile-major order (n-tiles fastest: each row block of A is read once); a wider band
// makes the CTAs running at once share each weight tile, for weights too large to stay in
// L2 between m-tiles. CTA c takes c, c + ctas, ...
// With clusters of two (Cfg::CLUSTER_M == 2) the units are pairs of m-tiles of one group
// (sharing each weight load, gemm::PairedRasterWork's way): cluster c of ctas clusters
// takes units c, c + ctas, ..., its CTA of rank r m-tile 2p + r of the pair p. A group
// with an odd m-tile count gives its last pair a tile past the group's rows: it loads
// rows of the next group (or zeros), and its stores are all clipped.
// Group g's units are [tile_prefix[g] * tiles_n, tile_prefix[g + 1] * tiles_n).
template <class Cfg>
struct GroupedWork {
    const int* offsets;
    const int* tile_prefix;             // shared memory
    int groups, rows, n, tiles_n, cta, ctas, group_m, rank;

    __device__ __forceinline__ int units() const { return tile_prefix[groups]; }
    __device__ __forceinline__ int tiles() const { return units() * tiles_n; }

    // Tile t of a work list over `columns` n-tiles per unit: its group, m (the virtual
    // m-tile: its place among all groups' m-tiles), n (within the group), index and a_row.
    // The caller sets where B's rows start.
    __device__ __forceinline__ gemm::Tile place(int t, int columns) const {
        // the group holding tile t: tile_prefix[g] <= t / columns < tile_prefix[g + 1]
        const int virtual_m = t / columns;
        int lo = 0, hi = groups;
        while (hi - lo > 1) {
            const int mid = (lo + hi) >> 1;
            if (tile_prefix[mid] <= virtual_m) lo = mid; else hi = mid;
        }
        const gemm::RasterWork raster{tile_prefix[lo + 1] - tile_prefix[lo], columns, group_m, 0, 1};
        const gemm::Tile local = raster.tile_at(t - tile_prefix[lo] * columns);
        const int m_tile = local.m * Cfg::CLUSTER_M + rank;          // within the group
        gemm::Tile tile;
        tile.m = tile_prefix[lo] * Cfg::CLUSTER_M + m_tile;
        tile.n = local.n;
        tile.index = t * Cfg::CLUSTER_M + rank;
        tile.group = lo;
        tile.a_row = clamp_row(offsets[lo], rows) + m_tile * Cfg::BM;
        return tile;
    }
    __device__ __forceinline__ gemm::Tile tile_at(int t) const { return tile_at(t, tiles_n); }
    // tile_at with tiles_n passed in as `columns` (a stream-K work list reads it from
    // shared memory)
    __device__ __forceinline__ gemm::Tile tile_at(int t, int columns) const {
        gemm::Tile tile = place(t, columns);
        tile.b_row = tile.group * n + tile.n * Cfg::BN;
        return tile;
    }
    __device__ __forceinline__ bool get(int i, gemm::Tile& tile) const {
        const int t = cta + i * ctas;
        if (t >= tiles()) return false;
        tile = tile_at(t);
        return true;
    }
    __device__ __forceinline__ bool wait(const gemm::Tile&) const { return true; }
};

}  // namespace grouped
}  // namespace mkrt
""", requires=("gemm_tile",))
