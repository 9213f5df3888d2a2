"""How evenly a ring's tiles spread over a rank's CTAs: a CPU simulation.

Each tile of `mkrt.kernels.ring_attention.tile_order` costs its key blocks
(`tile_blocks`, every source's) plus one (Q and the epilogue). The rank's compute CTAs
claim the next tile whenever they are free from time 0; its copying CTAs join once their
copies are done (`--copy`: that time in key blocks of one CTA; a 128x128 block at head
dim 128 is about 1.8 us on an H100 at 620 TFLOP/s over 132 SMs). Prints, per layout
and shape, the busiest CTA's finish over a perfectly balanced finish (the mean load
plus the copying CTAs' late start spread over all), for the claim order the kernel uses
and, for reference, for the same tiles sorted heaviest first (longest processing time).
If tile times were proportional to the cost, this is the time a ring loses to its tail.

    PYTHONPATH=$PWD python3 experiments/ring_balance.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mkrt.kernels import attention as A  # noqa: E402
from mkrt.kernels import ring_attention as RA  # noqa: E402
from attention_balance import claimed_finish as finish  # noqa: E402

# (nodes, ranks per node, CTAs per rank, copying CTAs): the emulated worlds on one H100
# (2x2 leaves 4 SMs to the proxy's copies) with the ring's default split
LAYOUTS = [(1, 2, 66, 16), (1, 4, 33, 8), (2, 2, 32, 8)]
# (B, rows per rank, Hq, Hkv, D, causal)
SHAPES = [(4, 4096, 16, 16, 128, False), (4, 4096, 16, 16, 128, True),
          (4, 12288, 16, 16, 128, True), (1, 4096, 64, 8, 128, True)]


def tile_costs(rank, N, G, B, rows, Hq, Hkv, D, causal):
    chunk = rows // 2
    band = A.kv_band(B, Hkv, D, N * G * rows, share=N * G)
    costs = []
    for _, _, q_row in RA.tile_order(B, Hq, Hkv, chunk, band, causal):
        q_rows = min(A.BLOCK_Q, chunk - q_row % chunk)
        costs.append(len(RA.tile_blocks(rank, G, N, chunk, q_row, q_rows, causal)) + 1.0)
    return costs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copy", type=float, default=60.0,
                        help="key blocks' time the copying CTAs spend before they compute")
    args = parser.parse_args()
    for N, G, ctas, comm in LAYOUTS:
        for shape in SHAPES:
            worst = worst_sorted = 0.0
            for rank in range(N * G):
                costs = tile_costs(rank, N, G, *shape)
                starts = [0.0] * (ctas - comm) + [args.copy] * comm
                ideal = (sum(costs) + sum(starts)) / ctas
                worst = max(worst, finish(costs, starts) / ideal)
                worst_sorted = max(worst_sorted, finish(sorted(costs, reverse=True), starts) / ideal)
            B, rows, Hq, Hkv, D, causal = shape
            print(f"{N}x{G} b{B} s{rows} h{Hq} kv{Hkv} d{D}{' causal' if causal else ''}: "
                  f"{len(costs) / ctas:.1f} tiles per CTA; busiest / balanced: claim order "
                  f"{worst:.3f}, heaviest first {worst_sorted:.3f}")


if __name__ == "__main__":
    main()
