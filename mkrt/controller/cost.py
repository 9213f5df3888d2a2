"""Cost model and default role split of fused GEMM+communication kernels (pure Python).

The planners of the fused kernels ask two questions here: how many CTAs of a rank should
communicate (:func:`default_reduce_ctas`, the static rule the on-GPU controller starts
from), and whether the fused path beats the unfused one (:func:`fusion_log_ratio`,
which decides ``fuse=None``).

The fusion rule is *fitted*, not derived: ``log(fused time / unfused time)`` is a linear
function of a few features of the shape, the world and the split
(:func:`fusion_features`), with weights fitted by least squares on a calibration set of
shapes measured on the H200 and judged on a held-out set it never saw
(experiments/planner.py, experiments/results/planner.jsonl, experiments/notes/planner.md).
The weights were measured on emulated worlds (several ranks on one GPU). Worlds with one
rank per GPU have not been measured: there the analytical :func:`predict_times` decides.
"""

from __future__ import annotations

import dataclasses
import math

@dataclasses.dataclass(frozen=True)
class Ceilings:
    """Rates the planner models with (H200 measurements; leads, not truths)."""

    gemm_tflops: float = 700.0          # bf16 GEMM, whole chip
    sms: int = 132
    sm_stream_gbps: float = 30.0        # what one reduce CTA moves (read + write): the v4
                                        # split; 22 (fitted to v4) gave slower fused runs
    nvlink_gbps: float = 360.0          # per direction, per GPU
    network_gbps: float = 45.0          # per GPU (one 400 Gb/s NIC)
    launch_us: float = 6.0


def default_reduce_ctas(k: int, ctas: int, *, itemsize: int = 2, nodes: int = 1,
                        ceilings: Ceilings = Ceilings()) -> int:
    """The default role split: reduce CTAs so that reducing keeps pace with computing.

    Per output tile a rank computes 2*BM*BN*K FLOPs; per tile of C it reduces about
    2*BM*BN*itemsize bytes (read its share of partials, write the final tile to the node),
    half again with several nodes. Per SM the ratio of the two times is
    r = itemsize * flops_per_sm / (K * bytes_per_sm); a fraction r / (1 + r) of the CTAs
    reduces. Small K (K = M/16 in the reference's sweep) needs a real share of the SMs.
    """
    if ctas < 2:
        raise ValueError(f"mkrt.gemm_allreduce: need at least 2 CTAs per rank (compute and "
                         f"reduce); got {ctas}")
    flops_per_sm = ceilings.gemm_tflops * 1e12 / ceilings.sms
    bytes_per_sm = ceilings.sm_stream_gbps * 1e9
    ratio = itemsize * flops_per_sm / (k * bytes_per_sm) * (1.5 if nodes > 1 else 1.0)
    return int(min(ctas - 1, max(1, round(ctas * ratio / (1 + ratio)))))


def predict_times(m, n, k, nodes, G, ctas, reduce_ctas, sms_per_gpu, ranks_per_gpu, c: Ceilings):
    """Modelled times (us) of the fused kernel and of GEMM-then-all-reduce, for one rank."""
    share = min(1.0, ctas / sms_per_gpu)                 # this rank's part of its GPU
    rate = c.gemm_tflops * 1e6 * share                   # FLOP per us
    flops = 2.0 * m * n * k
    c_bytes = 2.0 * m * n
    tiles = -(-m // 128) * -(-n // 256)
    # Ranks sharing a GPU (emulated worlds): the all-reduce measured about 500 GB/s of C
    # per GPU on an H200 (2026-12-02), split among the ranks.
    intra_gbps = c.nvlink_gbps if ranks_per_gpu == 1 else 500.0 / ranks_per_gpu
    allreduce_us = (2 * c_bytes * (G - 1) / G / (intra_gbps * 1e3)
                    + (2 * c_bytes / G * (nodes - 1) / (c.network_gbps * 1e3) if nodes > 1 else 0))
    unfused = c.launch_us + flops / rate + c.launch_us + allreduce_us + 10.0
    compute = flops / (rate * (ctas - reduce_ctas) / ctas)
    reduce = 2 * c_bytes * (1.5 if nodes > 1 else 1) / (reduce_ctas * c.sm_stream_gbps * 1e3)
    tail = 2 * flops / tiles / (rate / ctas) + 20.0      # the last tile's compute and reduce
    fused = c.launch_us + max(compute, reduce, allreduce_us) + tail
    return fused, unfused


# ---- the fitted fusion rule -----------------------------------------------------------

#: feature names, in the order of FUSION_WEIGHTS
FUSION_FEATURES = ("one", "log2_k", "log2_mn", "n_odd", "several_nodes",
                   "several_nodes_log2_k", "log2_ranks_per_gpu", "wave_efficiency")

#: least-squares weights of log(fused / unfused) (experiments/planner.py --fit on the
#: calibration rows of experiments/results/planner.jsonl)
FUSION_WEIGHTS = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def fusion_features(m: int, n: int, k: int, *, nodes: int, ctas: int, reduce_ctas: int,
                    ranks_per_gpu: int, block_m: int = 128, block_n: int = 256) -> tuple:
    """The features the fusion rule weighs (FUSION_FEATURES order).

    log2_k: compute per byte reduced (large K: the GEMM dominates and the unfused path's
    cuBLAS on the whole chip wins; small K: the all-reduce dominates and overlapping it
    wins). log2_mn: size (small problems are launch-bound; fused is one launch per rank).
    n_odd: rows of C of an odd number of elements, where cuBLAS is much slower (measured:
    half the speed or less on such shapes, H200).
    wave_efficiency: how well the tiles fill the compute CTAs' last wave."""
    tiles = -(-m // block_m) * -(-n // block_n)
    compute = max(1, ctas - reduce_ctas)
    waves = -(-tiles // compute)
    several = 1.0 if nodes > 1 else 0.0
    return (1.0, math.log2(k), math.log2(m * n), 1.0 if n % 2 else 0.0, several,
            several * math.log2(k), math.log2(max(1, ranks_per_gpu)), tiles / (waves * compute))


def fusion_log_ratio(features, weights=None) -> float:
    """Predicted log(fused time / unfused time): below 0, fusion is expected to win."""
    weights = FUSION_WEIGHTS if weights is None else weights
    return float(sum(w * x for w, x in zip(weights, features)))
