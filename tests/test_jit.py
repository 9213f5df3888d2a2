"""Rendering with #line, NVRTC compile-only for sm_90a, errors, resources, spills (CPU)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from mkrt.errors import CompileError
from mkrt.jit import compile_cuda, cuda_source, render
from mkrt.jit.compiler import parse_resources
from mkrt.kernels.registry import all_specs
from mkrt.jit.spec import KernelSpec

GOOD = cuda_source("test_good", r"""
extern "C" __global__ void add_one(float* x, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += $AMOUNT;
}
""", requires=("base",), register=False)

BROKEN = cuda_source("test_broken", r"""
extern "C" __global__ void broken(float* x) {
    x[0] = this_name_does_not_exist;
}
""", register=False)


def test_line_directives_point_at_the_python_text():
    source = render(GOOD, {"AMOUNT": "1.0f"})
    lines = source.splitlines()
    here = Path(__file__).read_text().splitlines()
    directives = [(i, m) for i, l in enumerate(lines) if (m := re.match(r'#line (\d+) "(.+)"', l))]
    assert [m.group(2) for _, m in directives] == ["mkrt/kernels/device/base.py", "tests/test_jit.py"]
    index, match = directives[-1]
    # The line after `#line N` is line N of the file (1-based); later lines follow on.
    start = int(match.group(1))
    for offset in range(1, 4):
        rendered = lines[index + 1 + offset].strip()
        assert rendered and rendered == here[start - 1 + offset].strip().replace("$AMOUNT", "1.0f")


def test_template_values_are_checked():
    with pytest.raises(KeyError, match=r"AMOUNT"):
        render(GOOD, {})
    with pytest.raises(ValueError, match="spans lines"):
        render(GOOD, {"AMOUNT": "1\n+1"})


def test_compile_error_names_file_and_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MKRT_JIT_CACHE_DIR", str(tmp_path))
    with pytest.raises(CompileError) as info:
        compile_cuda("test_broken_sm90a", render(BROKEN, {}))
    error = info.value
    assert error.file == "tests/test_jit.py"
    bad_line = next(i for i, l in enumerate(Path(__file__).read_text().splitlines(), 1)
                    if "this_name_does_not_exist;" in l and "x[0]" in l)
    assert error.line == bad_line
    assert error.spec == "test_broken_sm90a"
    assert Path(error.source_path).read_text().count("this_name_does_not_exist") == 1
    assert f"tests/test_jit.py:{bad_line}" in str(error)


def test_compile_reports_resources_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("MKRT_JIT_CACHE_DIR", str(tmp_path))
    source = render(GOOD, {"AMOUNT": "2.0f"})
    first = compile_cuda("test_good_sm90a", source)
    assert not first.cached and first.cubin_path.stat().st_size > 0
    assert first.resources["add_one"].registers > 0
    assert first.resources["add_one"].spills == 0
    again = compile_cuda("test_good_sm90a", source)
    assert again.cached and again.key == first.key
    other = compile_cuda("test_good_sm90a", render(GOOD, {"AMOUNT": "3.0f"}))
    assert other.key != first.key
    options = compile_cuda("test_good_sm90a", source, options=("-DMKRT_X=1",))
    assert options.key != first.key


SPILLER = cuda_source("test_spiller", r"""
extern "C" __global__ void spill(float* x, int n) {
    float acc[64];
    #pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = x[i * n + threadIdx.x];
    float total = 0.f;
    #pragma unroll
    for (int i = 0; i < 64; ++i) total += acc[i] * acc[(i * 7) % 64];
    #pragma unroll
    for (int i = 0; i < 64; ++i) x[i * n + threadIdx.x] = acc[i] + total;
}
""", register=False)


def test_spill_check_fails_a_spilling_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("MKRT_JIT_CACHE_DIR", str(tmp_path))
    source = render(SPILLER, {})
    relaxed = compile_cuda("test_spill_sm90a", source, options=("-maxrregcount=24",), check_spills=False)
    assert relaxed.resources["spill"].spills > 0
    with pytest.raises(CompileError, match="spills"):
        compile_cuda("test_spill_sm90a", source, options=("-maxrregcount=24",), check_spills=True)


def test_parse_resources_reads_ptxas_verbose():
    log = ("ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
           "ptxas info    : Function properties for k\n"
           "ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 168 registers, used 1 barriers, 1024 bytes smem, 400 bytes cmem[0]\n")
    (res,) = parse_resources(log).values()
    assert (res.registers, res.spill_stores, res.spill_loads, res.stack_frame,
            res.static_shared, res.barriers) == (168, 8, 4, 16, 1024, 1)
    # a kernel calling a non-inlined function reports its cumulative stack before smem
    log = log.replace("1 barriers, ", "1 barriers, 128 bytes cumulative stack size, ")
    (res,) = parse_resources(log).values()
    assert (res.registers, res.static_shared, res.barriers) == (168, 1024, 1)


@pytest.mark.parametrize("module,spec", all_specs(), ids=lambda v: getattr(v, "uri", v))
def test_every_default_spec_compiles_for_sm90a_without_spills(module, spec):
    build = spec.build(check_spills=True)
    for entry in spec.entry_points:
        assert entry in build.resources, f"{spec.uri}: no entry {entry}"
        # a spec states the spills it allows, and why (moe_fused: kept across its calls)
        assert build.resources[entry].spills <= spec.spill_allowance.get(entry, 0)


def test_spill_allowances_are_few_and_small():
    allowed = {(type(spec).__name__, entry): limit for _, spec in all_specs()
               for entry, limit in spec.spill_allowance.items()}
    assert set(allowed) == {("MoeFusedSpec", "moe_fused")} and max(allowed.values()) <= 96


def test_spec_uri_names_its_fields():
    @dataclasses.dataclass(frozen=True)
    class Demo(KernelSpec):
        family = "demo"
        block_m: int = dataclasses.field(default=128, metadata={"short": "bm"})
        dtype: str = "bf16"
    assert Demo().uri == "demo_bm128_bf16_sm90a"
    assert Demo(block_m=64).uri != Demo().uri


def test_a_build_without_a_ptxas_report_is_usable(tmp_path, monkeypatch):
    """NVRTC can return a good cubin with an empty log (no register report): the build
    is kept, with unknown resources, instead of failing for 'no entry points'."""
    from mkrt.jit import compiler
    from mkrt.kernels.probe import ProbeSpec
    monkeypatch.setenv("MKRT_JIT_CACHE_DIR", str(tmp_path))
    real = compiler._nvrtc_compile
    monkeypatch.setattr(compiler, "_nvrtc_compile",
                        lambda *args: (real(*args)[0], ""))
    build = ProbeSpec().build()
    assert build.resources == {} and build.cubin_path.exists()
