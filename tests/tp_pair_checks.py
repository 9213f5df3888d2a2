"""Checks the tensor-parallel pair's GPU tests share (tests/test_allgather_gemm_gpu.py,
tests/test_gemm_reducescatter_gpu.py): each takes the op, its operands and the test
module's own `operands(world, rows, n, k, b_layout, dtype, seed)` and
`worst_error(outs, a, b, b_layout)`."""

from __future__ import annotations

REL_ERROR_BOUND = 1e-2


def hundred_calls_are_identical(world, op, a, b, worst_error) -> None:
    """100 calls without a host sync: the first right, every later one the same bits."""
    import cupy
    results = [op(a, b) for _ in range(100)]
    world.synchronize()
    assert worst_error(results[0], a, b, "kn") < REL_ERROR_BOUND
    for call in results[1:]:
        for first, again in zip(results[0], call):
            assert cupy.array_equal(first.view(cupy.uint16), again.view(cupy.uint16))


def graph_replays_follow_new_inputs(world, op, a, b, outs, rows, operands, worst_error) -> None:
    """One call captured, then replayed three times with A changed in place between
    replays: each replay's outputs are right for the A it saw."""
    import cupy
    op(a, b, out=outs)
    world.synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        op(a, b, out=outs)
        graph = stream.end_capture()
    k, n = b[0].shape                                  # B is [K, N] ("kn") here
    for replay in range(3):
        with stream:
            fresh, _ = operands(world, rows, n, k, "kn", "bf16", seed=100 + replay)
            for x, new in zip(a, fresh):
                x[...] = new
            for out in outs:
                out.fill(0)
        graph.launch(stream)
        stream.synchronize()
        world.synchronize()
        assert worst_error(outs, a, b, "kn") < REL_ERROR_BOUND, f"replay {replay}"
