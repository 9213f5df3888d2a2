"""The kernel cache under concurrency: several processes build the same spec at once."""

from __future__ import annotations

import json
import subprocess
import sys

from mkrt.launch import child_env

BUILD_ONE = """
import json, sys, time
from mkrt.kernels.allgather import AllGatherSpec
start = time.time()
build = AllGatherSpec(threads=256).build(check_spills=True)
print(json.dumps({"cached": build.cached, "key": build.key, "cubin": str(build.cubin_path),
                  "size": build.cubin_path.stat().st_size}))
"""


def test_concurrent_builds_of_one_spec_compile_once(tmp_path):
    env = child_env(MKRT_JIT_CACHE_DIR=str(tmp_path))
    processes = [subprocess.Popen([sys.executable, "-c", BUILD_ONE], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(4)]
    results = []
    for process in processes:
        out, err = process.communicate(timeout=180)
        assert process.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(not r["cached"] for r in results) == 1, results    # one compiled, three waited
    assert len({r["key"] for r in results}) == 1
    assert len({r["size"] for r in results}) == 1 and results[0]["size"] > 0
    entries = [p for p in tmp_path.iterdir() if p.is_dir() and p.name != "locks"]
    assert len(entries) == 1
    assert sorted(f.name for f in entries[0].iterdir()) == ["kernel.cu", "kernel.cubin", "report.json"]
