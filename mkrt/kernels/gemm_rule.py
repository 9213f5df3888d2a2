"""Which output tile ``mkrt.gemm`` uses for a shape: a table, then a rule.

1. A tuned table, when one exists: ``gemm_table.json`` in the JIT cache folder
   (``MKRT_JIT_CACHE_DIR``), written by ``experiments/gemm_tune.py --table``: the fastest
   measured tile (and split-K parts) per exact (M, N, K, dtype, B layout, SMs).
2. Otherwise the rule, from (M, N, K, SMs) alone: a wave model,

       time(tile, split) = waves * (block_m * block_n * K / split) / rate[tile]
                           + (split - 1) * split_cost * block_m * block_n * tiles / SMs,
       waves = ceil(tiles * split / SMs),

   and for clusters of two CTAs sharing B (``cluster="m2"``, no split-K), pairs of tile
   rows on SMs / 2 clusters: waves = ceil(ceil(tiles_m / 2) * tiles_n / (SMs / 2)), with
   a rate of their own (``rates["128x256_m2"]``). Rows of A or B that start an odd multiple
   of 16 bytes off a 32-byte sector (K, or N of a [K, N] B, = 8 mod 16 elements) make the
   TMA loads slower (4096 x 4096 x 4040 took 1.45x the time of 4032 and 4048):

       + row_cost * waves * k_blocks * (block_m [A's rows odd] + block_n / cluster [B's])

   counts the rows a CTA loads per k-block; clusters load half of B each. The per-tile
   rates, the row cost and the split-K fix-up cost are fitted on the sweep's FIT shapes only
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
from typing import NamedTuple

#: (block_m, block_n) tiles the engine builds and the sweep measures
TILES = ((128, 256), (128, 192), (128, 128), (64, 256), (64, 128), (256, 128))
DEFAULT_TILE = (128, 256)
#: "": one CTA per tile; "m2": clusters of two CTAs on adjacent tile rows sharing B
CLUSTERS = ("", "m2")


class Choice(NamedTuple):
    """A configuration of the engine: tile, split-K parts, cluster."""
    block_m: int
    block_n: int
    split_k: int = 1
    cluster: str = ""


def rate_key(tile: tuple[int, int], cluster: str = "") -> str:
    """The fit's name of a tile's rate: "128x256", or "128x256_m2" with clusters."""
    return f"{tile[0]}x{tile[1]}" + (f"_{cluster}" if cluster else "")


def table_key(m: int, n: int, k: int, dtype: str, b_layout: str, sms: int) -> str:
    return f"{m}x{n}x{k}:{dtype}:{b_layout}:{sms}"


@functools.lru_cache(maxsize=4)
def _load_table(path: str, mtime: float) -> dict:
    with open(path) as handle:
        raw = json.load(handle)
    table = {}
    for key, config in raw.items():       # "128x256_g8", "..._sk4", "..._m2" as the sweep writes it
        parts = str(config).split("_")
        try:
            tile = tuple(int(x) for x in parts[0].split("x"))
            split_k = next((int(p[2:]) for p in parts[1:] if p.startswith("sk")), 1)
        except ValueError:
            continue
        cluster = "m2" if "m2" in parts[1:] else ""
        if tile in TILES and 1 <= split_k <= 64 and not (cluster and split_k > 1):
            table[key] = Choice(*tile, split_k, cluster)
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


def odd_rows(n: int, k: int, b_layout: str) -> tuple[bool, bool]:
    """Whether A's rows and B's rows start an odd multiple of 16 bytes off a 32-byte sector
    (two-byte elements: K, or for B [K, N] its N padded to 8, = 8 mod 16)."""
    a_odd = k % 16 == 8
    return a_odd, a_odd if b_layout == "nk" else (-(-n // 8) * 8) % 16 == 8


def wave_terms(m: int, n: int, k: int, sms: int, tile: tuple[int, int], split: int,
               cluster: str = "", b_layout: str = "nk") -> tuple[float, float, float] | None:
    """The wave model's terms of one configuration: (waves x work per CTA and wave, the
    split-K fix-up's element count per SM, the odd rows each CTA loads over its waves);
    None where the engine cannot run it."""
    block_m, block_n = tile
    tiles_m, tiles_n = -(-m // block_m), -(-n // block_n)
    k_blocks = -(-k // 64)
    if split > k_blocks or (cluster and (split > 1 or sms < 2)):
        return None                     # at most one part per 64-wide k-block; no split clusters
    if cluster:
        waves = -(-(-(-tiles_m // 2) * tiles_n) // (sms // 2))
    else:
        waves = -(-tiles_m * tiles_n * split // sms)
    a_odd, b_odd = odd_rows(n, k, b_layout)
    odd_per_block = block_m * a_odd + block_n // (2 if cluster else 1) * b_odd
    return (waves * block_m * block_n * (k / split),
            (split - 1) * block_m * block_n * tiles_m * tiles_n / sms,
            waves * (k_blocks / split) * odd_per_block)


def predicted_us(m: int, n: int, k: int, sms: int, tile: tuple[int, int], split: int,
                 fit: dict, cluster: str = "", b_layout: str = "nk") -> float:
    """The wave model's time of one configuration (see the module docstring)."""
    rate = fit["rates"].get(rate_key(tile, cluster))
    terms = wave_terms(m, n, k, sms, tile, split, cluster, b_layout)
    if not rate or terms is None:
        return math.inf
    work, fixup, odd = terms
    return (work / rate + fixup * fit.get("split_cost", 0.0) + odd * fit.get("row_cost", 0.0)
            + fit.get("launch_us", 0.0))


def best_configuration(m: int, n: int, k: int, sms: int, fit: dict,
                       b_layout: str = "nk") -> Choice:
    """The configuration with the least predicted time (ties: the earlier tile, no split,
    no cluster), among the split-K part counts the fit allows (``splits``: those that won
    a FIT shape) and the tiles and clusters it rates."""
    splits = [s for s in fit.get("splits", SPLITS) if s in SPLITS]
    options = [(predicted_us(m, n, k, sms, tile, split, fit, cluster, b_layout), i, split, c,
                tile, cluster)
               for i, tile in enumerate(TILES) for split in splits or (1,)
               for c, cluster in enumerate(CLUSTERS)]
    _, _, split, _, tile, cluster = min(options)
    return Choice(*tile, split, cluster)


def fused_tile_width(m: int, n: int, k: int, sms: int, widths: tuple[int, ...],
                     b_layout: str = "nk", block_m: int = 128) -> int:
    """The tile width a fused kernel's compute role uses on `sms` compute CTAs: the rule's
    least predicted time among ``block_m`` x width tiles it rates (one CTA per tile, no
    split-K: the fused kernels reduce whole tiles), the widest on a tie; without a fit,
    the widest. The wave model counts the compute role alone: what the tile costs the
    reduce role (narrower tiles: more, smaller partials, more puts between nodes) is not in
    it, and measured on the fused GEMM+AllReduce it mostly loses between nodes
    (experiments/results/fused_tile.jsonl), so that kernel uses it only when asked."""
    fit = fitted_model()
    best = (math.inf, 0)
    for width in sorted(widths, reverse=True):
        predicted = math.inf if fit is None else predicted_us(
            m, n, k, max(1, sms), (block_m, width), 1, fit, "", b_layout)
        if predicted < best[0] * (1 - 1e-9):
            best = (predicted, width)
    return best[1] or max(widths)


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
                b_layout: str = "nk") -> tuple[Choice, str]:
    """(Choice(block_m, block_n, split_k, cluster), why) for this problem."""
    choice = tuned_table().get(table_key(m, n, k, dtype, b_layout, sms))
    if choice is not None:
        return choice, "tuned table"
    fit = fitted_model()
    if fit is not None:
        return best_configuration(m, n, k, sms, fit, b_layout), "rule: the fitted wave model"
    return Choice(*DEFAULT_TILE), "rule: default tile, no split-K (no sweep has chosen a rule yet)"
