"""Which output tile ``mkrt.gemm`` uses for a shape: a table, then a rule.

1. A tuned table, when one exists: ``gemm_table.json`` in the JIT cache folder
   (``MKRT_JIT_CACHE_DIR``), written by ``experiments/gemm_tune.py --table``: the fastest
   measured tile (and split-K parts) per exact (M, N, K, dtype, B layout, SMs).
2. Otherwise the rule below, from (M, N, K, SMs) alone. Today it is the engine's one
   measured tile, 128 x 256, for every shape: what the rule should be is what the sweep
   measures (experiments/gemm_tune.py: its FIT shapes choose the rule, its HELD_OUT
   shapes judge it), and no sweep has run yet.

There is no call-time autotuning: the choice is a lookup and a few comparisons, made once
per prepared signature.
"""

from __future__ import annotations

import functools
import json

#: (block_m, block_n) tiles the engine builds and the sweep measures
TILES = ((128, 256), (128, 192), (128, 128), (64, 256), (64, 128))
DEFAULT_TILE = (128, 256)


def table_key(m: int, n: int, k: int, dtype: str, b_layout: str, sms: int) -> str:
    return f"{m}x{n}x{k}:{dtype}:{b_layout}:{sms}"


@functools.lru_cache(maxsize=4)
def _load_table(path: str, mtime: float) -> dict:
    with open(path) as handle:
        raw = json.load(handle)
    table = {}
    for key, config in raw.items():       # "128x256_g8" or "128x256_g8_sk4" as the sweep writes it
        parts = str(config).split("_")
        try:
            tile = tuple(int(x) for x in parts[0].split("x"))
            split_k = next((int(p[2:]) for p in parts[1:] if p.startswith("sk")), 1)
        except ValueError:
            continue
        if tile in TILES and 1 <= split_k <= 64:
            table[key] = (*tile, split_k)
    return table


def tuned_table() -> dict:
    """The tuned table of the JIT cache folder ({} when there is none or it is unreadable)."""
    import os

    from mkrt import envs
    path = envs.get("MKRT_JIT_CACHE_DIR") / "gemm_table.json"
    try:
        return _load_table(str(path), os.path.getmtime(path))
    except (OSError, ValueError):
        return {}


def choose_tile(m: int, n: int, k: int, *, sms: int, dtype: str = "bf16",
                b_layout: str = "nk") -> tuple[tuple[int, int, int], str]:
    """((block_m, block_n, split_k), why) for this problem."""
    choice = tuned_table().get(table_key(m, n, k, dtype, b_layout, sms))
    if choice is not None:
        return choice, "tuned table"
    return (*DEFAULT_TILE, 1), "rule: default tile, no split-K (no sweep has chosen a rule yet)"
