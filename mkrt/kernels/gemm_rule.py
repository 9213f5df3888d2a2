"""Which output tile ``mkrt.gemm`` uses for a shape: a table, then a rule.

1. A tuned table, when one exists: ``gemm_table.json`` in the JIT cache folder
   (``MKRT_JIT_CACHE_DIR``), written by ``experiments/gemm_tune.py --table``: the fastest
   measured tile (and split-K parts) per exact (M, N, K, dtype, B layout, SMs).
2. Otherwise the rule, from (M, N, K, SMs) alone: a wave model,

       time(tile, split) = waves * (block_m * block_n * K / split) / rate[tile]
                           + (split - 1) * split_cost * block_m * block_n * tiles / SMs,
       waves = ceil(tiles * split / SMs),

   whose per-tile rates and split-K fix-up cost are fitted on the sweep's FIT shapes only
   (``experiments/gemm_tune.py --fit`` writes ``gemm_rule_fit.json`` beside this module;
   its HELD_OUT shapes judge the fit). Split-K part counts that never won a FIT shape are
   left out (the fit's ``splits``). Without a fit the rule is the engine's one measured
   tile, 128 x 256, for every shape.

There is no call-time autotuning: the choice is a lookup and a few comparisons, made once
per prepared signature.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

#: (block_m, block_n) tiles the engine builds and the sweep measures
TILES = ((128, 256), (128, 192), (128, 128), (64, 256), (64, 128), (256, 128))
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


#: the fitted wave model (experiments/gemm_tune.py --fit), if one was committed
FIT_PATH = Path(__file__).with_name("gemm_rule_fit.json")
#: split-K parts the model may choose (the sweep measures these)
SPLITS = (1, 2, 4, 8)


def predicted_us(m: int, n: int, k: int, sms: int, tile: tuple[int, int], split: int,
                 fit: dict) -> float:
    """The wave model's time of one configuration (see the module docstring)."""
    block_m, block_n = tile
    tiles = -(-m // block_m) * -(-n // block_n)
    k_blocks = -(-k // 64)
    if split > k_blocks:
        return math.inf                 # at most one part per 64-wide k-block
    rate = fit["rates"].get(f"{block_m}x{block_n}")
    if not rate:
        return math.inf
    waves = -(-tiles * split // sms)
    work = block_m * block_n * (k / split)
    fixup = (split - 1) * fit.get("split_cost", 0.0) * block_m * block_n * tiles / sms
    return waves * work / rate + fixup + fit.get("launch_us", 0.0)


def best_configuration(m: int, n: int, k: int, sms: int, fit: dict) -> tuple[int, int, int]:
    """(block_m, block_n, split_k) with the least predicted time (ties: the earlier tile,
    then no split), among the split-K part counts the fit allows (``splits``: those that
    won a FIT shape)."""
    splits = [s for s in fit.get("splits", SPLITS) if s in SPLITS]
    options = [(predicted_us(m, n, k, sms, tile, split, fit), i, split, tile)
               for i, tile in enumerate(TILES) for split in splits or (1,)]
    _, _, split, tile = min(options)
    return (*tile, split)


@functools.lru_cache(maxsize=2)
def _load_fit(path: str, mtime: float, size: int) -> dict | None:
    try:
        with open(path) as handle:
            fit = json.load(handle)
    except (OSError, ValueError):
        return None
    rates = fit.get("rates") if isinstance(fit, dict) else None
    if not isinstance(rates, dict) or not rates:
        return None
    return fit


def fitted_model() -> dict | None:
    """The committed fit, or None."""
    import os
    try:
        stat = os.stat(FIT_PATH)
    except OSError:
        return None
    return _load_fit(str(FIT_PATH), stat.st_mtime_ns, stat.st_size)


def choose_tile(m: int, n: int, k: int, *, sms: int, dtype: str = "bf16",
                b_layout: str = "nk") -> tuple[tuple[int, int, int], str]:
    """((block_m, block_n, split_k), why) for this problem."""
    choice = tuned_table().get(table_key(m, n, k, dtype, b_layout, sms))
    if choice is not None:
        return choice, "tuned table"
    fit = fitted_model()
    if fit is not None:
        return best_configuration(m, n, k, sms, fit), "rule: the fitted wave model"
    return (*DEFAULT_TILE, 1), "rule: default tile, no split-K (no sweep has chosen a rule yet)"
