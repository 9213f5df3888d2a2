"""Asynchronous copies into shared memory: mbarriers and TMA tile loads (sm_90).

Two pieces, both small:

* ``mbarrier`` -- the shared-memory barrier that asynchronous copies complete on. A
  barrier counts arrivals *and* bytes: the producer announces how many bytes a stage will
  receive (``mbarrier_arrive_expect_tx``), the copy engine counts them down as they land,
  and the phase flips when both reach zero. Waiters poll the phase *parity*.
* ``tma`` -- ``cp.async.bulk.tensor`` 2-D tile loads described by a tensor map
  (``TmaDescriptor``, the driver's 128-byte ``CUtensorMap``, built on the host by
  ``mkrt.kernels.gemm.tma_descriptor_2d`` and passed as a ``__grid_constant__`` kernel
  parameter). Elements outside the tensor are filled with zeros, which is what makes
  partial edge tiles of a GEMM free: no bounds checks in the main loop.

The waits here are local to one CTA or its cluster (a stage of its own pipeline, or one a
cluster peer's multicast fills), so they need no timeout: the copy engine or a sibling
warp always completes them.
"""

from mkrt.jit.render import cuda_source

MBARRIER = cuda_source("mbarrier", r"""
namespace mkrt {
// 32-bit shared-window address of a generic pointer to shared memory (what PTX wants).
__device__ __forceinline__ u32 smem_address(const void* pointer) {
    return (u32)__cvta_generic_to_shared(pointer);
}

__device__ __forceinline__ void mbarrier_init(u64* barrier, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;"
                 :: "r"(smem_address(barrier)), "r"(arrivals) : "memory");
}

// Make initialised barriers visible to the async proxy (TMA) and the other threads;
// follow with a CTA barrier.
__device__ __forceinline__ void mbarrier_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive(u64* barrier) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];"
                 :: "r"(smem_address(barrier)) : "memory");
}

// One arrival that also announces `bytes` still to land from asynchronous copies.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(u64* barrier, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(smem_address(barrier)), "r"(bytes) : "memory");
}

// One arrival on the barrier at the same shared-memory offset in CTA `cta` of this
// cluster (this CTA included): a consumer frees a stage that a peer's multicast fills.
// Release at CTA scope (the default), as for a local arrival: what it orders are this
// warp's finished reads of the stage, before the copy that overwrites it. With a
// cluster-scope release every k-step of the clusters of two took about 1 us at any grid
// (experiments/results/gemm_probe.jsonl, a0cde01).
__device__ __forceinline__ void mbarrier_arrive_cluster(u64* barrier, u32 cta) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                 : "=r"(remote) : "r"(smem_address(barrier)), "r"(cta));
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];"
                 :: "r"(remote) : "memory");
}

// This CTA's rank in its cluster, and a barrier of every thread of every CTA of the
// cluster (release/acquire: barriers initialised before it are seen by the peers). Not
// .aligned: a warp may arrive diverged (the producer thread comes later than its warp).
__device__ __forceinline__ u32 cluster_rank() {
    u32 rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    return rank;
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\n"
                 "barrier.cluster.wait.acquire;" ::: "memory");
}

// Programmatic dependent launch (sm_90): wait until the kernels this one was launched to
// overlap have completed and their memory is visible; at once when launched plainly.
__device__ __forceinline__ void grid_dependency_wait() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
}

// Wait until the phase with this parity has completed. A fresh barrier is in phase 0,
// so waiting for parity 1 returns at once ("the phase before the first" counts as done):
// that is how a producer starts on empty slots without a special case.
__device__ __forceinline__ void mbarrier_wait(u64* barrier, u32 parity) {
    const u32 address = smem_address(barrier);
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" :: "r"(address), "r"(parity) : "memory");
}
}  // namespace mkrt
""", requires=("base",))

TMA = cuda_source("tma", r"""
namespace mkrt {
// The driver's CUtensorMap: opaque, 128 bytes, 64-byte aligned. Built on the host.
struct alignas(64) TmaDescriptor { u64 words[16]; };

// Pull the descriptor into the TMA unit's cache ahead of the first load.
__device__ __forceinline__ void tma_prefetch_descriptor(const TmaDescriptor* descriptor) {
    asm volatile("prefetch.tensormap [%0];" :: "l"(descriptor) : "memory");
}

// Load the box at element coordinates (inner, outer) of a 2-D tensor map into shared
// memory at `destination` (aligned as the map's swizzle needs: 1024 B for 128B swizzle).
// Completion is counted in bytes on `barrier`. Out-of-range elements arrive as zeros,
// and the byte count is always the full box.
__device__ __forceinline__ void tma_load_2d(void* destination, const TmaDescriptor* descriptor,
                                            int inner, int outer, u64* barrier) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];"
        :: "r"(smem_address(destination)), "l"(descriptor), "r"(inner), "r"(outer),
           "r"(smem_address(barrier))
        : "memory");
}

// The same box, delivered to the same shared-memory offset in every CTA of `cta_mask`
// (bit i: cluster rank i), each counting the bytes on its own barrier at `barrier`'s offset.
__device__ __forceinline__ void tma_load_2d_multicast(void* destination, const TmaDescriptor* descriptor,
                                                      int inner, int outer, u64* barrier,
                                                      unsigned short cta_mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%2, %3}], [%4], %5;"
        :: "r"(smem_address(destination)), "l"(descriptor), "r"(inner), "r"(outer),
           "r"(smem_address(barrier)), "h"(cta_mask)
        : "memory");
}

// The same for a 4-D tensor map (coordinates innermost first), e.g. one head's rows of a
// [B, S, H, D] tensor: box (64, 1, rows, 1) lands as `rows` rows of 128 bytes.
__device__ __forceinline__ void tma_load_4d(void* destination, const TmaDescriptor* descriptor,
                                            int c0, int c1, int c2, int c3, u64* barrier) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5}], [%6];"
        :: "r"(smem_address(destination)), "l"(descriptor), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
           "r"(smem_address(barrier))
        : "memory");
}

// And 5-D (e.g. [sources][B, S, H, D]: which rank's copy of a tensor is the outermost).
__device__ __forceinline__ void tma_load_5d(void* destination, const TmaDescriptor* descriptor,
                                            int c0, int c1, int c2, int c3, int c4, u64* barrier) {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];"
        :: "r"(smem_address(destination)), "l"(descriptor), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
           "r"(c4), "r"(smem_address(barrier))
        : "memory");
}

// Store the box at element coordinates (inner, outer) of a 2-D tensor map from shared
// memory (laid out as the map's swizzle says). Out-of-range elements are not written,
// so partial edge tiles need no masking. Tracked by bulk groups of the issuing thread.
__device__ __forceinline__ void tma_store_2d(const TmaDescriptor* descriptor, const void* source,
                                             int inner, int outer) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];"
                 :: "l"(descriptor), "r"(smem_address(source)), "r"(inner), "r"(outer)
                 : "memory");
}
__device__ __forceinline__ void tma_store_commit() {
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// Until at most IN_FLIGHT store groups still *read* shared memory (the source may be reused).
template <int IN_FLIGHT> __device__ __forceinline__ void tma_store_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(IN_FLIGHT) : "memory");
}
// Until at most IN_FLIGHT store groups are incomplete (writes done).
template <int IN_FLIGHT> __device__ __forceinline__ void tma_store_wait() {
    asm volatile("cp.async.bulk.wait_group %0;" :: "n"(IN_FLIGHT) : "memory");
}

// Ordinary shared-memory stores that TMA or the tensor cores read next need this fence
// in each writing thread before the barrier that publishes them.
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// Generic-proxy writes to global memory (another rank's stores, acquired through a flag)
// become visible to this thread's later TMA (async-proxy) reads.
__device__ __forceinline__ void fence_proxy_async_global() {
    asm volatile("fence.proxy.async.global;" ::: "memory");
}
}  // namespace mkrt
""", requires=("mbarrier",))
