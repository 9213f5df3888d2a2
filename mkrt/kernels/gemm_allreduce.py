"""GEMM+AllReduce: the row-parallel linear, C = sum over ranks of A_r @ B_r, fused.

Every rank ends with the full C. One persistent kernel per rank; its CTAs take roles:

* **compute** CTAs run the GEMM engine (``mkrt::gemm::run_tiles``). Output tile t is
  *owned* by the rank of the node with local index ``t % G``; the epilogue stores the
  rank's partial tile straight into the owner's slot (peer pointers) and release-stores
  a flag there: the intra-node reduce-scatter happens tile by tile, as tiles are produced.
* **reduce** CTAs of the owner wait for the G partials of each tile it owns and sum them
  in fp32 (source order fixed, so every node computes bit-identical sums).
  - one node: the sum is final; it is written into every node rank's C (intra-node
    all-gather) and each rank's ``final`` flag for the tile is set.
  - several nodes: the node sum goes, through the proxy (``ce`` in emulated worlds,
    ``verbs`` on clusters), to the rank with the same local index on every other node:
    each byte crosses the network once. A second pass adds the nodes' sums in node order
    and all-gathers the final tile inside the node.
* every CTA of a rank finally waits for its share of the rank's own C to be final.

Flags are epochs read and advanced on the device, so calls need no host sync and the op
can be captured in a CUDA graph. Every wait is bounded (mkrt.CommTimeout on timeout).

The roles are queues (mkrt/kernels/device/roles.py): compute CTAs claim output tiles one at
a time, reduce CTAs claim reduce tasks (a group of owned tiles, pass 1 or 2) in a fixed
order, and a CTA changes queue only between tasks. With ``roles="adaptive"`` (the default)
the on-GPU controller moves CTAs between the queues during the launch from what the tasks
count, every CTA joins the reduce queue once the compute queue is empty, and the split it
held is where the next launch starts. ``roles="static"`` keeps the starting split
(``reduce_ctas``, default :func:`mkrt.controller.cost.default_reduce_ctas`, which balances
the reduce role's bytes against the compute role's FLOPs per SM) for the whole launch.
Which CTA computes or reduces a tile never changes its bits: results are bit-identical
between calls and between the two modes. The unfused baseline (cuBLAS, then the library's all-reduce, which is this
same kernel with the compute role copying an existing C_r) lives here too, and the op
falls back to it when the planner predicts fusion loses. Planning (tiles, owners, split,
fused or not, the schedule checker) is in :mod:`mkrt.kernels.gemm_allreduce_plan`.
"""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np

from mkrt import checks
from mkrt.arrays import like_input
from mkrt.checks import MAX_GRID
from mkrt.controller.board import Board
from mkrt.controller.fusion import MeasuredFusion, check_fuse
from mkrt.jit import cuda_source
from mkrt.kernels import gemm as gemm_module
from mkrt.jit.spec import KernelSpec
from mkrt.kernels.gemm_allreduce_plan import (BLOCK_N, Ceilings, FlagLayout, Plan,  # noqa: F401
                                              check_block_n, plan)
from mkrt.kernels.launcher import KernelLaunch, Parameters, struct_size_assert
from mkrt.kernels.op import CONTEXT_PARAMETERS, Op, shared_op
from mkrt.memory import SymmetricBuffer
from mkrt.status import kernel_id

GEMM_ALLREDUCE = cuda_source("gemm_allreduce", r"""
using namespace mkrt;
typedef $CTYPE T;
// MODE_GEMM: compute partials with the engine. MODE_COPY: the partials exist already
// (C_r, row-major): the unfused baseline's all-reduce.
constexpr int MODE_GEMM = 0, MODE_COPY = 1;
constexpr int MODE = $MODE;
// SCATTER: reduce-scatter instead of all-reduce. Rank w keeps rows [w * rows_per_rank,
// (w + 1) * rows_per_rank) of C; a node sum goes only to the node that owns its rows.
constexpr bool SCATTER = $SCATTER;
typedef gemm::Config<T, $BLOCK_M, $BLOCK_N, $STAGES, $B_K_MAJOR, 0> Cfg;
constexpr int BM = Cfg::BM, BN = Cfg::BN, TILE = BM * BN, CHUNKS = TILE / 8;

// Where each flag word of a rank lives (mirrors FlagLayout in Python).
struct Layout {
    int G, nodes, slots, tiles;
    __device__ int arrive(int p) const { return p; }                 // node peer p's launch began
    __device__ int target(int p) const { return G + p; }             // node peer p's C (direct mode)
    __device__ int node_arrive(int n) const { return 2 * G + n; }    // node n's peer launch began
    __device__ int partial(int src, int slot) const { return 2 * G + nodes + src * slots + slot; }
    __device__ int inter(int node, int slot) const { return 2 * G + nodes + (G + node) * slots + slot; }
    __device__ int final_tile(int t) const { return 2 * G + nodes + (G + nodes) * slots + t; }
    __device__ int finished() const { return final_tile(tiles); }
    __device__ int ctas_before() const { return final_tile(tiles) + 1; }
    __device__ int launches() const { return final_tile(tiles) + 2; }
};

struct Args {
    const T* copy_source;       // MODE_COPY: this rank's C_r [m, n]
    T* out;                     // this rank's C [m, n] (row-major, ld = n)
    int m, n, k, group_m;
    int me, node, rank, G, nodes, slots;
    int send_batch;             // owned slots per group (one put per group between nodes)
    int rows_per_rank;          // SCATTER: rows of C each rank keeps (M / world size)
    u64* flags;                 // this rank's flag words
    const u64* peer_flags;      // [G] node peers' flag words
    const u64* peer_partial;    // [G] node peers' partial slots: [G][slots][TILE]
    const u64* peer_result;     // [G] node peers' staged C (processes) or null (direct)
    T* node_sum;                // [slots][TILE] this rank's node sums (several nodes)
    const T* inter_in;          // [nodes][slots][TILE] node sums from other nodes
    const Queue* queue;         // the proxy queue (several nodes)
    int node_sum_region, inter_region, flags_region;
    u64* board;                 // the role board of this call and rank (mkrt/kernels/device/roles.py)
};

__shared__ u64 reduce_wait_ns;  // this CTA's time in the reduce role's waits (thread 0)
// the reduce role's per-CTA state, set up once per launch (reduce_begin)
__shared__ T* targets[32];
__shared__ const u64* wait_flags[32];
__shared__ int wait_ids[32];
$ARGS_CHECKS

// ---- compute role: partial tile -> owner's slot, then its flag ------------------------
struct PartialEpilogue {
    const Args* args;
    Layout L;
    u64 epoch;

    template <int CONSUMERS>
    __device__ __forceinline__ void finish(const gemm::ConsumerThread<CONSUMERS>&) const {}
    template <int CONSUMERS>
    __device__ __forceinline__ void complete(const gemm::ConsumerThread<CONSUMERS>&) const {}

    template <class Acc, int CONSUMERS>
    __device__ __forceinline__ void operator()(const gemm::Tile& tile, const Acc& acc,
                                               const gemm::ConsumerThread<CONSUMERS>& who) const {
        const int owner = tile.index % L.G, slot = tile.index / L.G;
        T* slot_base = (T*)args->peer_partial[owner] + (long long)(args->me * L.slots + slot) * TILE;
        // The slot is one contiguous BM x BN tile: store it as tile (0, 0) of a BM x BN matrix.
        const gemm::StoreEpilogue<T, BM, BN> store{slot_base, BM, BN, BN, true};
        store(gemm::Tile{0, 0, tile.index}, acc, who);
        // Barrier, then one system fence: the leader's release covers the whole tile.
        who.sync();
        if (who.leader()) {
            __threadfence_system();
            st_release_sys((u64*)args->peer_flags[owner] + L.partial(args->me, slot), epoch);
        }
    }
};

// MODE_COPY: a CTA copies C_r's tiles into the owners' slots (the all-reduce alone),
// 16 bytes at a time where rows allow it.
__device__ void copy_partials(const Args& a, const Layout& L, u64 epoch, int cta, int ctas) {
    const int tiles_n = (a.n + BN - 1) / BN;
    const bool aligned = (a.n % 8) == 0;
    for (int t = cta; t < L.tiles; t += ctas) {
        const int row0 = (t / tiles_n) * BM, col0 = (t % tiles_n) * BN;
        const int owner = t % L.G, slot = t / L.G;
        T* dst = (T*)a.peer_partial[owner] + (long long)(a.me * L.slots + slot) * TILE;
        for (int chunk = threadIdx.x; chunk < CHUNKS; chunk += blockDim.x) {
            const int r = row0 + chunk / (BN / 8), c = col0 + (chunk % (BN / 8)) * 8;
            uint4 value = make_uint4(0, 0, 0, 0);
            if (r < a.m) {
                const T* row = a.copy_source + (long long)r * a.n;
                if (aligned && c + 8 <= a.n) {
                    value = *reinterpret_cast<const uint4*>(row + c);
                } else {
                    T* v = reinterpret_cast<T*>(&value);
                    for (int i = 0; i < 8 && c + i < a.n; ++i) v[i] = row[c + i];
                }
            }
            *reinterpret_cast<uint4*>(dst + chunk * 8) = value;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence_system();
            st_release_sys((u64*)a.peer_flags[owner] + L.partial(a.me, slot), epoch);
        }
    }
}

// ---- reduce role ----------------------------------------------------------------------
// UNROLL chunks per thread per step, enough that one step covers a whole tile: all its
// loads are in flight together, so a reduce CTA pays memory latency once per tile
// (with 4 per step it moved about 15 GB/s, latency-bound; H200, 2026-12-02).
constexpr int UNROLL = (CHUNKS + Cfg::THREADS - 1) / Cfg::THREADS;   // one round covers a tile

template <class Source>
__device__ __forceinline__ void sum_chunks(float (&sum)[UNROLL][8], int count, int chunk0,
                                           int stride, Source source) {
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u)
        #pragma unroll
        for (int i = 0; i < 8; ++i) sum[u][i] = 0.f;
    for (int s = 0; s < count; ++s) {
        uint4 raw[UNROLL];
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int chunk = chunk0 + u * stride;
            raw[u] = chunk < CHUNKS ? *reinterpret_cast<const uint4*>(source(s) + chunk * 8)
                                    : make_uint4(0, 0, 0, 0);
        }
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const T* v = reinterpret_cast<const T*>(&raw[u]);
            #pragma unroll
            for (int i = 0; i < 8; ++i) sum[u][i] += float(v[i]);
        }
    }
}

__device__ __forceinline__ uint4 pack_chunk(const float (&sum)[8]) {
    uint4 raw;
    T* v = reinterpret_cast<T*>(&raw);
    #pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = T(sum[i]);
    return raw;
}

// Every thread waits for one flag of a set; the CTA agrees on the outcome.
__device__ bool cta_wait_each(const u64* const* flags, int count, u64 expected, const Context& ctx,
                              int tile, const int* flag_ids, bool through_proxy, const Queue* q) {
    bool ok = true;
    const u64 began = threadIdx.x == 0 ? global_timer_ns() : 0;
    if (threadIdx.x < count) {
        ok = through_proxy ? proxy_wait_at_least(flags[threadIdx.x], expected, ctx, *q, ROLE_REDUCE, tile, flag_ids[threadIdx.x])
                           : wait_at_least(flags[threadIdx.x], expected, ctx, ROLE_REDUCE, tile, flag_ids[threadIdx.x]);
    }
    ok = __syncthreads_and(ok);
    if (threadIdx.x == 0) reduce_wait_ns += global_timer_ns() - began;
    return ok;
}

// Write a final tile (tile-contiguous, in registers chunk by chunk) into C of every node rank.
__device__ void deliver_chunk(const Args& a, T* const* targets, int row0, int col0, int chunk,
                              const uint4& value, bool aligned) {
    const int r = row0 + chunk / (BN / 8), c = col0 + (chunk % (BN / 8)) * 8;
    if (r >= a.m) return;
    int first = 0, last = a.G;
    long long target_row = r;
    if constexpr (SCATTER) {
        // Only the row's owner (a rank of this node) gets it, as a row of its shard.
        const int owner = r / a.rows_per_rank;
        first = owner - a.node * a.G;
        last = first + 1;
        target_row = r - (long long)owner * a.rows_per_rank;
    }
    for (int p = first; p < last; ++p) {
        T* row = targets[p] + target_row * a.n;
        if (aligned && c + 8 <= a.n) {
            *reinterpret_cast<uint4*>(row + c) = value;
        } else {
            const T* v = reinterpret_cast<const T*>(&value);
            for (int i = 0; i < 8 && c + i < a.n; ++i) row[c + i] = v[i];
        }
    }
}

// The CTA's writes of tile t are done: one thread fences (system scope, after the
// barrier) and tells every node rank.
__device__ void publish_final(const Args& a, const Layout& L, int t, u64 epoch) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        for (int p = 0; p < a.G; ++p) st_release_sys((u64*)a.peer_flags[p] + L.final_tile(t), epoch);
    }
}

// SCATTER: the node that keeps the rows of the tile in owned slot `slot` of this rank
// (the host makes node shards whole tile rows when nodes > 1).
__device__ __forceinline__ int owner_node(const Args& a, const Layout& L, int slot, int tiles_n) {
    const int t = slot * L.G + a.me;
    return ((t / tiles_n) * BM) / (a.rows_per_rank * a.G);
}

// Owned slots [run, end) of a group [run, last) that go to one node as one put: the whole
// group (all-reduce), or the slots kept by one node (SCATTER; tile rows grow with the
// slot, so a node's slots are consecutive). Passes 1 and 2 split groups alike.
__device__ __forceinline__ int run_end(const Args& a, const Layout& L, int run, int last,
                                       int tiles_n) {
    if constexpr (!SCATTER) return last;
    const int keeper = owner_node(a, L, run, tiles_n);
    int end = run + 1;
    while (end < last && owner_node(a, L, end, tiles_n) == keeper) ++end;
    return end;
}

// Owned slots go in groups of `send_batch` consecutive slots; each group is one task of
// the communication queue (pass 1), and with several nodes one more (pass 2). A group's
// node sums leave as one put.
__device__ __forceinline__ int reduce_groups(const Args& a, const Layout& L) {
    const int owned = (L.tiles - a.me + L.G - 1) / L.G;
    return (owned + a.send_batch - 1) / a.send_batch;
}
__device__ __forceinline__ int reduce_tasks(const Args& a, const Layout& L) {
    return reduce_groups(a, L) * (a.nodes > 1 ? 2 : 1);
}

// Once per CTA and launch, before its first reduce task: where final tiles go, and (several
// nodes) every node's arrival.
__device__ bool reduce_begin(const Args& a, const Layout& L, u64 epoch, const Context& ctx) {

    // Where final tiles go: each node peer's C once it has arrived (its stream is past
    // the readers of its previous C), or its staged result buffer.
    if (threadIdx.x < a.G) {
        wait_flags[threadIdx.x] = a.flags + L.arrive(threadIdx.x);
        wait_ids[threadIdx.x] = L.arrive(threadIdx.x);
    }
    __syncthreads();
    if (!cta_wait_each(wait_flags, a.G, epoch, ctx, -1, wait_ids, false, nullptr)) return false;
    if (threadIdx.x < a.G) {
        targets[threadIdx.x] = a.peer_result ? (T*)a.peer_result[threadIdx.x]
                                             : (T*)ld_relaxed_sys(a.flags + L.target(threadIdx.x));
    }
    __syncthreads();

    if (a.nodes > 1) {
        // node_sum is what last epoch's puts read. Every other node begins this epoch only
        // after it has read them (its previous launch waited for our data), so wait for
        // every node's arrival before overwriting node_sum.
        if (threadIdx.x < a.nodes) {
            wait_flags[threadIdx.x] = a.flags + L.node_arrive(threadIdx.x);
            wait_ids[threadIdx.x] = L.node_arrive(threadIdx.x);
        }
        __syncthreads();
        if (!cta_wait_each(wait_flags, a.nodes, threadIdx.x == a.node ? 0 : epoch, ctx, -1,
                           wait_ids, true, a.queue)) return false;
    }
    return true;
}


// Reduce task `task` of the queue: pass 1 of group `task` (node sums: final with one node,
// else sent to the other nodes), or pass 2 of group `task - groups` (the nodes' sums added
// in node order). False: a wait gave up.
__device__ __forceinline__ bool reduce_task_inline(const Args& a, const Layout& L, u64 epoch, const Context& ctx, int task) {
    const int tiles_n = (a.n + BN - 1) / BN;
    const bool aligned = (a.n % 8) == 0;
    const int groups = reduce_groups(a, L);
    const int owned = (L.tiles - a.me + L.G - 1) / L.G;
    const int batch = a.send_batch;
    if (task < groups) {
        const T* my_partials = (const T*)a.peer_partial[a.me];
        const int first = task * batch;
        const int last = min(first + batch, owned);
        for (int slot = first; slot < last; ++slot) {
            const int t = slot * L.G + a.me;
            if (threadIdx.x < a.G) {
                wait_flags[threadIdx.x] = a.flags + L.partial(threadIdx.x, slot);
                wait_ids[threadIdx.x] = L.partial(threadIdx.x, slot);
            }
            __syncthreads();
            if (!cta_wait_each(wait_flags, a.G, epoch, ctx, t, wait_ids, false, nullptr)) return false;
            const int row0 = (t / tiles_n) * BM, col0 = (t % tiles_n) * BN;
            const int stride = blockDim.x;
            for (int chunk0 = threadIdx.x; chunk0 < CHUNKS; chunk0 += stride * UNROLL) {
                float sum[UNROLL][8];
                sum_chunks(sum, a.G, chunk0, stride, [&](int src) {
                    return my_partials + (long long)(src * L.slots + slot) * TILE; });
                #pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const int chunk = chunk0 + u * stride;
                    if (chunk >= CHUNKS) break;
                    const uint4 packed = pack_chunk(sum[u]);
                    if (a.nodes == 1) deliver_chunk(a, targets, row0, col0, chunk, packed, aligned);
                    else *reinterpret_cast<uint4*>(a.node_sum + (long long)slot * TILE + chunk * 8) = packed;
                }
            }
            if (a.nodes == 1) publish_final(a, L, t, epoch);
        }
        if (a.nodes == 1) return true;
        // Several nodes: the group's node sums go, as one put, to the same local rank of
        // every other node, once that node's launch has begun (its inter buffer is free);
        // the flag of the group's first slot says the whole group arrived.
        __syncthreads();
        // Our own node's entry of each run says its node sums are written: pass 2 of this
        // group may run on another CTA of this rank (the queue hands tasks to any CTA).
        if (threadIdx.x == 0) {
            __threadfence();
            for (int run = first; run < last; run = run_end(a, L, run, last, tiles_n))
                st_release_gpu(a.flags + L.inter(a.node, run), epoch);
        }
        // (The two send loops stay apart: merged into one, the fused all-reduce kernel
        // spills registers.) The CTA waits while thread 0 sends (other nodes' arrival, room
        // in the proxy's queue): the controller counts that time as waiting.
        const u64 send_began = threadIdx.x == 0 ? global_timer_ns() : 0;
        if (SCATTER && threadIdx.x == 0) {
            // Only the node that keeps a tile's rows gets its node sum: one put per run.
            __threadfence_system();
            const u64 tile_bytes = (u64)TILE * sizeof(T);
            for (int run = first; run < last;) {
                const int dest = owner_node(a, L, run, tiles_n);
                const int end = run_end(a, L, run, last, tiles_n);
                if (dest != a.node) {
                    if (!proxy_wait_at_least(a.flags + L.node_arrive(dest), epoch, ctx, *a.queue,
                                             ROLE_INTER, run * L.G + a.me, L.node_arrive(dest))) {
                        wait_ids[0] = -1; break;
                    }
                    const u64 ticket = post_put_signal(*a.queue, ctx, (unsigned)(dest * a.G + a.me),
                        (unsigned)a.inter_region, (u64)(a.node * L.slots + run) * tile_bytes,
                        (unsigned)a.node_sum_region, (u64)run * tile_bytes, (u64)(end - run) * tile_bytes,
                        (unsigned)a.flags_region, (u64)L.inter(a.node, run) * 8, epoch,
                        ROLE_INTER, run * L.G + a.me);
                    if (ticket == POST_FAILED) { wait_ids[0] = -1; break; }
                }
                run = end;
            }
        } else if (threadIdx.x == 0) {
            __threadfence_system();
            const u64 tile_bytes = (u64)TILE * sizeof(T);
            for (int step = 1; step < a.nodes; ++step) {
                const int node = (a.node + step) % a.nodes;
                if (!proxy_wait_at_least(a.flags + L.node_arrive(node), epoch, ctx, *a.queue,
                                         ROLE_INTER, first * L.G + a.me, L.node_arrive(node))) {
                    wait_ids[0] = -1; break;
                }
                const u64 ticket = post_put_signal(*a.queue, ctx, (unsigned)(node * a.G + a.me),
                    (unsigned)a.inter_region, (u64)(a.node * L.slots + first) * tile_bytes,
                    (unsigned)a.node_sum_region, (u64)first * tile_bytes, (u64)(last - first) * tile_bytes,
                    (unsigned)a.flags_region, (u64)L.inter(a.node, first) * 8, epoch,
                    ROLE_INTER, first * L.G + a.me);
                if (ticket == POST_FAILED) { wait_ids[0] = -1; break; }
            }
        }
        if (threadIdx.x == 0) reduce_wait_ns += global_timer_ns() - send_began;
        __syncthreads();
        const bool failed = wait_ids[0] == -1;
        // every thread has read the word before thread 0 writes the next wait's ids
        __syncthreads();
        return !failed;
    }
    // Pass 2: add the nodes' sums in node order (the same bits on every node), deliver
    // inside the node.
    const int first = (task - groups) * batch;
    const int last = min(first + batch, owned);
    // The runs pass 1 sent (all-reduce: the whole group); SCATTER: only the runs this
    // node keeps are summed here.
    for (int run = first, end; run < last; run = end) {
        end = run_end(a, L, run, last, tiles_n);
        if (SCATTER && owner_node(a, L, run, tiles_n) != a.node) continue;
        if (threadIdx.x < a.nodes) {
            wait_flags[threadIdx.x] = a.flags + L.inter(threadIdx.x, run);
            wait_ids[threadIdx.x] = L.inter(threadIdx.x, run);
        }
        __syncthreads();
        // every node's sums of the run, our own included (pass 1 of the group, maybe on
        // another CTA, set our entry)
        if (!cta_wait_each(wait_flags, a.nodes, epoch, ctx, run * L.G + a.me, wait_ids, true,
                           a.queue)) return false;
        for (int slot = run; slot < end; ++slot) {
            const int t = slot * L.G + a.me;
            const int row0 = (t / tiles_n) * BM, col0 = (t % tiles_n) * BN;
            const int stride = blockDim.x;
            for (int chunk0 = threadIdx.x; chunk0 < CHUNKS; chunk0 += stride * UNROLL) {
                float sum[UNROLL][8];
                sum_chunks(sum, a.nodes, chunk0, stride, [&](int node) {
                    return node == a.node ? (const T*)a.node_sum + (long long)slot * TILE
                                          : a.inter_in + (long long)(node * L.slots + slot) * TILE; });
                #pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const int chunk = chunk0 + u * stride;
                    if (chunk >= CHUNKS) break;
                    deliver_chunk(a, targets, row0, col0, chunk, pack_chunk(sum[u]), aligned);
                }
            }
            publish_final(a, L, t, epoch);
        }
    }
    return true;
}

// The fused kernel calls it as a function of its own (its own register allocation: inlined
// after the engine's code it spilled); the copy mode inlines it (as a call it spilled).
__device__ __noinline__ bool reduce_task_call(const Args& a, const Layout& L, u64 epoch,
                                              const Context& ctx, int task) {
    return reduce_task_inline(a, L, epoch, ctx, task);
}
__device__ __forceinline__ bool reduce_task(const Args& a, const Layout& L, u64 epoch,
                                            const Context& ctx, int task) {
    if constexpr (MODE == MODE_GEMM) return reduce_task_call(a, L, epoch, ctx, task);
    else return reduce_task_inline(a, L, epoch, ctx, task);
}

// The tiles this rank waits for: all of C, or (SCATTER) the tile rows its shard touches.
__device__ __forceinline__ void own_tiles(const Args& a, int tiles, int& first, int& count) {
    first = 0;
    count = tiles;
    if constexpr (SCATTER) {
        const int tiles_n = (a.n + BN - 1) / BN;
        const int row0 = a.rank * a.rows_per_rank, row1 = row0 + a.rows_per_rank;
        first = (row0 / BM) * tiles_n;
        count = ((row1 - 1) / BM - row0 / BM + 1) * tiles_n;
    }
}

// Reduce CTA `cta` waits (all its threads at once) until its share of this rank's own
// tiles, i = cta (mod ctas), is final.
__device__ bool wait_own_result(const Args& a, const Layout& L, u64 epoch, const Context& ctx,
                                int cta, int ctas) {
    bool ok = true;
    int first, count;
    own_tiles(a, L.tiles, first, count);
    const u64 began = threadIdx.x == 0 ? global_timer_ns() : 0;
    for (int i = cta + ctas * threadIdx.x; i < count && ok; i += ctas * blockDim.x) {
        const int t = first + i;
        ok = wait_at_least(a.flags + L.final_tile(t), epoch, ctx, ROLE_REDUCE, t, L.final_tile(t));
    }
    ok = __syncthreads_and(ok);
    if (threadIdx.x == 0) reduce_wait_ns += global_timer_ns() - began;
    return ok;
}

extern "C" __global__ void __launch_bounds__(Cfg::THREADS, 1)
gemm_allreduce(const __grid_constant__ TmaDescriptor tma_a,
               const __grid_constant__ TmaDescriptor tma_b,
               const __grid_constant__ Args args, int muted_rank,
               u64* status, u64* host_flag, int slot, int rank, u64 timeout_ns) {
    extern __shared__ char dynamic_smem[];
    const Context ctx{status, host_flag, slot, rank, timeout_ns, $KERNEL_ID};
    const Args& a = args;
    const int tiles_m = (a.m + BM - 1) / BM, tiles_n = (a.n + BN - 1) / BN;
    const Layout L{a.G, a.nodes, a.slots, tiles_m * tiles_n};
    // The two queues: compute = the output tiles (partials to their owners), communication
    // = this rank's reduce tasks (roles.py: CTAs draw from them and change queue between
    // tasks; the copy mode's board is static).
    const roles::Board board{a.board, (int)gridDim.x, L.tiles, reduce_tasks(a, L), reduce_groups(a, L)};

    __shared__ u64 epoch_shared, base_shared;
    __shared__ int role_shared;
    __shared__ roles::Ring ring;
    if (threadIdx.x == 0) {
        epoch_shared = ld_acquire_gpu(a.flags + L.launches()) + 1;
        base_shared = ld_acquire_gpu(a.flags + L.ctas_before());
        roles::begin_launch(board);
        role_shared = roles::first_role(board);
        reduce_wait_ns = 0;
    }
    __syncthreads();
    const u64 epoch = epoch_shared;
    const u64 all_ctas = base_shared + gridDim.x;
    int role = role_shared;

    // Arrive: node peers may now write this launch's results into our C; other nodes
    // may send into our inter buffer (our previous launch has finished reading it).
    if (blockIdx.x == 0 && threadIdx.x < a.G && rank != muted_rank) {
        u64* peer = (u64*)a.peer_flags[threadIdx.x];
        const u64 where = a.peer_result ? 0ull : (u64)a.out;
        st_relaxed_sys(peer + L.target(a.me), where);
        st_release_sys(peer + L.arrive(a.me), epoch);
    }
    // From CTA 0 (its second warp), like the arrival above: the one CTA sure to run, so a
    // grid not all resident at once (a GPU shared with other work, a sanitizer) still
    // tells the other nodes; any CTA can take any task on the role board.
    if (a.nodes > 1 && blockIdx.x == 0 && threadIdx.x == 32 && rank != muted_rank) {
        for (int step = 1; step < a.nodes; ++step) {
            const int node = (a.node + step) % a.nodes;
            if (post_signal(*a.queue, ctx, (unsigned)(node * a.G + a.me), (unsigned)a.flags_region,
                            (u64)L.node_arrive(a.node) * 8, epoch) == POST_FAILED) break;
        }
    }

    // Roles: compute until this CTA leaves the compute queue (empty, or the controller
    // moved it), then reduce tasks until that queue is empty. A CTA enters the compute
    // role at most once per launch: ptxas keeps the engine's register split between
    // warpgroups (setmaxnreg) only in code reached once (a second entry spilled about
    // 1,500 registers per copy); the controller's moves towards compute take effect at
    // the next launch, which starts from the split it learned.
    if (role == roles::COMPUTE) {
        if (rank == muted_rank) {
            role = roles::FINAL;
        } else if constexpr (MODE == MODE_GEMM) {
            roles::ring_init<Cfg::CONSUMERS>(ring);
            const roles::ClaimedWork<gemm::RasterWork> work{
                board, gemm::RasterWork{tiles_m, tiles_n, a.group_m, 0, 1}, &ring};
            const roles::Counted<PartialEpilogue> epilogue{PartialEpilogue{&a, L, epoch}, board};
            gemm::run_tiles<Cfg>(&tma_a, &tma_b, a.k, work, epilogue, dynamic_smem);
            role = roles::after_compute<Cfg>(board, ring);
        } else {
            copy_partials(a, L, epoch, blockIdx.x, (int)gridDim.x - (int)board.w[roles::LEARNED]);
            role = roles::FINAL;
        }
    }
    if (role == roles::COMM) {
        if (!reduce_begin(a, L, epoch, ctx)) return;
        for (int task; (task = roles::next_comm_task(board)) >= 0;) {
            const u64 began = global_timer_ns(), waited = reduce_wait_ns;
            if (!reduce_task(a, L, epoch, ctx, task)) return;
            if (threadIdx.x == 0) roles::comm_task_done(board, began, reduce_wait_ns - waited);
        }
    }

    // Every CTA: its share (i = blockIdx, mod the grid) of this rank's own tiles is final.
    // Leave together: a per-thread read of the abort word could split the CTA at the
    // barriers below.
    __shared__ int stop;
    if (threadIdx.x == 0) stop = aborted(ctx);
    __syncthreads();
    if (stop) return;
    if (!wait_own_result(a, L, epoch, ctx, blockIdx.x, gridDim.x)) return;
    if (a.peer_result) {
        // Staged (processes): copy our result buffer into C once all of it is final.
        // Each CTA waited for its share only: copy that share.
        const T* result = (const T*)a.peer_result[a.me];
        int first, count;
        own_tiles(a, L.tiles, first, count);
        // Rows of C this rank keeps, and where its result buffer starts among them.
        const int keep0 = SCATTER ? a.rank * a.rows_per_rank : 0;
        const int keep1 = SCATTER ? keep0 + a.rows_per_rank : a.m;
        for (int i = blockIdx.x; i < count; i += gridDim.x) {
            const int t = first + i;
            const int row0 = (t / tiles_n) * BM, col0 = (t % tiles_n) * BN;
            for (int e = threadIdx.x; e < TILE; e += blockDim.x) {
                const int r = row0 + e / BN, c = col0 + e % BN;
                if (r >= keep0 && r < keep1 && r < a.m && c < a.n) {
                    const long long at = (long long)(r - keep0) * a.n + c;
                    a.out[at] = result[at];
                }
            }
        }
    }

    // The last CTA out publishes the epoch for the next launch; the board's last CTA
    // resets it (with the split this launch learned).
    __syncthreads();
    if (threadIdx.x == 0) {
        roles::end_launch(board);
        finish_launch(a.flags + L.finished(), a.flags + L.ctas_before(), a.flags + L.launches(),
                      epoch, all_ctas);
    }
}
""", requires=("gemm_tile", "roles", "queue", "sync"), register=False)

KERNEL_ID = kernel_id("gemm_allreduce")
#: how the CTAs' split between compute and reduce is decided (see GemmAllReduce)
ROLE_MODES = ("adaptive", "static", "search")
#: what the reduce role ends with: every rank all of C, or each rank its rows of C
COLLECTIVES = ("allreduce", "reducescatter")
_CTYPES = {"bf16": "__nv_bfloat16", "f16": "__half"}

# Kernel argument struct, defined once here; the template asserts the C layout matches.
ARGS_DTYPE = np.dtype([
    ("copy_source", "<u8"), ("out", "<u8"),
    ("m", "<i4"), ("n", "<i4"), ("k", "<i4"), ("group_m", "<i4"),
    ("me", "<i4"), ("node", "<i4"), ("rank", "<i4"), ("G", "<i4"), ("nodes", "<i4"),
    ("slots", "<i4"), ("send_batch", "<i4"), ("rows_per_rank", "<i4"),
    ("flags", "<u8"), ("peer_flags", "<u8"), ("peer_partial", "<u8"), ("peer_result", "<u8"),
    ("node_sum", "<u8"), ("inter_in", "<u8"), ("queue", "<u8"),
    ("node_sum_region", "<i4"), ("inter_region", "<i4"), ("flags_region", "<i4"),
    ("board", "<u8"),
], align=True)

def args_layout_checks() -> str:
    """A static_assert tying the C struct Args to ARGS_DTYPE."""
    return struct_size_assert("Args", ARGS_DTYPE)



@dataclasses.dataclass(frozen=True)
class GemmAllReduceSpec(gemm_module.OnEngine, KernelSpec):
    family = "gemm_allreduce"
    entry_points = ("gemm_allreduce",)

    dtype: str = "bf16"
    b_layout: str = "kn"
    block_m: int = dataclasses.field(default=128, metadata={"short": "bm"})
    block_n: int = dataclasses.field(default=256, metadata={"short": "bn"})
    stages: int = dataclasses.field(default=4, metadata={"short": "s"})
    mode: str = "gemm"          # "gemm": fused; "copy": the all-reduce alone (baseline)
    collective: str = "allreduce"   # or "reducescatter": each rank keeps its rows only

    def __post_init__(self):
        super().__post_init__()
        self.engine        # the engine's own checks (dtype, layout, tile, shared memory)
        if self.mode not in ("gemm", "copy"):
            raise ValueError(f"mkrt.gemm_allreduce: mode={self.mode!r}; expected 'gemm' or 'copy'")
        if self.collective not in COLLECTIVES:
            raise ValueError(f"mkrt.gemm_allreduce: collective={self.collective!r}; expected one "
                             f"of {COLLECTIVES}")

    @property
    def smem_bytes(self) -> int:
        return self.engine.smem_bytes if self.mode == "gemm" else 0

    def template(self):
        return GEMM_ALLREDUCE

    def params(self):
        return {"CTYPE": _CTYPES[self.dtype], "BLOCK_M": self.block_m, "BLOCK_N": self.block_n,
                "STAGES": self.stages, "B_K_MAJOR": self.b_layout == "nk",
                "MODE": 0 if self.mode == "gemm" else 1, "KERNEL_ID": f"{KERNEL_ID}ull",
                "SCATTER": int(self.collective == "reducescatter"),
                "ARGS_CHECKS": args_layout_checks()}


def spec_for(p: Plan, mode: str = "gemm") -> GemmAllReduceSpec:
    """The kernel that runs plan `p` (``mode="copy"``: the collective alone)."""
    return GemmAllReduceSpec(p.dtype, p.b_layout, p.block_m, p.block_n, p.stages, mode,
                             p.collective)


def default_specs() -> list[GemmAllReduceSpec]:
    stages = gemm_module.max_stages(128, 256, "direct")
    return [GemmAllReduceSpec(dtype, layout, 128, 256, stages, mode, collective)
            for dtype in ("bf16", "f16") for layout in ("kn", "nk") for mode in ("gemm", "copy")
            for collective in COLLECTIVES]



# ---- reference ----------------------------------------------------------------------------

def reference(a_per_rank, b_per_rank, *, b_layout: str = "kn", dtype=np.float64):
    """sum_r A_r @ B_r in float64 (or float32): what every rank's C should be."""
    total = None
    for a, b in zip(a_per_rank, b_per_rank):
        part = gemm_module.reference(a, b, b_layout=b_layout, dtype=dtype)
        total = part if total is None else total + part
    return total


# ---- the op -------------------------------------------------------------------------------

class GemmAllReduce(Op):
    """``c = op(a, b)``: every rank gets sum over ranks of a_r @ b_r (row-parallel linear).

    a: per rank [M, K_r] (bf16/f16, row-major; K_r the rank's shard of K, equal on every
    rank); b: [K_r, N] (``b_layout="kn"``) or [N, K_r] (``"nk"``, nn.Linear's weight).
    ``reduce_ctas``: CTAs per rank in the reduce role (default: :func:`default_reduce_ctas`);
    ``ctas``: CTAs per rank in all (default: the rank's SM share); ``fuse``: None or
    ``"measure"`` (the default) times both paths on the first call of each size class (M
    rounded up to a power of two) and keeps the faster (``op.measured.times``;
    mkrt/controller/fusion.py), so that call costs about 15 calls; ``"model"`` lets the
    planner's cost model choose per shape without timing (``op.last_plan`` says which and
    why); True / False force a path.
    ``muted_rank``: a rank that never computes or signals (tests of the bounded waits).
    ``roles``: ``"adaptive"`` (default) lets the on-GPU controller move CTAs between the
    compute and reduce queues during each launch, starting from ``reduce_ctas`` (or the
    default rule) and then from what the last launch learned; ``"static"`` keeps
    ``reduce_ctas`` reduce CTAs for the whole launch (experiments, sweeps); ``"search"``
    runs the adaptive rule for four launches, then finds the split by measuring launch times
    (a hill climb over splits, two launches each; no moves within a launch; it settles after
    about 20 to 30 launches: :class:`mkrt.controller.rule.LaunchSearch`).
    :meth:`controller_state` shows each rank's board; ``trace=True`` records every CTA's
    role changes and every control step (:meth:`role_trace`). ``block_n``: the compute
    tile's width, 256 (default), 192 or 128 (128 rows each; narrower tiles give the reduced
    compute grid more tiles to share); None: the GEMM engine's rule picks it per shape for
    the compute CTAs of the default split (``last_plan.block_n`` says which). Measured
    against every width in the same run (experiments/fused_tile.py): on 1x2 the rule's
    narrower picks were 1.03x the 256 tile in geomean on held-out shapes (0.86 to 1.22), on
    2x2 0.91x, so it is not the default.

    Launches of one op are ordered on each rank's stream (epochs are read and advanced on
    the device): do not run a captured graph of an op concurrently with eager calls of
    the same op, or replays of it on two unordered streams.
    """

    name = "gemm_allreduce"
    collective = "allreduce"

    def __init__(self, world=None, *, b_layout: str = "kn", ctas: int | None = None,
                 reduce_ctas: int | None = None, fuse: bool | None = None, group_m: int = 8,
                 timeout_ms: float | None = None, muted_rank: int | None = None,
                 roles: str = "adaptive", trace: bool = False, block_n: int | None = BLOCK_N):
        super().__init__(world, timeout_ms=timeout_ms)
        if b_layout not in gemm_module.B_LAYOUTS:
            raise ValueError(f"mkrt.gemm_allreduce: b_layout={b_layout!r}; expected 'kn' or 'nk'")
        self.block_n = check_block_n(block_n, self.name)
        area = "gemm_allreduce"
        ctas = checks.integer(ctas, "ctas", area, low=1, high=MAX_GRID, optional=True)
        reduce_ctas = checks.integer(reduce_ctas, "reduce_ctas", area, low=1, high=MAX_GRID,
                                     optional=True)
        fuse = check_fuse(fuse, area)
        group_m = checks.integer(group_m, "group_m", area, low=1, high=1 << 16)
        muted_rank = checks.integer(muted_rank, "muted_rank", area, low=0,
                                    high=self.world.size - 1, optional=True)
        sizes = {len(self.world.node_ranks(n)) for n in range(self.world.nodes)}
        if len(sizes) != 1:
            raise ValueError(f"mkrt.gemm_allreduce: nodes of different sizes ({self.world.layout}) "
                             "are not supported")
        share = min(self.world.sm_count(info.rank) for info in self.world.local
                    if info.device is not None) if any(
                        info.device is not None for info in self.world.local) else None
        if ctas is not None and share is not None and ctas > share:
            # Every CTA of the fused kernel needs a whole SM, and all ranks' CTAs must be
            # resident together: more than the rank's share can wait forever for an SM.
            raise ValueError(f"mkrt.gemm_allreduce: ctas={ctas} exceeds this rank's share of "
                             f"{share} SMs (ranks sharing a GPU split its SMs)")
        self.b_layout, self.ctas, self.reduce_ctas, self.fuse = b_layout, ctas, reduce_ctas, fuse
        self.group_m = group_m
        self.muted_rank = -1 if muted_rank is None else int(muted_rank)
        if not isinstance(roles, str) or roles not in ROLE_MODES:
            raise ValueError(f"mkrt.{self.name}: roles={roles!r}; expected one of {ROLE_MODES}")
        self.roles = roles
        self.trace = checks.flag(trace, "trace", area)
        self.last_plan: Plan | None = None
        self._buffers: dict[str, SymmetricBuffer] = {}
        self._layout_key = None
        self._generation = 0         # counts buffer allocations (a layout can come back)
        self._prepared: dict = {}
        self.measured = MeasuredFusion()   # fuse="measure": the paths' times per size class

    # -- planning and buffers --
    def plan_for(self, m: int, n: int, k: int, dtype: str, mode_fuse=None) -> Plan:
        info = self.world.local[0]
        ranks_per_gpu = len(self.world.ranks_on_device(info.device))
        ctas = self.ctas or self.world.sm_count(info.rank)
        # Nodes on one host talk through the `ce` proxy, not a network (measured about
        # 35 GB/s per rank through one proxy thread with 1 MiB puts, H200 2026-12-02).
        same_host = self.world.emulated or len(set(self.world.hosts)) == 1
        ceilings = Ceilings(network_gbps=35.0) if same_host else Ceilings()
        send_bytes = 1 << 20
        fuse = self.fuse if mode_fuse is None else mode_fuse
        if fuse in ("measure", "model"):
            fuse = None              # the model's pick (until the paths are measured)
        fusable = not (self.b_layout == "kn" and n % 8)
        if fuse and not fusable:
            raise ValueError(f"mkrt.gemm_allreduce: the fused kernel with b_layout='kn' needs "
                             f"n % 8 == 0 (TMA rows of 16 bytes); got n={n}: pass B as [N, K] "
                             "(b_layout='nk') or leave fuse=None for the unfused path")
        p = plan(m, n, k, nodes=self.world.nodes, ranks_per_node=self.world.ranks_per_node,
                 ctas=ctas, dtype=dtype, b_layout=self.b_layout, reduce_ctas=self.reduce_ctas,
                 fuse=fuse if fusable else False,
                 sms_per_gpu=self.world.sm_count(info.rank) * ranks_per_gpu,
                 ranks_per_gpu=ranks_per_gpu, send_bytes=send_bytes, ceilings=ceilings,
                 collective=self.collective, block_n=self.block_n)
        if not fusable and mode_fuse is None and self.fuse in ("model", "measure"):
            p = dataclasses.replace(p, reason="b_layout='kn' with n % 8 != 0: the fused kernel's "
                                              "TMA needs 16-byte rows of B; unfused path")
        return p

    def _ensure_buffers(self, p: Plan) -> None:
        """Symmetric buffers big enough for `p` (re-made, after a sync, when a shape grows)."""
        tile_bytes = p.tile_bytes
        need = {"flags": p.flags.words * 8,
                "partial": p.G * p.slots * tile_bytes,
                "result": 0 if self.world.emulated else p.kept_rows * p.n * 2}
        if p.nodes > 1:
            need["node_sum"] = p.slots * tile_bytes
            need["inter"] = p.nodes * p.slots * tile_bytes
        key = (p.tiles, p.slots, p.kept_rows * p.n)
        if self._layout_key == key:
            return
        if self.capturing():
            # Re-making them synchronizes, and a new layout needs zeroed flags: neither can
            # be recorded into a graph.
            raise ValueError(f"mkrt.{self.name}: this shape ({p.m}x{p.n}x{p.k}) needs the op's "
                             "buffers laid out anew (the last call had another shape), which "
                             "cannot happen during CUDA graph capture: call the op once with "
                             "this shape before capturing it")
        if self._buffers:
            self.world.synchronize()
            self.world.barrier()
        for buffer in self._buffers.values():
            buffer.close()
        self._buffers = {name: SymmetricBuffer(self.world, size, name=f"gemm_allreduce.{name}",
                                               zero=(name == "flags"))
                         for name, size in need.items() if size}
        self._layout_key = key
        self._generation += 1        # prepared launches of older buffers must be re-made
        self._scratch.clear()
        if p.nodes > 1:
            self.world.proxy()     # starts the proxy and registers the buffers

    def _args(self, p: Plan, info, out_ptr: int, copy_source: int = 0) -> np.ndarray:
        """The kernel's Args struct for one rank (a numpy record; its bytes are the argument)."""
        b = self._buffers
        rank = info.rank
        flags_table, partial_table = b["flags"].peer_table(rank), b["partial"].peer_table(rank)
        result_table = b["result"].peer_table(rank) if "result" in b else None
        args = np.zeros((), ARGS_DTYPE)
        args["copy_source"], args["out"] = copy_source, out_ptr
        args["m"], args["n"], args["k"], args["group_m"] = p.m, p.n, p.k, self.group_m
        args["me"], args["node"], args["rank"] = info.local_rank, info.node, rank
        args["G"], args["nodes"], args["slots"] = p.G, p.nodes, p.slots
        args["send_batch"] = p.send_batch
        args["rows_per_rank"] = p.kept_rows
        args["flags"] = b["flags"].local_ptr(rank)
        args["peer_flags"] = flags_table.data.ptr
        args["peer_partial"] = partial_table.data.ptr
        args["peer_result"] = result_table.data.ptr if result_table is not None else 0
        if p.nodes > 1:
            proxy = self.world.proxy()
            args["node_sum"] = b["node_sum"].local_ptr(rank)
            args["inter_in"] = b["inter"].local_ptr(rank)
            args["queue"] = proxy.queue_pointer(rank)
            args["node_sum_region"] = b["node_sum"].region
            args["inter_region"] = b["inter"].region
            args["flags_region"] = b["flags"].region
        return args

    # -- the call --
    def _operands(self, a_list, b_list, outs):
        """Every check of a new signature (the prepared path repeats the per-array ones)."""
        self.per_rank(a_list, "a")
        self.per_rank(b_list, "b")
        self.same_everywhere(a_list, "a")
        self.same_everywhere(b_list, "b")
        m, n, k, dtype = gemm_module.check_operands(a_list[0].shape, b_list[0].shape, a_list[0].dtype,
                                                    b_list[0].dtype, self.b_layout)
        out_shape = self.out_shape(m, n)
        if outs is not None:
            self.per_rank(outs, "out")
            for i, o in enumerate(outs):
                if o.shape != out_shape or o.dtype != a_list[0].dtype:
                    raise ValueError(f"mkrt.{self.name}: out[{i}] is {o.shape} {o.dtype}; "
                                     f"expected {out_shape} {a_list[0].dtype}")
        for name, arrays in (("a", a_list), ("b", b_list), ("out", outs or [])):
            for i, x in enumerate(arrays):
                if x.data.ptr % 16:
                    raise ValueError(f"mkrt.gemm_allreduce: {name}[{i}] starts at {x.data.ptr:#x}, "
                                     "not 16-byte aligned")
        return m, n, k, dtype

    def _prepared_call(self, a_list, b_list, outs, fuse=None) -> "_PreparedCall":
        """The prepared call of this signature: made (with every check) on first sight,
        afterwards only the per-array checks run."""
        key = (a_list[0].shape, a_list[0].dtype, b_list[0].shape, b_list[0].dtype, fuse)
        call = self._prepared.get(key)
        if call is None:
            m, n, k, dtype = self._operands(a_list, b_list, outs)
            p = self.plan_for(m, n, k, dtype, mode_fuse=fuse)
            call = _PreparedCall(p, a_list[0].dtype, a_list[0].shape, b_list[0].shape,
                                 self.out_shape(m, n))
            self._prepared[key] = call
            return call
        self.check_arrays(a_list, "a", call.a_shape, call.dtype, aligned=True)
        self.check_arrays(b_list, "b", call.b_shape, call.dtype, aligned=True)
        if outs is not None:
            self.check_arrays(outs, "out", call.out_shape, call.dtype, aligned=True)
        return call

    def __call__(self, a, b, out=None):
        if self.world.size == 1 and not isinstance(a, (list, tuple)):
            # One rank: the plain GEMM (it checks its operands); nothing to reduce.
            self.before_launch()
            self.last_plan = None
            return gemm_module.gemm(a, b, out=out, b_layout=self.b_layout, sms=self.ctas,
                                    group_m=self.group_m)
        a_list, as_list = self.arrays(a, "a")
        b_list, _ = self.arrays(b, "b")
        outs = self.arrays(out, "out")[0] if out is not None else None
        call = self._prepared_call(a_list, b_list, outs)
        self.before_launch()
        if outs is None:
            outs = self.new_outputs(call.out_shape, call.dtype)
        if self.fuse == "measure" and not call.settled and self.world.size > 1:
            self._settle_fusion(call, a_list, b_list, outs)
        p = self.last_plan = call.plan
        if self.world.size == 1:
            gemm_module.gemm(a_list[0], b_list[0], out=outs[0], b_layout=self.b_layout,
                             sms=self.ctas)
        elif p.fused:
            self._run(call, "gemm", a_list, b_list, outs)
        else:
            self._unfused(call, a_list, b_list, outs, gemm="cublas")
        self.after_launch()
        if out is not None:
            return out
        return outs if as_list else like_input(outs[0], a)

    def _settle_fusion(self, call: "_PreparedCall", a_list, b_list, outs) -> None:
        """``fuse="measure"``: this call's path, timed once per size class."""
        self.measured.settle(self, call, lambda: self._run(call, "gemm", a_list, b_list, outs),
                             lambda: self._unfused(call, a_list, b_list, outs))

    def out_shape(self, m: int, n: int) -> tuple:
        """Each rank's C: all of it (subclasses keep a part)."""
        return (m, n)

    def _launches(self, call: "_PreparedCall", mode: str) -> list:
        """The prepared launches of `call` in `mode` ("gemm": fused; "copy": the all-reduce
        of existing partials), one per local rank, made on first use."""
        launches = call.launches.get(mode)
        if launches is not None and call.buffers_key == self._generation:
            return launches
        p = call.plan
        if mode == "copy":
            # The collective alone: copying and reducing both stream memory; split evenly.
            p = dataclasses.replace(p, reduce_ctas=max(1, p.ctas // 2))
            if not p.whole_node_tiles:
                # Node shards that split a tile: all-reduce into whole partial-size outputs
                # (the caller keeps its rows, see _unfused).
                p = dataclasses.replace(p, collective="allreduce")
        spec = spec_for(p, mode)
        self._ensure_buffers(p)
        if call.buffers_key != self._generation:     # buffers were re-made: re-patch all
            call.launches.clear()      # (boards stay: they point into no buffer, and what
            call.words.clear()         # a shape's board learned outlives a re-allocation)
            call.operand_pointers.clear()
            call.buffers_key = self._generation
        if mode not in call.boards:
            static = mode == "copy" or self.roles == "static"
            search = mode == "gemm" and self.roles == "search"
            call.boards[mode] = [self._new_board(p, device, static, search)
                                 for device in self._local_devices]
        launches = []
        for i, info in enumerate(self.world.local):
            function = spec.function("gemm_allreduce", info.device, spec.smem_bytes)
            params = Parameters(LAUNCH_PARAMETERS)
            args = self._args(p, info, 0)
            args["board"] = call.boards[mode][i].ptr
            params.set(args=args, muted_rank=self.muted_rank, **self.context_params(info.rank))
            launches.append(KernelLaunch(function, p.ctas, spec.threads, spec.smem_bytes, params))
        call.launches[mode] = launches
        call.words[mode] = [(launch.params.field_view("args", "out"),
                             launch.params.field_view("args", "copy_source")) for launch in launches]
        return launches

    def _new_board(self, p: Plan, device: int, static: bool, search: bool = False):
        """A rank's role board for one shape: no launch yet, `p.reduce_ctas` reducing."""
        with self.on_device(device):
            return Board(p.ctas, p.reduce_ctas, static=static, search=search,
                         trace=self.trace and not static)

    def controller_state(self) -> list[dict]:
        """Per prepared shape and local rank, the fused kernel's board (synchronizes): the
        split the next launch starts from (``comm_ctas`` reduce CTAs of ``ctas``), launches
        seen, and the last launch's role changes, control steps and moves."""
        self.world.synchronize()
        out = []
        for call in self._prepared.values():
            for info, board in zip(self.world.local, call.boards.get("gemm", [])):
                out.append(dict(board.state(), rank=info.rank, ctas=call.plan.ctas,
                                shape=(call.plan.m, call.plan.n, call.plan.k),
                                static=self.roles == "static"))
        return out

    def role_trace(self, clear: bool = True) -> list[dict]:
        """Per prepared shape and local rank (``trace=True``): every CTA's role changes
        and the control steps since the last clear, times in ns from the first event
        (synchronizes; ``clear`` empties the buffers after reading)."""
        if not self.trace:
            raise ValueError(f"mkrt.{self.name}: role_trace needs trace=True")
        self.world.synchronize()
        out = []
        for call in self._prepared.values():
            for info, board in zip(self.world.local, call.boards.get("gemm", [])):
                if board.trace is None:
                    continue
                out.append(dict(board.timeline(), rank=info.rank,
                                shape=(call.plan.m, call.plan.n, call.plan.k)))
                if clear:
                    board.clear_trace()
        return out

    def _run(self, call, mode: str, a_list, b_list, outs, copy_sources=None) -> None:
        """Patch what changed since the last call of `call` and launch on every local rank."""
        launches = self._launches(call, mode)
        for i, launch in enumerate(launches):
            params = launch.params
            if mode == "gemm":
                pointers = (a_list[i].data.ptr, b_list[i].data.ptr)
                if call.operand_pointers.get(i) != pointers:
                    tma_a, tma_b = _descriptors(call.plan, a_list[i], b_list[i])
                    ctypes.memmove(params.address("tma_a"), tma_a.address, 128)
                    ctypes.memmove(params.address("tma_b"), tma_b.address, 128)
                    call.operand_pointers[i] = pointers
            else:
                call.words[mode][i][1][()] = copy_sources[i].data.ptr
            call.words[mode][i][0][()] = outs[i].data.ptr
        self.launch(launches)

    def _unfused(self, call, a_list, b_list, outs, *, gemm: str = "cublas",
                 allreduce: str = "auto", gemm_options: dict | None = None) -> None:
        """GEMM (cuBLAS through CuPy, or mkrt's engine with ``gemm_options``, e.g. its
        epilogue), then the all-reduce, not overlapped: NCCL when the world is one process
        per GPU and torch.distributed is initialised (``allreduce="auto"`` or ``"nccl"``),
        else mkrt's own over the same peer pointers and transports (the fused kernel with
        its compute role copying C_r)."""
        import cupy
        if gemm_options and gemm != "mkrt":
            raise ValueError(f"mkrt.gemm_allreduce: gemm_options are mkrt.gemm's; got gemm={gemm!r}")
        if allreduce not in ("auto", "nccl", "mkrt"):
            raise ValueError(f"mkrt.gemm_allreduce: allreduce={allreduce!r}; expected 'auto', "
                             "'nccl' or 'mkrt'")
        use_nccl = _nccl_ready(self.world) if allreduce == "auto" else allreduce == "nccl"
        if use_nccl and not _nccl_ready(self.world):
            raise ValueError("mkrt.gemm_allreduce: allreduce='nccl' needs one process per GPU "
                             "and torch.distributed initialised with the nccl backend")
        full = (call.plan.m, call.plan.n)            # each rank's partial C_r is all of C
        partial_needed = not use_nccl or full != call.out_shape
        kept = self.kept_buffers("partials", full, call.dtype) if partial_needed else None
        partials = []
        for i, (device, a_r, b_r, out) in enumerate(zip(self._local_devices, a_list, b_list, outs)):
            with self.on_device(device):
                target = kept[i] if partial_needed else out
                if gemm == "mkrt":
                    partials.append(gemm_module.gemm(a_r, b_r, out=target, b_layout=self.b_layout,
                                                     **(gemm_options or {})))
                else:
                    b_view = b_r.T if self.b_layout == "nk" else b_r
                    partials.append(cupy.matmul(a_r, b_view, out=target))
        if use_nccl:
            if partial_needed:
                _nccl_reduce_scatter(outs[0], partials[0])
            else:
                _nccl_all_reduce(outs[0])
            return
        # The next call's GEMM overwrites the partials only after this all-reduce has read
        # them: it runs on the caller's stream, which waits for the ranks' launches.
        if call.plan.whole_node_tiles:
            self._run(call, "copy", a_list, b_list, outs, copy_sources=partials)
            return
        # Reduce-scatter whose node shards split a tile: all-reduce into whole-size sums
        # (not in place: a peer may deliver a tile before this rank has copied it out),
        # then each rank keeps its rows (on the caller's stream, after the ranks).
        sums = self.kept_buffers("sums", full, call.dtype)
        self._run(call, "copy", a_list, b_list, sums, copy_sources=partials)
        rows = call.out_shape[0]
        for info, device, full, out in zip(self.world.local, self._local_devices, sums, outs):
            with self.on_device(device):
                out[...] = full[info.rank * rows:(info.rank + 1) * rows]

    def unfused(self, a, b, out=None, *, gemm: str = "cublas", allreduce: str = "auto",
                gemm_options: dict | None = None):
        """The baseline: cuBLAS (or ``gemm="mkrt"``, with ``gemm_options`` for mkrt.gemm)
        then the all-reduce (NCCL or mkrt's, see :meth:`_unfused`), not overlapped."""
        import cupy
        a_list, as_list = self.arrays(a, "a")
        b_list, _ = self.arrays(b, "b")
        outs = self.arrays(out, "out")[0] if out is not None else None
        call = self._prepared_call(a_list, b_list, outs, fuse=False)
        self.before_launch()
        if outs is None:
            outs = self.new_outputs(call.out_shape, call.dtype)
        if self.world.size == 1:
            outs[0][...] = cupy.matmul(a_list[0], b_list[0].T if self.b_layout == "nk" else b_list[0])
        else:
            self._unfused(call, a_list, b_list, outs, gemm=gemm, allreduce=allreduce,
                          gemm_options=gemm_options)
        self.after_launch()
        return out if out is not None else (outs if as_list else outs[0])

    def close(self) -> None:
        for buffer in self._buffers.values():
            buffer.close()
        self._buffers.clear()
        self._layout_key = None


def _nccl_ready(world) -> bool:
    """One process per GPU, and the caller has initialised torch.distributed with NCCL."""
    if world.emulated or len(world.local) != 1:
        return False
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"


def _nccl_all_reduce(out) -> None:
    """Sum `out` (a CuPy array) over the world with NCCL, in CuPy's current stream order."""
    import cupy
    import torch
    import torch.distributed as dist
    stream = torch.cuda.ExternalStream(cupy.cuda.get_current_stream().ptr,
                                       device=torch.device("cuda", out.device.id))
    with torch.cuda.stream(stream):
        dist.all_reduce(torch.from_dlpack(out))


def _nccl_reduce_scatter(out, partial) -> None:
    """This rank's rows of the sum over the world of `partial`, into `out`, with NCCL."""
    import cupy
    import torch
    import torch.distributed as dist
    stream = torch.cuda.ExternalStream(cupy.cuda.get_current_stream().ptr,
                                       device=torch.device("cuda", out.device.id))
    with torch.cuda.stream(stream):
        dist.reduce_scatter_tensor(torch.from_dlpack(out), torch.from_dlpack(partial))


def _descriptors(p: Plan, a, b):
    if p.b_layout == "kn" and p.n % 8:
        raise ValueError(f"mkrt.gemm_allreduce: b_layout='kn' needs n % 8 == 0 (TMA rows of "
                         f"16 bytes); got n={p.n}: pass B as [N, K] (b_layout='nk')")
    return gemm_module.operand_descriptors(spec_for(p).engine, a.data.ptr, b.data.ptr, p.m, p.n, p.k)


#: kernel parameters of gemm_allreduce, in order (tensor maps 64-byte aligned)
LAUNCH_PARAMETERS = [("tma_a", 128, 64), ("tma_b", 128, 64), ("args", ARGS_DTYPE, 8),
                     ("muted_rank", np.int32, 4), *CONTEXT_PARAMETERS]


@dataclasses.dataclass(eq=False)
class _PreparedCall:
    """What a signature (shapes, dtype, options) of GemmAllReduce needs, made once."""

    plan: Plan
    dtype: np.dtype
    a_shape: tuple
    b_shape: tuple
    out_shape: tuple
    launches: dict = dataclasses.field(default_factory=dict)          # mode -> [KernelLaunch]
    words: dict = dataclasses.field(default_factory=dict)   # mode -> per rank (out, copy_source)
    operand_pointers: dict = dataclasses.field(default_factory=dict)  # rank index -> (a, b)
    boards: dict = dataclasses.field(default_factory=dict)    # mode -> per rank: role Board
    buffers_key: int = -1     # the op's buffer generation its launches point into
    settled: bool = False     # fuse="measure": the path is chosen (plan.fused)


def gemm_allreduce(a, b, *, world=None, out=None, b_layout: str = "kn", **options):
    """C = sum over ranks of a_r @ b_r on every rank; see :class:`GemmAllReduce`. Keeps one
    op per (world, options); an op that failed is replaced on the next call."""
    return shared_op(GemmAllReduce, world, b_layout=b_layout, **options)(a, b, out=out)


def test_cases():
    """(layout, m, n, k per rank, b_layout, dtype) the GPU tests run."""
    return [("1x2", 512, 768, 256, "kn", "bf16"), ("1x2", 300, 520, 64, "nk", "bf16"),
            ("1x4", 1024, 1024, 128, "kn", "bf16"), ("2x1", 384, 512, 136, "nk", "f16"),
            ("2x2", 640, 1000, 64, "nk", "bf16"), ("2x4", 1024, 512, 64, "kn", "bf16"),
            ("1x1", 257, 264, 72, "kn", "bf16")]


def bench_cases():
    """(m, n, k per rank) of the reference's sweep (K = M/16) and LLM row-parallel shapes."""
    sweep = [(s, s, s // 16) for s in (2048, 4096, 8192, 16384)]
    llm = [(4096, 8192, 28672 // 8), (8192, 8192, 28672 // 8), (16384, 8192, 28672 // 8)]
    return sweep + llm
