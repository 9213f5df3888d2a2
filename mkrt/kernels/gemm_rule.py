"""Which output tile ``mkrt.gemm`` uses for a shape: a table, then a rule.

1. A tuned table, when one exists: ``gemm_table.json`` in the JIT cache folder
   (``MKRT_JIT_CACHE_DIR``), written by ``experiments/gemm_tune.py --table``: the fastest
   measured tile per exact (M, N, K, dtype, B layout, SMs).
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
    for key, config in raw.items():       # "128x256_g8" as the sweep writes it
        try:
            tile = tuple(int(x) for x in str(config).split("_")[0].split("x"))
        except ValueError:
            continue
        if tile in TILES:
            table[key] = tile
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
                b_layout: str = "nk") -> tuple[tuple[int, int], str]:
    """((block_m, block_n), why) for this problem."""
    tile = tuned_table().get(table_key(m, n, k, dtype, b_layout, sms))
    if tile is not None:
        return tile, "tuned table"
    return DEFAULT_TILE, "rule: default tile (no sweep has chosen a rule yet)"
