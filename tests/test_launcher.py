"""The prepared-call parameter buffer (CPU): layout, alignment, field views."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from mkrt.kernels import allgather, gemm_allreduce
from mkrt.kernels.launcher import Parameters


def test_fields_sit_at_their_c_alignment_and_pointers_point_at_them():
    params = Parameters([("tma", 128, 64), ("flag", np.int32, 4), ("pointer", np.uint64, 8),
                         ("record", gemm_allreduce.ARGS_DTYPE, 8), ("last", np.int32, 4)])
    assert params.base % 64 == 0
    offsets = [p - params.base for p in params.pointers]
    assert offsets[:3] == [0, 128, 136]
    assert offsets[3] % 8 == 0 and offsets[4] == offsets[3] + gemm_allreduce.ARGS_DTYPE.itemsize
    params.set(flag=-7, pointer=0xDEADBEEF, last=3)
    assert ctypes.c_int32.from_address(params.pointers[1]).value == -7
    assert ctypes.c_uint64.from_address(params.pointers[2]).value == 0xDEADBEEF
    assert ctypes.c_int32.from_address(params.pointers[4]).value == 3


@pytest.mark.parametrize("field", ["out", "copy_source", "queue", "m", "send_batch"])
def test_a_field_view_writes_the_same_bytes_as_the_record_view(field):
    params = Parameters(gemm_allreduce.LAUNCH_PARAMETERS)
    record = np.zeros((), gemm_allreduce.ARGS_DTYPE)
    record["m"], record["out"] = 11, 22
    params.set(args=record)
    params.field_view("args", field)[()] = 1234567
    seen = params.view("args")
    assert int(seen[field]) == 1234567
    for other in ("m", "out", "copy_source", "queue", "send_batch"):
        if other != field:
            assert int(seen[other]) == int(record[other])


def test_launch_parameter_lists_match_the_kernel_signatures():
    """One entry per kernel parameter, in order (names from the CUDA signatures)."""
    gar_source = gemm_allreduce.default_specs()[0].render()
    signature = gar_source.split("gemm_allreduce(")[1].split(")")[0]
    assert len(signature.split(",")) == len(gemm_allreduce.LAUNCH_PARAMETERS)
    ag_source = allgather.default_specs()[0].render()
    signature = ag_source.split("allgather(const unsigned char* input")[1].split(")")[0]
    names = [part.split()[-1].lstrip("*") for part in ("input" + signature).split(",")]
    assert names == [name for name, _, _ in allgather.LAUNCH_PARAMETERS]


def test_context_params_fill_the_context_fields_of_every_prepared_kernel():
    """Op.context_params(rank) is splatted into Parameters.set: its names must be the
    kernels' context parameters, and the typed form (context_args) must carry the same."""
    from types import SimpleNamespace

    from mkrt.kernels.op import Op
    block = SimpleNamespace(device_ptr=0x1000, host_flag_ptr=0x2000)
    world = SimpleNamespace(ranks=[SimpleNamespace(device=0)] * 3, status=lambda device: block,
                            device_slot=lambda rank: 1)
    op = SimpleNamespace(world=world, timeout_ms=2.5)
    values = Op.context_params(op, 2)
    for fields in (allgather.LAUNCH_PARAMETERS, gemm_allreduce.LAUNCH_PARAMETERS):
        params = Parameters(fields)
        params.set(**values)
        assert [int(params.view(name)) for name in values] == list(values.values())
    op.context_params = lambda rank: Op.context_params(op, rank)
    assert [int(v) for v in Op.context_args(op, 2)] == [0x1000, 0x2000, 1, 2, 2_500_000]


def test_stream_workspace_keeps_one_per_stream_and_a_fresh_one_per_capture(monkeypatch):
    """Eager launches on a stream share its workspace; a launch being captured gets a new
    one each time, kept alive but never handed to an eager launch."""
    import contextlib

    import cupy
    from cupy_backends.cuda.api import runtime

    from mkrt.kernels.launcher import stream_workspace

    capturing = set()
    monkeypatch.setattr(runtime, "streamIsCapturing", lambda ptr: 1 if ptr in capturing else 0)
    monkeypatch.setattr(cupy.cuda, "Device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(cupy.cuda, "ExternalStream", lambda ptr: contextlib.nullcontext())
    made = []

    def make():
        made.append(object())
        return made[-1]

    cache = {}
    first, kept = stream_workspace(cache, 0, 7, make)
    assert kept and stream_workspace(cache, 0, 7, make) == (first, True) and len(made) == 1
    capturing.add(7)
    graph1, kept1 = stream_workspace(cache, 0, 7, make)
    graph2, kept2 = stream_workspace(cache, 0, 7, make)
    assert not kept1 and not kept2 and len({id(first), id(graph1), id(graph2)}) == 3
    assert graph1 in cache.values() and graph2 in cache.values()       # alive as long as the cache
    capturing.clear()
    assert stream_workspace(cache, 0, 7, make) == (first, True)
    other, _ = stream_workspace(cache, 0, 8, make)
    assert other is not first and len(made) == 4
