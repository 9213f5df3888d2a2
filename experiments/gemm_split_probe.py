"""Does the split-K kernel run its whole tiles as fast as the plain kernel? And what does
the tail split cost or gain, timed in interleaved rounds (every configuration once per
round, so clock and power drift fall on all of them alike)?

Per shape: the plain kernel (whole tiles), the split-K kernel told to run every unit
whole (whole_units patched to the unit count: the same work as the plain kernel through
the split kernel's code), and the tail split in 2, 3 and 4 parts; torch.matmul in the
same rounds. Rows: experiments/results/gemm_split_probe.jsonl.

    PYTHONPATH=$PWD python3 experiments/gemm_split_probe.py --out OUT.jsonl
"""

from __future__ import annotations

import argparse

import numpy as np

SHAPES = ["8192x8192x8192", "3000x5000x7000", "8192x1024x8192", "16384x4096x14336",
          "5000x3000x2000", "7168x7168x7168"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=SHAPES)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--out", default="experiments/results/gemm_split_probe.jsonl")
    args = parser.parse_args()
    import cupy
    import torch

    from mkrt.bench import append_jsonl, record
    from mkrt.kernels import gemm as G
    device = 0
    for shape in args.shapes:
        m, n, k = (int(x) for x in shape.split("x"))
        a = cupy.from_dlpack(torch.randn((m, k), dtype=torch.bfloat16, device="cuda"))
        b = cupy.from_dlpack(torch.randn((n, k), dtype=torch.bfloat16, device="cuda") / 8)
        out = cupy.empty((m, n), dtype=a.dtype)
        ta, tb = torch.from_dlpack(a), torch.from_dlpack(b).t()
        ref = G.reference(a, b, b_layout="nk")
        for cluster in ("", "m2"):
            calls = {"torch": lambda: torch.matmul(ta, tb)}
            base = G.plan(m, n, k, block_m=128, block_n=256, cluster=cluster)
            calls["whole"] = lambda: G.gemm(a, b, out, b_layout="nk", block_m=128, block_n=256,
                                            split_k=1, cluster=cluster)
            # the split kernel with every unit whole
            p = G.plan(m, n, k, block_m=128, block_n=256, split_k=2, split_tail=True,
                       cluster=cluster)
            if p.splits > 1:
                function = p.spec.function("gemm", device, p.spec.smem_bytes)
                prepared = G._PreparedGemm(p, function, device)
                prepared.launch.params.set(whole_units=prepared.plan.units)
                prepared.patch(a.data.ptr, b.data.ptr, out.data.ptr)
                stream = cupy.cuda.get_current_stream()
                calls["split kernel, all whole"] = lambda: prepared.run(stream.ptr)
            for splits in (2, 3, 4):
                calls[f"tail {splits}"] = (lambda s=splits: G.gemm(
                    a, b, out, b_layout="nk", block_m=128, block_n=256, split_k=s,
                    split_tail=True, cluster=cluster))
            errors = {}
            for name, fn in calls.items():
                if name == "torch":
                    continue
                G.poison(out)
                fn()
                errors[name] = float(cupy.linalg.norm(G.to_float32(out) - ref) / cupy.linalg.norm(ref))
            samples = {name: [] for name in calls}
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            for name, fn in calls.items():
                fn()
            for _ in range(args.rounds):
                for name, fn in calls.items():
                    start.record()
                    for _ in range(args.iterations):
                        fn()
                    stop.record()
                    stop.synchronize()
                    samples[name].append(1e3 * cupy.cuda.get_elapsed_time(start, stop) / args.iterations)
            us = {name: float(np.median(v)) for name, v in samples.items()}
            rows = []
            for name, value in us.items():
                if name in ("torch", "whole"):
                    continue
                print(f"{shape:18s} {cluster or '-':2s} {name:24s} {value:8.1f} us, whole "
                      f"{us['whole']:8.1f} ({us['whole'] / value:5.3f}x), torch {us['torch']:8.1f}, "
                      f"error {errors[name]:.1e}", flush=True)
                rows.append(record("gemm_split_probe", f"{shape} {name}" + (" m2" if cluster else ""),
                                   "us", value, us["whole"], "us", higher_is_better=False,
                                   cluster=cluster, variant=name, torch_us=us["torch"],
                                   error=errors[name], units=base.units, grid=base.grid,
                                   baseline_name="mkrt.gemm whole tiles, same tile"))
            print(f"{shape:18s} {cluster or '-':2s} whole {us['whole']:8.1f} us, torch {us['torch']:8.1f} "
                  f"({us['torch'] / us['whole']:5.3f}x)", flush=True)
            append_jsonl(args.out, rows)
        a = b = out = ta = tb = ref = None
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
