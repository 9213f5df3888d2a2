"""Run under mpiexec by tests/test_verbs_loopback_gpu.py: one host split into nodes of one
rank (MKRT_WORLD_RANKS_PER_NODE=1) whose proxy is the verbs one over the loopback NIC
(MKRT_TRANSPORT=verbs, MKRT_VERBS_PROVIDER=loopback): gemm_allreduce and a world
allgather between processes, checked against float64 / exact references."""

import os
import sys

import cupy
import numpy as np

import mkrt
from mkrt.arrays import bfloat16
from mkrt.kernels.gemm import to_float32
from mkrt.proxy.verbs_world import VerbsWorldProxy

M, N, K = 640, 512, 256


def operands(rank, call):
    rng = np.random.default_rng(100 * call + rank)
    a = rng.standard_normal((M, K), dtype=np.float32).astype(bfloat16)
    b = (rng.standard_normal((N, K), dtype=np.float32) / 4).astype(bfloat16)
    return a, b


TIMEOUT_MS = int(os.environ.get("MPI_VERBS_TIMEOUT_MS", "20000"))


def diagnose(world, proxy, error):
    """What each process saw when a call failed: its world, SM share, every rank's first
    failed wait and the NIC counters of the proxy the calls ran through (asking the world
    for its proxy after a failure would give a fresh one: it retires the failed proxy)."""
    if proxy is None:
        print(f"rank {world.local[0].rank}: failed before the proxy started: {error}", flush=True)
        return
    lines = [f"rank {world.local[0].rank}: {world!r}; sm_count={world.sm_count(world.local[0].rank)}; "
             f"proxy {proxy!r}; {type(error).__name__}: {str(error)[:300]}"]
    for record in getattr(error, "records", None) or []:
        lines.append(f"  first failed wait: {record}")
    for rank, transport in getattr(proxy, "transports", {}).items():
        for peer, qp in transport.qps.items():
            nic = getattr(qp, "nic", None)
            if nic is not None:
                words = [int(w) for w in nic.qps[qp.index][1][:6]]
                lines.append(f"  rank {rank} -> {peer}: qp words (depth, posted, freed, fail_after, "
                             f"error, peer_cq) {words}; outstanding {nic.outstanding(qp.index)}")
        if hasattr(transport, "regions"):
            lines.append(f"  regions registered: {int((transport.regions[:, :, 3] != 0).sum())}")
    print("\n".join(lines), flush=True)


world = mkrt.init()
(me,) = world.local
op = mkrt.GemmAllReduce(world, fuse=True, b_layout="nk", timeout_ms=TIMEOUT_MS)
gather = mkrt.AllGather(world, timeout_ms=TIMEOUT_MS)
proxy = None       # the proxy the calls run through (the first call starts it)
worst, gathered_exact = 0.0, True
for call in range(3):
    a, b = operands(me.rank, call)
    try:
        out = op(cupy.asarray(a), cupy.asarray(b))
        proxy = proxy or world.running_service("proxy")
        x = cupy.arange(3000, dtype=np.float32) + 1000 * me.rank + call
        rows = gather(x)
        world.synchronize()
    except mkrt.MkrtError as error:
        diagnose(world, proxy, error)
        raise
    expected = sum(to_float32(p[0]).astype(np.float64) @ to_float32(p[1]).astype(np.float64).T
                   for p in (operands(r, call) for r in range(world.size)))
    worst = max(worst, float(np.linalg.norm(to_float32(out.get()) - expected) / np.linalg.norm(expected)))
    want = np.stack([np.arange(3000, dtype=np.float32) + 1000 * r + call for r in range(world.size)])
    gathered_exact &= bool(np.array_equal(rows.get(), want))
verbs = isinstance(world.proxy(), VerbsWorldProxy)
MPI = __import__("mpi4py").MPI
worst = world.comm.allreduce(worst, op=MPI.MAX)
gathered_exact = world.comm.allreduce(int(gathered_exact), op=MPI.MIN)
verbs = world.comm.allreduce(int(verbs), op=MPI.MIN)
op.close()
world.close()
if me.rank == 0:
    print(f"MPI_VERBS_LOOPBACK ranks={world.size} layout={world.layout} verbs={verbs} "
          f"worst_error={worst:.2e} gathered_exact={gathered_exact}")
sys.exit(0 if worst < 1e-2 and gathered_exact and verbs else 1)
