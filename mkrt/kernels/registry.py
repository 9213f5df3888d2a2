"""The kernel modules of the library, for `python -m mkrt compile --all` and the tests.

A kernel module defines ``default_specs()``: the specs its default configurations
compile. Adding a kernel adds its module name here.
"""

from __future__ import annotations

import importlib

KERNEL_MODULES = [
    "mkrt.kernels.probe",
    "mkrt.kernels.allgather",
    "mkrt.kernels.gemm",
    "mkrt.kernels.gemm_allreduce",
    "mkrt.kernels.allgather_gemm",
    "mkrt.kernels.attention",
    "mkrt.kernels.grouped_gemm",
    "mkrt.kernels.moe_experts",
    "mkrt.kernels.moe",
    "mkrt.kernels.ring_attention",
]


def optional_modules() -> list[str]:
    """Kernel modules that exist in this checkout (some land in later issues)."""
    found = []
    for name in ("mkrt.proxy.kernels", "mkrt.proxy.transports.ce_copy"):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name != name:
                raise
            continue
        found.append(name)
    return found


def all_specs():
    """(module name, spec) for every default spec of every kernel module."""
    out = []
    for name in KERNEL_MODULES + optional_modules():
        module = importlib.import_module(name)
        if hasattr(module, "default_specs"):
            out.extend((name, spec) for spec in module.default_specs())
    return out
