"""Where RingAttention(slots=k) goes wrong: per call and rank, the output's and LSE's error
against the float32 reference, for a few worlds, slot counts and shapes; rows of the worst
128-row tiles. A debugging probe (prints only)."""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main():
    import cupy

    import mkrt
    from mkrt.arrays import bfloat16
    from mkrt.kernels import attention as A
    from mkrt.kernels import ring_attention as RA
    from mkrt.kernels.gemm import from_float32, poison, to_float32
    for layout, slots, causal, chunk in (("1x2", 1, False, 128), ("1x2", 1, False, 192), ("1x3", 1, False, 128),
                                         ("1x3", 2, False, 128), ("1x2", 1, True, 128), ("1x4", 3, False, 128)):
        world = mkrt.init(emulate=layout)
        W = world.size
        rng = cupy.random.default_rng(5)
        S = 2 * W * chunk
        q, k, v = (from_float32(rng.standard_normal((1, S, h, 128), dtype=np.float32), bfloat16)
                   for h in (2, 2, 2))
        ref_o, ref_lse = A.reference(q, k, v, causal=causal)
        qs, ks, vs = ([RA.shard(x, info.rank, W, causal=causal) for info in world.local] for x in (q, k, v))
        for label, op in (("slots", mkrt.RingAttention(world, timeout_ms=5000, slots=slots)),
                          ("gathered", mkrt.RingAttention(world, timeout_ms=5000))):
            outs = [poison(cupy.empty_like(x)) for x in qs]
            lses = [cupy.full((1, 2, 2 * chunk), np.nan, np.float32) for _ in qs]
            for call in range(2):
                op(qs, ks, vs, causal=causal, out=outs, lse=lses)
                world.synchronize()
                line = []
                for info, out, lse in zip(world.local, outs, lses):
                    want = RA.shard(ref_o, info.rank, W, causal=causal)
                    want_lse = cupy.moveaxis(RA.shard(cupy.moveaxis(ref_lse, 2, 1), info.rank, W, causal=causal), 1, 2)
                    err = cupy.abs(to_float32(out) - want).max(axis=(0, 2, 3)) / float(cupy.abs(want).max())
                    tiles = err.reshape(-1, 64).max(axis=1).get()
                    lse_err = float(cupy.nanmax(cupy.abs(lse - want_lse)))
                    line.append(f"r{info.rank} err {float(err.max()):.3f} lse {lse_err:.3f} tiles64 "
                                + " ".join(f"{t:.2f}" for t in tiles))
                print(f"{layout} slots={slots} causal={causal} chunk={chunk} {label} call{call}: " + " | ".join(line),
                      flush=True)
        world.close()


if __name__ == "__main__":
    main()
