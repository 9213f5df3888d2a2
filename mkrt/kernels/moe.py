"""MoE expert parallelism: routed dispatch, grouped GEMMs, combine, on one node or several.

    y = mkrt.MoE(world, experts=E, capacity=T_max)(x, topk_ids, topk_weights, w1, w2)

Per rank: x [T, H] (bf16), topk_ids [T, k] int32 (global expert ids; rank w holds experts
w*E/W .. (w+1)*E/W - 1), topk_weights [T, k] float32, w1 [E/W, 2I, H] (gate rows then up
rows) and w2 [E/W, H, I]. Every rank gets y [T, H] = sum over its k experts of
weight * w2_e (SiLU(gate) * up), [gate; up] = w1_e x. T may differ between ranks (0 too).

Each call runs five launches per rank on the rank's stream, none waiting for the host
(with ``fused_experts=True``, one: ``moe_fused``, below):

1. ``moe_dispatch`` (a few CTAs): one warp ranks the rank's (token, choice) entries per
   expert in token order and counts them; the counts go to every rank (peer stores inside
   the node, proxy puts to the other nodes); rows land at their expert's holder
   expert-major, inside an expert by (source rank, token): the order
   mkrt/kernels/moe_plan.py plans. A row for an expert on the rank's own node is copied
   there directly. On worlds of several nodes a token goes **once to each other node**
   that holds one of its experts: the rank packs those tokens' rows per node (token
   order) and puts them, with its routes (each entry's expert and place), to the rank of
   that node with its own local index, which places each row at the holders of its node
   that need it. The launch ends once every node peer's rows (its own and those it
   forwarded) are in.
2. ``mkrt.grouped_gemm`` of the received rows with w1 (group offsets from step 1, on the
   device), 3. SwiGLU, 4. ``mkrt.grouped_gemm`` with w2 (or, with ``fused_experts=True``,
   steps 2-4 as one launch of mkrt/kernels/moe_experts.py),
5. ``moe_combine``: each result row of a source on the node goes back to its slot
   (token, choice). For the rows that crossed, the forwarding rank reads the node's
   results where they were computed and sums each token's rows weighted, in fp32 and
   choice order, after the source's weights arrived; one fp32 sum per (token, node) goes
   back. The source then adds, node by node in order, its own node's rows weighted and
   each other node's sum, in fp32, rounded once: bit-identical between calls.

``moe_fused`` is the same call in one launch: its first CTAs (``fused_route_ctas``) run
the dispatch's code, wait until this rank's experts are done, then run the combine's;
the other CTAs wait until every node peer's rows are in, then run both expert GEMMs on the
engine (mkrt/kernels/moe_experts.py: SwiGLU in the w1 GEMM's epilogue; each w2 tile starts
once its rows' SwiGLU is in) and count themselves done. The launch keeps the dispatch's and
the combine's epochs as if they had run alone, so ``dispatch()`` / ``combine()`` mix with
it on one op.

Buffers live in symmetric memory sized by ``capacity`` (tokens per rank) and
``receive_rows`` (rows a rank may receive; default 2 x capacity x 8, the average load of
top-8 routing twice over): a call whose routing sends a rank more rows fails on the device
with a CommTimeout record naming the overflow (flag -5), before any row is written past
the end. Worlds of several nodes add, per rank, N sections of capacity rows each way
(bf16 rows out and in, fp32 sums out and in: 12 x N x capacity x H bytes) and the routes.
Every wait is bounded; flags are epochs (graph-capturable for a fixed routing capacity).
mkrt/kernels/moe_plan.py's ``schedule`` is this protocol as tasks and waits (CPU tests:
no wait cycle, no buffer reused before its reader is done); ``landing`` and
``forwarding`` below mirror the kernels' index arithmetic.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mkrt import checks
from mkrt.arrays import bfloat16, dtype_name, like_input
from mkrt.jit import cuda_source
from mkrt.jit.spec import KernelSpec
from mkrt.kernels import gemm as gemm_module
from mkrt.kernels import grouped_gemm as grouped_module
from mkrt.kernels import moe_experts as experts_module
from mkrt.kernels.device import gather  # noqa: F401  (register the pieces)
from mkrt.kernels.launcher import KernelLaunch, Parameters, struct_size_assert
from mkrt.kernels.op import CONTEXT_PARAMETERS, Op, shared_op
from mkrt.memory import SymmetricBuffer, flags as flag_buffer
from mkrt.status import kernel_id

MAX_EXPERTS = 1024
MAX_RANKS = 256
MAX_NODES = 32          # a token's nodes are bits of a 32-bit mask

MOE = cuda_source("moe", r"""
using namespace mkrt;
typedef __nv_bfloat16 T;
constexpr int MAX_EXPERTS = $MAX_EXPERTS;
constexpr int MAX_NODES = $MAX_NODES;
constexpr int BAD_EXPERT = -4, OVER_CAPACITY = -5;      // mkrt.errors.SPECIAL_FLAGS

// A rank's flag words (mirror: MoeFlags in Python). W ranks, N nodes; s a world rank,
// n a node. Node peers set theirs by stores, ranks of other nodes through the proxy.
struct Flags {
    int W, N;
    __device__ int arrive(int s) const { return s; }               // rank s's call began
    __device__ int counts_ready(int s) const { return W + s; }     // rank s's counts are here
    __device__ int rows_ready(int s) const { return 2 * W + s; }   // node peer s's rows (own and forwarded) are here
    __device__ int back_ready(int s) const { return 3 * W + s; }   // node peer s sent our rows back
    __device__ int results_ready(int s) const { return 4 * W + s; } // node peer s's expert results may be read
    __device__ int landed(int n) const { return 5 * W + n; }       // rows and routes of rank (n, local) are in
    __device__ int weights_landed(int n) const { return 5 * W + N + n; }  // its weights are in
    __device__ int partial_landed(int n) const { return 5 * W + 2 * N + n; }  // node n's partial sums are in
    __device__ int slots_ready() const { return 5 * W + 3 * N; }   // CTA 0 wrote this launch's slots and routes
    __device__ int packed() const { return slots_ready() + 1; }    // CTA counters
    __device__ int dispatched() const { return slots_ready() + 2; }
    __device__ int combined() const { return slots_ready() + 3; }
    __device__ int summed(int n) const { return slots_ready() + 4 + n; }
    __device__ int launch_words(int kernel) const { return slots_ready() + 4 + N + 3 * kernel; }  // finished, ctas_before, launches
};

struct Args {
    const T* x;                 // [tokens, H]
    const int* ids;             // [tokens, k]
    const float* weights;       // [tokens, k]
    T* y;                       // [tokens, H]
    int* entry_rank;            // [capacity * k]: an entry's place among this rank's entries of its expert
    int* offsets;               // [experts_per_rank + 1]: this rank's received rows per local expert
    int* pack_slot;             // [N][capacity]: a token's row in the rows sent to node m, or -1
    const T* results;           // [receive_rows, H]: the w2 GEMM's rows (combine)
    int* counts;                // symmetric [W][E]: counts[s][e] = rank s's entries for expert e
    T* received;                // symmetric [receive_rows, H]
    int* sources;               // symmetric [receive_rows, 2]: (source rank, entry)
    T* back;                    // symmetric [capacity * k, H]: results of this rank's node-local entries
    u64* flags;
    // several nodes (symmetric; section m of an out buffer goes to rank (m, local), which
    // keeps it as section `node` of its in buffer)
    T* outbox;                  // [N][capacity, H]: our token rows for node m, packed
    T* inbox;                   // [N][capacity, H]: rows of rank (m, local)
    int* routes_out;            // [N][route_ints]: R, T, -, -, tokens [R], (expert, entry_rank) [T * k]
    int* routes_in;
    float* weights_out;         // [capacity * k]
    float* weights_in;          // [N][capacity * k]
    float* partial_out;         // [N][capacity, H]: sums for rank (m, local)'s rows, fp32
    float* partial_in;          // [N][capacity, H]: node m's sums of our tokens' rows
    const Queue* queue;
    const u64* peer_flags;      // [G] tables of the node's ranks' pointers
    const u64* peer_counts;
    const u64* peer_received;
    const u64* peer_sources;
    const u64* peer_back;
    const u64* peer_results;
    int tokens, k, hidden, experts, per_rank, me, W, receive_rows;
    int local, node, G, N, capacity, route_ints;
    int muted;                  // tests of the bounded waits: this rank never sends its counts
    int counts_region, flags_region, outbox_region, inbox_region, routes_out_region,
        routes_in_region, weights_out_region, weights_in_region, partial_out_region,
        partial_in_region;
};
$ARGS_CHECKS

__device__ __forceinline__ int node_of_expert(const Args& a, int e) { return e / a.per_rank / a.G; }
__device__ __forceinline__ int route_tokens_at() { return 4; }
__device__ __forceinline__ int routes_at(const Args& a) { return 4 + ((a.capacity + 3) & ~3); }

// The CTA waits until flags[word0 + s] >= epoch for s in [0, count) (thread s polls word s),
// through the proxy's error word on worlds of several nodes.
__device__ bool wait_words(const Args& a, int word0, int count, u64 epoch, const Context& ctx, int role) {
    return cta_wait_words(a.flags, word0, 1, count, -1, epoch, ctx, role, 0, 1,
                          a.N > 1 ? a.queue : nullptr);
}

// Launch bookkeeping of kernel `kernel` (0 dispatch, 1 combine): this launch's epoch.
__device__ u64 begin_launch(const Args& a, const Flags& L, int kernel) {
    __shared__ u64 epoch;
    if (threadIdx.x == 0) epoch = ld_acquire_gpu(a.flags + L.launch_words(kernel) + 2) + 1;
    __syncthreads();
    return epoch;
}
__device__ void end_launch(const Args& a, const Flags& L, int kernel, u64 epoch, int ctas) {
    __shared__ u64 before;
    if (threadIdx.x == 0) before = ld_acquire_gpu(a.flags + L.launch_words(kernel) + 1);
    __syncthreads();
    const u64 all = before + ctas;
    __syncthreads();
    if (threadIdx.x == 0) {
        u64* words = a.flags + L.launch_words(kernel);
        finish_launch(words, words + 1, words + 2, epoch, all);
    }
}
__device__ __forceinline__ u64 launch_ctas(const Args& a, const Flags& L, int kernel, int ctas) {
    return ld_acquire_gpu(a.flags + L.launch_words(kernel) + 1) + ctas;
}

// Copy `bytes` (a multiple of 16) with the 32 lanes of a warp.
__device__ __forceinline__ void warp_copy(void* dst, const void* src, int bytes) {
    const int lane = threadIdx.x & 31;
    for (int v = lane; v < bytes / 16; v += 32)
        reinterpret_cast<uint4*>(dst)[v] = reinterpret_cast<const uint4*>(src)[v];
}

// place[e] = where source s's rows for expert e start at the expert's holder: the rows of
// the holder's experts before e (from every source), then those of sources before s.
// Experts e in [first, last); the CTA's threads share the work.
__device__ void landing_bases(const Args& a, int s, int first, int last, int* place) {
    for (int e = first + threadIdx.x; e < last; e += blockDim.x) {
        const int own_first = (e / a.per_rank) * a.per_rank;
        int at = 0;
        for (int src = 0; src < a.W; ++src) {
            const int* row = a.counts + src * a.experts;
            for (int f = own_first; f < e; ++f) at += row[f];
            if (src < s) at += row[e];
        }
        place[e] = at;
    }
}

// The posts of one thread (several nodes), kept out of line: the kernels' own registers
// stay free of the queue's.
// (a) our call began, to every rank of the other nodes
__device__ __noinline__ void post_arrivals(const Args& a, const Context& ctx, const Flags& L, u64 epoch) {
    const Queue q = *a.queue;
    for (int s = 0; s < a.W; ++s) {
        if (s / a.G == a.node) continue;
        if (post_signal(q, ctx, (unsigned)s, (unsigned)a.flags_region, (u64)L.arrive(a.me) * 8,
                        epoch, ROLE_INTER, s) == POST_FAILED) return;
    }
}
// (b) our row of counts, to every rank of the other nodes (each has begun this call)
__device__ __noinline__ void post_counts(const Args& a, const Context& ctx, const Flags& L, u64 epoch) {
    const Queue q = *a.queue;
    const u64 row = (u64)a.me * a.experts * 4;
    for (int s = 0; s < a.W; ++s) {
        if (s / a.G == a.node) continue;
        if (post_put_signal(q, ctx, (unsigned)s, (unsigned)a.counts_region, row,
                            (unsigned)a.counts_region, row, (u64)a.experts * 4,
                            (unsigned)a.flags_region, (u64)L.counts_ready(a.me) * 8, epoch,
                            ROLE_INTER, s) == POST_FAILED) return;
    }
}
// (c) the rows and routes packed for each other node, to its rank with our local index,
// once that rank has begun this call (its previous call has read its inbox)
__device__ __noinline__ void post_rows(const Args& a, const Context& ctx, const Flags& L, u64 epoch) {
    const Queue q = *a.queue;
    const u64 row_bytes = (u64)a.hidden * sizeof(T);
    const u64 route_bytes = 4ull * (routes_at(a) + 2ull * a.tokens * a.k);
    for (int m = 0; m < a.N; ++m) {
        if (m == a.node) continue;
        const int dst = m * a.G + a.local;
        if (!proxy_wait_at_least(a.flags + L.arrive(dst), epoch, ctx, q, ROLE_INTER, dst, L.arrive(dst)))
            return;
        const int rows = a.routes_out[(long long)m * a.route_ints];
        if (rows > 0 && post_put(q, ctx, (unsigned)dst, (unsigned)a.inbox_region,
                                 (u64)a.node * a.capacity * row_bytes, (unsigned)a.outbox_region,
                                 (u64)m * a.capacity * row_bytes, (u64)rows * row_bytes,
                                 ROLE_INTER, dst) == POST_FAILED) return;
        if (post_put_signal(q, ctx, (unsigned)dst, (unsigned)a.routes_in_region,
                            (u64)a.node * a.route_ints * 4, (unsigned)a.routes_out_region,
                            (u64)m * a.route_ints * 4, route_bytes, (unsigned)a.flags_region,
                            (u64)L.landed(a.node) * 8, epoch, ROLE_INTER, dst) == POST_FAILED) return;
    }
}
// (d) combine: our router weights to the rank with our local index on every other node
__device__ __noinline__ void post_weights(const Args& a, const Context& ctx, const Flags& L, u64 epoch) {
    const Queue q = *a.queue;
    const int entries = a.tokens * a.k;
    for (int m = 0; m < a.N; ++m) {
        if (m == a.node) continue;
        const int dst = m * a.G + a.local;
        const u64 at = (u64)a.node * a.capacity * a.k * 4;
        const u64 ok = entries > 0
            ? post_put_signal(q, ctx, (unsigned)dst, (unsigned)a.weights_in_region, at,
                              (unsigned)a.weights_out_region, 0, (u64)entries * 4,
                              (unsigned)a.flags_region, (u64)L.weights_landed(a.node) * 8,
                              epoch, ROLE_INTER, dst)
            : post_signal(q, ctx, (unsigned)dst, (unsigned)a.flags_region,
                          (u64)L.weights_landed(a.node) * 8, epoch, ROLE_INTER, dst);
        if (ok == POST_FAILED) return;
    }
}
// (e) combine: the `sums` fp32 rows summed for rank (m, local), back to it
__device__ __noinline__ void post_sums(const Args& a, const Context& ctx, const Flags& L, u64 epoch,
                                       int m, int sums) {
    const Queue q = *a.queue;
    const int dst = m * a.G + a.local;
    const u64 row_bytes = (u64)a.hidden * 4;
    if (sums > 0)
        post_put_signal(q, ctx, (unsigned)dst, (unsigned)a.partial_in_region,
                        (u64)a.node * a.capacity * row_bytes, (unsigned)a.partial_out_region,
                        (u64)m * a.capacity * row_bytes, (u64)sums * row_bytes,
                        (unsigned)a.flags_region, (u64)L.partial_landed(a.node) * 8, epoch,
                        ROLE_INTER, dst);
    else
        post_signal(q, ctx, (unsigned)dst, (unsigned)a.flags_region,
                    (u64)L.partial_landed(a.node) * 8, epoch, ROLE_INTER, dst);
}

// The dispatch, run by CTAs cta = 0 .. ctas - 1 of a launch (the moe_dispatch kernel, or the
// routing CTAs of moe_fused) up to its rows sent and forwarded; false: a wait gave up.
__device__ __forceinline__ bool dispatch_body(const Args& a, const Context& ctx, const Flags& L,
                                           u64 epoch, int cta, int ctas) {
    __shared__ int place[MAX_EXPERTS];       // CTA 0: this rank's counts; then: where rows land
    __shared__ int sent[MAX_NODES];          // CTA 0: tokens sent to each node
    const int entries = a.tokens * a.k;
    const int first_rank = a.node * a.G;     // world rank of the node's local rank 0

    if (cta == 0) {
        // 1. our call began: ranks may write into our buffers (our last combine is done)
        if (threadIdx.x < a.G) st_release_sys((u64*)a.peer_flags[threadIdx.x] + L.arrive(a.me), epoch);
        if (a.N > 1 && threadIdx.x == blockDim.x - 1) post_arrivals(a, ctx, L, epoch);
        for (int e = threadIdx.x; e < a.experts; e += blockDim.x) place[e] = 0;
        for (int m = threadIdx.x; m < a.N; m += blockDim.x) sent[m] = 0;
        __syncthreads();
        // 2. one warp ranks the entries per expert, in entry (token) order, and (several
        // nodes) gives each token its row among the rows sent to each other node
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
                    const int at = place[e] + __popc(same & below);
                    a.entry_rank[entry] = at;
                    __syncwarp(same);
                    if (lane == leader) place[e] += __popc(same);
                }
                __syncwarp();
            }
            for (int base = 0; a.N > 1 && base < a.tokens; base += 32) {
                const int t = base + lane;
                unsigned nodes = 0;
                for (int j = 0; t < a.tokens && j < a.k; ++j) {
                    const int e = a.ids[t * a.k + j];
                    if (e >= 0 && e < a.experts) nodes |= 1u << node_of_expert(a, e);
                }
                nodes &= ~(1u << a.node);
                for (int m = 0; m < a.N; ++m) {
                    if (m == a.node) continue;
                    const bool goes = (nodes >> m) & 1;
                    const unsigned vote = __ballot_sync(0xffffffffu, goes);
                    const int row = sent[m] + __popc(vote & below);
                    if (t < a.tokens) {
                        a.pack_slot[m * a.capacity + t] = goes ? row : -1;
                        if (goes) a.routes_out[(long long)m * a.route_ints + route_tokens_at() + row] = t;
                    }
                    __syncwarp();
                    if (lane == 0) sent[m] += __popc(vote);
                    __syncwarp();
                }
            }
        }
        __syncthreads();
        // (several nodes) each section's header and the routes the forwarding rank reads
        for (int m = 0; m < a.N; ++m) {
            if (m == a.node) continue;
            int* section = a.routes_out + (long long)m * a.route_ints;
            if (threadIdx.x == 0) { section[0] = sent[m]; section[1] = a.tokens; }
            for (int entry = threadIdx.x; entry < entries; entry += blockDim.x) {
                const int e = a.ids[entry];
                const bool good = e >= 0 && e < a.experts;
                section[routes_at(a) + 2 * entry] = good ? e : -1;
                section[routes_at(a) + 2 * entry + 1] = good ? a.entry_rank[entry] : 0;
            }
        }
        __threadfence_system();
        __syncthreads();
        if (a.N > 1 && threadIdx.x == 0) st_release_gpu(a.flags + L.slots_ready(), epoch);
        // 3. the counts to every rank once it has begun this call: node peers by stores,
        // other nodes' ranks by puts from our own row
        if (!wait_words(a, L.arrive(0), a.W, epoch, ctx, ROLE_INTRA)) return false;
        for (int p = 0; p < a.G; ++p) {
            int* target = (int*)a.peer_counts[p] + a.me * a.experts;
            for (int e = threadIdx.x; e < a.experts; e += blockDim.x) target[e] = place[e];
        }
        __threadfence_system();
        __syncthreads();
        if (!a.muted && threadIdx.x < a.G)
            st_release_sys((u64*)a.peer_flags[threadIdx.x] + L.counts_ready(a.me), epoch);
        if (!a.muted && a.N > 1 && threadIdx.x == blockDim.x - 1) post_counts(a, ctx, L, epoch);
        // (an entry with a bad id was reported and is skipped below; going on keeps the
        // CTA counters and the ranks' flags in step, so only this rank's record fails)
    }

    const int warp = (cta * blockDim.x + threadIdx.x) >> 5;
    const int warps = (ctas * blockDim.x) >> 5;
    const int row_bytes = a.hidden * (int)sizeof(T);

    // 4. (several nodes) each token's row, once per other node that holds one of its
    // experts, packed in token order; then one put of the rows and one of the routes to
    // the rank with our local index there
    if (a.N > 1) {
        if (!cta_wait_words(a.flags, L.slots_ready(), 1, 1, -1, epoch, ctx, ROLE_INTER, 0, 1, nullptr))
            return false;
        for (int t = warp; t < a.tokens; t += warps) {
            for (int m = 0; m < a.N; ++m) {
                if (m == a.node) continue;
                const int row = a.pack_slot[m * a.capacity + t];
                if (row >= 0)
                    warp_copy(a.outbox + ((long long)m * a.capacity + row) * a.hidden,
                              a.x + (long long)t * a.hidden, row_bytes);
            }
        }
        if (last_cta_done(a.flags + L.packed(), launch_ctas(a, L, 0, ctas))) post_rows(a, ctx, L, epoch);
    }

    // 5. every rank's counts in: where each expert's rows from us land (expert-major, then
    // source rank, then token), and this rank's group offsets
    if (!wait_words(a, L.counts_ready(0), a.W, epoch, ctx, ROLE_INTRA)) return false;
    __syncthreads();
    const int node_experts = a.G * a.per_rank;
    const int node_first = a.node * node_experts;
    landing_bases(a, a.me, node_first, node_first + node_experts, place);
    if (cta == 0 && threadIdx.x == 0) {
        int total = 0;
        a.offsets[0] = 0;
        for (int j = 0; j < a.per_rank; ++j) {
            for (int s = 0; s < a.W; ++s) total += a.counts[s * a.experts + a.me * a.per_rank + j];
            a.offsets[j + 1] = min(total, a.receive_rows);
        }
        if (total > a.receive_rows) report_timeout(ctx, ROLE_INTRA, -1, OVER_CAPACITY, (u64)a.receive_rows, (u64)total);
    }
    __syncthreads();

    // 6. each routed row whose expert is on our node, once, to the rank holding it (a warp per row)
    for (int entry = warp; entry < entries; entry += warps) {
        const int e = a.ids[entry];
        if (e < 0 || e >= a.experts || node_of_expert(a, e) != a.node) continue;
        const int holder = e / a.per_rank - first_rank;
        const int row = place[e] + a.entry_rank[entry];
        if (row >= a.receive_rows) continue;          // reported by the holder (step 5)
        warp_copy((T*)a.peer_received[holder] + (long long)row * a.hidden,
                  a.x + (long long)(entry / a.k) * a.hidden, row_bytes);
        if ((threadIdx.x & 31) == 0) {
            int* source = (int*)a.peer_sources[holder] + 2 * row;
            source[0] = a.me;
            source[1] = entry;
        }
    }

    // 7. (several nodes) forward the rows rank (m, local) sent us to the node's ranks that
    // hold their experts, at the places its counts give
    for (int step = 1; step < a.N; ++step) {
        const int m = (a.node + a.N - step) % a.N;
        const int s = m * a.G + a.local;
        if (!wait_words(a, L.landed(m), 1, epoch, ctx, ROLE_INTER)) return false;
        __syncthreads();                       // place[] is rewritten below
        landing_bases(a, s, node_first, node_first + node_experts, place);
        __syncthreads();
        const int* section = a.routes_in + (long long)m * a.route_ints;
        const int rows = section[0];
        for (int i = warp; i < rows; i += warps) {
            const int t = section[route_tokens_at() + i];
            const T* from = a.inbox + ((long long)m * a.capacity + i) * a.hidden;
            for (int j = 0; j < a.k; ++j) {
                const int e = section[routes_at(a) + 2 * (t * a.k + j)];
                if (e < 0 || node_of_expert(a, e) != a.node) continue;
                const int holder = e / a.per_rank - first_rank;
                const int row = place[e] + section[routes_at(a) + 2 * (t * a.k + j) + 1];
                if (row >= a.receive_rows) continue;  // reported by the holder
                warp_copy((T*)a.peer_received[holder] + (long long)row * a.hidden, from, row_bytes);
                if ((threadIdx.x & 31) == 0) {
                    int* source = (int*)a.peer_sources[holder] + 2 * row;
                    source[0] = s;
                    source[1] = t * a.k + j;
                }
            }
        }
    }
    if (last_cta_done(a.flags + L.dispatched(), launch_ctas(a, L, 0, ctas))) {
        for (int p = 0; p < a.G; ++p) st_release_sys((u64*)a.peer_flags[p] + L.rows_ready(a.me), epoch);
    }
    return true;
}

extern "C" __global__ void __launch_bounds__(256)
moe_dispatch(const __grid_constant__ Args a, u64* status, u64* host_flag, int slot, int rank,
             u64 timeout_ns) {
    const Context ctx{status, host_flag, slot, rank, timeout_ns, $KERNEL_ID};
    const Flags L{a.W, a.N};
    const u64 epoch = begin_launch(a, L, 0);
    if (!dispatch_body(a, ctx, L, epoch, (int)blockIdx.x, (int)gridDim.x)) return;
    // 8. every node peer's rows for us (its own and those it forwarded) are in before the
    // GEMMs read them
    if (wait_words(a, L.rows_ready(a.node * a.G), a.G, epoch, ctx, ROLE_INTRA))
        end_launch(a, L, 0, epoch, (int)gridDim.x);
}

// SwiGLU of the rows the w1 GEMM wrote: act[r, c] = silu(h[r, c]) * h[r, inter + c], for
// the rows this rank received (offsets[per_rank] of them, clamped to the buffer: after a
// dispatch that ended in a timeout the offsets are whatever the memory held).
extern "C" __global__ void moe_swiglu(const T* h, T* act, const int* offsets, int per_rank,
                                      int inter, int receive_rows) {
    const long long rows = min(max(offsets[per_rank], 0), receive_rows);
    const long long total = rows * inter;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / inter, c = i - r * inter;
        const float gate = __bfloat162float(h[r * 2 * inter + c]);
        const float up = __bfloat162float(h[r * 2 * inter + inter + c]);
        act[i] = __float2bfloat16_rn(gate / (1.f + __expf(-gate)) * up);
    }
}

// The combine, run by CTAs cta = 0 .. ctas - 1 of a launch (the moe_combine kernel, or the
// routing CTAs of moe_fused once the experts are done); false: a wait gave up.
__device__ __forceinline__ bool combine_body(const Args& a, const Context& ctx, const Flags& L,
                                          u64 epoch, int cta, int ctas) {
    __shared__ int place[MAX_EXPERTS];
    const int warp = (cta * blockDim.x + threadIdx.x) >> 5;
    const int warps = (ctas * blockDim.x) >> 5;
    const int row_bytes = a.hidden * (int)sizeof(T);
    const int first_rank = a.node * a.G;
    const int pairs = a.hidden / 2;
    const int entries = a.tokens * a.k;
    if (cta == 0) {
        // 1. our expert results are in (the GEMM ran before us on our stream): the node's
        // forwarding ranks may read them
        if (threadIdx.x < a.G) st_release_sys((u64*)a.peer_flags[threadIdx.x] + L.results_ready(a.me), epoch);
        // (several nodes) our router weights to the rank with our local index on every
        // other node, which sums our tokens' rows there
        if (a.N > 1) {
            for (int i = threadIdx.x; i < entries; i += blockDim.x) a.weights_out[i] = a.weights[i];
            __threadfence_system();
            __syncthreads();
            if (threadIdx.x == 0) post_weights(a, ctx, L, epoch);
        }
    }
    // 2. each result row whose source is on our node back to its slot (token, choice).
    // Offsets and sources are checked against the buffers: after a dispatch that ended in
    // a timeout they are whatever the memory held (the call raises; nothing may fault).
    const int rows = min(max(a.offsets[a.per_rank], 0), a.receive_rows);
    for (int r = warp; r < rows; r += warps) {
        const int* source = a.sources + 2 * r;
        if (source[0] / a.G != a.node) continue;       // summed here, sent by the forwarding rank
        if (source[0] < first_rank || source[1] < 0 || source[1] >= a.capacity * a.k) continue;
        warp_copy((T*)a.peer_back[source[0] - first_rank] + (long long)source[1] * a.hidden,
                  a.results + (long long)r * a.hidden, row_bytes);
    }
    if (last_cta_done(a.flags + L.combined(), launch_ctas(a, L, 1, ctas))) {
        for (int p = 0; p < a.G; ++p) st_release_sys((u64*)a.peer_flags[p] + L.back_ready(a.me), epoch);
    }

    // 3. (several nodes) for the rows rank (m, local) sent us: the weighted sum, in fp32 and
    // choice order, of each token's rows from our node's experts, read where they were
    // computed; one put of the sums back
    const int node_experts = a.G * a.per_rank;
    const int node_first = a.node * node_experts;
    for (int step = 1; step < a.N; ++step) {
        const int m = (a.node + step) % a.N;
        const int s = m * a.G + a.local;
        if (!wait_words(a, L.results_ready(first_rank), a.G, epoch, ctx, ROLE_REDUCE)) return false;
        if (!wait_words(a, L.weights_landed(m), 1, epoch, ctx, ROLE_INTER)) return false;
        __syncthreads();
        landing_bases(a, s, node_first, node_first + node_experts, place);
        __syncthreads();
        const int* section = a.routes_in + (long long)m * a.route_ints;
        const float* w = a.weights_in + (long long)m * a.capacity * a.k;
        const int sums = min(max(section[0], 0), a.capacity);
        float* out = a.partial_out + (long long)m * a.capacity * a.hidden;
        for (long long i = (long long)cta * blockDim.x + threadIdx.x; i < (long long)sums * pairs;
             i += (long long)ctas * blockDim.x) {
            const int r = (int)(i / pairs), c = 2 * (int)(i - (long long)r * pairs);
            const int t = section[route_tokens_at() + r];
            float s0 = 0.f, s1 = 0.f;
            for (int j = 0; j < a.k && t >= 0 && t < a.capacity; ++j) {
                const int e = section[routes_at(a) + 2 * (t * a.k + j)];
                if (e < 0 || e >= a.experts || node_of_expert(a, e) != a.node) continue;
                const int row = place[e] + section[routes_at(a) + 2 * (t * a.k + j) + 1];
                if (row < 0 || row >= a.receive_rows) continue;
                const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(
                    (const T*)a.peer_results[e / a.per_rank - first_rank] + (long long)row * a.hidden + c);
                const float weight = w[t * a.k + j];
                s0 = fmaf(weight, __bfloat162float(v.x), s0);
                s1 = fmaf(weight, __bfloat162float(v.y), s1);
            }
            *reinterpret_cast<float2*>(out + (long long)r * a.hidden + c) = make_float2(s0, s1);
        }
        if (last_cta_done(a.flags + L.summed(m), launch_ctas(a, L, 1, ctas))) post_sums(a, ctx, L, epoch, m, sums);
    }

    // 4. every node peer sent its rows back, every other node its sums: y[t] = over nodes
    // in order, our node's rows weighted in choice order, another node's fp32 sum; in
    // fp32, rounded once (bit-identical between calls)
    if (!wait_words(a, L.back_ready(first_rank), a.G, epoch, ctx, ROLE_REDUCE)) return false;
    if (a.N > 1 && !cta_wait_words(a.flags, L.partial_landed(0), 1, a.N, a.node, epoch, ctx,
                                   ROLE_INTER, 0, 1, a.queue))       // every node but ours
        return false;
    // (several nodes) our own routes: section (node + 1) of what the dispatch sent
    const int* routes = a.N > 1 ? a.routes_out + (long long)((a.node + 1) % a.N) * a.route_ints + routes_at(a)
                                : nullptr;
    for (long long i = (long long)cta * blockDim.x + threadIdx.x; i < (long long)a.tokens * pairs;
         i += (long long)ctas * blockDim.x) {
        const int t = (int)(i / pairs), c = 2 * (int)(i - (long long)t * pairs);
        float s0 = 0.f, s1 = 0.f;
        for (int m = 0; m < a.N; ++m) {
            if (m == a.node) {
                for (int j = 0; j < a.k; ++j) {
                    if (routes != nullptr) {
                        const int e = routes[2 * (t * a.k + j)];
                        if (e < 0 || node_of_expert(a, e) != a.node) continue;
                    }
                    const float w = a.weights[t * a.k + j];
                    const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(
                        a.back + ((long long)t * a.k + j) * a.hidden + c);
                    s0 = fmaf(w, __bfloat162float(v.x), s0);
                    s1 = fmaf(w, __bfloat162float(v.y), s1);
                }
            } else {
                const int row = a.pack_slot[m * a.capacity + t];
                if (row < 0 || row >= a.capacity) continue;
                const float2 v = *reinterpret_cast<const float2*>(
                    a.partial_in + ((long long)m * a.capacity + row) * a.hidden + c);
                s0 += v.x;
                s1 += v.y;
            }
        }
        *reinterpret_cast<__nv_bfloat162*>(a.y + (long long)t * a.hidden + c) = __floats2bfloat162_rn(s0, s1);
    }
    return true;
}

extern "C" __global__ void __launch_bounds__(256)
moe_combine(const __grid_constant__ Args a, u64* status, u64* host_flag, int slot, int rank,
            u64 timeout_ns) {
    const Context ctx{status, host_flag, slot, rank, timeout_ns, $KERNEL_ID};
    const Flags L{a.W, a.N};
    const u64 epoch = begin_launch(a, L, 1);
    if (combine_body(a, ctx, L, epoch, (int)blockIdx.x, (int)gridDim.x))
        end_launch(a, L, 1, epoch, (int)gridDim.x);
}

#if $FUSED
// ---- the whole call in one launch (MoE(fused_experts=True)) ----------------------------
// CTAs 0 .. route_ctas - 1 route: the dispatch (as moe_dispatch runs it), then, once this
// rank's experts are done, the combine. The others run the experts (experts_tiles: w1 with
// SwiGLU in its epilogue, w2 on each m-tile once its SwiGLU rows are in) as soon as every
// node peer's rows for this rank are in. The launch keeps the dispatch's and the combine's
// launch words as if they had run alone with route_ctas CTAs, so calls of either form and
// dispatch()/combine() keep one epoch.
typedef gemm::Config<T, $BLOCK_M, $BLOCK_N, $STAGES, true, 0, 1> Cfg;
constexpr int MAX_GROUPS = $MAX_GROUPS;

// The routing CTAs' part, out of line: the experts' registers stay free of it.
__device__ __noinline__ void route(const Args& a, const Context& ctx, const Flags& L,
                                   const u64* expert_words, int experts_ctas, int route_ctas) {
    const u64 epoch = begin_launch(a, L, 0);
    if (!dispatch_body(a, ctx, L, epoch, (int)blockIdx.x, route_ctas)) return;
    end_launch(a, L, 0, epoch, route_ctas);
    // every experts CTA of this rank is done: the results may be sent back and read
    if (!cta_wait_at_least(expert_words + experts::EXPERTS_DONE,
                           (epoch << experts::COUNT_BITS) + (u64)experts_ctas, ctx, ROLE_REDUCE, -1,
                           experts::EXPERTS_DONE))
        return;
    const u64 epoch1 = begin_launch(a, L, 1);
    if (combine_body(a, ctx, L, epoch1, (int)blockIdx.x, route_ctas))
        end_launch(a, L, 1, epoch1, route_ctas);
}

// An experts CTA waits until every node peer's rows for this rank are in (its own and those
// it forwarded), and with them this rank's offsets (written before the dispatch's last CTA
// released its flag). Out of line, like route(): nothing of the experts' is live across it.
__device__ __noinline__ bool rows_are_in(const Args& a, const Context& ctx, u64 epoch) {
    const Flags L{a.W, a.N};
    if (!wait_words(a, L.rows_ready(a.node * a.G), a.G, epoch, ctx, ROLE_COMPUTE)) return false;
    fence_proxy_async_global();         // peers wrote the rows with generic stores; TMA reads them
    return true;
}

extern "C" __global__ void __launch_bounds__(Cfg::THREADS, 1)
moe_fused(const __grid_constant__ Args a,
          const __grid_constant__ TmaDescriptor tma_x,      // received [receive_rows, H], box 64 x BM
          const __grid_constant__ TmaDescriptor tma_w1,     // w1 [E_local * 2I, H], box 64 x BN/2
          const __grid_constant__ TmaDescriptor tma_act,    // act [receive_rows, I], box 64 x BM
          const __grid_constant__ TmaDescriptor tma_w2,     // w2 [E_local * H, I], box 64 x BN
          T* act, u64* expert_words, int group_m1, int group_m2, int inter, int route_ctas,
          u64* status, u64* host_flag, int slot, int rank, u64 timeout_ns) {
    if ((int)blockIdx.x < route_ctas) {
        route(a, Context{status, host_flag, slot, rank, timeout_ns, $KERNEL_ID}, Flags{a.W, a.N},
              expert_words, (int)gridDim.x - route_ctas, route_ctas);
        return;
    }
    extern __shared__ char dynamic_smem[];
    __shared__ int tile_prefix[MAX_GROUPS + 1];
    __shared__ u64 call_epoch;
    // This call's epoch: the combine's launch count + 1 (its words move only after the
    // experts of this call are done, so no experts CTA can see them moved).
    if (threadIdx.x == 0) call_epoch = ld_acquire_gpu(a.flags + Flags{a.W, a.N}.launch_words(1) + 2) + 1;
    __syncthreads();
    if (!rows_are_in(a, Context{status, host_flag, slot, rank, timeout_ns, $KERNEL_ID}, call_epoch)) return;
    const Context ctx{status, host_flag, slot, rank, timeout_ns, $KERNEL_ID};
    const u64 epoch = *reinterpret_cast<volatile u64*>(&call_epoch);
    const int experts_ctas = (int)gridDim.x - route_ctas;
    experts::run_experts<Cfg>(&tma_x, &tma_w1, &tma_act, &tma_w2, act, const_cast<T*>(a.results),
                              a.offsets, expert_words, a.per_rank, a.receive_rows, inter, a.hidden,
                              group_m1, group_m2, epoch, (int)blockIdx.x - route_ctas, experts_ctas,
                              ctx, tile_prefix, dynamic_smem);
    __threadfence_system();             // our results: node peers read them in the combine
    __syncthreads();
    if (threadIdx.x == 0) experts::count_tagged(expert_words + experts::EXPERTS_DONE, epoch);
}
#endif
""", requires=("gather", "experts_tiles"), headers=("cuda_bf16.h",), register=False)

KERNEL_ID = kernel_id("moe")

POINTER_FIELDS = (
    "x", "ids", "weights", "y", "entry_rank", "offsets", "pack_slot", "results", "counts",
    "received", "sources", "back", "flags", "outbox", "inbox", "routes_out", "routes_in",
    "weights_out", "weights_in", "partial_out", "partial_in", "queue", "peer_flags",
    "peer_counts", "peer_received", "peer_sources", "peer_back", "peer_results")
INT_FIELDS = (
    "tokens", "k", "hidden", "experts", "per_rank", "me", "W", "receive_rows", "local", "node",
    "G", "N", "capacity", "route_ints", "muted")
#: symmetric buffers the proxy addresses (each field ``<name>_region``)
REGIONS = ("counts", "flags", "outbox", "inbox", "routes_out", "routes_in", "weights_out",
           "weights_in", "partial_out", "partial_in")
ARGS_DTYPE = np.dtype([(f, "<u8") for f in POINTER_FIELDS] + [(f, "<i4") for f in INT_FIELDS]
                      + [(f"{r}_region", "<i4") for r in REGIONS], align=True)

LAUNCH_PARAMETERS = [("args", ARGS_DTYPE, 8), *CONTEXT_PARAMETERS]
#: moe_fused's parameters: the same Args, the experts' four TMA maps and their own values
FUSED_PARAMETERS = [("args", ARGS_DTYPE, 8), ("tma_x", 128, 64), ("tma_w1", 128, 64),
                    ("tma_act", 128, 64), ("tma_w2", 128, 64), ("act", np.uint64, 8),
                    ("expert_words", np.uint64, 8), ("group_m1", np.int32, 4), ("group_m2", np.int32, 4),
                    ("inter", np.int32, 4), ("route_ctas", np.int32, 4), *CONTEXT_PARAMETERS]


def fused_route_ctas(sms: int, ctas: int) -> int:
    """Routing CTAs of moe_fused on `sms` SMs (the rest run the experts): the op's ``ctas``,
    at most an eighth of the SMs, at least one."""
    return max(1, min(ctas, sms // 8))


@dataclasses.dataclass(frozen=True)
class MoeFlags:
    """Index of every flag word of a rank (mirrors the template's struct Flags): W ranks,
    N nodes."""

    W: int
    N: int = 1

    def arrive(self, s): return s
    def counts_ready(self, s): return self.W + s
    def rows_ready(self, s): return 2 * self.W + s
    def back_ready(self, s): return 3 * self.W + s
    def results_ready(self, s): return 4 * self.W + s
    def landed(self, n): return 5 * self.W + n
    def weights_landed(self, n): return 5 * self.W + self.N + n
    def partial_landed(self, n): return 5 * self.W + 2 * self.N + n
    def slots_ready(self): return 5 * self.W + 3 * self.N
    def launch_words(self, kernel): return self.slots_ready() + 4 + self.N + 3 * kernel

    @property
    def words(self) -> int:
        return self.launch_words(2)


def route_ints(capacity: int, k: int) -> int:
    """Ints of one node's section of the routes a rank sends: R, T and two spare words,
    the tokens sent (capacity, rounded up to 4), (expert, entry place) per entry."""
    return 4 + -(-capacity // 4) * 4 + 2 * capacity * k


@dataclasses.dataclass(frozen=True)
class MoeSpec(KernelSpec):
    """The dispatch, SwiGLU and combine kernels (bf16; URI ``moe_sm90a``)."""

    family = "moe"
    entry_points = ("moe_dispatch", "moe_swiglu", "moe_combine")

    def template(self):
        return MOE

    def params(self):
        return {"MAX_EXPERTS": MAX_EXPERTS, "MAX_NODES": MAX_NODES, "KERNEL_ID": f"{KERNEL_ID}ull",
                "ARGS_CHECKS": struct_size_assert("Args", ARGS_DTYPE), "FUSED": 0, "BLOCK_M": 0,
                "BLOCK_N": 0, "STAGES": 0, "MAX_GROUPS": experts_module.MAX_GROUPS}


#: static shared memory of moe_fused beside the engine's stages: the dispatch's and the
#: combine's expert places, the dispatch's node counts, the experts' group prefix, a few words
FUSED_STATIC_SMEM_BYTES = 2 * MAX_EXPERTS * 4 + MAX_NODES * 4 + (experts_module.MAX_GROUPS + 1) * 4 + 128


@dataclasses.dataclass(frozen=True)
class MoeFusedSpec(experts_module.MoeExpertsSpec):
    """MoE's kernels plus ``moe_fused``, the whole call in one launch, its experts on the
    engine with tiles block_m x block_n (URI e.g. ``moe_fused_bf16_nk_bm128_bn256_s4_sm90a``)."""

    family = "moe_fused"
    entry_points = ("moe_dispatch", "moe_swiglu", "moe_combine", "moe_fused")
    # ptxas keeps a few words across the entry's two out-of-line calls (route(), rows_are_in()):
    # 24 to 72 bytes whatever the tile's width, none with the calls made straight-line code
    # (a CPU test compiles that variant), so none in the tile loops
    spill_allowance = {"moe_fused": 96}

    def __post_init__(self):
        super().__post_init__()        # the experts' checks (dtype, layout, tile)
        if self.smem_bytes + FUSED_STATIC_SMEM_BYTES > gemm_module.SMEM_LIMIT:
            raise ValueError(f"mkrt.moe: {self.stages} stages of {self.block_m}x{self.block_n} tiles "
                             "do not fit beside the fused kernel's own shared memory (use fused_spec_for)")

    def template(self):
        return MOE

    def params(self):
        return {**MoeSpec().params(), "FUSED": 1, "BLOCK_M": self.block_m, "BLOCK_N": self.block_n,
                "STAGES": self.stages}


def fused_spec_for(block_m: int, block_n: int = 256) -> MoeFusedSpec:
    return MoeFusedSpec("bf16", "nk", block_m, block_n,
                        gemm_module.max_stages(block_m, block_n, "direct", FUSED_STATIC_SMEM_BYTES))


def default_specs() -> list[MoeSpec]:
    return [MoeSpec()] + [fused_spec_for(block_m) for block_m in (64, 128)]


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


def forwarding(topk_ids: list, experts: int, nodes: int, per_node: int):
    """What the dispatch kernel does on a world of several nodes, step for step in Python:
    (sent, written). ``sent[(s, m)]``: the tokens rank s packs for node m, in their slot
    order (a token goes once to each other node holding one of its experts); ``written[h]``:
    {row: (source rank, entry)} of every row placed at holder h, by the source itself (its
    own node) or by the rank of h's node with the source's local index (the rows that
    crossed), each at the landing bases of its source plus the entry's place."""
    W, G = nodes * per_node, per_node
    per_rank = experts // W
    ids = [np.asarray(x) for x in topk_ids]          # [T, k] each
    counts = np.zeros((W, experts), np.int64)
    entry_rank = []
    for s, x in enumerate(ids):
        flat = x.reshape(-1)
        places = np.zeros(flat.size, np.int64)
        for entry, e in enumerate(flat):          # the ranking warp: entry order
            places[entry] = counts[s, e]
            counts[s, e] += 1
        entry_rank.append(places)

    def bases(source):                          # landing_bases()
        out = np.zeros(experts, np.int64)
        for e in range(experts):
            first = (e // per_rank) * per_rank
            out[e] = counts[:, first:e].sum() + counts[:source, e].sum()
        return out

    node_of = lambda e: e // per_rank // G      # noqa: E731
    sent = {}
    for s, x in enumerate(ids):
        for m in range(nodes):
            if m != s // G:
                sent[(s, m)] = [t for t in range(x.shape[0]) if any(node_of(int(e)) == m for e in x[t])]
    written: list[dict] = [{} for _ in range(W)]

    def place(holder, row, source, entry):
        if row in written[holder]:
            raise AssertionError(f"row {row} of rank {holder} written twice")
        written[holder][row] = (source, entry)

    for s, x in enumerate(ids):                 # step 6: rows for the source's own node
        base = bases(s)
        for entry, e in enumerate(x.reshape(-1)):
            if node_of(int(e)) == s // G:
                place(int(e) // per_rank, int(base[e] + entry_rank[s][entry]), s, entry)
    for g in range(W):                          # step 7: the forwarding rank g = (n, l)
        n, l = divmod(g, G)
        for m in range(nodes):
            if m == n:
                continue
            s = m * G + l
            base = bases(s)
            k = ids[s].shape[1]
            for t in sent[(s, n)]:              # routes_in: tokens, (expert, place) per entry
                for j in range(k):
                    e = int(ids[s][t, j])
                    if node_of(e) == n:
                        place(e // per_rank, int(base[e] + entry_rank[s][t * k + j]), s, t * k + j)
    return sent, written


# ---- the op --------------------------------------------------------------------------------

class MoE(Op):
    """``y = op(x, topk_ids, topk_weights, w1, w2)``: routed experts over the world (nodes of
    equal size).

    ``experts``: E in the world (a multiple of the world size, at most 1024); ``capacity``:
    most tokens a rank passes per call; ``receive_rows``: most rows a rank may receive
    (default 2 x capacity x k_max with k_max = 8, or as given). ``ctas``: CTAs of the
    dispatch and combine kernels (default 16). ``muted_rank``: a world rank that never
    sends its counts (tests of the bounded waits: every rank's call ends in CommTimeout);
    leave it None. ``fused_experts``: the whole call in one launch per rank (``moe_fused``:
    a few routing CTAs dispatch, then combine; the others run the experts as
    :func:`mkrt.grouped_mlp` does, SwiGLU in the w1 GEMM's epilogue and the w2 GEMM's tiles
    starting as their rows' SwiGLU lands, never writing the [rows, 2I] product) instead of
    five; off until measured against them. ``route_ctas``: the fused launch's routing CTAs
    (default :func:`fused_route_ctas`'s)."""

    name = "moe"

    def __init__(self, world=None, *, experts: int, capacity: int, receive_rows: int | None = None,
                 ctas: int = 16, timeout_ms: float | None = None, validate: bool = True,
                 muted_rank: int | None = None, fused_experts: bool = False,
                 route_ctas: int | None = None):
        super().__init__(world, timeout_ms=timeout_ms)
        area = self.name
        W = self.world.size
        if W > MAX_RANKS or self.world.nodes > MAX_NODES:
            raise ValueError(f"mkrt.moe: at most {MAX_RANKS} ranks on {MAX_NODES} nodes; this "
                             f"world is {self.world.layout}")
        if len({len(self.world.node_ranks(n)) for n in range(self.world.nodes)}) != 1:
            raise ValueError(f"mkrt.moe: nodes of different sizes ({self.world.layout}) are not "
                             "supported")
        self.experts = checks.integer(experts, "experts", area, low=1, high=MAX_EXPERTS)
        if self.experts % W:
            raise ValueError(f"mkrt.moe: {self.experts} experts do not split over {W} ranks")
        self.capacity = checks.integer(capacity, "capacity", area, low=1, high=1 << 24)
        self.receive_rows = checks.integer(receive_rows if receive_rows is not None
                                           else min(2 * self.capacity * 8, 1 << 26),
                                           "receive_rows", area, low=1, high=1 << 26)
        self.ctas = checks.integer(ctas, "ctas", area, low=1, high=64)
        self.validate = checks.flag(validate, "validate", area)
        self.fused_experts = checks.flag(fused_experts, "fused_experts", area)
        self.route_ctas = checks.integer(route_ctas, "route_ctas", area, low=1, high=1024, optional=True)
        muted = checks.integer(muted_rank, "muted_rank", area, low=0, high=W - 1, optional=True)
        self.muted_rank = -1 if muted is None else muted
        self.experts_per_rank = self.experts // W
        # The grouped GEMMs' tile: grouped_gemm.choose_tile was fitted on the rows a call
        # really has; here the host knows only the receive buffer's size (up to 16x the
        # capacity), so the tile stays the one the MoE rows were measured with (932f011),
        # and so do the direct stores, single CTAs and whole tiles (choose_epilogue,
        # choose_cluster and choose_stream_k too count rows per group)
        self._tile = (grouped_module.choose_block_m(self.receive_rows, self.experts_per_rank), 256)
        self.layout = MoeFlags(W, self.world.nodes)
        self._buffers: dict = {}
        self._prepared: dict = {}
        self._streams: dict = {}
        self._expert_words: dict = {}  # rank -> the fused launch's experts words (zeroed once)
        self._dispatched = None        # tokens per rank of a dispatch() awaiting its combine()

    # -- buffers --
    def _ensure_buffers(self, shape: MoeShape) -> None:
        key = (shape.hidden, shape.k)
        if self._buffers.get("key") == key:
            return
        self.world.synchronize()       # allocations wait for the device (DESIGN.md)
        self.close()
        W, N, rows, H = self.world.size, self.world.nodes, self.receive_rows, shape.hidden
        cap, k = self.capacity, shape.k
        sizes = {"counts": W * self.experts * 4, "received": rows * H * 2, "sources": rows * 8,
                 "back": cap * k * H * 2, "results": rows * H * 2}
        if N > 1:
            # what crosses between nodes: token rows and routes out, weights out, fp32 sums
            # back; one section per node (a rank's own node's stays unused)
            sizes.update(outbox=N * cap * H * 2, inbox=N * cap * H * 2,
                         routes_out=N * route_ints(cap, k) * 4, routes_in=N * route_ints(cap, k) * 4,
                         weights_out=cap * k * 4, weights_in=N * cap * k * 4,
                         partial_out=N * cap * H * 4, partial_in=N * cap * H * 4)
        b = self._buffers
        b["flags"] = flag_buffer(self.world, self.layout.words, name="moe.flags")
        for name, nbytes in sizes.items():
            b[name] = SymmetricBuffer(self.world, max(nbytes, 16), name=f"moe.{name}",
                                      zero=name == "counts")
        b["key"] = key
        self._prepared.clear()
        if N > 1:
            self.world.proxy()         # registers the buffers as regions

    def _routing_buffers(self, shape: MoeShape) -> list:
        """Per rank: entry places, group offsets, each token's row among those sent to
        each other node."""
        return [self.kept_buffers(name, shp, np.int32) for name, shp in (
            ("entry_rank", (self.capacity * shape.k,)), ("offsets", (self.experts_per_rank + 1,)),
            ("pack_slot", (self.world.nodes * self.capacity,)))]

    def _results(self, rank: int, hidden: int):
        """Rank's expert results (the w2 GEMM's rows; symmetric: on worlds of several
        nodes the forwarding ranks of its node read them)."""
        return self._buffers["results"].view(rank, bfloat16, (self.receive_rows, hidden))

    def _expert_buffers(self, shape: MoeShape) -> list:
        """Per rank: the w1 GEMM's rows (not with fused experts: never written) and
        SwiGLU's."""
        act = self.kept_buffers("act", (self.receive_rows, shape.inter), bfloat16)
        if self.fused_experts:
            return [None] * len(act), act
        return self.kept_buffers("h", (self.receive_rows, 2 * shape.inter), bfloat16), act

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
        if self.validate and not self.capturing():
            if self.world.nodes > 1:
                # The host waits for the ids below: never while this op's earlier call may
                # wait for the proxy's copies (mkrt/DESIGN.md, "Runtime hazards"); finish
                # it first. (validate=False skips the check; the kernel still reports a
                # bad id, flag -4.)
                self.world.synchronize()
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
    def _no_pending_dispatch(self) -> None:
        if self._dispatched is not None:
            raise ValueError("mkrt.moe: a dispatch() of this op awaits its combine(); call "
                             "combine() first (the combine reads what the dispatch left)")

    def __call__(self, x, topk_ids, topk_weights, w1, w2, out=None):
        self._no_pending_dispatch()
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
        :meth:`combine` (every rank calls both, in the same order, before the next call)."""
        self._no_pending_dispatch()
        xs, ids, as_list, dims = self._routing(x, topk_ids)
        tokens, k, hidden = dims[0]
        shape = MoeShape(tokens, k, hidden, 0, self.experts_per_rank)
        self.before_launch()
        self._ensure_buffers(shape)
        self._run(shape, dims, xs, ids, None, None, stages=("dispatch",))
        self.after_launch()
        self._dispatched = [d[0] for d in dims]
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
        if self._dispatched is None:
            raise ValueError("mkrt.moe: combine() needs a dispatch() of this op first")
        if [d[0] for d in dims] != self._dispatched:
            raise ValueError(f"mkrt.moe: topk_weights give {[d[0] for d in dims]} tokens per rank; "
                             f"the dispatch had {self._dispatched}")
        weights, outs = weights_list, self._weights_and_out(weights_list, out, dims)
        self.before_launch()
        outs = outs if outs is not None else self._new_outs(dims)
        shape = MoeShape(dims[0][0], k, hidden, 0, self.experts_per_rank)
        self._run(shape, dims, None, None, weights, outs, stages=("combine",), results=results_list)
        self.after_launch()
        self._dispatched = None
        if out is not None:
            return out
        return outs if as_list else like_input(outs[0], results)

    def _args(self, info, shape: MoeShape, scratch) -> np.ndarray:
        b, rank = self._buffers, info.rank
        args = np.zeros((), ARGS_DTYPE)
        i = self.world.local.index(info)
        for name, per_rank in zip(("entry_rank", "offsets", "pack_slot"), scratch):
            args[name] = per_rank[i].data.ptr
        for name in ("counts", "received", "sources", "back", "flags", "results"):
            args[name] = b[name].local_ptr(rank)
            args[f"peer_{name}"] = b[name].peer_table(rank).data.ptr
        if self.world.nodes > 1:
            for name in REGIONS:
                args[name] = b[name].local_ptr(rank)
                args[f"{name}_region"] = b[name].region
            args["queue"] = self.world.proxy().queue_pointer(rank)
        args["k"], args["hidden"], args["experts"] = shape.k, shape.hidden, self.experts
        args["per_rank"], args["me"], args["W"] = self.experts_per_rank, rank, self.world.size
        args["receive_rows"] = self.receive_rows
        args["local"], args["node"] = info.local_rank, info.node
        args["G"], args["N"] = self.world.ranks_per_node, self.world.nodes
        args["capacity"], args["route_ints"] = self.capacity, route_ints(self.capacity, shape.k)
        args["muted"] = int(rank == self.muted_rank)
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

    def _fused_launch(self, info, shape: MoeShape, scratch):
        """Rank's one-launch call (moe_fused; fused_experts=True): built once per (rank, k,
        H, I); (launch, the Args fields patched per call, the maps' pointers)."""
        key = ("fused", info.rank, shape.k, shape.hidden, shape.inter)
        prepared = self._prepared.get(key)
        if prepared is None:
            import cupy
            spec = fused_spec_for(*self._tile)
            sms = self.world.sm_count(info.rank)
            if sms < 2:
                raise ValueError(f"mkrt.moe: fused_experts needs 2 SMs per rank (one routing CTA, "
                                 f"one for the experts); rank {info.rank} has {sms}")
            route_ctas = fused_route_ctas(sms, self.ctas) if self.route_ctas is None else self.route_ctas
            if route_ctas >= sms:
                raise ValueError(f"mkrt.moe: route_ctas={route_ctas} leaves no CTA for the experts on "
                                 f"rank {info.rank}'s {sms} SMs")
            words = self._expert_words.get(info.rank)
            size = experts_module.counter_words(self.receive_rows, self.experts_per_rank, spec.block_m)
            if words is None or words.size < size:
                with self.on_device(info.device):
                    words = self._expert_words[info.rank] = cupy.zeros(size, np.uint64)
            params = Parameters(FUSED_PARAMETERS)
            params.set(args=self._args(info, shape, scratch), expert_words=words.data.ptr,
                       group_m1=grouped_module.band_m_tiles(2 * shape.inter, shape.hidden),
                       group_m2=grouped_module.band_m_tiles(shape.hidden, shape.inter),
                       inter=shape.inter, route_ctas=route_ctas, **self.context_params(info.rank))
            launch = KernelLaunch(spec.function("moe_fused", info.device, spec.smem_bytes), sms,
                                  spec.threads, spec.smem_bytes, params)
            fields = ("x", "ids", "weights", "y", "tokens", "results")
            prepared = self._prepared[key] = [launch, tuple(params.field_view("args", f) for f in fields),
                                              None]
        return prepared

    def _patch_fused_maps(self, prepared, received, w1, w2, act, shape: MoeShape) -> None:
        """The fused launch's four TMA maps, rebuilt when a pointer moved."""
        launch, _, pointers = prepared
        now = (received.data.ptr, w1.data.ptr, w2.data.ptr, act.data.ptr)
        if pointers == now:
            return
        experts_module.write_maps(launch.params, *now, self.receive_rows, self.experts_per_rank,
                                  shape.hidden, shape.inter, self._tile)
        launch.params.set(act=now[3])
        prepared[2] = now

    def _run(self, shape, dims, xs, ids, weights, outs, *, experts=None,
             stages=("dispatch", "experts", "combine"), results=None) -> None:
        """Launch `stages` on every local rank's stream ("experts": both grouped GEMMs and
        SwiGLU on the op's own buffers; combine then reads them, unless `results` is given)."""
        scratch = self._routing_buffers(shape)
        expert_scratch = self._expert_buffers(shape) if "experts" in stages else None
        # the whole call in one launch per rank (moe_fused): dispatch and combine stay
        # launches of their own only when called alone
        fused = self.fused_experts and len(stages) == 3
        # Build every kernel of every rank before the first launch: a rank's dispatch waits
        # for the other ranks' dispatches, and a compile between two ranks' launches (the
        # grouped GEMM's, on a first call) could outlast its bounded wait.
        prepared = [self._prepared_launches(i, info, shape, scratch)
                    for i, info in enumerate(self.world.local)]
        fused_launches = [self._fused_launch(info, shape, scratch) for info in self.world.local] \
            if fused else None
        if "experts" in stages and not fused:
            for info in self.world.local:
                for columns in (2 * shape.inter, shape.hidden):          # w1's, w2's
                    grouped_module.build(self.receive_rows, self.experts_per_rank, columns, "bf16",
                                         info.device, self.world.sm_count(info.rank), *self._tile,
                                         epilogue="direct", cluster="", stream_k=False)
        streams = self._launch_streams()
        for i, (info, stream_ptr) in enumerate(zip(self.world.local, streams)):
            launches, words, swiglu = prepared[i]
            offsets = scratch[1][i]
            own_results = self._results(info.rank, shape.hidden)
            if results is not None and self.world.nodes > 1:
                # the node's forwarding ranks read results where they are: in the op's
                # symmetric buffer
                with self.on_device(info.device), self._stream(stream_ptr):
                    own_results[...] = results[i]
                results_i = own_results
            else:
                results_i = results[i] if results is not None else own_results
            pointers = (xs[i].data.ptr if xs is not None else 0, ids[i].data.ptr if ids is not None else 0,
                        weights[i].data.ptr if weights is not None else 0,
                        outs[i].data.ptr if outs is not None else 0, dims[i][0],
                        results_i.data.ptr)
            for word in words if not fused else (fused_launches[i][1],):
                for field, value in zip(word, pointers):
                    field[()] = value
            with self.on_device(info.device):
                if fused:
                    received = self._buffers["received"].view(info.rank, bfloat16,
                                                               (self.receive_rows, shape.hidden))
                    self._patch_fused_maps(fused_launches[i], received, experts[0][i], experts[1][i],
                                           expert_scratch[1][i], shape)
                    fused_launches[i][0](stream_ptr)
                    continue
                if "dispatch" in stages:
                    launches[0](stream_ptr)
                if "experts" in stages:
                    received = self._buffers["received"].view(info.rank, bfloat16,
                                                               (self.receive_rows, shape.hidden))
                    w1s, w2s = experts
                    h, act = (s[i] for s in expert_scratch)
                    self._separate_experts(info, stream_ptr, received, w1s[i], w2s[i], h, act,
                                           offsets, own_results, shape, swiglu)
                if "combine" in stages:
                    launches[1](stream_ptr)
        if self._local_count != 1:
            self.release_to_caller_stream()

    def _separate_experts(self, info, stream_ptr, received, w1, w2, h, act, offsets, results,
                          shape: MoeShape, swiglu) -> None:
        """The experts in three launches: the w1 grouped GEMM into h, SwiGLU, the w2 one."""
        stream = self._stream(stream_ptr)
        sms = self.world.sm_count(info.rank)
        block_m, block_n = self._tile
        grouped_module.grouped_gemm(received, w1, offsets, out=h, sms=sms, stream=stream,
                                    block_m=block_m, block_n=block_n, epilogue="direct",
                                    cluster="", stream_k=False)
        with stream:
            swiglu((sms,), (256,), (h, act, offsets, np.int32(self.experts_per_rank),
                                    np.int32(shape.inter), np.int32(self.receive_rows)))
        grouped_module.grouped_gemm(act, w2, offsets, out=results, sms=sms, stream=stream,
                                    block_m=block_m, block_n=block_n, epilogue="direct",
                                    cluster="", stream_k=False)

    def _stream(self, stream_ptr: int):
        """A CuPy stream object for a rank's stream (made once per stream)."""
        stream = self._streams.get(stream_ptr)
        if stream is None:
            import cupy
            stream = self._streams[stream_ptr] = cupy.cuda.ExternalStream(stream_ptr)
        return stream

    def close(self) -> None:
        for name, buffer in list(self._buffers.items()):
            if name != "key":
                buffer.close()
        self._buffers = {}
        self._prepared = {}
        self._expert_words = {}


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
            ("1x3", [40, 40, 40], 8, 64, 64, 12, "uniform"),
            # several nodes: rows cross once per node through the proxy, sums come back
            ("2x1", [64, 33], 2, 128, 64, 4, "uniform"), ("2x2", [40, 0, 96, 17], 4, 256, 128, 16, "zipf"),
            ("2x2", [64] * 4, 8, 128, 64, 16, "uniform"), ("3x1", [30, 30, 30], 2, 64, 64, 6, "hot"),
            ("2x3", [24] * 6, 4, 64, 64, 12, "uniform")]


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
