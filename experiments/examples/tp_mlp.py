"""A tensor-parallel transformer MLP block under mpiexec, checked against one GPU.

    y = silu(x @ W1) @ W2        x: [tokens, hidden], W1: [hidden, ffn], W2: [ffn, hidden]

split over W ranks the Megatron way: rank r holds columns r*F..(r+1)*F of W1 and the same
rows of W2 (F = ffn / W), and every rank holds the whole x.
  1. column-parallel linear, input replicated: h_r = x @ W1[:, cols_r] is a local
     ``mkrt.gemm``; no communication;
  2. h_r = silu(h_r), elementwise on the shard;
  3. row-parallel linear: y = sum_r h_r @ W2[rows_r, :], which is ``mkrt.gemm_allreduce``:
     every rank ends with the whole y.
Every rank builds the same W1, W2 and x from one seed, so rank 0 can check y against the
unsplit block computed on its GPU (torch when installed, else CuPy) in float32.

Run (one process per GPU; on a one-GPU machine both processes share GPU 0, which CUDA
time-slices between them: the check means as much as on several GPUs, the time does not):

    mpiexec -n 2 python -m mpi4py experiments/examples/tp_mlp.py
    python experiments/examples/tp_mlp.py --launch 2      # starts mpiexec itself (right flags
                                                          # for Open MPI or MPICH)
    python experiments/examples/tp_mlp.py --cpu           # no GPU: plan, compile, and the
    mpiexec -n 2 python -m mpi4py experiments/examples/tp_mlp.py --cpu   # split checked in
                                                          # NumPy on small sizes
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the checkout, when not installed

import numpy as np


def weights(tokens: int, hidden: int, ffn: int, xp=np):
    """x, W1, W2 in float32, the same on every rank (one seed)."""
    rng = np.random.default_rng(2026)
    x = rng.standard_normal((tokens, hidden), dtype=np.float32)
    w1 = rng.standard_normal((hidden, ffn), dtype=np.float32) / np.sqrt(hidden)
    w2 = rng.standard_normal((ffn, hidden), dtype=np.float32) / np.sqrt(ffn)
    return xp.asarray(x), xp.asarray(w1), xp.asarray(w2)


def silu(v, xp=np):
    return v / (1 + xp.exp(-v))


def shard(ffn: int, rank: int, size: int) -> slice:
    if ffn % size or (ffn // size) % 8:
        raise ValueError(f"tp_mlp: ffn={ffn} must split into {size} shards of a multiple of 8")
    width = ffn // size
    return slice(rank * width, (rank + 1) * width)


def cpu_part(world, args) -> int:
    """No GPU: check the split in float64 NumPy on small sizes (summing the shards over MPI
    when there are several processes), plan both linears, compile their kernels."""
    from mkrt.kernels import gemm, gemm_allreduce as gar
    me = world.local[0].rank if len(world.local) == 1 else None
    tokens, hidden, ffn = 64, 32, 128
    x, w1, w2 = (a.astype(np.float64) for a in weights(tokens, hidden, ffn))
    full = silu(x @ w1) @ w2
    parts = {}
    for info in world.local:
        cols = shard(ffn, info.rank, world.size)
        parts[info.rank] = silu(x @ w1[:, cols]) @ w2[cols, :]     # steps 1-3 of rank r
    local_sum = sum(parts.values())
    total = world.comm.allreduce(local_sum) if world.comm is not None else local_sum
    error = float(np.linalg.norm(total - full) / np.linalg.norm(full))
    lead = me in (None, 0)
    if lead:
        print(f"tp_mlp --cpu: world {world.layout} ({'mpiexec' if world.comm else 'one process'}); "
              f"sum of {world.size} shards vs the unsplit block (float64, {tokens}x{hidden}x{ffn}): "
              f"relative error {error:.1e}")
    F = args.ffn // world.size
    g = gemm.plan(args.tokens, F, args.hidden, b_layout="kn", sms=132 // world.size)
    p = gar.plan(args.tokens, args.hidden, F, nodes=world.nodes, ranks_per_node=world.ranks_per_node,
                 ctas=132 // world.size, ranks_per_gpu=world.size)
    problems = p.check()
    if lead:
        print(f"column-parallel: mkrt.gemm {args.tokens}x{F}x{args.hidden} per rank, {g.tiles} tiles")
        print(f"row-parallel: gemm_allreduce {args.tokens}x{args.hidden}x{F} per rank: "
              f"{'fused' if p.fused else 'unfused'} ({p.reason}), {p.compute_ctas} compute + "
              f"{p.reduce_ctas} reduce CTAs; schedule: {'; '.join(problems) or 'ok'}")
        from mkrt.kernels.registry import all_specs
        for _, spec in all_specs():
            if spec.uri.startswith(("gemm_bf16_kn_", "gemm_allreduce_bf16_kn_")):
                spec.build(check_spills=True)
                print(f"compiled {spec.uri}")
        print("tp_mlp --cpu: ok" if error < 1e-12 and not problems else "tp_mlp --cpu: FAILED")
    return 0 if error < 1e-12 and not problems else 1


def gpu_part(world, args) -> int:
    import cupy
    from mpi4py import MPI

    import mkrt
    from mkrt.arrays import bfloat16
    from mkrt.bench import median_ms
    from mkrt.kernels.gemm import to_float32
    (me,) = world.local
    lead = me.rank == 0
    cols = shard(args.ffn, me.rank, world.size)
    x, w1, w2 = weights(args.tokens, args.hidden, args.ffn, xp=cupy)
    x16 = x.astype(bfloat16)
    w1_r = cupy.ascontiguousarray(w1[:, cols]).astype(bfloat16)    # [hidden, F]: column shard
    w2_r = cupy.ascontiguousarray(w2[cols, :]).astype(bfloat16)    # [F, hidden]: row shard
    # The planner picks fused or unfused per shape; the second op always fuses.
    ops = {"planner's choice": mkrt.GemmAllReduce(world, timeout_ms=60000),
           "fused": mkrt.GemmAllReduce(world, fuse=True, timeout_ms=60000)}

    def block(row_parallel):
        h = mkrt.gemm(x16, w1_r)                                    # 1. local GEMM
        h = silu(to_float32(h), xp=cupy).astype(bfloat16)           # 2. SiLU on the shard
        return row_parallel(h, w2_r)                                # 3. GEMM + all-reduce

    # The unsplit block on this GPU, float32, from the same bf16-rounded inputs.
    xf, w1f, w2f = (to_float32(v.astype(bfloat16)) for v in (x, w1, w2))
    try:
        import torch
        t = [torch.from_dlpack(v) for v in (xf, w1f, w2f)]
        expected = cupy.from_dlpack(torch.nn.functional.silu(t[0] @ t[1]) @ t[2])
        reference = "torch float32"
    except ImportError:
        expected = silu(xf @ w1f, xp=cupy) @ w2f
        reference = "cupy float32"
    if lead:
        flops = 2.0 * args.tokens * args.hidden * args.ffn * 2
        print(f"tp_mlp: {world.size} ranks ({world.layout}), tokens={args.tokens}, "
              f"hidden={args.hidden}, ffn={args.ffn} ({args.ffn // world.size} per rank), bf16; "
              f"reference: the unsplit block in {reference}")
    status = 0
    for name, row_parallel in ops.items():
        y = block(row_parallel)
        world.synchronize()
        error = float(cupy.linalg.norm(to_float32(y) - expected) / cupy.linalg.norm(expected))
        worst = world.comm.allreduce(error, op=MPI.MAX)
        world.barrier()
        ms = median_ms(lambda: block(row_parallel), warmup=3, iters=args.iters)
        world.synchronize()
        slowest = world.comm.allreduce(ms, op=MPI.MAX)
        p = row_parallel.last_plan
        if lead:
            print(f"  {name}: gemm_allreduce {'fused' if p.fused else 'unfused'} ({p.reason}), "
                  f"{p.compute_ctas} compute + {p.reduce_ctas} reduce CTAs per rank")
            print(f"    worst relative error over ranks: {worst:.2e} (bound 2e-2); block "
                  f"{slowest * 1e3:.0f} us per call (slowest rank), "
                  f"{flops / slowest / 1e9:.0f} TFLOP/s over all ranks")
        status |= 0 if worst < 2e-2 else 1
        row_parallel.close()
    if lead and len({info.device for info in world.ranks}) < world.size:
        print("  (ranks share a GPU: CUDA time-slices their processes, so the times are no "
              "speed figure)")
    if lead:
        print("tp_mlp: ok" if status == 0 else "tp_mlp: FAILED")
    return status


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="no GPU: NumPy check, plans, compile")
    parser.add_argument("--launch", type=int, metavar="RANKS",
                        help="start mpiexec with this many processes running this script")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    if args.launch:
        from mkrt.launch import child_env, mpiexec_command
        rest = [a for a in (argv if argv is not None else sys.argv[1:])]
        drop = rest.index("--launch")
        rest = rest[:drop] + rest[drop + 2:]
        command = mpiexec_command(args.launch, str(Path(__file__).resolve()), *rest)
        print(" ".join(command), flush=True)
        return subprocess.run(command, env=child_env(), timeout=600).returncode
    import mkrt
    from mkrt.world import under_mpiexec
    if args.cpu:   # no GPU: ranks without a device; outside mpiexec, two ranks in this process
        world = mkrt.init(gpus=0) if under_mpiexec() else mkrt.init(emulate="1x2", gpus=0)
    else:
        world = mkrt.init()
    try:
        return cpu_part(world, args) if args.cpu else gpu_part(world, args)
    finally:
        world.close()


if __name__ == "__main__":
    sys.exit(main())
