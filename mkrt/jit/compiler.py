"""Compile rendered CUDA for sm_90a with NVRTC; load it with CuPy when a GPU is there.

One path for both machines: NVRTC (through ``cupy_backends``) turns source into a cubin,
which works without a GPU; on a GPU ``cupy.RawModule(path=cubin)`` loads it. ptxas's
verbose report gives registers, shared memory and spills per kernel.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from mkrt import envs
from mkrt.errors import CompileError
from mkrt.jit import cache

log = logging.getLogger("mkrt.jit")

BASE_OPTIONS = ("-std=c++17", "-default-device", "-Xptxas=-v", "-lineinfo")


@dataclass(frozen=True)
class KernelResources:
    """ptxas's report for one entry function."""

    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    static_shared: int
    barriers: int

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads


@dataclass
class Build:
    """A compiled kernel module on disk."""

    uri: str
    key: str
    cubin_path: Path
    source_path: Path
    resources: dict[str, KernelResources]
    seconds: float            # compile time (0 when it came from the cache)
    cached: bool
    log: str = field(repr=False, default="")


def compiler_version() -> str:
    from cupy_backends.cuda.libs import nvrtc
    major, minor = nvrtc.getVersion()
    return f"nvrtc-{major}.{minor}"


def include_dirs() -> list[str]:
    """CUDA headers for NVRTC, which has no default include path (mkrt/DESIGN.md, "Machine facts")."""
    import cupy
    found: list[str] = []
    site_roots = {Path(p) for p in sys.path if p.endswith("site-packages")}
    site_roots.add(Path(cupy.__file__).resolve().parents[1])
    candidates = []
    for root in sorted(site_roots):
        candidates += [root / "nvidia" / "cu13" / "include",
                       root / "nvidia" / "cuda_runtime" / "include"]
    candidates += [Path("/usr/local/cuda/include")]
    candidates += [Path(cupy.__file__).resolve().parent / "_core" / "include" / "cupy" / "_cccl" / "libcudacxx"]
    for path in candidates:
        if path.is_dir() and ((path / "cuda_bf16.h").exists() or (path / "cuda" / "atomic").exists()):
            if str(path) not in found:
                found.append(str(path))
    return found


_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, \d+ bytes cumulative stack size)?"
                   r"(?:, (\d+) bytes smem)?")
_PROPERTIES = re.compile(r"Function properties for (\w+)")


def parse_resources(ptxas_log: str) -> dict[str, KernelResources]:
    """Per-entry registers, spills and static shared memory from ``-Xptxas=-v`` output."""
    out: dict[str, KernelResources] = {}
    current = None
    frame = (0, 0, 0)
    for line in ptxas_log.splitlines():
        if m := _ENTRY.search(line):
            current, frame = m.group(1), (0, 0, 0)
        elif m := _PROPERTIES.search(line):
            current = m.group(1)
        elif (m := _FRAME.search(line)) and current:
            frame = tuple(int(g) for g in m.groups())
        elif (m := _USED.search(line)) and current:
            registers, barriers, smem = (int(g or 0) for g in m.groups())
            out[current] = KernelResources(registers, frame[1], frame[2], frame[0], smem, barriers)
    return out


_ERROR = re.compile(r"^(?P<file>[^\s()]+)\((?P<line>\d+)\): (?:catastrophic )?error")


def _raise_compile_error(uri: str, source_path: Path, log_text: str) -> None:
    match = next((m for m in map(_ERROR.match, log_text.splitlines()) if m), None)
    file = match.group("file") if match else None
    line = int(match.group("line")) if match else None
    where = f"{file}:{line}" if match else "(no file/line in the log)"
    first = next((l for l in log_text.splitlines() if "error" in l), log_text.strip()[:400])
    raise CompileError(
        f"mkrt.jit: compiling {uri} failed at {where}: {first.strip()}\n"
        f"  rendered source kept at {source_path}\n{log_text.strip()}",
        spec=uri, file=file, line=line, source_path=str(source_path), log=log_text)


def _nvrtc_compile(uri: str, source: str, options: list[str]) -> tuple[bytes | None, str]:
    from cupy_backends.cuda.libs import nvrtc
    program = nvrtc.createProgram(source, f"{uri}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(program, options)
            ok = True
        except nvrtc.NVRTCError:
            ok = False
        log_text = nvrtc.getProgramLog(program).rstrip("\x00")
        return (nvrtc.getCUBIN(program) if ok else None), log_text
    finally:
        nvrtc.destroyProgram(program)


def compile_cuda(uri: str, source: str, *, options: tuple[str, ...] = (),
                 arch: str | None = None, check_spills: bool | None = None,
                 spill_allowance: dict[str, int] | None = None) -> Build:
    """Build (or fetch from the cache) the cubin of one rendered translation unit."""
    arch = arch or envs.get("MKRT_JIT_ARCH")
    if check_spills is None:
        check_spills = envs.get("MKRT_JIT_PTXAS_CHECK")
    all_options = (*BASE_OPTIONS, f"-arch={arch}", *options)
    key = cache.cache_key(source, all_options, arch, compiler_version())
    entry = cache.entry_dir(uri, key)

    report = cache.read_report(entry)
    if report is None:
        with cache.build_lock(entry):
            report = cache.read_report(entry)   # another process may have built it meanwhile
            if report is None:
                report = _build_entry(uri, key, entry, source, all_options)
                report["cached"] = False
    build = Build(uri=uri, key=key, cubin_path=entry / "kernel.cubin",
                  source_path=entry / "kernel.cu",
                  resources={k: KernelResources(**v) for k, v in report["resources"].items()},
                  seconds=report["seconds"] if report.get("cached") is False else 0.0,
                  cached=report.get("cached", True), log=report["log"])
    if check_spills:
        allowed = spill_allowance or {}
        spilling = {k: r.spills for k, r in build.resources.items() if r.spills > allowed.get(k, 0)}
        if spilling:
            raise CompileError(
                f"mkrt.jit: {uri} spills registers "
                f"(MKRT_JIT_PTXAS_CHECK): {spilling}; source at {build.source_path}",
                spec=uri, file=None, line=None, source_path=str(build.source_path), log=build.log)
    return build


def _build_entry(uri: str, key: str, entry: Path, source: str, options: tuple[str, ...]) -> dict:
    source_path = entry / "kernel.cu"
    cache.write_atomic(source_path, source.encode())
    options = [*options, *(f"-I{d}" for d in include_dirs())]
    start = time.perf_counter()
    cubin, log_text = _nvrtc_compile(uri, source, options)
    if cubin is not None and not parse_resources(log_text):
        # Seen on the H200 machine, each time after the same source had been compiled
        # earlier on that machine (by another process, into another cache folder): NVRTC
        # returned the cubin with an empty log, so there is no register report. The build
        # is good; its resources are unknown (spills unchecked) until a fresh compile.
        log.warning("mkrt.jit: %s: NVRTC gave no ptxas report (log %r): registers and "
                    "spills unknown", uri, log_text[:200])
    seconds = time.perf_counter() - start
    if cubin is None:
        _raise_compile_error(uri, source_path, log_text)
    resources = parse_resources(log_text)
    report = {"uri": uri, "key": key, "options": options, "seconds": seconds, "log": log_text,
              "resources": {k: vars(r) for k, r in resources.items()}}
    cache.write_atomic(entry / "kernel.cubin", cubin)
    cache.write_atomic(entry / "report.json", json.dumps(report, indent=1).encode())
    if envs.get("MKRT_JIT_DEBUG"):
        log.info("compiled %s in %.2fs: %s", uri, seconds,
                 {k: (r.registers, r.spills) for k, r in resources.items()})
    return report


_MODULES: dict[tuple[str, int], object] = {}


def load_function(build: Build, name: str, device: int, dynamic_shared: int = 0):
    """The kernel `name` of `build` as a ``cupy.RawKernel``-like function on `device`."""
    import cupy
    key = (str(build.cubin_path), device)
    with cupy.cuda.Device(device):
        module = _MODULES.get(key)
        if module is None:
            module = _MODULES[key] = cupy.RawModule(path=str(build.cubin_path))
        function = module.get_function(name)
        if dynamic_shared > 48 * 1024:
            function.max_dynamic_shared_size_bytes = dynamic_shared
    return function
