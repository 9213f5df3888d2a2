"""Tiles handed out at run time: a CTA's producer claims the next position of a queue (one
counter word, or the controller's board in roles.py) and passes it to its consumer
warpgroups through a small ring in shared memory. (The attention engine hands
its claims over with Q's barrier instead: attention_tile.py.) Which CTA runs a tile does not change
what the tile computes, so results stay bit-identical; the CTAs that finish early take
more tiles, which balances uneven tiles (causal attention) better than a fixed deal."""

from mkrt.jit.render import cuda_source

TILE_QUEUE = cuda_source("tile_queue", r"""
namespace mkrt {
namespace roles {

// The producer claims each tile and passes its number to the consumers through a small
// ring in shared memory (full/empty barriers, like the engines' stages).
constexpr int RING = 4;
struct Ring {
    int position[RING];
    u64 full[RING];
    u64 empty[RING];
    int left_because;
};

template <int CONSUMERS>
__device__ __forceinline__ void ring_init(Ring& ring) {
    if (threadIdx.x == 0) {
        for (int i = 0; i < RING; ++i) {
            mbarrier_init(&ring.full[i], 1);
            mbarrier_init(&ring.empty[i], CONSUMERS * 4);
        }
        ring.left_because = 0;
        mbarrier_init_fence();
    }
    __syncthreads();
}

// A queue with no controller: positions 0 .. count - 1 of one counter word, which the
// kernel resets between launches (AllGather+GEMM and ring attention: their last CTA out;
// mkrt.attention: reset_when_last_out).
struct CountedQueue {
    u64* next;
    int count;
};

__device__ __forceinline__ int claim(const CountedQueue& q, int* left_because) {
    const u64 position = atomicAdd((unsigned long long*)q.next, 1ull);
    if (position >= (u64)q.count) { *left_because = 1; return -1; }
    return (int)position;
}

// The queue position of an engine's i-th tile: the producer (one thread of warpgroup 0)
// claims it and every consumer thread reads it from the ring; -1 when the queue is empty.
template <class Source>
__device__ __forceinline__ int claimed_position(const Source& source, Ring* ring, int i) {
    const int slot = i % RING;
    const u32 phase = (u32)(i / RING) & 1u;
    int position;
    if (threadIdx.x < 128) {
        mbarrier_wait(&ring->empty[slot], phase ^ 1u);
        position = claim(source, &ring->left_because);
        ring->position[slot] = position;
        mbarrier_arrive(&ring->full[slot]);
    } else {
        mbarrier_wait(&ring->full[slot], phase);
        position = ring->position[slot];
        __syncwarp();
        if ((threadIdx.x & 31) == 0) mbarrier_arrive(&ring->empty[slot]);
    }
    return position;
}


// A standalone queue's reset (mkrt.attention): counter = {next, exited}. Every CTA counts
// itself out after its last claim; the last one zeroes both words for the next launch on
// the stream (no CTA claims any more by then).
__device__ __forceinline__ void reset_when_last_out(u64* counter) {
    __syncthreads();
    if (threadIdx.x == 0 &&
        atomicAdd((unsigned long long*)(counter + 1), 1ull) == (unsigned long long)(gridDim.x - 1)) {
        counter[0] = 0;
        counter[1] = 0;
    }
}

}  // namespace roles
}  // namespace mkrt
""", requires=("tma", "base"))
