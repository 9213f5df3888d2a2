"""Cooperative byte copies: many threads (of one CTA or of a grid) move one span.

16-byte vector loads and stores, four in flight per thread, when both ends and the size
are 16-byte aligned; a byte loop otherwise (correct for any size, slow).
"""

from mkrt.jit.render import cuda_source

COPY = cuda_source("copy", r"""
namespace mkrt {
// Thread `worker` of `workers` copies its share of [src, src + nbytes) to dst.
__device__ __forceinline__ void copy_span(void* dst, const void* src, u64 nbytes,
                                          u64 worker, u64 workers) {
    if ((((u64)dst | (u64)src | nbytes) & 15) == 0) {
        uint4* d = (uint4*)dst;
        const uint4* s = (const uint4*)src;
        const u64 vectors = nbytes / 16;
        u64 v = worker;
        for (; v + 3 * workers < vectors; v += 4 * workers) {
            const uint4 a = s[v], b = s[v + workers], c = s[v + 2 * workers], e = s[v + 3 * workers];
            d[v] = a; d[v + workers] = b; d[v + 2 * workers] = c; d[v + 3 * workers] = e;
        }
        for (; v < vectors; v += workers) d[v] = s[v];
    } else {
        unsigned char* d = (unsigned char*)dst;
        const unsigned char* s = (const unsigned char*)src;
        for (u64 i = worker; i < nbytes; i += workers) d[i] = s[i];
    }
}
}  // namespace mkrt
""", requires=("base",))
