"""Reading the ring's trace build (``mkrt.RingAttention(trace=True)``): where a call's
time went, per rank (`experiments/ring_trace.py` prints it for a sweep)."""

from __future__ import annotations

import numpy as np


def summarise(records: list[dict], compute_ctas: int, G: int = 1, N: int = 1) -> tuple[float, list[dict]]:
    """(the world's span in us, per-rank summaries) of one traced call's records
    (:meth:`RingAttention.trace`: rank order, a world of N nodes of G ranks, the first
    `compute_ctas` CTAs of each rank computing from the start). Times are microseconds from
    the first CTA of any rank to start:

    * ``start_first``, ``start_last``: the rank's first and last CTA starts;
    * ``copies_median``, ``copies_last``: when its copying CTAs were done copying;
    * ``end_first``, ``end_median``, ``end_last``: when its CTAs were done (the spread is
      the tail);
    * ``flag_wait_mean``, ``flag_wait_max``: what the producers waited for key blocks'
      flags, per CTA; ``starved_mean``, ``starved_max``: what the first consumer
      warpgroups waited for loaded stages (no keys for the tensor cores);
    * ``tiles_min``, ``tiles_max``, ``blocks``: tiles per CTA, key blocks in all;
    * ``sources``: per source in the order the rank visits them, when its producers first
      asked for one of its blocks (first CTA, median) and first saw it whole (first CTA).
    """
    from mkrt.kernels import ring_attention as RA
    origin = min(int(r["start_ns"].min()) for r in records)
    ends = [np.maximum(r["producer_done_ns"], r["consumer_done_ns"]) for r in records]
    span = (max(int(e.max()) for e in ends) - origin) / 1e3
    ranks = []
    for rank, (r, end) in enumerate(zip(records, ends)):
        us = lambda x: (np.asarray(x, np.float64) - origin) / 1e3      # noqa: E731
        sources = []
        for source in RA.source_order(rank // G, rank % G, G, N):
            if source >= RA.TRACE_SOURCES:
                break
            reached = r["source_reached_ns"][:, source]
            whole = r["source_whole_ns"][:, source]
            reached, whole = us(reached[reached > 0]), us(whole[whole > 0])
            sources.append({"source": source,
                            "reached_first": float(reached.min()) if reached.size else None,
                            "reached_median": float(np.median(reached)) if reached.size else None,
                            "whole_first": float(whole.min()) if whole.size else None})
        copies = us(r["copies_done_ns"][compute_ctas:])
        ranks.append({
            "start_first": float(us(r["start_ns"]).min()), "start_last": float(us(r["start_ns"]).max()),
            "copies_median": float(np.median(copies)) if copies.size else None,
            "copies_last": float(copies.max()) if copies.size else None,
            "end_first": float(us(end).min()), "end_median": float(np.median(us(end))),
            "end_last": float(us(end).max()),
            "flag_wait_mean": float(r["flag_wait_ns"].mean() / 1e3),
            "flag_wait_max": float(r["flag_wait_ns"].max() / 1e3),
            "starved_mean": float(r["starved_ns"].mean() / 1e3),
            "starved_max": float(r["starved_ns"].max() / 1e3),
            "tiles_min": int(r["tiles"].min()), "tiles_max": int(r["tiles"].max()),
            "blocks": int(r["blocks"].sum()),
            "ns_per_cycle": float(np.median(r["ns_per_cycle"])),
            "sources": sources,
        })
    return span, ranks
