"""How evenly the attention engine's tiles spread over the CTAs: a CPU simulation.

Each tile of `mkrt.kernels.attention.tile_order` costs its key blocks plus one (the load
of Q and the epilogue); 132 CTAs either take a fixed deal (CTA c: tiles c, c + 132, ...,
the engine before 79501e3) or claim the next tile of the same order whenever they are free
(since 79501e3). Prints the busiest CTA's load over the mean for each: the time a launch
would take over a perfectly balanced one, if tile times were proportional to the cost.

    PYTHONPATH=$PWD python3 experiments/attention_balance.py
"""

from __future__ import annotations

import heapq
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mkrt.kernels import attention as A  # noqa: E402

# (B, S, Hq, Hkv, D, block_q, block_kv): the engine suite's causal shapes at S >= 4096 and
# their default key blocks; three consumer warpgroups (192-row tiles) at D 64 for reference
SHAPES = [(4, 4096, 16, 16, 128, 128, 128), (4, 12288, 16, 16, 128, 128, 128),
          (1, 8192, 64, 8, 128, 128, 128), (1, 4096, 64, 8, 128, 128, 128),
          (4, 4096, 16, 16, 64, 128, 192), (2, 8192, 32, 32, 64, 128, 192),
          (4, 4096, 16, 16, 64, 192, 128)]


def claimed_finish(costs, starts):
    """When the last CTA finishes if CTAs free at `starts` claim `costs` in order (each
    tile goes to the CTA free first)."""
    free = [(s, c) for c, s in enumerate(starts)]
    heapq.heapify(free)
    for cost in costs:
        t, cta = heapq.heappop(free)
        heapq.heappush(free, (t + cost, cta))
    return max(t for t, _ in free)


def loads(shape, ctas=132):
    B, S, Hq, Hkv, D, block_q, block_kv = shape
    p = A.AttentionProblem(B, S, S, Hq, Hkv, D, "bf16", True)
    cost = [A.tile_blocks(p, block_q, block_kv, q) + 1.0 for _, _, q in A.tile_order(p, block_q)]
    fixed = [0.0] * ctas
    for i, c in enumerate(cost):
        fixed[i % ctas] += c
    claimed = claimed_finish(cost, [0.0] * ctas)
    mean = sum(cost) / ctas
    deal = A.deal_tiles(p, block_q, block_kv, ctas)
    planned = max(sum(cost[t] for t in deal[:, c] if t >= 0) for c in range(ctas))
    return max(fixed) / mean, claimed / mean, planned / mean


def main():
    print("shape (B S Hq Hkv D block_q block_kv) | busiest CTA / mean: fixed deal | claimed | planned deal")
    for shape in SHAPES:
        fixed, claimed, planned = loads(shape)
        print(f"{' '.join(map(str, shape))} | {fixed:.3f} | {claimed:.3f} | {planned:.3f}")


if __name__ == "__main__":
    main()
