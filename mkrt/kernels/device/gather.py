"""Pieces of an all-gather that a kernel's communication CTAs share: waiting for a set of
flag words as one CTA, spreading one span to several peers' memory, and counting the
CTAs of a launch that finished a step (mkrt.allgather and AllGather+GEMM use them); and
the whole gathering role of a fused kernel (``gather_role``: AllGather+GEMM gathers A,
ring attention K and V) with its flag words (``GatheredFlags``)."""

from mkrt.jit.render import cuda_source

GATHER = cuda_source("gather", r"""
namespace mkrt {
// The CTA waits until flags[word0 + i * step] >= expected for i in [0, count), i != skip;
// thread i (mod blockDim) polls word i, through the proxy's error word when q is given.
// A timeout records tile tile0 + i * tile_step. All threads agree on the outcome.
__device__ bool cta_wait_words(const u64* flags, int word0, int step, int count, int skip,
                               u64 expected, const Context& ctx, int role, int tile0,
                               int tile_step, const Queue* q) {
    bool ok = true;
    for (int i = threadIdx.x; i < count && ok; i += blockDim.x) {
        if (i == skip) continue;
        const int word = word0 + i * step, tile = tile0 + i * tile_step;
        ok = q != nullptr ? proxy_wait_at_least(flags + word, expected, ctx, *q, role, tile, word)
                          : wait_at_least(flags + word, expected, ctx, role, tile, word);
    }
    return __syncthreads_and(ok);
}

// Thread `worker` of `workers` copies its share of [src, src + nbytes) to each non-null
// dst[i], at dst[i] + offset, reading src once; destinations in rotated order from
// `first` so concurrent senders spread over the node's links.
__device__ void scatter_span(unsigned char* const* dst, int count, int first,
                             const unsigned char* src, u64 nbytes, u64 worker, u64 workers,
                             u64 offset = 0) {
    u64 bits = (u64)src | nbytes | offset;
    for (int i = 0; i < count; ++i) bits |= (u64)dst[i];
    if ((bits & 15) == 0) {
        const uint4* s = (const uint4*)src;
        const u64 vectors = nbytes / 16;
        u64 v = worker;
        for (; v + 3 * workers < vectors; v += 4 * workers) {
            const uint4 a = s[v], b = s[v + workers], c = s[v + 2 * workers], e = s[v + 3 * workers];
            for (int i = 0; i < count; ++i) {
                unsigned char* base = dst[(first + i) % count];
                if (base == nullptr) continue;
                uint4* d = (uint4*)(base + offset);
                d[v] = a; d[v + workers] = b; d[v + 2 * workers] = c; d[v + 3 * workers] = e;
            }
        }
        for (; v < vectors; v += workers) {
            const uint4 a = s[v];
            for (int i = 0; i < count; ++i) {
                unsigned char* base = dst[(first + i) % count];
                if (base != nullptr) ((uint4*)(base + offset))[v] = a;
            }
        }
    } else {
        for (u64 k = worker; k < nbytes; k += workers) {
            const unsigned char a = src[k];
            for (int i = 0; i < count; ++i) if (dst[i] != nullptr) dst[i][offset + k] = a;
        }
    }
}

// This CTA's stores are done: fence them (system scope: peers and the proxy read them),
// count the CTA in `counter`; true in thread 0 of the last CTA of this launch.
__device__ __forceinline__ bool last_cta_done(u64* counter, u64 all_ctas) {
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x != 0) return false;
    return fetch_add_acq_rel_gpu(counter, 1) + 1 == all_ctas;
}
}  // namespace mkrt
""", requires=("sync", "queue"))


GATHER_ROLE = cuda_source("gather_role", r"""
namespace mkrt {
constexpr int GATHER_MAX_CHUNKS = 64;      // chunk flags per block (mirror: mkrt.kernels.gathering)
// The flag words of a kernel that gathers one block per rank into every rank's symmetric
// `gathered` buffer (mirror: mkrt.kernels.allgather_gemm.FlagLayout). G ranks per node,
// N nodes.
struct GatheredFlags {
    int G, N;
    __device__ int arrive(int p) const { return p; }                 // node peer p's launch began
    __device__ int node_arrive(int n) const { return G + n; }        // rank (n, me) began (proxy)
    __device__ int ready(int b) const { return G + N + b; }          // block b is in our buffer
    __device__ int pushed() const { return G + N + N * G; }          // communication CTA counters
    __device__ int forwarded(int n) const { return pushed() + 1 + n; }
    __device__ int comm_before() const { return pushed() + 1 + N; }  // comm CTAs of earlier launches
    __device__ int finished() const { return comm_before() + 1; }    // every CTA, all launches
    __device__ int ctas_before() const { return finished() + 1; }
    __device__ int launches() const { return finished() + 2; }
    // chunk c of block b is in our buffer (blocks are spread in gather_chunks() chunks)
    __device__ int chunk(int b, int c) const { return finished() + 3 + b * GATHER_MAX_CHUNKS + c; }
    // tiles claimed this launch by a compute role that draws from a queue (AllGather+GEMM);
    // the last CTA out resets it
    __device__ int claims() const { return chunk(N * G, 0); }
    // ring attention's K/V slots: rank (n, me) has our data's slot free up to step (value
    // epoch x W + step) (its credit, through the proxy)
    __device__ int credit(int n) const { return claims() + 1 + n; }
    // ... and every forward out of the slot of our step s is done (value epoch)
    __device__ int forwarded_step(int s) const { return credit(N) + s; }
};

// Blocks are spread chunk by chunk, a CTA copying whole chunks, so the compute role can
// start on a block's first rows before its last have arrived. A kernel whose host split
// has comm_ctas communication CTAs cuts each block in gather_chunks(comm_ctas, want)
// chunks (a multiple of comm_ctas, so every CTA copies as many; at least `want` where
// that fits). Every rank must cut alike (a rank waits for chunks of other ranks' blocks
// by its own count), so the count comes from the host's split, the same on every rank,
// not from a launch's (roles="search" may give ranks different splits: a CTA then copies
// chunks comm, comm + comm_ctas, .. of the same chunks, some one more than others).
// Chunk c of an nbytes block is bytes [chunk_begin(nbytes, c, chunks),
// chunk_begin(.., c + 1, ..)), 16-byte aligned.
__device__ __forceinline__ int gather_chunks(int comm_ctas, int want = 16) {
    return min(comm_ctas * ((want + comm_ctas - 1) / comm_ctas), GATHER_MAX_CHUNKS);
}
__device__ __forceinline__ u64 chunk_begin(u64 nbytes, int c, int chunks) {
    return c >= chunks ? nbytes : (nbytes * (u64)c / (u64)chunks) & ~(u64)15;
}
// The chunk holding byte x < nbytes: the estimate, moved past chunks that chunk_begin's
// rounding left ending at or before x (one step unless chunks are under 16 bytes).
__device__ __forceinline__ int chunk_holding(u64 nbytes, u64 x, int chunks) {
    int c = min((int)(x * (u64)chunks / nbytes), chunks - 1);
    while (c + 1 < chunks && chunk_begin(nbytes, c + 1, chunks) <= x) ++c;
    return c;
}
// The k-th chunk a launch copies. A block of two equal spans (ring attention's K and V)
// goes K0, V0, K1, V1, ...: the rows a consumer needs first are whole soonest.
__device__ __forceinline__ int chunk_at(int k, int chunks, bool pairs) {
    return pairs ? (k & 1) * (chunks / 2) + (k >> 1) : k;
}

// What the gathering role needs. A rank's block is its two input spans back to back
// (input1 may be empty): block b of the gathered buffer is at b * (bytes0 + bytes1).
struct GatherArgs {
    const unsigned char* input0;
    u64 bytes0;
    const unsigned char* input1;
    u64 bytes1;
    unsigned char* gathered;    // this rank's gathered buffer (symmetric)
    u64* flags;                 // this rank's flag words
    const u64* peer_flags;      // [G] node peers' flag words
    const u64* peer_gathered;   // [G] node peers' gathered buffers
    const Queue* queue;         // the proxy queue (several nodes)
    int me, node, G, N;
    int gathered_region, flags_region;
    int chunks;                 // chunks per block (gather_chunks of the host's split)
    bool own_in_input;          // the compute reads our block from the inputs: no copy of it
                                // into our own buffer on one node (several: the puts read it)
};

constexpr int GATHER_MAX_NODE_RANKS = 32;

// The gathering role of a kernel whose Args carries the role's fields under these names
// (gathered, flags, peer_flags, peer_gathered, queue, me, node, G, N, gathered_region,
// flags_region), with the rank's block as the spans input0 and input1.
template <class A>
__device__ __forceinline__ GatherArgs gather_args(const A& a, const void* input0, u64 bytes0,
                                                  const void* input1, u64 bytes1, int chunks) {
    return GatherArgs{(const unsigned char*)input0, bytes0, (const unsigned char*)input1, bytes1,
                      (unsigned char*)a.gathered, a.flags, a.peer_flags, a.peer_gathered, a.queue,
                      a.me, a.node, a.G, a.N, a.gathered_region, a.flags_region, chunks};
}

// A gathering kernel's launch bookkeeping: this launch's epoch and CTA counts, from the
// words the previous launch on this stream left (stable: that launch is complete); at
// the end, the last CTA out publishes them for the next launch.
struct GatherLaunch {
    u64 epoch, all_ctas, comm_all;

    __device__ static GatherLaunch begin(const u64* flags, const GatheredFlags& L, int comm_ctas) {
        __shared__ u64 words[3];
        if (threadIdx.x == 0) {
            words[0] = ld_acquire_gpu(flags + L.launches()) + 1;
            words[1] = ld_acquire_gpu(flags + L.ctas_before());
            words[2] = ld_acquire_gpu(flags + L.comm_before());
        }
        __syncthreads();
        return GatherLaunch{words[0], words[1] + gridDim.x, words[2] + comm_ctas};
    }
    __device__ void end(u64* flags, const GatheredFlags& L) const {
        __syncthreads();
        if (threadIdx.x == 0 && finish_launch(flags + L.finished(), flags + L.ctas_before(),
                                              flags + L.launches(), epoch, all_ctas)) {
            st_release_gpu(flags + L.comm_before(), comm_all);
            st_release_gpu(flags + L.claims(), 0);   // every CTA has claimed its last tile
        }
    }
};

// The compute role's wait for flags[word] >= epoch, written inline: a call here, in an
// engine's producer or consumer, makes ptxas spill around it. The same bound, backoff and
// abort checks as wait_at_least; a timeout is reported as `tile` of the compute role, with
// flag `reported` (default: the word). The caller fences for TMA once its blocks are in.
__device__ __forceinline__ bool wait_gathered_word(const u64* flags, int word, u64 epoch,
                                                   const Context& ctx, int tile, int reported = -1) {
    const u64* flag = flags + word;
    u64 seen = ld_acquire_sys(flag);
    if (seen >= epoch) return true;
    const u64 start = global_timer_ns();
    u32 backoff = 0;
    for (unsigned spin = 0; seen < epoch; ++spin) {
        if ((spin & 63) == 63) {
            if (aborted(ctx)) return false;
            if (global_timer_ns() - start > ctx.timeout_ns) {
                report_timeout(ctx, ROLE_COMPUTE, tile, reported == -1 ? word : reported, epoch, seen);
                return false;
            }
            backoff = backoff == 0 ? 32 : (backoff < 256 ? backoff << 1 : 256);
        }
        if (backoff) sleep_ns(backoff);
        seen = ld_acquire_sys(flag);
    }
    return true;
}

// The compute role's wait for rows [row0, row1] of block `block` (`rows` rows of
// `row_bytes` each): only the chunks that hold them.
__device__ __forceinline__ bool wait_gathered_rows(const u64* flags, const GatheredFlags& L, int block,
                                                   int row0, int row1, u64 row_bytes, int rows,
                                                   int chunks, u64 epoch, const Context& ctx, int tile) {
    const u64 nbytes = (u64)rows * row_bytes;
    const int last = chunk_holding(nbytes, (u64)(row1 + 1) * row_bytes - 1, chunks);
    for (int c = chunk_holding(nbytes, (u64)row0 * row_bytes, chunks); c <= last; ++c)
        if (!wait_gathered_word(flags, L.chunk(block, c), epoch, ctx, tile)) return false;
    return true;
}

// Chunk c of a block made of two spans back to back ([src0, src0 + bytes0) then src1;
// nbytes in all), copied by this CTA to each non-null target (block starts).
__device__ __forceinline__ void spread_chunk(unsigned char* const* targets, int count, int first,
                                             const unsigned char* src0, u64 bytes0,
                                             const unsigned char* src1, u64 nbytes, int c,
                                             int chunks) {
    const u64 x0 = chunk_begin(nbytes, c, chunks), x1 = chunk_begin(nbytes, c + 1, chunks);
    if (x0 < bytes0)
        scatter_span(targets, count, first, src0 + x0, min(x1, bytes0) - x0, threadIdx.x,
                     blockDim.x, x0);
    if (x1 > bytes0) {
        const u64 y0 = max(x0, bytes0);
        scatter_span(targets, count, first, src1 + (y0 - bytes0), x1 - y0, threadIdx.x, blockDim.x, y0);
    }
}

// The communication CTAs (comm of comm_ctas) of one launch: mkrt.allgather's steps into
// `gathered`, chunk by chunk. Each block crosses to each other node once, through the
// proxy, to the rank with the same local index, and is spread inside the node with peer
// stores; chunk(b, c) at a rank says chunk c of block b is in its buffer, ready(b) that all
// of it is. A rank writes into a peer's buffer only after the peer's launch has begun
// (arrive), so the peer's previous call has read it.
__device__ __noinline__ void gather_role(const GatherArgs& a, u64 epoch, const Context& ctx,
                                         int comm, int comm_ctas, u64 comm_all, bool muted) {
    const GatheredFlags L{a.G, a.N};
    __shared__ unsigned char* targets[GATHER_MAX_NODE_RANKS];
    const u64 nbytes = a.bytes0 + a.bytes1;
    const int mine = a.node * a.G + a.me;
    const int chunks = a.chunks;
    const bool pairs = a.bytes1 == a.bytes0 && chunks % 2 == 0;
    const int poster = blockDim.x - 1;

    // 1. arrive: node peers may now write into our buffer (our previous call has read it);
    // rank `me` of every other node may send into it.
    if (comm == 0 && threadIdx.x < a.G) {
        st_release_sys((u64*)a.peer_flags[threadIdx.x] + L.arrive(a.me), epoch);
    }
    if (a.N > 1 && comm == 0 && threadIdx.x == poster) {
        const Queue q = *a.queue;
        for (int step = 1; step < a.N; ++step) {
            const int other = (a.node + step) % a.N;
            if (post_signal(q, ctx, (unsigned)(other * a.G + a.me), (unsigned)a.flags_region,
                            (u64)L.node_arrive(a.node) * 8, epoch, ROLE_INTER, mine) == POST_FAILED) break;
        }
    }

    // 2. push and send: our block into every node rank's buffer, chunk by chunk (this CTA
    // copies chunks chunk_at(comm), chunk_at(comm + comm_ctas), ...), reading the inputs
    // once; chunk(mine, c) at each rank it was copied to says chunk c is there. With
    // several nodes our own buffer gets it too, and each chunk, once there, is put to
    // rank `me` of every other node with chunk(mine, c) as the landed flag: the puts read
    // our buffer (registered memory), and a chunk starts across as soon as it is copied.
    // Node ranks must have arrived; other nodes too before our own buffer is overwritten:
    // rank `me` there began this launch only after its last one saw our last put land, so
    // the proxy no longer reads the span we overwrite.
    if (!cta_wait_words(a.flags, L.arrive(0), 1, a.G, -1, epoch, ctx, ROLE_INTRA, a.node * a.G, 1,
                        nullptr))
        return;
    if (a.N > 1 && !cta_wait_words(a.flags, L.node_arrive(0), 1, a.N, a.node, epoch, ctx, ROLE_INTER,
                                   mine, 0, a.queue))
        return;
    __syncthreads();          // targets is rewritten below
    if (threadIdx.x < a.G) {
        const int p = threadIdx.x;
        // one node, with our compute reading the inputs: nobody reads our own copy
        targets[p] = (p == a.me && a.N == 1 && a.own_in_input) ? nullptr
                     : (unsigned char*)a.peer_gathered[p] + (u64)mine * nbytes;
    }
    __syncthreads();
    for (int k = comm; k < chunks && !muted; k += comm_ctas) {
        const int c = chunk_at(k, chunks, pairs);
        spread_chunk(targets, a.G, (a.me + 1) % a.G, a.input0, a.bytes0, a.input1, nbytes, c, chunks);
        __threadfence_system();
        __syncthreads();
        if (threadIdx.x < a.G && targets[threadIdx.x] != nullptr)
            st_release_sys((u64*)a.peer_flags[threadIdx.x] + L.chunk(mine, c), epoch);
        if (a.N > 1 && threadIdx.x == poster) {
            const Queue q = *a.queue;
            const u64 x0 = chunk_begin(nbytes, c, chunks), x1 = chunk_begin(nbytes, c + 1, chunks);
            const u64 at = (u64)mine * nbytes + x0;
            for (int step = 1; step < a.N; ++step) {
                const int other = (a.node + step) % a.N;
                if (post_put_signal(q, ctx, (unsigned)(other * a.G + a.me), (unsigned)a.gathered_region,
                                    at, (unsigned)a.gathered_region, at, x1 - x0, (unsigned)a.flags_region,
                                    (u64)L.chunk(mine, c) * 8, epoch, ROLE_INTER, mine) == POST_FAILED)
                    break;
            }
        }
    }
    if (last_cta_done(a.flags + L.pushed(), comm_all) && !muted) {
        for (int p = 0; p < a.G; ++p) st_release_sys((u64*)a.peer_flags[p] + L.ready(mine), epoch);
    }

    // 3. forward: the block of rank `me` of each other node to every other rank of the
    // node, each chunk as soon as it has landed here (the chunks this CTA copied in step 2);
    // ready(block) everywhere in the node once every chunk has been forwarded.
    for (int step = 1; step < a.N; ++step) {
        const int other = (a.node + a.N - step) % a.N;
        const int block = other * a.G + a.me;
        __syncthreads();      // targets is rewritten below
        if (threadIdx.x < a.G) {
            const int p = threadIdx.x;
            targets[p] = p == a.me ? nullptr : (unsigned char*)a.peer_gathered[p] + (u64)block * nbytes;
        }
        __syncthreads();
        const unsigned char* landed = a.gathered + (u64)block * nbytes;
        for (int k = comm; k < chunks; k += comm_ctas) {
            const int c = chunk_at(k, chunks, pairs);
            if (!cta_wait_words(a.flags, L.chunk(block, c), 0, 1, -1, epoch, ctx, ROLE_INTER, block, 0,
                                a.queue))
                return;
            spread_chunk(targets, a.G, (a.me + 1) % a.G, landed, nbytes, nullptr, nbytes, c, chunks);
            __threadfence_system();
            __syncthreads();
            if (threadIdx.x < a.G && targets[threadIdx.x] != nullptr)
                st_release_sys((u64*)a.peer_flags[threadIdx.x] + L.chunk(block, c), epoch);
        }
        if (last_cta_done(a.flags + L.forwarded(other), comm_all)) {
            for (int p = 0; p < a.G; ++p) st_release_sys((u64*)a.peer_flags[p] + L.ready(block), epoch);
        }
    }
}
}  // namespace mkrt
""", requires=("gather", "sync", "queue"))
