"""Pieces of an all-gather that a kernel's communication CTAs share: waiting for a set of
flag words as one CTA, spreading one span to several peers' memory, and counting the
CTAs of a launch that finished a step (mkrt.allgather and AllGather+GEMM use them)."""

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
// dst[i], reading src once; destinations in rotated order from `first` so concurrent
// senders spread over the node's links.
__device__ void scatter_span(unsigned char* const* dst, int count, int first,
                             const unsigned char* src, u64 nbytes, u64 worker, u64 workers) {
    u64 bits = (u64)src | nbytes;
    for (int i = 0; i < count; ++i) bits |= (u64)dst[i];
    if ((bits & 15) == 0) {
        const uint4* s = (const uint4*)src;
        const u64 vectors = nbytes / 16;
        u64 v = worker;
        for (; v + 3 * workers < vectors; v += 4 * workers) {
            const uint4 a = s[v], b = s[v + workers], c = s[v + 2 * workers], e = s[v + 3 * workers];
            for (int i = 0; i < count; ++i) {
                uint4* d = (uint4*)dst[(first + i) % count];
                if (d == nullptr) continue;
                d[v] = a; d[v + workers] = b; d[v + 2 * workers] = c; d[v + 3 * workers] = e;
            }
        }
        for (; v < vectors; v += workers) {
            const uint4 a = s[v];
            for (int i = 0; i < count; ++i) {
                uint4* d = (uint4*)dst[(first + i) % count];
                if (d != nullptr) d[v] = a;
            }
        }
    } else {
        for (u64 k = worker; k < nbytes; k += workers) {
            const unsigned char a = src[k];
            for (int i = 0; i < count; ++i) if (dst[i] != nullptr) dst[i][k] = a;
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
