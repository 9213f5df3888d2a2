"""Kernel specs: the compile-time parameters of one kernel, with a readable URI.

A spec is a frozen dataclass. Its fields are exactly the values that change the
generated code (tile sizes, dtype, world layout where it is baked in); everything else
stays a runtime argument. The URI names the cache entry and the logs, e.g.
``allgather_t512_sm90a``.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import ClassVar

from mkrt import envs
from mkrt.jit.compiler import Build, compile_cuda, load_function
from mkrt.jit.render import CudaSource, render


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    #: name of the kernel family; first part of the URI
    family: ClassVar[str] = ""
    #: entry functions the module defines (checked for spills, loaded by name)
    entry_points: ClassVar[tuple[str, ...]] = ()
    #: bytes of spills (stores + loads) an entry may have and still pass the spill check;
    #: only where the spec says why (none by default)
    spill_allowance: ClassVar[dict[str, int]] = {}

    def __post_init__(self):
        """Fields declared int must be ints (a 128.0 would render as 128.0 into the source
        and the cache name). Subclasses with checks of their own call this first."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", int) and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
                raise TypeError(f"mkrt.{self.family or 'jit'}: {f.name} must be an int, got "
                                f"{value!r} ({type(value).__name__})")
            if f.type in ("str", str) and not isinstance(value, str):
                raise TypeError(f"mkrt.{self.family or 'jit'}: {f.name} must be a str, got {value!r}")

    def template(self) -> CudaSource:
        raise NotImplementedError(f"{type(self).__name__} must return its CUDA template")

    def params(self) -> dict[str, object]:
        """Values for the template's $NAMES (the fields, upper-cased, by default)."""
        return {f.name.upper(): getattr(self, f.name) for f in dataclasses.fields(self)}

    def options(self) -> tuple[str, ...]:
        return ()

    @property
    def uri(self) -> str:
        parts = [self.family]
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            short = f.metadata.get("short", f.name)
            parts.append(f"{short}{value}" if not isinstance(value, str) else str(value))
        parts.append(envs.get("MKRT_JIT_ARCH").replace("_", ""))
        return "_".join(p for p in parts if p)

    def render(self) -> str:
        return render(self.template(), self.params(), banner=f"mkrt kernel {self.uri}")

    def build(self, *, check_spills: bool | None = None) -> Build:
        """The compiled module (memoised in this process; NVRTC runs once per cache key)."""
        arch = envs.get("MKRT_JIT_ARCH")
        memo_key = (self, arch, check_spills, str(envs.get("MKRT_JIT_CACHE_DIR")))
        if memo_key in _BUILDS:
            return _BUILDS[memo_key]
        build = compile_cuda(self.uri, self.render(), options=self.options(),
                             check_spills=check_spills, spill_allowance=self.spill_allowance)
        missing = [name for name in self.entry_points if name not in build.resources]
        if missing and build.resources:      # no report at all: see compiler._build_entry
            raise KeyError(f"mkrt.jit: {self.uri} does not define entry points {missing}; "
                           f"ptxas reported {sorted(build.resources)} (compile log: "
                           f"{build.log[:300]!r}; entry {build.cubin_path.parent})")
        _BUILDS[memo_key] = build
        return build

    def function(self, name: str, device: int, dynamic_shared: int = 0):
        """Kernel `name` on `device`, built and loaded once per process (launch-path cheap)."""
        key = (self, name, device, dynamic_shared, envs.get("MKRT_JIT_ARCH"))
        function = _FUNCTIONS.get(key)
        if function is None:
            function = _FUNCTIONS[key] = load_function(self.build(), name, device, dynamic_shared)
        return function


_BUILDS: dict = {}
_FUNCTIONS: dict = {}
