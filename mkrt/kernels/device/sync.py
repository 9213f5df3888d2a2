"""Bounded waits on epoch flags, and the status block they report into.

Every wait in mkrt goes through ``mkrt::wait_at_least``: it acquire-loads a flag until it
reaches the expected epoch, backs off with ``nanosleep``, and gives up after the
context's timeout (``%globaltimer``). Giving up writes a record into the status block
(rank, role, CTA, tile, flag, expected, seen) and raises the block's abort word, which
every other wait on the device checks, so the whole launch drains instead of hanging.
The host reads the block (mkrt/status.py) and raises ``mkrt.CommTimeout``.

The block lives in device memory (atomics); a second word in pinned, mapped host memory
(``host_flag``) mirrors the abort word so the host sees a failure without synchronizing.

Status block layout, u64 words (mirrored by mkrt/status.py):
  [0] abort      nonzero once any wait on this device gave up
  [1] first      1 + slot of the first record written (0: none)
  [2] failures   how many waits gave up
  [8 + 8*slot + i]  record of slot: rank, role, cta, tile, flag, expected, seen, kernel id
"""

from mkrt.jit.render import cuda_source

# Must match mkrt/status.py.
STATUS_HEADER_WORDS = 8
STATUS_RECORD_WORDS = 8

SYNC = cuda_source("sync", r"""
namespace mkrt {
enum Role { ROLE_COMPUTE = 0, ROLE_INTRA = 1, ROLE_INTER = 2, ROLE_REDUCE = 3,
            ROLE_PROXY = 4, ROLE_TEST = 5 };

// What a launch needs to report failures: where its status slot is and its deadline.
struct Context {
    u64* status;        // the device's status block
    u64* host_flag;     // pinned host word the host polls for free
    int slot;           // this rank's record in it
    int rank;
    u64 timeout_ns;
    u64 kernel_id;      // which kernel, for the record
};

__device__ __forceinline__ bool aborted(const Context& ctx) {
    return ld_relaxed_sys(ctx.status) != 0;
}

__device__ __noinline__ void report_timeout(const Context& ctx, int role, int tile, int flag,
                                            u64 expected, u64 seen) {
    u64* record = ctx.status + 8 + 8 * ctx.slot;
    // The first failure of a slot keeps its record; later ones only count.
    if (atomicCAS((unsigned long long*)(record + 7), 0ull, ctx.kernel_id | (1ull << 63)) == 0ull) {
        record[0] = (u64)ctx.rank;
        record[1] = (u64)role;
        record[2] = (u64)blockIdx.x;
        record[3] = (u64)(i64)tile;
        record[4] = (u64)(i64)flag;
        record[5] = expected;
        record[6] = seen;
        __threadfence_system();
        atomicCAS((unsigned long long*)(ctx.status + 1), 0ull, (u64)(ctx.slot + 1));
    }
    atomicAdd((unsigned long long*)(ctx.status + 2), 1ull);
    __threadfence_system();
    st_release_sys(ctx.status, 1ull);
    st_release_sys(ctx.host_flag, 1ull);
}

constexpr int PROXY_ERROR_FLAG = -2;   // recorded flag of a wait its error word ended

// Wait (one thread) until *flag >= expected. False: timed out, the launch aborted, or
// `error_word` (optional: a proxy's error word in mapped host memory) became nonzero;
// the caller must then leave the kernel. Polls without sleeping for the first 64 reads
// (a proxy's answer is ~1 us away), then backs off up to 256 ns between reads.
__device__ __noinline__ bool wait_at_least(const u64* flag, u64 expected, const Context& ctx,
                              int role, int tile, int flag_id,
                              const u64* error_word = nullptr) {
    u64 seen = ld_acquire_sys(flag);
    if (seen >= expected) return true;
    const u64 start = global_timer_ns();
    u32 backoff = 0;
    for (unsigned spin = 0;; ++spin) {
        seen = ld_acquire_sys(flag);
        if (seen >= expected) return true;
        if ((spin & 63) == 63) {
            if (aborted(ctx)) return false;
            if (error_word != nullptr) {
                const u64 error = ld_relaxed_sys(error_word);
                if (error != 0) {
                    report_timeout(ctx, role, tile, PROXY_ERROR_FLAG, expected, error);
                    return false;
                }
            }
            if (global_timer_ns() - start > ctx.timeout_ns) {
                report_timeout(ctx, role, tile, flag_id, expected, seen);
                return false;
            }
            backoff = backoff == 0 ? 32 : (backoff < 256 ? backoff << 1 : 256);
        }
        if (backoff) sleep_ns(backoff);
    }
}

// The whole CTA waits: thread 0 polls, the others park at the barrier.
__device__ bool cta_wait_at_least(const u64* flag, u64 expected, const Context& ctx,
                                  int role, int tile, int flag_id) {
    __shared__ int reached;
    if (threadIdx.x == 0) reached = wait_at_least(flag, expected, ctx, role, tile, flag_id);
    __syncthreads();
    const bool ok = reached;
    __syncthreads();
    return ok;
}

// End of a launch, one thread per CTA (mkrt/DESIGN.md, "Epochs and bounded waits"): count
// the CTA out of `finished`; the last CTA out (true) publishes `ctas_before` and the
// launch's epoch for the next launch, which starts only once this one is complete.
__device__ __forceinline__ bool finish_launch(u64* finished, u64* ctas_before, u64* launches,
                                              u64 epoch, u64 all_ctas) {
    __threadfence();
    const u64 done = fetch_add_acq_rel_gpu(finished, 1) + 1;
    if (done != all_ctas) return false;
    st_release_gpu(ctas_before, all_ctas);
    st_release_gpu(launches, epoch);
    return true;
}
}  // namespace mkrt
""", requires=("base",))
