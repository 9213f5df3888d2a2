"""Disk cache of compiled kernels.

An entry is a folder named ``<uri>-<key>`` holding ``kernel.cu`` (the rendered source),
``kernel.cubin`` and ``report.json``. The key hashes everything the binary depends on:
the whole rendered source, the options, the architecture and the NVRTC version.
Many ranks may build the same kernel at once: the builder holds a file lock, re-checks
the cache under it, and every file lands by atomic rename, ``report.json`` last, so an
entry with a report is complete.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
from pathlib import Path

from mkrt import envs


def cache_dir() -> Path:
    path = Path(envs.get("MKRT_JIT_CACHE_DIR"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def cache_key(source: str, options: tuple[str, ...], arch: str, compiler_version: str) -> str:
    digest = hashlib.sha256()
    for part in (source, "\0".join(options), arch, compiler_version):
        digest.update(part.encode())
        digest.update(b"\x01")
    return digest.hexdigest()[:24]


def entry_dir(uri: str, key: str) -> Path:
    return cache_dir() / f"{uri}-{key}"


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_report(entry: Path) -> dict | None:
    """The entry's report if the entry is complete, else None."""
    try:
        report = json.loads((entry / "report.json").read_text())
    except (OSError, ValueError):
        return None
    return report if (entry / "kernel.cubin").is_file() else None


@contextlib.contextmanager
def build_lock(entry: Path):
    """Exclusive lock for building one entry, shared by every process on this machine."""
    locks = cache_dir() / "locks"
    locks.mkdir(exist_ok=True)
    with open(locks / f"{entry.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
