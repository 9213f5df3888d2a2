"""Every environment variable mkrt reads, in one table (the README lists the same table).

Variables are read when used, not at import, so a test or an IPython session can change
them. Tuning knobs belong on ops and specs, not here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


def _flag(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on")


def _timeout_ms(text: str) -> float:
    from mkrt.checks import MAX_TIMEOUT_MS
    value = float(text)
    if not 0 < value <= MAX_TIMEOUT_MS:       # also refuses nan and inf
        raise ValueError(f"expected milliseconds > 0 and <= {MAX_TIMEOUT_MS:g}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("expected an integer >= 0")
    return value


def _arch(text: str) -> str:
    import re
    if not re.fullmatch(r"sm_\d+[a-z]?", text):
        raise ValueError("expected an architecture such as sm_90a")
    return text


def _choice(*allowed: str):
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}")
        return value
    return parse


def _log_level(text: str) -> str:
    level = text.strip().upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError("expected DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return level


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    parse: Callable[[str], object]
    doc: str

    def get(self):
        return self.parse(os.environ.get(self.name, self.default))


VARIABLES: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("MKRT_JIT_CACHE_DIR", str(Path.home() / ".cache" / "mkrt"), Path,
           "Folder of compiled kernels (cubin), their rendered sources and resource reports."),
    EnvVar("MKRT_JIT_PTXAS_CHECK", "0", _flag,
           "1: a kernel that spills registers fails to build (CompileError). "
           "`python -m mkrt compile` and the tests always check."),
    EnvVar("MKRT_JIT_DEBUG", "0", _flag,
           "1: log every compile (spec, options, time, registers) at INFO on `mkrt.jit`."),
    EnvVar("MKRT_JIT_ARCH", "sm_90a", _arch,
           "Target architecture of every compile."),
    EnvVar("MKRT_WAIT_TIMEOUT_MS", "10000", _timeout_ms,
           "Default bound of every device-side wait, in milliseconds; a wait past it "
           "aborts the kernel and the host raises mkrt.CommTimeout. Ops take timeout_ms= too."),
    EnvVar("MKRT_GEMM_STREAM_K_RULE", "1", _flag,
           "1: mkrt.gemm's tile rule shares the last wave out by k-blocks where "
           "gemm_rule.stream_k_pays says; 0: never (whole tiles or the fit's split-K)."),
    EnvVar("MKRT_SYNC_CHECK", "0", _flag,
           "1: synchronize after every op and raise its device errors at once (debugging)."),
    EnvVar("MKRT_EMULATE", "", str,
           "Layout 'NxG' that mkrt.init() emulates when it is not given one and runs "
           "without mpiexec (default: 1 node x every visible GPU)."),
    EnvVar("MKRT_WORLD_RANKS_PER_NODE", "0", _count,
           "Under mpiexec: treat every N consecutive ranks of a host as one node "
           "(0: a node is a host). Splits one host into nodes that talk through the proxy."),
    EnvVar("MKRT_TRANSPORT", "auto", _choice("auto", "ce", "verbs"),
           "How the proxy moves data between nodes: 'ce' (GPU copies; nodes on one host), "
           "'verbs' (RDMA queue pairs, posted by the compiled proxy loop), 'auto' (verbs when "
           "nodes are on different hosts, else ce)."),
    EnvVar("MKRT_VERBS_PROVIDER", "device", _choice("device", "loopback", "loopback_efa"),
           "With MKRT_TRANSPORT=verbs: 'device' (an RDMA device through pyverbs), "
           "'loopback' (mkrt's stand-in NIC behind the same ibv ABI, RC queue pairs, for "
           "nodes of one process: tests of the verbs path without RDMA hardware) or "
           "'loopback_efa' (the stand-in as an EFA SRD endpoint: one queue pair, delivery "
           "out of order)."),
    EnvVar("MKRT_VERBS_DEVICES", "", str,
           "RDMA devices for the verbs transport, comma-separated, one per GPU of the host "
           "(GPU i uses the i-th; a single name serves every GPU); empty: the first device. "
           "Name the NIC nearest each GPU (`nvidia-smi topo -m`)."),
    EnvVar("MKRT_BENCH_COMMIT", "", str,
           "Git commit that experiments record when the checkout has no .git (a copied tree)."),
    EnvVar("MKRT_LOG_LEVEL", "WARNING", _log_level,
           "Level of the `mkrt` loggers (DEBUG, INFO, WARNING, ...)."),
)}


def get(name: str):
    """Value of one mkrt variable, parsed; unknown names are a programming error."""
    try:
        return VARIABLES[name].get()
    except KeyError:
        raise KeyError(f"mkrt.envs: no variable {name!r}; known: {sorted(VARIABLES)}") from None
    except ValueError as error:
        raise ValueError(f"mkrt.envs: {name}={os.environ.get(name)!r} is invalid: {error}") from None


def markdown_table() -> str:
    """The table the README carries (a test keeps the two equal)."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for var in VARIABLES.values():
        default = var.default if var.name != "MKRT_JIT_CACHE_DIR" else "~/.cache/mkrt"
        rows.append(f"| `{var.name}` | `{default}` | {var.doc} |")
    return "\n".join(rows)
