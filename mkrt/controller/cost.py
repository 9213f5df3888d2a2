"""Cost model and default role split of fused GEMM+communication kernels (pure Python).

The planners of the fused kernels ask two questions here: how many CTAs of a rank should
communicate (:func:`default_reduce_ctas`, the static rule the on-GPU controller starts
from), and whether the fused path beats the unfused one (:func:`fitted_times`, else
:func:`predict_times`), which decides ``fuse=None``.

The fusion rule is *fitted*: per world layout, a time model of each path (linear in its
weights over terms such as FLOPs on the compute CTAs and bytes on the reduce CTAs,
:func:`fusion_terms`), fitted by least squares on a calibration set of shapes measured
on the H200 and judged on a held-out set it never saw (experiments/planner.py,
experiments/results/planner.jsonl, experiments/notes/planner.md). The weights were
measured on emulated worlds (all ranks on one GPU); layouts without weights, and worlds
with one rank per GPU, fall back to the analytical :func:`predict_times`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path


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
#
# Two time models per world layout, linear in their weights over physically meaningful
# terms, fitted by least squares on relative error (experiments/planner.py --fit writes
# FIT_PATH). F: GFLOP the GPU runs (all its ranks); C: MB of C its ranks write.
#   unfused = w0 + w1 F + w2 F [n odd] + w3 C + w4 F 128/m
#             (cuBLAS on the whole chip, slower on odd rows of C and short M; the all-reduce)
#   fused   = v0 + v1 F ctas/(compute ctas * wave efficiency) + v2 C ctas/reduce ctas
#             + v3 C + v4 tiles/1000
#             (the engine on the compute CTAs with its last wave; reducing on the reduce CTAs)

FIT_PATH = Path(__file__).with_name("fusion_fit.json")


def fusion_terms(m: int, n: int, k: int, *, ctas: int, reduce_ctas: int, ranks_per_gpu: int,
                 block_m: int = 128, block_n: int = 256) -> tuple[list[float], list[float]]:
    """(fused terms, unfused terms) of the time models above."""
    gflop = 2.0 * m * n * k * ranks_per_gpu / 1e9
    c_mb = 2.0 * m * n * ranks_per_gpu / 1e6
    tiles = -(-m // block_m) * -(-n // block_n)
    compute = max(1, ctas - reduce_ctas)
    efficiency = tiles / (-(-tiles // compute) * compute)
    fused = [1.0, gflop * ctas / compute / efficiency, c_mb * ctas / max(1, reduce_ctas), c_mb,
             tiles * ranks_per_gpu / 1e3]
    unfused = [1.0, gflop, gflop * (n % 2), c_mb, gflop * 128.0 / m]
    return fused, unfused


@functools.cache
def fusion_fit() -> dict:
    """The fitted weights per layout ("1x2": {"fused": [...], "unfused": [...]}), or {}."""
    try:
        return json.loads(FIT_PATH.read_text())
    except (OSError, ValueError):
        return {}


def fitted_times(layout: str, m: int, n: int, k: int, *, ctas: int, reduce_ctas: int,
                 ranks_per_gpu: int, fit: dict | None = None) -> tuple[float, float] | None:
    """(fused us, unfused us) from the fitted models (``fit``: weights to judge instead of
    the shipped ones), or None when `layout` was not fitted (or was fitted with all its
    ranks on one GPU and this world spreads them)."""
    entry = (fusion_fit() if fit is None else fit).get("layouts", {}).get(layout)
    if entry is None or entry.get("ranks_per_gpu") != ranks_per_gpu:
        return None
    fused, unfused = fusion_terms(m, n, k, ctas=ctas, reduce_ctas=reduce_ctas,
                                  ranks_per_gpu=ranks_per_gpu)
    return (sum(w * x for w, x in zip(entry["fused"], fused)),
            sum(w * x for w, x in zip(entry["unfused"], unfused)))
