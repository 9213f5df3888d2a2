"""Which output tile ``mkrt.gemm`` uses for a shape: a table, then a rule.

1. A tuned table, when one exists: ``gemm_table.json`` in the JIT cache folder
   (``MKRT_JIT_CACHE_DIR``), written by ``experiments/gemm_tune.py --table``: the fastest
   measured tile (and split-K parts) per exact (M, N, K, dtype, B layout, SMs).
2. Otherwise the rule, from (M, N, K, SMs) alone: a wave model,

       time(tile, split) = waves * (block_m * block_n * K) / rate[tile]
                           + (split - 1) * split_cost * block_m * block_n * tiles / SMs,
       waves = waves(tiles * split over SMs) * ceil(k_blocks / split) / k_blocks,

   where a last partial wave running on a fraction f of the SMs counts as
   partial_cost + (1 - partial_cost) * f of a full wave (``partial_cost`` fitted; 1, a
   full wave, without it: a partly idle GPU runs its last tiles faster),

   and for clusters of two CTAs sharing B (``cluster="m2"``), pairs of tile rows on
   SMs / 2 clusters (units of a wave), with a rate of their own (``rates["128x256_m2"]``).
   With the split only on the last, partial wave's tiles (``split_tail``; the waves before
   it run whole tiles): waves = whole waves + ceil(tail * split / SMs) x the part's share
   of K, the fix-up counts the tail's tiles, and the last part of each tail tile adds the
   parts up (``+ tail_cost * split * block_m * block_n``: it does so alone, at the end).
   Rows of A or B that start an odd multiple of 16 bytes off a 32-byte sector (K, or N of
   a [K, N] B, = 8 mod 16 elements) make the TMA loads slower (4096 x 4096 x 4040 took
   1.45x the time of 4032 and 4048):

       + row_cost * waves * k_blocks * (block_m [A's rows odd] + block_n / cluster [B's])

   counts the rows a CTA loads per k-block; clusters load half of B each. The per-tile
   rates, the row cost and the split-K costs are fitted on the sweep's FIT shapes only
   (``experiments/gemm_tune.py --fit`` writes ``gemm_rule_fit.json`` beside this module;
   its HELD_OUT shapes judge the fit). With B [N, K] a 128 x 256 tile may also be trimmed
   to the narrowest width of TRIM_WIDTHS that takes as many waves (``trimmed_width``: same
   waves, less work per tile, direct stores), at a rate of its own ("128xT", "128xT_m2")
   fitted on the sweep's trimmed rows; the committed fit has none (a fit rating them lost
   on its FIT set), so only a tuned table chooses them. Split-K part counts that never won
   a FIT shape are left out (the fit's ``splits``, and ``tail_splits`` for the tail).
   Without a fit the rule is the engine's one measured tile, 128 x 256, for every shape.
3. Unless ``MKRT_GEMM_STREAM_K_RULE=0``, stream-K for the last wave (``stream_k_pays``),
   on top of the fitted model's pick: when that pick is one CTA per 128 x 256 tile, K is
   at least STREAM_K_MIN_K, and the last of at least STREAM_K_WAVES waves keeps between
   STREAM_K_FILL of the grid busy, that wave's k-blocks are shared out over every CTA instead. It is a rule of its own because the
   wave model prices it wrong: its split-K cost per element, put on stream-K's fix-up,
   predicts a 16% gain on 8192 x 1024 x 8192 on 116 SMs (2.2 waves), which ran 0.89x
   (experiments/results/gemm_streamk_probe.jsonl).

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
#: widths a 128-row tile may be trimmed to (B [N, K], direct stores): 128 x 256 tiles cut
#: to the narrowest of these that takes as many waves (trimmed_width), one rate for all
TRIM_WIDTHS = (144, 160, 176, 208, 224, 240)
TRIM_FROM = 256
#: "": one CTA per tile; "m2": clusters of two CTAs on adjacent tile rows sharing B
CLUSTERS = ("", "m2")


class Choice(NamedTuple):
    """A configuration of the engine: tile, split-K parts, cluster, whether split-K cuts
    only the last partial wave's tiles (``split_tail``) or every tile, and whether the
    last wave is shared out by k-blocks (``stream_k``: one CTA per tile, no split-K)."""
    block_m: int
    block_n: int
    split_k: int = 1
    cluster: str = ""
    split_tail: bool = False
    stream_k: bool = False


def rate_key(tile: tuple[int, int], cluster: str = "") -> str:
    """The fit's name of a tile's rate: "128x256", or "128x256_m2" with clusters; "128xT"
    (and "128xT_m2") for every trimmed width."""
    width = "T" if tile[1] in TRIM_WIDTHS else tile[1]
    return f"{tile[0]}x{width}" + (f"_{cluster}" if cluster else "")


def trimmed_width(m: int, n: int, sms: int, cluster: str = "") -> int | None:
    """The narrowest of TRIM_WIDTHS whose 128-row tiles take as many waves over `sms` as
    128 x 256 tiles (each CTA as many tiles, each less work), or None when none does: on
    3000 x 5000, 240-wide tiles make 21 columns where 256 make 20 (four waves of pairs
    either way), 6% less work per tile and 0.8% padding instead of 2.3%."""
    cluster_m = 2 if cluster else 1
    per_wave = sms // cluster_m
    if per_wave < 1:
        return None
    pair_rows = -(-(-(-m // 128)) // cluster_m)

    def wave_count(width: int) -> int:
        return -(-(pair_rows * -(-n // width)) // per_wave)
    full = wave_count(TRIM_FROM)
    fits = [w for w in TRIM_WIDTHS if wave_count(w) == full and -(-n // w) > -(-n // TRIM_FROM)]
    return min(fits) if fits else None


def table_key(m: int, n: int, k: int, dtype: str, b_layout: str, sms: int) -> str:
    return f"{m}x{n}x{k}:{dtype}:{b_layout}:{sms}"


def config_name(choice: Choice, group_m: int = 8) -> str:
    """The sweep's name of a configuration: "128x256_g8", with "_sk4" (every tile in 4
    parts), "_tk3" (the last wave's tiles in 3 parts), "_streamk" (the last wave shared
    out by k-blocks) and "_m2" (clusters of two)."""
    split = ""
    if choice.split_k > 1:
        split = f"_{'tk' if choice.split_tail else 'sk'}{choice.split_k}"
    elif choice.stream_k:
        split = "_streamk"
    return (f"{choice.block_m}x{choice.block_n}_g{group_m}{split}"
            + (f"_{choice.cluster}" if choice.cluster else ""))


def parse_config(config: str) -> Choice | None:
    """config_name's inverse (None for a tile the engine does not build); ValueError on
    a malformed name."""
    parts = config.split("_")
    tile = tuple(int(x) for x in parts[0].split("x"))
    split_k, split_tail = 1, False
    for part in parts[1:]:
        if part[:2] in ("sk", "tk"):
            split_k, split_tail = int(part[2:]), part[:2] == "tk"
    cluster = "m2" if "m2" in parts[1:] else ""
    stream_k = "streamk" in parts[1:]
    trimmed = tile[0] == 128 and tile[1] in TRIM_WIDTHS        # whole tiles only
    if (tile not in TILES and not (trimmed and split_k == 1)) or not 1 <= split_k <= 64:
        return None
    if stream_k and (split_k > 1 or cluster or trimmed):
        return None                     # stream-K runs one CTA per whole-width tile, alone
    return Choice(*tile, split_k, cluster, split_tail and split_k > 1, stream_k)


@functools.lru_cache(maxsize=4)
def _load_table(path: str, mtime: float) -> dict:
    with open(path) as handle:
        raw = json.load(handle)
    table = {}
    for key, config in raw.items():       # "128x256_g8", "..._sk4", "..._tk3", "..._m2" as the sweep writes it
        try:
            choice = parse_config(str(config))
        except ValueError:
            continue
        if choice is not None:
            table[key] = choice
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
#: split-K part counts the model may choose (the sweep measures these), for every tile
SPLITS = (1, 2, 4, 8)
#: and for the last partial wave's tiles only (split_tail)
TAIL_SPLITS = (2, 3, 4)


def odd_rows(n: int, k: int, b_layout: str) -> tuple[bool, bool]:
    """Whether A's rows and B's rows start an odd multiple of 16 bytes off a 32-byte sector
    (two-byte elements: K, or for B [K, N] its N padded to 8, = 8 mod 16)."""
    a_odd = k % 16 == 8
    return a_odd, a_odd if b_layout == "nk" else (-(-n // 8) * 8) % 16 == 8


def waves(units: int, per_wave: int, partial_cost: float = 1.0) -> float:
    """Waves of `units` over `per_wave` at a time: the full ones, and a last partial wave
    of a fraction f of the SMs counted as partial_cost + (1 - partial_cost) * f of a full
    one (1: as long as a full wave; below 1: a partly idle GPU runs its few tiles faster,
    on clocks and memory bandwidth the idle SMs leave)."""
    full, left = divmod(units, per_wave)
    if not left:
        return float(full)
    return full + partial_cost + (1.0 - partial_cost) * left / per_wave


def wave_terms(m: int, n: int, k: int, sms: int, tile: tuple[int, int], split: int,
               cluster: str = "", b_layout: str = "nk", split_tail: bool = False,
               partial_cost: float = 1.0) -> tuple[float, float, float, float] | None:
    """The wave model's terms of one configuration: (waves x work per CTA and wave, the
    split-K fix-up's element count per SM, the odd rows each CTA loads over its waves, the
    elements the last part of a tail-split tile adds up); None where the engine cannot
    run it. A split wave counts the longest part (ceil of the k-blocks over the parts); a
    last partial wave counts as :func:`waves` says."""
    block_m, block_n = tile
    tiles_m, tiles_n = -(-m // block_m), -(-n // block_n)
    k_blocks = -(-k // 64)
    cluster_m = 2 if cluster else 1
    if split > k_blocks or (cluster and sms < 2) or (split_tail and split == 1):
        return None                     # at most one part per 64-wide k-block
    units, per_wave = -(-tiles_m // cluster_m) * tiles_n, sms // cluster_m
    part = math.ceil(k_blocks / split) / k_blocks          # a part's share of K
    if split_tail:
        whole, tail = units // per_wave, units % per_wave
        if not whole or not tail:
            return None                 # no full wave, or no tail: the same as a plain split
        count = whole + waves(tail * split, per_wave, partial_cost) * part
        fixup = (split - 1) * block_m * block_n * tail * cluster_m / sms
        tail_sum = split * block_m * block_n
    else:
        count = waves(units * split, per_wave, partial_cost) * (part if split > 1 else 1.0)
        fixup = (split - 1) * block_m * block_n * tiles_m * tiles_n / sms
        tail_sum = 0.0
    a_odd, b_odd = odd_rows(n, k, b_layout)
    odd_per_block = block_m * a_odd + block_n // cluster_m * b_odd
    return (count * block_m * block_n * k, fixup, count * k_blocks * odd_per_block, tail_sum)


def predicted_us(m: int, n: int, k: int, sms: int, tile: tuple[int, int], split: int,
                 fit: dict, cluster: str = "", b_layout: str = "nk",
                 split_tail: bool = False) -> float:
    """The wave model's time of one configuration (see the module docstring)."""
    rate = fit["rates"].get(rate_key(tile, cluster))
    terms = wave_terms(m, n, k, sms, tile, split, cluster, b_layout, split_tail,
                       fit.get("partial_cost", 1.0))
    if not rate or terms is None:
        return math.inf
    work, fixup, odd, tail_sum = terms
    return (work / rate + fixup * fit.get("split_cost", 0.0) + odd * fit.get("row_cost", 0.0)
            + tail_sum * fit.get("tail_cost", 0.0) + fit.get("launch_us", 0.0))


def best_configuration(m: int, n: int, k: int, sms: int, fit: dict,
                       b_layout: str = "nk") -> Choice:
    """The configuration with the least predicted time (ties: the earlier tile, no split,
    no cluster), among the split-K part counts the fit allows for every tile (``splits``)
    and for the last wave's tiles (``tail_splits``: those that won a FIT shape), and the
    tiles and clusters it rates."""
    options = [(1, False)]
    options += [(s, False) for s in fit.get("splits", SPLITS) if s in SPLITS and s > 1]
    options += [(s, True) for s in fit.get("tail_splits", ()) if s in TAIL_SPLITS]
    scored = [(predicted_us(m, n, k, sms, tile, split, fit, cluster, b_layout, tail), i, split,
               tail, c, tile, cluster)
              for i, tile in enumerate(TILES) for split, tail in options
              for c, cluster in enumerate(CLUSTERS)]
    if b_layout == "nk":      # trimmed widths: whole tiles, direct stores
        for c, cluster in enumerate(CLUSTERS):
            width = trimmed_width(m, n, sms, cluster)
            if width:
                scored.append((predicted_us(m, n, k, sms, (128, width), 1, fit, cluster, b_layout),
                               len(TILES), 1, False, c, (128, width), cluster))
    _, _, split, tail, _, tile, cluster = min(scored)
    return Choice(*tile, split, cluster, tail and split > 1)


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


#: stream-K for the last wave (stream_k_pays): 128 x 256 tiles (the one measured) over K of
#: at least STREAM_K_MIN_K (its fix-up took 16-22 us, a fifth to a half of a wave at
#: K = 4096 to 7168: at small K it would cost more than a wave), at least this many waves
#: of whole tiles ...
STREAM_K_WAVES = 4
STREAM_K_MIN_K = 4096
#: ... and a last wave that keeps this share of the grid busy. Sharing that wave out saves
#: the idle share of it (x 0.9, the fitted cost of a partial wave) and costs a fix-up that
#: grows with the parts each tail tile is cut in: measured (gemm_streamk_probe.jsonl) at
#: about 0.19 of a wave for 2 parts, 0.52 for 4, 0.76 for 7 (a fill of 0.52, 0.24, 0.14).
#: Net gains from about a fifth of the grid busy to about seven tenths.
STREAM_K_FILL = (0.2, 0.7)


def stream_k_by_rule() -> bool:
    """Whether choose_tile applies stream_k_pays (on unless ``MKRT_GEMM_STREAM_K_RULE=0``).
    On the suite (gemm.jsonl, 6888eda) it took 11 of 90 cases, all on 4 or more waves, and
    brought the worst scaling pair (7168^3 on 116 SMs) from 1.070 to 1.019 of linear."""
    from mkrt import envs
    return bool(envs.get("MKRT_GEMM_STREAM_K_RULE"))


def stream_k_pays(m: int, n: int, k: int, sms: int, choice: Choice) -> bool:
    """Whether the rule shares the last wave of `choice` out by k-blocks (module docstring,
    3.): one CTA per 128 x 256 tile without split-K, K of at least STREAM_K_MIN_K, at least
    STREAM_K_WAVES full waves over `sms`, and a last wave that fills between STREAM_K_FILL
    of the grid. Measured in
    turns against the same tile without it (gemm_streamk_probe.jsonl, c9a3525): 7168^3 on
    116 SMs (13.5 waves, last 52% full) 1.017x; 32768 x 1024 x 4096 on 100 SMs (10.2, 24%)
    1.016x; 3000 x 5000 x 7000 on 116 (4.1, 14%: tail tiles in 7 parts) 1.006x; 0.61-0.89x
    on shapes of under 3 waves."""
    if choice[:4] != (128, 256, 1, "") or k < STREAM_K_MIN_K:
        return False
    tiles = -(-m // choice.block_m) * -(-n // choice.block_n)
    whole, tail = divmod(tiles, sms)
    return whole >= STREAM_K_WAVES and STREAM_K_FILL[0] <= tail / sms <= STREAM_K_FILL[1]


def choose_tile(m: int, n: int, k: int, *, sms: int, dtype: str = "bf16",
                b_layout: str = "nk") -> tuple[Choice, str]:
    """(Choice(block_m, block_n, split_k, cluster, split_tail, stream_k), why) for this
    problem."""
    choice = tuned_table().get(table_key(m, n, k, dtype, b_layout, sms))
    if choice is not None:
        return choice, "tuned table"
    fit = fitted_model()
    if fit is not None:
        choice = best_configuration(m, n, k, sms, fit, b_layout)
        if stream_k_by_rule() and stream_k_pays(m, n, k, sms, choice):
            return choice._replace(stream_k=True), "rule: the fitted wave model, stream-K tail"
        return choice, "rule: the fitted wave model"
    return Choice(*DEFAULT_TILE), "rule: default tile, no split-K (no sweep has chosen a rule yet)"
