"""Markers: `gpu` tests need a CUDA GPU and are skipped without one.

Every test that launches a persistent kernel or a process must be bounded: GPU waits
carry a timeout_ms, subprocesses a timeout=.
"""

from __future__ import annotations

import functools
import os
import tempfile

import pytest


@functools.cache
def gpu_count() -> int:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() if cupy.cuda.is_available() else 0
    except Exception:
        return 0


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (sm_90a); skipped without one")
    # Tests never share the user's kernel cache (and CI starts with none).
    os.environ.setdefault("MKRT_JIT_CACHE_DIR", tempfile.mkdtemp(prefix="mkrt-test-cache-"))


def pytest_collection_modifyitems(config, items):
    if gpu_count() > 0:
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def make_world():
    """make_world("2x2") -> an emulated world on the visible GPUs, closed after the test."""
    import mkrt
    worlds = []

    def make(layout):
        world = mkrt.init(emulate=layout)
        worlds.append(world)
        return world
    yield make
    for world in worlds:
        world.close()
