"""Warpgroup matrix multiply (``wgmma.mma_async``, sm_90a) from shared memory.

Vocabulary:

* ``smem_descriptor_sw128(address, leading, stride)`` -- the 64-bit matrix descriptor
  of an operand tile stored with the 128-byte swizzle that TMA writes. For a K-major tile
  (rows of 64 two-byte elements along K, 128 B each) ``stride`` is 1024 B, the distance
  between groups of 8 rows, and ``leading`` is unused. For an MN-major tile (B stored
  [K, N]: rows of 64 N-elements, one row per k) ``leading`` is the distance between
  64-wide chunks along N and ``stride`` again 1024 B between groups of 8 k-rows.
* ``Mma64<T, N, TRANSPOSE_B>::run(accumulator, descriptor_a, descriptor_b, accumulate)``
  -- one ``m64nNk16`` step of a warpgroup, fp32 accumulators in registers
  (``N / 2`` floats per thread). ``accumulate == 0`` overwrites the accumulators, so a
  tile needs no zeroing.
* ``MmaRegA64<T, N, TRANSPOSE_B>::run(accumulator, a, descriptor_b, accumulate)`` -- the
  same step with A from registers (``u32 a[4]``: 8 elements of a 64 x 16 slice of A, in
  the layout of the accumulator's columns 16k..16k+15 packed in pairs). Attention feeds
  its softmax probabilities this way, without a trip through shared memory.
* ``wgmma_fence`` before the first MMA of a batch, ``wgmma_commit`` after it,
  ``wgmma_wait<N>`` until at most N batches are still in flight.

Accumulator layout of m64nNk16 (thread t of the warpgroup, warp w = t / 32, lane l):
register ``4 * j + r`` holds row ``16 * w + l / 4 + 8 * (r / 2)``, column
``8 * j + 2 * (l % 4) + r % 2`` of the 64 x N tile.

The ``m64nNk16`` wrappers are generated below (an asm statement needs every accumulator
register named), for the element types and widths in ``TYPES`` and ``WIDTHS``.
"""

from mkrt.jit.render import cuda_source

#: C++ element type -> PTX type of wgmma's A/B operands
TYPES = {"__nv_bfloat16": "bf16", "__half": "f16"}
#: N of the m64nNk16 shapes generated: the engine's tile widths (multiples of 64, and the
#: trimmed widths between them, multiples of 16: gemm_rule.TRIM_WIDTHS)
WIDTHS = (64, 128, 144, 160, 176, 192, 208, 224, 240, 256)


def _wrapper(ctype: str, ptx_type: str, width: int) -> str:
    count = width // 2
    registers = ", ".join(f"%{i}" for i in range(count))
    outputs = ", ".join(f'"+f"(d[{i}])' for i in range(count))
    a, b, scale, transpose = count, count + 1, count + 2, count + 3
    return (
        f"template <int TRANSPOSE_B> struct Mma64<{ctype}, {width}, TRANSPOSE_B> {{ "
        f"__device__ static __forceinline__ void run(float (&d)[{count}], u64 descriptor_a, "
        f"u64 descriptor_b, int accumulate) {{ "
        f'asm volatile("{{ .reg .pred p; setp.ne.b32 p, %{scale}, 0; '
        f"wgmma.mma_async.sync.aligned.m64n{width}k16.f32.{ptx_type}.{ptx_type} "
        f'{{{registers}}}, %{a}, %{b}, p, 1, 1, 0, %{transpose}; }}" '
        f': {outputs} : "l"(descriptor_a), "l"(descriptor_b), "r"(accumulate), '
        f'"n"(TRANSPOSE_B)); }} }};'
    )


def _register_a_wrapper(ctype: str, ptx_type: str, width: int) -> str:
    count = width // 2
    registers = ", ".join(f"%{i}" for i in range(count))
    outputs = ", ".join(f'"+f"(d[{i}])' for i in range(count))
    a = ", ".join(f"%{count + i}" for i in range(4))
    b, scale, transpose = count + 4, count + 5, count + 6
    return (
        f"template <int TRANSPOSE_B> struct MmaRegA64<{ctype}, {width}, TRANSPOSE_B> {{ "
        f"__device__ static __forceinline__ void run(float (&d)[{count}], const u32 (&a)[4], "
        f"u64 descriptor_b, int accumulate) {{ "
        f'asm volatile("{{ .reg .pred p; setp.ne.b32 p, %{scale}, 0; '
        f"wgmma.mma_async.sync.aligned.m64n{width}k16.f32.{ptx_type}.{ptx_type} "
        f'{{{registers}}}, {{{a}}}, %{b}, p, 1, 1, %{transpose}; }}" '
        f': {outputs} : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(descriptor_b), '
        f'"r"(accumulate), "n"(TRANSPOSE_B)); }} }};'
    )


_WRAPPERS = "\n".join(_wrapper(c, p, w) for c, p in TYPES.items() for w in WIDTHS)
_WRAPPERS += "\n" + "\n".join(_register_a_wrapper(c, p, w) for c, p in TYPES.items()
                               for w in WIDTHS)

WGMMA = cuda_source("wgmma", r"""
namespace mkrt {
// Matrix descriptor of a 128B-swizzled operand tile in shared memory (address and
// offsets in bytes; the tile must start 1024-byte aligned, or at a k-offset inside such
// a tile, which is how the k16 steps of a 64-wide tile are addressed).
__device__ __forceinline__ u64 smem_descriptor_sw128(u32 address, u32 leading, u32 stride) {
    return (u64)((address & 0x3FFFF) >> 4)
         | ((u64)(leading >> 4) << 16)
         | ((u64)(stride >> 4) << 32)
         | (1ull << 62);   // swizzle mode 1: 128 bytes
}

// Registers feeding wgmma were written by ordinary instructions: order them first.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int IN_FLIGHT> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(IN_FLIGHT) : "memory");
}
// Keep the compiler from moving accumulator reads/writes across the asynchronous MMAs.
template <int COUNT> __device__ __forceinline__ void fence_accumulators(float (&d)[COUNT]) {
    #pragma unroll
    for (int i = 0; i < COUNT; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

// Register budget of a warpgroup (sm_90a). Needs a kernel with __launch_bounds__(threads, 1).
template <int REGISTERS> __device__ __forceinline__ void warpgroup_registers_increase() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(REGISTERS));
}
template <int REGISTERS> __device__ __forceinline__ void warpgroup_registers_decrease() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(REGISTERS));
}

template <class T, int N, int TRANSPOSE_B> struct Mma64;
template <class T, int N, int TRANSPOSE_B> struct MmaRegA64;
""" + _WRAPPERS + r"""
}  // namespace mkrt
""", requires=("base",), headers=("cuda_bf16.h", "cuda_fp16.h"))
