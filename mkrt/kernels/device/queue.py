"""Device side of the command queue: comm CTAs post commands for the host proxy.

The command struct is generated from the one numpy dtype in ``mkrt/proxy/queue.py``
(``static_assert`` on size and every offset), so C and Python cannot drift.

Posting (one thread; any number of CTAs and queues at once)::

    const mkrt::Queue q = queues[i];                  // descriptors from QueueSet.device_descriptors()
    u64 t = mkrt::post_put_signal(q, ctx, dst_rank, dst_region, dst_offset,
                                  src_region, src_offset, bytes,
                                  flag_region, flag_offset, epoch);
    if (t == mkrt::POST_FAILED) return;               // proxy error or timeout: recorded, abort set

1. claim a ticket: ``atomicAdd`` on the queue's head (device memory);
2. wait, bounded, for space: ``ticket < tail + slots`` — a cached tail in device memory
   first, the proxy's tail in mapped host memory only when the cache says full; the wait
   also leaves when the proxy's error word is set (``proxy_wait_at_least``);
3. write words 1..7 of the slot, then release-store ``valid = ticket + 1``.

A thread that alone posts to a queue for a while can own it and skip step 1's atomic
(0.25-0.3 us of a 3.3 us round trip on the H200: experiments/notes/proxy.md)::

    mkrt::OwnedQueue mine = mkrt::own_queue(queues[i]);
    mkrt::post_signal(mine, ctx, ...);                // every post_* takes either
    mkrt::release_queue(mine);                        // others may post again

Descriptors: copy the one you post to into a local (``const mkrt::Queue q = queues[i];``)
before a loop of posts and waits. A reference into the descriptor array makes every post
re-read the ring's address from device memory, and after an acquire wait (which drops
the L1) that read goes to L2: a dependent L2 round trip before the command's stores.

Data a put reads must be visible at system scope before the post: the CTA writes,
``__syncthreads()``, and the posting thread's release store orders it (add
``__threadfence_system()`` when other CTAs wrote the data).

Waits on flags the proxy writes should use ``proxy_wait_at_least`` (also checks the
proxy's error word); a failure is recorded in the status block with
flag = ``PROXY_ERROR_FLAG`` (-2) and seen = the proxy's error word, or as an ordinary
timeout, and the abort word is raised, so the launch drains.
"""

from mkrt.jit.render import cuda_source
from mkrt.proxy import layout as _layout

#: recorded as the flag of a wait that ended because the proxy reported an error
PROXY_ERROR_FLAG = -2
#: recorded as the flag of a wait for ring space (the proxy's tail) that timed out
QUEUE_TAIL_FLAG = -3

QUEUE_LAYOUT = cuda_source("queue_layout", "namespace mkrt {\n" + _layout.command_struct_source()
                           + "\n}  // namespace mkrt\n", requires=("base",))

QUEUE = cuda_source("queue", r"""
namespace mkrt {
// Mirrors mkrt.proxy.queue.QUEUE_DESC_DTYPE.
struct Queue {
    Command* ring;      // mapped host memory
    u64* header;        // mapped host memory: tail, done, error (QUEUE_* words)
    u64* head;          // device memory: claim counter
    u64* tail_cache;    // device memory: the largest tail any poster has seen
    u64 slots;          // power of two
    u64 rank;           // the rank whose regions this queue's sources are
};
static_assert(sizeof(Queue) == 48, "mkrt::Queue");

constexpr int QUEUE_TAIL_FLAG = -3;
constexpr u64 POST_FAILED = ~0ull;

__device__ __forceinline__ u64 queue_error(const Queue& q) {
    return ld_relaxed_sys(q.header + QUEUE_ERROR);
}

// wait_at_least that also leaves when the queue's proxy reports an error.
__device__ __forceinline__ bool proxy_wait_at_least(const u64* flag, u64 expected, const Context& ctx,
                                                    const Queue& q, int role, int tile, int flag_id) {
    return wait_at_least(flag, expected, ctx, role, tile, flag_id, q.header + QUEUE_ERROR);
}

// Bounded wait until the proxy's tail (mapped host memory) reaches `needed`; `tail` gets
// the tail then read. False: timed out or the proxy reported an error (recorded).
__device__ __forceinline__ bool wait_for_tail(const Queue& q, u64 needed, const Context& ctx,
                                              int role, int tile, u64& tail) {
    if (!proxy_wait_at_least(q.header + QUEUE_TAIL, needed, ctx, q, role, tile, QUEUE_TAIL_FLAG))
        return false;
    tail = ld_relaxed_sys(q.header + QUEUE_TAIL);
    return true;
}

// Bounded wait until slot `ticket` is free (the proxy consumed ticket - slots).
// `cached_tail`: tail_cache read before the ticket was claimed (a lower bound: tails only
// grow), so the two device-memory reads of a post overlap instead of queueing.
__device__ __forceinline__ bool queue_reserve(const Queue& q, u64 ticket, u64 cached_tail,
                                              const Context& ctx, int role, int tile) {
    if (ticket < q.slots) return true;
    const u64 needed = ticket - q.slots + 1;
    if (cached_tail >= needed) return true;
    if (*(volatile const u64*)q.tail_cache >= needed) return true;
    u64 tail;
    if (!wait_for_tail(q, needed, ctx, role, tile, tail)) return false;
    atomicMax((unsigned long long*)q.tail_cache, tail);
    return true;
}

__device__ __forceinline__ void st_v2_u64(u64* address, u64 a, u64 b) {
    asm volatile("st.global.v2.u64 [%0], {%1, %2};" :: "l"(address), "l"(a), "l"(b) : "memory");
}

// Words 1..7, then valid = ticket + 1 with a release store (system scope).
__device__ __forceinline__ void queue_write(const Queue& q, u64 ticket, const Command& c) {
    u64* slot = reinterpret_cast<u64*>(q.ring + (ticket & (q.slots - 1)));
    const u64* w = reinterpret_cast<const u64*>(&c);
    asm volatile("st.global.u64 [%0], %1;" :: "l"(slot + 1), "l"(w[1]) : "memory");
    st_v2_u64(slot + 2, w[2], w[3]);
    st_v2_u64(slot + 4, w[4], w[5]);
    st_v2_u64(slot + 6, w[6], w[7]);
    st_release_sys(slot, ticket + 1);
}

// Post one command (one thread). Returns its ticket, or POST_FAILED (recorded, abort set).
// No read of host memory on the fast path (a PCIe round trip): the proxy's error word is
// checked only when the post must wait for space, and in proxy_wait_at_least.
__device__ __forceinline__ u64 post(const Queue& q, const Context& ctx, Command& c, int role, int tile) {
    const u64 cached_tail = *(volatile const u64*)q.tail_cache;   // in flight with the claim
    const u64 ticket = atomicAdd((unsigned long long*)q.head, 1ull);
    if (!queue_reserve(q, ticket, cached_tail, ctx, role, tile)) return POST_FAILED;
    c.valid = 0;
    queue_write(q, ticket, c);
    return ticket;
}

// A queue one thread posts to alone for a while (a comm CTA that owns it) needs no claim
// atomic: the thread keeps the next ticket and the largest tail it saw in registers, and
// gives them back with release_queue (then others may post again). Saves a device-memory
// atomic per post; the post_* functions take an OwnedQueue wherever they take a Queue.
struct OwnedQueue {
    Queue queue;       // a copy of the descriptor (registers: see "Descriptors" above)
    u64 next;          // the next ticket
    u64 tail_seen;     // largest proxy tail seen (space bound)
};

__device__ __forceinline__ OwnedQueue own_queue(const Queue& q) {
    return OwnedQueue{q, *(volatile const u64*)q.head, *(volatile const u64*)q.tail_cache};
}

__device__ __forceinline__ void release_queue(const OwnedQueue& o) {
    *(volatile u64*)o.queue.head = o.next;
    atomicMax((unsigned long long*)o.queue.tail_cache, o.tail_seen);
}

__device__ __forceinline__ u64 post(OwnedQueue& o, const Context& ctx, Command& c, int role, int tile) {
    const Queue& q = o.queue;
    const u64 ticket = o.next;
    if (ticket >= q.slots && o.tail_seen < ticket - q.slots + 1
        && !wait_for_tail(q, ticket - q.slots + 1, ctx, role, tile, o.tail_seen))
        return POST_FAILED;
    c.valid = 0;
    queue_write(q, ticket, c);
    o.next = ticket + 1;
    return ticket;
}

__device__ __forceinline__ Command make_command(unsigned opcode, unsigned dst_rank) {
    Command c;
    c.valid = 0; c.opcode = (unsigned short)opcode; c.dst_rank = (unsigned short)dst_rank;
    c.src_region = 0; c.dst_region = 0; c.src_offset = 0; c.dst_offset = 0; c.bytes = 0;
    c.signal_offset = 0; c.signal_value = 0; c.signal_region = (unsigned short)NO_REGION;
    c.flags = 0; c.reserved = 0;
    return c;
}

// Copy `bytes` from (q.rank, src_region, src_offset) to (dst_rank, dst_region, dst_offset).
template <class Q>
__device__ u64 post_put(Q& q, const Context& ctx, unsigned dst_rank,
                        unsigned dst_region, u64 dst_offset, unsigned src_region,
                        u64 src_offset, u64 bytes, int role = ROLE_INTER, int tile = -1) {
    Command c = make_command(OP_PUT, dst_rank);
    c.src_region = (unsigned short)src_region; c.dst_region = (unsigned short)dst_region;
    c.src_offset = src_offset; c.dst_offset = dst_offset; c.bytes = bytes;
    return post(q, ctx, c, role, tile);
}

// A put, then `value` written to the u64 at (dst_rank, signal_region, signal_offset),
// delivered after the data.
template <class Q>
__device__ u64 post_put_signal(Q& q, const Context& ctx, unsigned dst_rank,
                               unsigned dst_region, u64 dst_offset, unsigned src_region,
                               u64 src_offset, u64 bytes, unsigned signal_region,
                               u64 signal_offset, u64 value, int role = ROLE_INTER,
                               int tile = -1) {
    Command c = make_command(OP_PUT_SIGNAL, dst_rank);
    c.src_region = (unsigned short)src_region; c.dst_region = (unsigned short)dst_region;
    c.src_offset = src_offset; c.dst_offset = dst_offset; c.bytes = bytes;
    c.signal_region = (unsigned short)signal_region; c.signal_offset = signal_offset;
    c.signal_value = value;
    return post(q, ctx, c, role, tile);
}

// `value` written to the u64 at (dst_rank, signal_region, signal_offset), after every
// earlier put of this queue.
template <class Q>
__device__ u64 post_signal(Q& q, const Context& ctx, unsigned dst_rank,
                           unsigned signal_region, u64 signal_offset, u64 value,
                           int role = ROLE_INTER, int tile = -1) {
    Command c = make_command(OP_SIGNAL, dst_rank);
    c.signal_region = (unsigned short)signal_region; c.signal_offset = signal_offset;
    c.signal_value = value;
    return post(q, ctx, c, role, tile);
}

// Every earlier command of this queue completes before any later one starts; then, if
// signal_region != NO_REGION, `value` is written at (dst_rank, signal_region, signal_offset).
template <class Q>
__device__ u64 post_fence(Q& q, const Context& ctx, unsigned dst_rank = 0,
                          unsigned signal_region = NO_REGION, u64 signal_offset = 0,
                          u64 value = 0, int role = ROLE_INTER, int tile = -1) {
    Command c = make_command(OP_FENCE, dst_rank);
    c.signal_region = (unsigned short)signal_region; c.signal_offset = signal_offset;
    c.signal_value = value;
    return post(q, ctx, c, role, tile);
}

// Fence, then `epoch` written at (r, signal_region, signal_offset + 8 * q.rank) on every
// rank r that registered signal_region. Wait for all ranks with
// proxy_wait_at_least on each u64 of your own (signal_region, signal_offset + 8 * r).
template <class Q>
__device__ u64 post_barrier(Q& q, const Context& ctx, unsigned signal_region,
                            u64 signal_offset, u64 epoch, int role = ROLE_INTER, int tile = -1) {
    Command c = make_command(OP_BARRIER, 0);
    c.signal_region = (unsigned short)signal_region; c.signal_offset = signal_offset;
    c.signal_value = epoch;
    return post(q, ctx, c, role, tile);
}

// Wait (bounded) until command `ticket` and all before it are complete at the transport.
__device__ bool queue_quiet(const Queue& q, const Context& ctx, u64 ticket,
                            int role = ROLE_INTER, int tile = -1) {
    return proxy_wait_at_least(q.header + QUEUE_DONE, ticket + 1, ctx, q, role, tile,
                               QUEUE_TAIL_FLAG);
}
}  // namespace mkrt
""", requires=("sync", "queue_layout"))
