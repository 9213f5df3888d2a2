"""Small helpers the GPU tests share for CUDA-graph capture and bitwise comparison."""

from __future__ import annotations


def capture(call):
    """(graph, stream): `call()` captured on a new non-blocking stream."""
    import cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            call()
        except BaseException:
            stream.end_capture()         # the stream stays usable; the graph is dropped
            raise
        graph = stream.end_capture()
    return graph, stream


def assert_same_bits(outs, expected) -> None:
    """Every array of `outs` holds the bits of its partner in `expected` (2-byte dtypes)."""
    import cupy
    for out, want in zip(outs, expected, strict=True):
        assert cupy.array_equal(out.view(cupy.uint16), want.view(cupy.uint16))
