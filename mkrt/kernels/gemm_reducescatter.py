"""GEMM+ReduceScatter: the row-parallel linear whose output stays sharded by rows (sequence
parallelism), fused. Rank r ends with rows r*M/W .. (r+1)*M/W of C = sum over ranks of
A_r @ B_r: a true W-way reduce-scatter over the whole world.

It is the GEMM+AllReduce kernel (:mod:`mkrt.kernels.gemm_allreduce`) built with
``collective="reducescatter"``; what changes:

* inside a node, tiles are still reduced as they are produced (each rank's partial tile
  into the reducing rank's slot, summed in fixed source order), but a final row goes
  only to the rank that keeps it, not to every rank of the node;
* between nodes, a node sends the node sum of a tile only to the node that keeps the
  tile's rows (once, through the proxy), where the nodes' sums are added in node order:
  (N - 1) / N of the tile bytes an all-reduce sends, and every byte crosses between two
  nodes at most once. With several nodes, each node's rows (M / N) must be whole
  128-row tiles for the fused kernel; other shapes take the unfused path;
* each rank waits only for the tiles of its own rows.

Shapes: any M that the world size divides (rank r keeps rows r*M/W .. (r+1)*M/W: the
same rule as ``torch.distributed.reduce_scatter_tensor``), any N, K a multiple of 8 per
rank; bf16 / f16; B as [K, N] or [N, K]. The unfused baseline (cuBLAS, then mkrt's
reduce-scatter over the same transports, or NCCL's when the world is one process per GPU
with torch.distributed initialised) is ``op.unfused``; ``fuse=None`` (as ``"measure"``)
times both paths once per size class and keeps the faster; ``fuse="model"`` takes the
all-reduce's fitted cost model's pick (``op.last_plan.reason``).
"""

from __future__ import annotations

import numpy as np

from mkrt.kernels import gemm as gemm_module
from mkrt.kernels.gemm_allreduce import GemmAllReduce
from mkrt.kernels.op import shared_op


class GemmReduceScatter(GemmAllReduce):
    """``c = op(a, b)``: rank r gets rows r*M/W .. (r+1)*M/W of sum over ranks of a_r @ b_r.

    a: per rank [M, K_r]; b: [K_r, N] (``b_layout="kn"``) or [N, K_r] (``"nk"``); out: per
    rank [M / W, N]. Options as :class:`mkrt.GemmAllReduce` (``ctas``, ``reduce_ctas``,
    ``fuse``, ``timeout_ms``, ``muted_rank``). The same ordering rule holds: launches of
    one op stay ordered on each rank's stream.
    """

    name = "gemm_reducescatter"
    collective = "reducescatter"

    def out_shape(self, m: int, n: int) -> tuple:
        size = self.world.size
        if m % size:
            raise ValueError(f"mkrt.gemm_reducescatter: m={m} must be a multiple of the world "
                             f"size {size} (rank r keeps rows r*m/{size} .. (r+1)*m/{size})")
        return (m // size, n)


def gemm_reducescatter(a, b, *, world=None, out=None, b_layout: str = "kn", **options):
    """This rank's rows of sum over ranks of a_r @ b_r; see :class:`GemmReduceScatter`.
    Keeps one op per (world, options)."""
    return shared_op(GemmReduceScatter, world, b_layout=b_layout, **options)(a, b, out=out)


def reference(a_per_rank, b_per_rank, rank: int, *, b_layout: str = "kn", dtype=np.float64):
    """Rows of rank `rank` of sum_r A_r @ B_r, in float64 (what its output should be)."""
    total = None
    for a, b in zip(a_per_rank, b_per_rank):
        part = gemm_module.reference(a, b, b_layout=b_layout, dtype=dtype)
        total = part if total is None else total + part
    rows = total.shape[0] // len(a_per_rank)
    return total[rank * rows:(rank + 1) * rows]


def test_cases():
    """(layout, m, n, k per rank, b_layout, dtype) the GPU tests run: several nodes need
    m / nodes a multiple of 128 for the fused kernel."""
    return [("1x2", 512, 768, 256, "kn", "bf16"), ("1x2", 302, 520, 64, "nk", "bf16"),
            ("1x4", 1000, 384, 136, "nk", "f16"), ("2x2", 512, 1000, 128, "nk", "bf16"),
            ("2x3", 768, 512, 200, "kn", "bf16"), ("3x1", 384, 264, 64, "kn", "f16")]
