"""The `ce` transport's batch copy kernel: one launch carries a whole batch of puts.

A device-to-device ``cuMemcpyAsync`` is itself an SM kernel on the H200 (see
experiments/notes/proxy.md), launched once per copy: about 3.5-5 us each, so 1 MiB puts
reach a fraction of HBM bandwidth. The proxy instead passes up to :data:`MAX_PENDING`
(dst, src, bytes) triples BY VALUE as one ``__grid_constant__`` parameter (the driver
copies parameters at launch, so the proxy may refill its arrays at once) and every
thread of the grid copies its share of each span in turn.
"""

from __future__ import annotations

import dataclasses

from mkrt.jit import cuda_source
from mkrt.jit.spec import KernelSpec
from mkrt.kernels import device as _device  # noqa: F401  (registers the shared CUDA pieces)

#: most puts one launch (or one cuMemcpyBatchAsync) carries; 3 x 8 x 128 + 8 bytes of
#: parameters, under the 4 KiB limit
MAX_PENDING = 128
#: threads per CTA of the copy kernel
COPY_THREADS = 512

BATCH_COPY = cuda_source("ce_batch_copy", r"""
// Mirrors the words the ce transport's thread state keeps from T_COUNT on.
struct CopyBatch {
    mkrt::u64 count;
    mkrt::u64 dst[$MAX_PENDING];
    mkrt::u64 src[$MAX_PENDING];
    mkrt::u64 bytes[$MAX_PENDING];
};
static_assert(sizeof(CopyBatch) == 8 * (1 + 3 * $MAX_PENDING), "CopyBatch layout");

extern "C" __global__ void __launch_bounds__($COPY_THREADS)
batch_copy(const __grid_constant__ CopyBatch batch) {
    const mkrt::u64 worker = (mkrt::u64)blockIdx.x * blockDim.x + threadIdx.x;
    const mkrt::u64 workers = (mkrt::u64)gridDim.x * blockDim.x;
    for (mkrt::u64 c = 0; c < batch.count; ++c)
        mkrt::copy_span((void*)batch.dst[c], (const void*)batch.src[c], batch.bytes[c],
                        worker, workers);
}
""", requires=("copy",), register=False)


@dataclasses.dataclass(frozen=True)
class BatchCopySpec(KernelSpec):
    family = "ce_batch_copy"
    entry_points = ("batch_copy",)

    def template(self):
        return BATCH_COPY

    def params(self):
        return {"MAX_PENDING": MAX_PENDING, "COPY_THREADS": COPY_THREADS}


def default_specs() -> list[BatchCopySpec]:
    return [BatchCopySpec()]


def copy_function_handle(device: int) -> int:
    """The CUfunction of `batch_copy` on `device` (built and loaded once per process)."""
    import cupy
    with cupy.cuda.Device(device):
        return int(BatchCopySpec().function("batch_copy", device).kernel.ptr)
