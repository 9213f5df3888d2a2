"""The smallest shared vocabulary: integer types, scoped loads/stores, the clock.

Scopes are explicit in every name: ``_sys`` is visible to other GPUs and the host
(peer memory, pinned host memory), ``_gpu`` to the whole device.
"""

from mkrt.jit.render import cuda_source

BASE = cuda_source("base", r"""
namespace mkrt {
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;

__device__ __forceinline__ u64 ld_acquire_sys(const u64* address) {
    u64 value;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(address) : "memory");
    return value;
}
__device__ __forceinline__ u64 ld_acquire_gpu(const u64* address) {
    u64 value;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(value) : "l"(address) : "memory");
    return value;
}
__device__ __forceinline__ u64 ld_relaxed_sys(const u64* address) {
    u64 value;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(address) : "memory");
    return value;
}
__device__ __forceinline__ void st_release_sys(u64* address, u64 value) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" :: "l"(address), "l"(value) : "memory");
}
__device__ __forceinline__ void st_release_gpu(u64* address, u64 value) {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" :: "l"(address), "l"(value) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys(u64* address, u64 value) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" :: "l"(address), "l"(value) : "memory");
}
// Returns the old value; acq_rel at gpu scope (counters shared by the CTAs of one kernel).
__device__ __forceinline__ u64 fetch_add_acq_rel_gpu(u64* address, u64 value) {
    u64 old;
    asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], %2;"
                 : "=l"(old) : "l"(address), "l"(value) : "memory");
    return old;
}
__device__ __forceinline__ void fence_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// Nanoseconds; ticks coarsely (about 1 us) but never stops, unlike clock64 across SMs.
__device__ __forceinline__ u64 global_timer_ns() {
    u64 now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    return now;
}
__device__ __forceinline__ void sleep_ns(u32 ns) { asm volatile("nanosleep.u32 %0;" :: "r"(ns)); }
}  // namespace mkrt
""")
