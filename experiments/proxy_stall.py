"""What lets a fused gemm_allreduce on emulated 2x2 time out: a host call that waits for the
device while the fused kernels wait for the proxy (mkrt/DESIGN.md, "Runtime hazards").

Shapes that timed out in the planner experiment, one world per mode, each shape's paths
(fused; unfused = cuBLAS + mkrt's all-reduce; the planner's pick) timed as
experiments/planner.py times them:
  planner        its warm-up as it was before f209c40: fused, fused, unfused, unfused,
                 auto, auto back to back, so a path's first cuBLAS call of a shape is issued
                 while fused calls run (planner.py now synchronizes after each path)
  synced_warmup  each path once, then world.synchronize(), before the timing
  fused_only     the fused path alone
A watchdog (faulthandler) dumps every thread's Python stack 2.5 s into a shape (the bound
is 5 s): the stack says which host call was in progress while the kernels waited.

    PYTHONPATH=$PWD python3 experiments/proxy_stall.py planner,synced_warmup,fused_only 1

Rows: $OUT/gar_timeout.jsonl (or /tmp); the committed experiments/results/proxy_stall.jsonl
holds those of a0a45db in the results format.
"""
import faulthandler
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cupy  # noqa: E402
import numpy as np  # noqa: E402

import mkrt  # noqa: E402
from mkrt.arrays import bfloat16  # noqa: E402
from planner import proxy_state, time_paths  # noqa: E402

SHAPES = [(16384, 4096, 1024), (16384, 8192, 2048), (896, 8704, 9664), (8320, 3840, 3648),
          (2304, 7936, 4160), (1792, 7424, 9920), (7168, 3584, 12544), (2944, 12544, 4352)]


def new_ops(world):
    return (mkrt.GemmAllReduce(world, fuse=True, b_layout="nk", timeout_ms=5000),
            mkrt.GemmAllReduce(world, b_layout="nk", timeout_ms=5000))


def run(mode, passes, out):
    world = mkrt.init(emulate="2x2")
    fused_op, auto_op = new_ops(world)
    dump = tempfile.TemporaryFile("w+")
    fails = 0
    for p in range(passes):
        for m, n, k in SHAPES:
            rng = cupy.random.default_rng(m + n + k + p)
            a = [rng.standard_normal((m, k), dtype=np.float32).astype(bfloat16) for _ in world.local]
            b = [(rng.standard_normal((n, k), dtype=np.float32) / 8).astype(bfloat16) for _ in world.local]
            outs = {x: [cupy.empty((m, n), bfloat16) for _ in world.local] for x in ("f", "u", "a")}
            paths = {"fused": lambda: fused_op(a, b, out=outs["f"])}
            if mode != "fused_only":
                paths["unfused"] = lambda: fused_op.unfused(a, b, out=outs["u"])
                paths["auto"] = lambda: auto_op(a, b, out=outs["a"])
            dump.seek(0)
            dump.truncate()
            faulthandler.dump_traceback_later(2.5, repeat=False, file=dump)
            t0 = time.perf_counter()
            try:
                if mode == "synced_warmup":
                    for call in paths.values():
                        call()
                        world.synchronize()
                else:
                    # planner.py's warm-up before f209c40 (time_paths has synchronized after
                    # each path since; the rows of a0a45db ran inside it unsynchronized)
                    for call in paths.values():
                        call()
                        call()
                time_paths(world, paths, 3, 3)
                status = "ok"
                err = None
            except mkrt.CommTimeout as e:
                status = "timeout"
                fails += 1
                err = {"error": str(e), "records": [str(r) for r in e.records],
                       "proxy": proxy_state(world)}
            faulthandler.cancel_dump_traceback_later()
            dump.seek(0)
            stacks = dump.read()
            row = {"mode": mode, "pass": p, "shape": f"{m}x{n}x{k}", "status": status,
                   "seconds": round(time.perf_counter() - t0, 3), "err": err,
                   "stacks": stacks[-6000:] if stacks else None}
            print(json.dumps({k2: v for k2, v in row.items() if k2 != "stacks"}), flush=True)
            if stacks:
                print(stacks[-4000:], flush=True)
            out.write(json.dumps(row) + "\n")
            out.flush()
            del a, b, outs, paths
            if status == "timeout":
                world.close()
                world = mkrt.init(emulate="2x2")
                fused_op, auto_op = new_ops(world)
            cupy.get_default_memory_pool().free_all_blocks()
    world.close()
    return fails


if __name__ == "__main__":
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "gar_timeout.jsonl"), "a") as rows:
        for mode in sys.argv[1].split(","):
            print("MODE", mode, "fails", run(mode, int(sys.argv[2]), rows), flush=True)
