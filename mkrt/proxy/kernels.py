"""Kernels that exercise the queue: GPU tests and experiments/proxy.py use them.

* ``post_puts``: CTA b posts `count` put+signal commands on queue ``b % queues``: chunk i
  of `chunk` bytes from (its rank, region 0, (b*count+i)*chunk) to (dst_rank, region 0,
  same offset), signalling (dst_rank, flag_region, 8*b) = i+1 after every
  `signal_every`-th chunk and the last. Then it waits, bounded,
  for its own flag on the destination (a device pointer) to reach `count`.
* ``hold_sms_until``: every thread slot of the GPU held until a flag is set (can a
  proxy copy run while persistent CTAs occupy every SM?).
* ``post_signals``: CTA b posts `count` signals (value i+1) to (rank, flag_region, 8*b).
* ``ping_pong_proxy``: one thread: post a signal to itself, wait for it, `iters` times,
  cycles per round trip into `cycles` (through a shared or an owned queue).
* ``ping_pong_raw``: the reference: release-store a word in mapped host memory, wait for
  a host thread's answer, `iters` times.
* ``elapsed``: globaltimer ns and clock64 of the whole loop, to convert cycles to ns.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mkrt.jit import cuda_source
from mkrt.jit.spec import KernelSpec
from mkrt.kernels import device as _device  # noqa: F401  (registers the shared CUDA pieces)
from mkrt.status import kernel_id

KERNELS = cuda_source("proxy_kernels", r"""
// Fields by name: robust to the Context growing (new fields start zeroed).
__device__ __forceinline__ mkrt::Context make_context(mkrt::u64* status, mkrt::u64* host_flag,
                                                      int rank, mkrt::u64 timeout_ns) {
    mkrt::Context ctx{};
    ctx.status = status; ctx.host_flag = host_flag; ctx.slot = 0; ctx.rank = rank;
    ctx.timeout_ns = timeout_ns; ctx.kernel_id = $KERNEL_ID;
    return ctx;
}
extern "C" __global__ void post_puts(const mkrt::Queue* queues, int nqueues, unsigned dst_rank,
                                     unsigned flag_region, const mkrt::u64* dst_flags,
                                     mkrt::u64 chunk, int count, int signal_every,
                                     mkrt::u64* status, mkrt::u64* host_flag,
                                     mkrt::u64 timeout_ns, mkrt::u64* result) {
    const mkrt::Context ctx = make_context(status, host_flag, (int)queues[0].rank, timeout_ns);
    if (threadIdx.x != 0) return;
    const mkrt::Queue q = queues[blockIdx.x % nqueues];   // registers (queue.py: Descriptors)
    const mkrt::u64 base = (mkrt::u64)blockIdx.x * count * chunk;
    for (int i = 0; i < count; ++i) {
        const mkrt::u64 offset = base + (mkrt::u64)i * chunk;
        const bool signal = (i + 1) % signal_every == 0 || i + 1 == count;
        const mkrt::u64 ticket = signal
            ? mkrt::post_put_signal(q, ctx, dst_rank, 0, offset, 0, offset, chunk, flag_region,
                                    8ull * blockIdx.x, (mkrt::u64)(i + 1), mkrt::ROLE_INTER, i)
            : mkrt::post_put(q, ctx, dst_rank, 0, offset, 0, offset, chunk, mkrt::ROLE_INTER, i);
        if (ticket == mkrt::POST_FAILED) { result[blockIdx.x] = 1; return; }
    }
    const bool ok = mkrt::proxy_wait_at_least(dst_flags + blockIdx.x, (mkrt::u64)count, ctx, q,
                                              mkrt::ROLE_INTER, count, (int)blockIdx.x);
    result[blockIdx.x] = ok ? 0 : 2;
}

// Every thread of every CTA stays resident until *flag >= expected (or timeout_ns, then
// result[cta] = 2). Launched as 2 CTAs x 1024 threads per SM it holds every thread slot
// of the GPU, so a proxy copy that needs an SM kernel cannot run until it gives up. (The
// spin is written out here: a call would not fit the 32 registers this occupancy allows.)
extern "C" __global__ void __launch_bounds__(1024, 2)
hold_sms_until(const mkrt::u64* flag, mkrt::u64 expected, mkrt::u64 timeout_ns,
               mkrt::u64* result) {
    if (threadIdx.x == 0) {
        const mkrt::u64 start = mkrt::global_timer_ns();
        mkrt::u64 outcome = 0;
        while (mkrt::ld_acquire_sys(flag) < expected)
            if (mkrt::global_timer_ns() - start > timeout_ns) { outcome = 2; break; }
        result[blockIdx.x] = outcome;
    }
    __syncthreads();
}

extern "C" __global__ void post_signals(const mkrt::Queue* queues, int nqueues, unsigned rank,
                                        unsigned flag_region, int count, mkrt::u64* status, mkrt::u64* host_flag,
                                        mkrt::u64 timeout_ns, mkrt::u64* result) {
    const mkrt::Context ctx = make_context(status, host_flag, (int)rank, timeout_ns);
    if (threadIdx.x != 0) return;
    const mkrt::Queue q = queues[blockIdx.x % nqueues];   // registers (queue.py: Descriptors)
    for (int i = 0; i < count; ++i)
        if (mkrt::post_signal(q, ctx, rank, flag_region, 8ull * blockIdx.x, (mkrt::u64)(i + 1),
                              mkrt::ROLE_INTER, i) == mkrt::POST_FAILED) {
            result[blockIdx.x] = 1; return;
        }
    result[blockIdx.x] = 0;
}

// One thread: post a signal to itself, wait for it, `iters` times. `owned`: 0 a shared
// queue; 1 an OwnedQueue (no claim atomic); 2 an OwnedQueue that skips every other slot
// (commands 128 bytes apart: only a responder that reads every other slot can answer);
// 3 a shared queue whose descriptor is read from device memory at every post (a
// reference into the array) instead of kept in registers. (Prefetching the next slot,
// the reference's inline wait loop and staggered polls were tried here: no gain or worse,
// experiments/notes/proxy.md.)
__device__ __forceinline__ void skip_slot(mkrt::OwnedQueue& o) { o.next += 1; }
__device__ __forceinline__ void skip_slot(const mkrt::Queue&) {}

template <class Q>
__device__ void ping_pong_loop(Q& poster, const mkrt::Queue& q, unsigned rank, unsigned flag_region,
                               mkrt::u64 flag_offset, const mkrt::u64* flag, int iters,
                               const mkrt::Context& ctx, long long* cycles, mkrt::u64* elapsed,
                               bool skip) {
    const mkrt::u64 t0 = mkrt::global_timer_ns();
    const long long c0 = clock64();
    long long last = c0;
    for (int i = 0; i < iters; ++i) {
        const mkrt::u64 ticket = mkrt::post_signal(poster, ctx, rank, flag_region, flag_offset,
                                                   (mkrt::u64)(i + 1));
        if (ticket == mkrt::POST_FAILED) return;
        if (skip) skip_slot(poster);
        if (!mkrt::proxy_wait_at_least(flag, (mkrt::u64)(i + 1), ctx, q, mkrt::ROLE_TEST, i, 0))
            return;
        const long long now = clock64();
        cycles[i] = now - last;
        last = now;
    }
    elapsed[0] = mkrt::global_timer_ns() - t0;
    elapsed[1] = (mkrt::u64)(clock64() - c0);
}

extern "C" __global__ void ping_pong_proxy(const mkrt::Queue* queues, unsigned rank,
                                           unsigned flag_region, mkrt::u64 flag_offset,
                                           const mkrt::u64* flag, int iters, mkrt::u64* status, mkrt::u64* host_flag,
                                           mkrt::u64 timeout_ns, long long* cycles,
                                           mkrt::u64* elapsed, int owned) {
    const mkrt::Context ctx = make_context(status, host_flag, (int)rank, timeout_ns);
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const mkrt::Queue q = queues[0];
    if (owned == 1 || owned == 2) {
        mkrt::OwnedQueue mine = mkrt::own_queue(q);
        ping_pong_loop(mine, q, rank, flag_region, flag_offset, flag, iters, ctx, cycles, elapsed,
                       owned == 2);
        mkrt::release_queue(mine);
    } else if (owned == 3) {     // the descriptor read from device memory at every post
        ping_pong_loop(queues[0], queues[0], rank, flag_region, flag_offset, flag, iters, ctx,
                       cycles, elapsed, false);
    } else {
        ping_pong_loop(q, q, rank, flag_region, flag_offset, flag, iters, ctx, cycles, elapsed,
                       false);
    }
}

extern "C" __global__ void command_layout(mkrt::u64* out) {
    mkrt::Command c;
    const char* base = reinterpret_cast<const char*>(&c);
    int i = 0;
$LAYOUT_PROBES
    out[i] = sizeof(mkrt::Command);
}

// The reference ping-pong; `extra` adds one part of a post before each store, to see
// what each costs: 1 = a claim atomic on device memory (`counter`), 2 = the 56 bytes of
// command words (st + 3 x st.v2) into the same host line first, 3 = both (a post's work);
// 4 = a new line each time (16 lines, 128 bytes apart; 64 bytes apart with 16 too).
extern "C" __global__ void ping_pong_raw(mkrt::u64* command, const mkrt::u64* answer, int iters,
                                         long long* cycles, mkrt::u64* elapsed, int extra,
                                         mkrt::u64* counter) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const mkrt::u64 t0 = mkrt::global_timer_ns();
    const long long c0 = clock64();
    long long last = c0;
    mkrt::u64 claimed = 0;
    const int stride = (extra & 16) ? 8 : 16;
    for (int i = 0; i < iters; ++i) {
        mkrt::u64* command_line = (extra & 4) ? command + stride * (i % 16) : command;
        if (extra & 1) claimed += atomicAdd((unsigned long long*)counter, 1ull);
        if (extra & 2) {
            asm volatile("st.global.u64 [%0], %1;" :: "l"(command_line + 1), "l"(claimed) : "memory");
            mkrt::st_v2_u64(command_line + 2, claimed, (mkrt::u64)i);
            mkrt::st_v2_u64(command_line + 4, claimed, (mkrt::u64)i);
            mkrt::st_v2_u64(command_line + 6, claimed, (mkrt::u64)i);
        }
        mkrt::st_release_sys(command_line, (mkrt::u64)(i + 1));
        const mkrt::u64 start = mkrt::global_timer_ns();
        while (mkrt::ld_acquire_sys(answer) < (mkrt::u64)(i + 1)) {
            if (mkrt::global_timer_ns() - start > 2000000000ull) return;   // 2 s: host gone
        }
        const long long now = clock64();
        cycles[i] = now - last;
        last = now;
    }
    elapsed[0] = mkrt::global_timer_ns() - t0;
    elapsed[1] = (mkrt::u64)(clock64() - c0);
    if (claimed == 1) counter[1] = claimed;    // keeps the atomics' results live
}
""", requires=("queue",), register=False)

KERNEL_ID = kernel_id("proxy_kernels")


@dataclasses.dataclass(frozen=True)
class ProxyKernelsSpec(KernelSpec):
    family = "proxy_kernels"
    entry_points = ("post_puts", "hold_sms_until", "post_signals", "ping_pong_proxy", "ping_pong_raw",
                    "command_layout")

    def template(self):
        return KERNELS

    def params(self):
        from mkrt.proxy.queue import COMMAND_DTYPE
        probes = " ".join(f"out[i++] = (mkrt::u64)(reinterpret_cast<const char*>(&c.{name}) - base);"
                          for name in COMMAND_DTYPE.names)
        return {"KERNEL_ID": f"{KERNEL_ID}ull", "LAYOUT_PROBES": probes}


def default_specs() -> list[ProxyKernelsSpec]:
    """The queue's test and benchmark kernels (compiled by `python -m mkrt compile --all`)."""
    return [ProxyKernelsSpec()]


class StatusWords:
    """A status block for one device (layout in mkrt/kernels/device/sync.py) and the
    pinned host word its waits also raise; ``args`` = the two kernel arguments."""

    def __init__(self, slots: int = 1):
        import cupy
        from mkrt.kernels.device.sync import STATUS_HEADER_WORDS, STATUS_RECORD_WORDS
        from mkrt.proxy.queue import PinnedMemory
        self.device = cupy.zeros(STATUS_HEADER_WORDS + STATUS_RECORD_WORDS * slots, dtype=np.uint64)
        self.host = PinnedMemory(4096)
        self.args = (self.device, np.uint64(self.host.device_address))

    def get(self):
        return self.device.get()


def status_words(slots: int = 1) -> StatusWords:
    return StatusWords(slots)


def raise_status(status, timeout_ms: float | None = None):
    """Raise CommTimeout from a status block whose abort word is set (slot 0's record)."""
    from mkrt.errors import CommTimeout, WaitRecord
    from mkrt.status import decode_records
    words = status.get() if hasattr(status, "get") else np.asarray(status)
    if not words[0]:
        return
    record = decode_records(words, 1).get(0) or WaitRecord(-1, "unknown", -1, -1, -1, 0, 0,
                                                           kernel="proxy_kernels")
    raise CommTimeout(record, timeout_ms=timeout_ms, others=max(0, int(words[2]) - 1))
