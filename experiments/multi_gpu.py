"""The fused kernels on one multi-GPU host, against NCCL + cuBLAS and torch symmetric memory.

One command, under ten minutes, on a host with 2, 4 or 8 GPUs:
    python3 experiments/multi_gpu.py
It starts ``mpiexec`` itself (one process per GPU; Open MPI gets --allow-run-as-root), twice:
  1. one node of all GPUs (peer pointers, CUDA IPC);
  2. the same host split into 2 nodes (MKRT_WORLD_RANKS_PER_NODE = GPUs/2): traffic between
     the halves goes through each rank's proxy and the `ce` transport.
Per run, every rank checks peer access, then correctness (allgather, gemm_allreduce against
a float32 reference), then times, in the same run:
  allgather:      mkrt.allgather vs NCCL all_gather_into_tensor (bus bandwidth, nccl-tests'
                  definition: algbw * (W-1)/W)
  gemm_allreduce: mkrt fused vs torch.matmul (cuBLAS) + NCCL all_reduce vs mkrt unfused, and
                  torch.matmul + symmetric-memory all-reduce where torch offers one without
                  multicast (else the reason it does not apply is recorded)
  allgather_gemm: mkrt fused vs NCCL all_gather + torch.matmul, and torch's symmetric-memory
                  fused_all_gather_matmul where it runs (the reference's sweep: M = K,
                  N = M/16 per rank, plus Llama-3 70B's column-parallel widths)
  gemm_reducescatter: mkrt fused vs torch.matmul + NCCL reduce_scatter, and torch's
                  fused_matmul_reduce_scatter where it runs (K = M/16 per rank, plus Llama-3
                  70B's row-parallel shapes)
  ring_attention: mkrt's one-kernel ring (non-causal) vs NCCL all_gather of K and V + torch
                  SDPA (its best backend here), B 1, 32 heads, D 128, 4096 tokens per rank
Results: experiments/results/multi_gpu.jsonl (one line per case, with GPU count and layout),
multi_gpu_topology.txt (``nvidia-smi topo -m``) and multi_gpu.png.

NVLink multicast stays off (mkrt/DESIGN.md, "Machine facts"): NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 are set for every process, and mkrt never uses multimem.

``--dry-run`` runs the mkrt half on an emulated world of this process's GPUs (no NCCL),
so the script can be checked on one GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "experiments" / "results"
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
for _name, _value in NO_MULTICAST.items():
    os.environ[_name] = _value

ALLGATHER_MIB = [1, 4, 16, 64, 256]
GEMM_CASES = [(2048, 2048, 128), (4096, 4096, 256), (8192, 8192, 512), (16384, 16384, 1024),
              (4096, 8192, 3584), (8192, 8192, 3584)]
#: AllGather+GEMM (M, N per rank, K): the reference's sweep, then Llama-3 70B's fused QKV and
#: gate/up widths at TP 8 (10240 / 8, 57344 / 8) for 8192 tokens
AG_CASES = [(4096, 256, 4096), (8192, 512, 8192), (8192, 1280, 8192), (8192, 7168, 8192)]
#: GEMM+ReduceScatter (M, N, K per rank): K = M/16, then Llama-3 70B's o_proj and down_proj
#: at TP 8 for 8192 tokens
RS_CASES = [(4096, 4096, 256), (8192, 8192, 512), (8192, 8192, 1024), (8192, 8192, 3584)]


# ---- launcher ------------------------------------------------------------------------------

def gpu_count() -> int:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def launch(args) -> int:
    from mkrt.launch import child_env, mpiexec_command
    gpus = gpu_count()
    if gpus < 2:
        print(f"multi_gpu: {gpus} GPU(s) here; this experiment needs at least 2 "
              "(use --dry-run to check the mkrt half on one GPU)")
        return 2
    RESULTS.mkdir(parents=True, exist_ok=True)
    topology = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=60)
    (RESULTS / "multi_gpu_topology.txt").write_text(topology.stdout)
    print(topology.stdout)
    status = 0
    for ranks_per_node in (0, gpus // 2):
        env = child_env(MKRT_WORLD_RANKS_PER_NODE=str(ranks_per_node), **NO_MULTICAST)
        command = mpiexec_command(gpus, __file__, "--rank-job", "--out", args.out,
                                  "--iters", str(args.iters))
        print(" ".join(command), f"(MKRT_WORLD_RANKS_PER_NODE={ranks_per_node})", flush=True)
        start = time.perf_counter()
        result = subprocess.run(command, env=env, timeout=420)
        print(f"(run took {time.perf_counter() - start:.0f} s, exit {result.returncode})")
        status |= result.returncode
    plot(args.out)
    return status


# ---- inside each rank ----------------------------------------------------------------------

def init_torch_distributed(world):
    import torch
    import torch.distributed as dist
    (me,) = world.local
    port = world.comm.bcast(29500 + os.getpid() % 1000 if me.rank == 0 else None, root=0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(me.device)
    dist.init_process_group("nccl", rank=me.rank, world_size=world.size,
                            device_id=torch.device("cuda", me.device))
    return dist


def check_peer_access(world) -> list[str]:
    import cupy
    (me,) = world.local
    problems = []
    for peer in world.node_ranks(me.node):
        device = world.ranks[peer].device
        if device != me.device and not cupy.cuda.runtime.deviceCanAccessPeer(me.device, device):
            problems.append(f"GPU {me.device} cannot access GPU {device}")
    return problems


def slowest(world, ms: float) -> float:
    """The slowest rank's time: a collective is as fast as its last rank."""
    return world.comm.allreduce(ms, op=__import__("mpi4py").MPI.MAX) if world.comm else ms


def rank_job(args) -> int:
    import cupy
    import numpy as np
    import torch

    import mkrt
    from mkrt.arrays import bfloat16
    from mkrt.bench import median_ms, record
    from mkrt.kernels import gemm_allreduce as gar
    from mkrt.kernels.gemm import to_float32

    world = mkrt.init()
    (me,) = world.local
    lead = me.rank == 0
    problems = check_peer_access(world)
    dist = init_torch_distributed(world)
    layout = world.layout
    records = []
    tag = {"gpus": world.size, "layout": layout}

    # allgather: correctness, then mkrt vs NCCL
    ag = mkrt.AllGather(world, timeout_ms=30000)
    W = world.size                # mkrt.allgather gathers the world, as NCCL's does
    for mib in ALLGATHER_MIB:
        count = int(mib * 2**20) // 4
        x = cupy.random.standard_normal(count, dtype=np.float32) + me.rank
        out = ag(x)
        world.synchronize()
        gathered = [np.asarray(v) for v in world.comm.allgather(x[:64].get())]
        ok = all(np.array_equal(out[i, :64].get(), gathered[i]) for i in range(W))
        ms = slowest(world, median_ms(lambda: ag(x, out=out), iters=args.iters))
        xt, ot = torch.from_dlpack(x), torch.empty((W * count,), device="cuda", dtype=torch.float32)
        nccl_ms = slowest(world, median_ms(lambda: dist.all_gather_into_tensor(ot, xt), iters=args.iters))
        total = W * count * 4
        bus = total / (ms * 1e-3) / 1e9 * (W - 1) / W
        nccl_bus = total / (nccl_ms * 1e-3) / 1e9 * (W - 1) / W if nccl_ms else None
        if lead:
            print(f"[{layout}] allgather {mib:>4} MiB/rank: mkrt {bus:7.1f} GB/s bus"
                  + (f", NCCL {nccl_bus:7.1f} GB/s" if nccl_bus else "") + f"  correct={ok}")
        records.append(record("multi_gpu", f"{layout}_allgather_{mib}MiB", "bus_bandwidth", bus,
                              nccl_bus, "GB/s", correct=ok, baseline_name="NCCL all_gather", **tag))
    ag.close()

    # gemm_allreduce: correctness on the small cases, then mkrt fused / unfused vs torch+NCCL
    op = gar.GemmAllReduce(world, fuse=True, timeout_ms=60000)
    for m, n, k in GEMM_CASES:
        rng = cupy.random.default_rng(1000 + me.rank)
        a = rng.standard_normal((m, k), dtype=np.float32).astype(bfloat16)
        b = (rng.standard_normal((k, n), dtype=np.float32) / 8).astype(bfloat16)
        out = cupy.empty((m, n), bfloat16)
        error = None
        if m * n <= 4096 * 4096:
            op(a, b, out=out)
            world.synchronize()
            all_a = world.comm.allgather(a.get())
            all_b = world.comm.allgather(b.get())
            expected = sum(to_float32(x) @ to_float32(y) for x, y in zip(all_a, all_b))
            error = float(np.linalg.norm(to_float32(out.get()) - expected) / np.linalg.norm(expected))
        fused_ms = slowest(world, median_ms(lambda: op(a, b, out=out), iters=args.iters))
        unfused_ms = slowest(world, median_ms(lambda: op.unfused(a, b, out=out, allreduce="mkrt"),
                                              iters=args.iters))
        at, bt = torch.from_dlpack(a), torch.from_dlpack(b)
        ct = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)

        def torch_nccl():
            torch.matmul(at, bt, out=ct)
            dist.all_reduce(ct)
        torch_ms = slowest(world, median_ms(torch_nccl, iters=args.iters))
        symm_ms, symm_note = symmetric_memory_baseline(world, dist, at, bt, args.iters)
        case = f"{m}x{n}x{k}"
        if lead:
            print(f"[{layout}] gemm_allreduce {case:>18}: fused {fused_ms * 1e3:9.1f} us, "
                  f"torch+NCCL {torch_ms * 1e3:9.1f} us ({torch_ms / fused_ms:.2f}x), "
                  f"unfused {unfused_ms * 1e3:9.1f} us, symm_mem "
                  + (f"{symm_ms * 1e3:.1f} us" if symm_ms else symm_note)
                  + (f", error {error:.1e}" if error is not None else ""))
        records.append(record("multi_gpu", f"{layout}_gemm_allreduce_{case}", "time", fused_ms * 1e3,
                              torch_ms * 1e3, "us", higher_is_better=False, m=m, n=n, k_per_rank=k,
                              unfused_us=unfused_ms * 1e3, symm_mem_us=symm_ms and symm_ms * 1e3,
                              symm_mem_note=symm_note, rel_error=error,
                              baseline_name="torch.matmul + NCCL all_reduce", **tag))
    op.close()
    records += tensor_parallel_pair(args, world, dist, tag, lead)
    records += ring_attention_cases(args, world, dist, tag, lead)
    if lead:
        from mkrt.bench import append_jsonl
        append_jsonl(args.out, records)
        if problems:
            print("peer access problems:", problems)
    dist.destroy_process_group()
    world.close()
    return 0


def tensor_parallel_pair(args, world, dist, tag, lead) -> list:
    """AllGather+GEMM and GEMM+ReduceScatter: mkrt fused vs NCCL + cuBLAS vs torch's fused
    symmetric-memory ops, same run; correctness against the NCCL path's output."""
    import cupy
    import numpy as np
    import torch

    import mkrt
    from mkrt.arrays import bfloat16
    (me,) = world.local
    W, records = world.size, []
    group = dist.group.WORLD.group_name

    def operands(rows, k, n, seed):
        rng = cupy.random.default_rng(seed + me.rank)
        a = rng.standard_normal((rows, k), dtype=np.float32).astype(bfloat16)
        b = (rng.standard_normal((k, n), dtype=np.float32) / 8).astype(bfloat16)
        return a, b, torch.from_dlpack(a), torch.from_dlpack(b)

    ag = mkrt.AllGatherGemm(world, fuse=True, timeout_ms=60000)
    for m, n, k in AG_CASES:
        a, b, at, bt = operands(m // W, k, n, 2000)
        out = cupy.empty((m, n), bfloat16)
        a_full = torch.empty((m, k), device="cuda", dtype=torch.bfloat16)
        ct = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)

        def nccl():
            dist.all_gather_into_tensor(a_full, at)
            torch.matmul(a_full, bt, out=ct)
        records.append(_compare(
            args, world, lead, "allgather_gemm", f"{m}x{n}x{k}", lambda: ag(a, b, out=out), out,
            nccl, ct, "NCCL all_gather + torch.matmul",
            lambda: torch.ops.symm_mem.fused_all_gather_matmul(at, [bt], gather_dim=0,
                                                               group_name=group),
            group, dict(tag, m=m, n_per_rank=n, k=k)))
    ag.close()

    rs = mkrt.GemmReduceScatter(world, fuse=True, timeout_ms=60000)
    for m, n, k in RS_CASES:
        a, b, at, bt = operands(m, k, n, 3000)
        out = cupy.empty((m // W, n), bfloat16)
        partial = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
        ct = torch.empty((m // W, n), device="cuda", dtype=torch.bfloat16)

        def nccl():
            torch.matmul(at, bt, out=partial)
            dist.reduce_scatter_tensor(ct, partial)
        records.append(_compare(
            args, world, lead, "gemm_reducescatter", f"{m}x{n}x{k}", lambda: rs(a, b, out=out), out,
            nccl, ct, "torch.matmul + NCCL reduce_scatter",
            lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(at, bt, "sum", scatter_dim=0,
                                                                   group_name=group),
            group, dict(tag, m=m, n=n, k_per_rank=k)))
    rs.close()
    return records


def _compare(args, world, lead, op_name, case, fused, out, baseline, baseline_out, baseline_name,
             torch_fused, group, fields):
    """One case: both paths once (the fused output against the baseline's), then both timed
    (the slowest rank's median), then torch's fused op where it runs; one record."""
    import cupy
    import numpy as np
    import torch

    from mkrt.bench import median_ms, record
    from mkrt.kernels.gemm import to_float32
    fused()
    baseline()
    torch.cuda.synchronize()
    world.synchronize()
    mine = to_float32(out).astype(np.float64)
    theirs = cupy.from_dlpack(baseline_out.float().contiguous()).astype(np.float64)   # (no bf16 in CuPy)
    error = float(cupy.linalg.norm(mine - theirs) / max(float(cupy.linalg.norm(theirs)), 1e-30))
    fused_ms = slowest(world, median_ms(fused, iters=args.iters))
    base_ms = slowest(world, median_ms(baseline, iters=args.iters))
    symm_ms, note = _symm_fused(world, args.iters, torch_fused, group)
    layout = world.layout
    if lead:
        print(f"[{layout}] {op_name} {case:>16}: fused {fused_ms * 1e3:9.1f} us, {baseline_name} "
              f"{base_ms * 1e3:9.1f} us ({base_ms / fused_ms:.2f}x), torch fused "
              + (f"{symm_ms * 1e3:.1f} us" if symm_ms else note) + f", error {error:.1e}")
    return record("multi_gpu", f"{layout}_{op_name}_{case}", "time", fused_ms * 1e3, base_ms * 1e3,
                  "us", higher_is_better=False, torch_fused_us=symm_ms and symm_ms * 1e3,
                  torch_fused_note=note, rel_error=error, baseline_name=baseline_name, **fields)


def ring_attention_cases(args, world, dist, tag, lead) -> list:
    """Non-causal ring attention: mkrt vs NCCL all_gather(K, V) + SDPA, same run."""
    import cupy
    import numpy as np
    import torch
    import torch.nn.functional as F

    import mkrt
    from mkrt.arrays import bfloat16
    from mkrt.bench import median_ms, record
    from mkrt.kernels.gemm import to_float32
    W, layout, records = world.size, world.layout, []
    op = mkrt.RingAttention(world, timeout_ms=60000)
    for per_rank in (4096,):
        B, H, D = 1, 32, 128
        rng = cupy.random.default_rng(4000 + world.local[0].rank)
        q, k, v = (rng.standard_normal((B, per_rank, H, D), dtype=np.float32).astype(bfloat16)
                   for _ in range(3))
        out = op(q, k, v, causal=False)[0]
        qt, kt, vt = (torch.from_dlpack(x) for x in (q, k, v))
        k_all = torch.empty((W, B, per_rank, H, D), device="cuda", dtype=torch.bfloat16)
        v_all = torch.empty_like(k_all)

        def nccl():
            dist.all_gather_into_tensor(k_all, kt)
            dist.all_gather_into_tensor(v_all, vt)
            # non-causal chunks are in rank order: the full sequence is the ranks' K/V in turn
            kf = k_all.permute(1, 3, 0, 2, 4).reshape(B, H, W * per_rank, D)
            vf = v_all.permute(1, 3, 0, 2, 4).reshape(B, H, W * per_rank, D)
            return F.scaled_dot_product_attention(qt.transpose(1, 2), kf, vf)
        want = nccl().transpose(1, 2)
        torch.cuda.synchronize()
        world.synchronize()
        mine, theirs = to_float32(out).astype(np.float64), cupy.from_dlpack(want.float().contiguous())
        error = float(cupy.linalg.norm(mine - theirs) / cupy.linalg.norm(theirs))
        ring_ms = slowest(world, median_ms(lambda: op(q, k, v, causal=False), iters=args.iters))
        nccl_ms = slowest(world, median_ms(nccl, iters=args.iters))
        flops = 4 * B * H * per_rank * (W * per_rank) * D
        case = f"b{B}_s{W * per_rank}_h{H}_d{D}"
        if lead:
            print(f"[{layout}] ring_attention {case}: mkrt {ring_ms * 1e3:9.1f} us "
                  f"({flops / ring_ms / 1e9:.0f} TFLOP/s per GPU), NCCL+SDPA {nccl_ms * 1e3:9.1f} us "
                  f"({nccl_ms / ring_ms:.2f}x), error {error:.1e}")
        records.append(record("multi_gpu", f"{layout}_ring_attention_{case}", "time", ring_ms * 1e3,
                              nccl_ms * 1e3, "us", higher_is_better=False, rel_error=error,
                              tflops_per_gpu=flops / ring_ms / 1e9,
                              baseline_name="NCCL all_gather K,V + torch SDPA", **tag))
    op.close()
    return records


def _symm_fused(world, iters, run, group):
    """Time one of torch's fused symmetric-memory ops, or say why it does not run here."""
    from mkrt.bench import median_ms
    note = ""
    try:
        import torch.distributed._symmetric_memory as symm_mem
        symm_mem.enable_symm_mem_for_group(group)
        run()
    except Exception as error:       # not in this torch, or it needs what this host lacks
        note = f"n/a ({type(error).__name__}: {str(error)[:80]})"
    # every rank times it or none does (a rank alone in a collective would wait forever)
    runs_everywhere = world.comm.allreduce(int(not note), op=__import__("mpi4py").MPI.MIN)
    if not runs_everywhere:
        return None, note or "n/a (failed on another rank)"
    return slowest(world, median_ms(run, iters=iters)), ""


def symmetric_memory_baseline(world, dist, at, bt, iters):
    """torch.matmul + torch's symmetric-memory all-reduce, if torch has one without multicast."""
    import torch
    from mkrt.bench import median_ms
    try:
        import torch.distributed._symmetric_memory as symm_mem
        m, n = at.shape[0], bt.shape[1]
        buffer = symm_mem.empty((m, n), device="cuda", dtype=torch.bfloat16)
        symm_mem.rendezvous(buffer, dist.group.WORLD.group_name)
        reduce = torch.ops.symm_mem.two_shot_all_reduce_

        def run():
            torch.matmul(at, bt, out=buffer)
            reduce(buffer, "sum", dist.group.WORLD.group_name)
        return slowest(world, median_ms(run, iters=iters)), ""
    except Exception as error:       # not available in this torch / needs multicast
        return None, f"n/a ({type(error).__name__}: {str(error)[:80]})"


# ---- dry run and plot ----------------------------------------------------------------------

def dry_run(args) -> int:
    """The mkrt half on an emulated world of this process's GPUs (no NCCL): checks the script."""
    import cupy
    import numpy as np

    import mkrt
    from mkrt.arrays import bfloat16
    from mkrt.kernels import gemm_allreduce as gar
    gpus = cupy.cuda.runtime.getDeviceCount()
    for layout in (f"1x{max(2, gpus)}", f"2x{max(1, gpus // 2)}"):
        world = mkrt.init(emulate=layout)
        out = mkrt.AllGather(world)([cupy.ones(1000, np.float32) * i for i in range(world.size)])
        op = gar.GemmAllReduce(world, fuse=True)
        a = [cupy.ones((256, 64), bfloat16) for _ in world.local]
        b = [cupy.ones((64, 256), bfloat16) for _ in world.local]
        c = op(a, b)
        world.synchronize()
        ok = float(c[0][0, 0].astype(np.float32)) == 64.0 * world.size
        rows = [cupy.ones((128, 64), bfloat16) for _ in world.local]
        gathered = mkrt.AllGatherGemm(world, fuse=True)(rows, [cupy.ones((64, 256), bfloat16)
                                                               for _ in world.local])
        scattered = mkrt.GemmReduceScatter(world, fuse=True)(a, b)
        world.synchronize()
        ok_tp = (gathered[0].shape == (128 * world.size, 256)
                 and float(scattered[0][0, 0].astype(np.float32)) == 64.0 * world.size)
        print(f"dry run {layout}: allgather {out[0].shape}, gemm_allreduce correct={ok}, "
              f"allgather_gemm / gemm_reducescatter correct={ok_tp}")
        world.close()
    return 0


def plot(path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["experiment"] == "multi_gpu" and r["metric"] == "time"
            and "_gemm_allreduce_" in r["case"]]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for layout in sorted({r["layout"] for r in rows}):
        mine = [r for r in rows if r["layout"] == layout]
        ax.plot([f"{r['m']}x{r['n']}x{r['k_per_rank']}" for r in mine], [r["ratio"] for r in mine],
                marker="o", label=f"{layout} vs torch+NCCL")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("torch+NCCL time / mkrt fused time")
    ax.tick_params(axis="x", rotation=30)
    ax.legend()
    fig.tight_layout()
    fig.savefig(Path(path).with_suffix(".png"), dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank-job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default=str(RESULTS / "multi_gpu.jsonl"))
    args = parser.parse_args()
    if args.rank_job:
        return rank_job(args)
    if args.dry_run:
        return dry_run(args)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
