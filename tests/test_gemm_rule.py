"""The tile choice of mkrt.gemm: a tuned table in the JIT cache folder, else the rule."""

from __future__ import annotations

import json

import pytest

from mkrt.kernels import gemm_rule


@pytest.fixture
def no_fit(tmp_path, monkeypatch):
    """The rule as it is without a committed fit (the default tile)."""
    monkeypatch.setattr(gemm_rule, "FIT_PATH", tmp_path / "no_fit.json")


def test_the_committed_fit_rates_every_tile_and_allows_only_measured_splits():
    fit = gemm_rule.fitted_model()
    assert fit is not None, gemm_rule.FIT_PATH
    # every tile the sweep measured when the fit was made (a tile added since has no rate
    # and is never chosen until the next sweep)
    named = {gemm_rule.rate_key(tile, c) for tile in [*gemm_rule.TILES, (128, 240)]
             for c in gemm_rule.CLUSTERS}
    assert set(fit["rates"]) <= named and len(fit["rates"]) >= 5
    assert all(rate > 0 for rate in fit["rates"].values())
    assert 1 in fit["splits"] and set(fit["splits"]) <= set(gemm_rule.SPLITS)
    # every pick is a configuration the fit allows, on shapes of every kind
    for shape in [(16, 8192, 8192), (2048, 2048, 2048), (3000, 5000, 7000), (8192, 8192, 8192)]:
        choice = gemm_rule.best_configuration(*shape, 132, fit)
        assert gemm_rule.rate_key(choice[:2], choice.cluster) in fit["rates"]
        allowed = fit.get("tail_splits", []) if choice.split_tail else fit["splits"]
        assert choice.split_k in allowed


def test_without_a_table_or_fit_the_rule_gives_the_default_tile(tmp_path, monkeypatch, no_fit):
    monkeypatch.setenv("MKRT_JIT_CACHE_DIR", str(tmp_path))
    tile, why = gemm_rule.choose_tile(2048, 2048, 2048, sms=132)
    assert tile == gemm_rule.Choice(*gemm_rule.DEFAULT_TILE) and why.startswith("rule")


def test_the_tuned_table_wins_for_its_exact_shape_only(tmp_path, monkeypatch, no_fit):
    monkeypatch.setenv("MKRT_JIT_CACHE_DIR", str(tmp_path))
    key = gemm_rule.table_key(2048, 2048, 2048, "bf16", "nk", 132)
    (tmp_path / "gemm_table.json").write_text(json.dumps({
        key: "128x128_g8",                                             # as gemm_tune writes it
        gemm_rule.table_key(16, 4096, 8192, "bf16", "nk", 132): "128x256_g8_sk4",
        gemm_rule.table_key(4096, 4096, 4040, "bf16", "nk", 132): "128x192_g8_m2",
        gemm_rule.table_key(5, 2, 8, "bf16", "nk", 132): "128x192_g8_sk2_m2",
        gemm_rule.table_key(3000, 5000, 7000, "bf16", "nk", 132): "128x256_g8_tk3_m2",
        gemm_rule.table_key(1, 2, 8, "bf16", "nk", 132): "96x96_g8",   # no such tile: ignored
        gemm_rule.table_key(3, 2, 8, "bf16", "nk", 132): "garbage"}))
    default = gemm_rule.Choice(*gemm_rule.DEFAULT_TILE)
    assert gemm_rule.choose_tile(2048, 2048, 2048, sms=132) == (gemm_rule.Choice(128, 128), "tuned table")
    assert gemm_rule.choose_tile(16, 4096, 8192, sms=132)[0] == gemm_rule.Choice(128, 256, 4)
    assert gemm_rule.choose_tile(4096, 4096, 4040, sms=132)[0] == gemm_rule.Choice(128, 192, 1, "m2")
    assert gemm_rule.choose_tile(5, 2, 8, sms=132)[0] == gemm_rule.Choice(128, 192, 2, "m2")
    assert gemm_rule.choose_tile(3000, 5000, 7000, sms=132)[0] == gemm_rule.Choice(128, 256, 3, "m2", True)
    assert gemm_rule.choose_tile(2048, 2048, 2048, sms=100)[0] == default
    assert gemm_rule.choose_tile(2048, 2048, 2048, sms=132, b_layout="kn")[0] == default
    assert gemm_rule.choose_tile(1, 2, 8, sms=132)[0] == default
    assert gemm_rule.choose_tile(3, 2, 8, sms=132)[0] == default


def test_an_unreadable_table_is_no_table(tmp_path, monkeypatch, no_fit):
    monkeypatch.setenv("MKRT_JIT_CACHE_DIR", str(tmp_path))
    (tmp_path / "gemm_table.json").write_text("{not json")
    assert gemm_rule.choose_tile(64, 64, 64, sms=132)[0] == gemm_rule.Choice(*gemm_rule.DEFAULT_TILE)


def test_every_tile_the_rule_can_name_is_one_the_engine_builds():
    from mkrt.kernels import gemm
    for block_m, block_n in gemm_rule.TILES:
        for cluster in gemm_rule.CLUSTERS:
            gemm.plan(256, 256, 256, block_m=block_m, block_n=block_n, cluster=cluster)


def test_the_sweep_measures_every_tile_the_rule_may_choose():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
    import gemm_tune
    assert tuple(map(tuple, gemm_tune.CONFIGS)) == gemm_rule.TILES
    assert not set(gemm_tune.FIT) & set(gemm_tune.HELD_OUT)
    assert len(gemm_tune.FIT) + len(gemm_tune.HELD_OUT) == 30


def _sweep_rows(shapes, set_name, truth, sms=132, noise=0.0, seed=0, trim=False):
    """Rows as experiments/gemm_tune.py writes them (split-K of every tile without clusters,
    of the last wave's tiles with and without; with `trim`, each shape's trimmed widths),
    timed by the wave model with `truth`."""
    import random
    rng = random.Random(seed)
    rows = []
    options = [(split, False, cluster) for split in gemm_rule.SPLITS
               for cluster in (gemm_rule.CLUSTERS if split == 1 else ("",))]
    options += [(split, True, cluster) for split in gemm_rule.TAIL_SPLITS
                for cluster in gemm_rule.CLUSTERS]
    for m, n, k in shapes:
        trimmed = [((128, width), 1, False, cluster) for cluster in gemm_rule.CLUSTERS
                   for width in [gemm_rule.trimmed_width(m, n, sms, cluster)] if width and trim]
        configurations = [(tile, split, tail, cluster) for tile in gemm_rule.TILES
                          for split, tail, cluster in options] + trimmed
        for (block_m, block_n), split, tail, cluster in configurations:
            if True:
                us = gemm_rule.predicted_us(m, n, k, sms, (block_m, block_n), split, truth,
                                            cluster, split_tail=tail)
                if us == float("inf"):
                    continue
                rows.append({"experiment": "gemm_tune", "metric": "us",
                             "case": f"{m}x{n}x{k}", "set": set_name,
                             "value": us * (1 + rng.uniform(-noise, noise)),
                             "baseline": us * 1.05, "block_m": block_m, "block_n": block_n,
                             "split_k": split, "split_tail": tail, "cluster": cluster,
                             "sms": sms})
    return rows


def test_the_wave_model_fit_recovers_its_rates_and_picks_on_held_out_shapes():
    """Times made by a known wave model (1% noise) on the FIT shapes: the fit gets its rates
    back, and on the HELD_OUT shapes (never fitted) the pick is within 4% of the fastest
    (the rule keeps only the split-K counts that won a FIT shape, so a held-out shape whose
    fastest split never won one loses a little)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
    import gemm_tune
    truth = {"rates": {"128x256": 5.0e6, "128x192": 4.6e6, "128x128": 4.2e6,
                       "64x256": 3.9e6, "64x128": 3.3e6, "128x256_m2": 5.4e6, "64x128_m2": 3.0e6},
             "split_cost": 2e-4, "tail_cost": 2e-6, "launch_us": 6.0}
    fit = gemm_tune.fit_model(_sweep_rows(gemm_tune.FIT, "fit", truth, noise=0.01, seed=1))
    for tile, rate in truth["rates"].items():
        assert abs(fit["rates"][tile] / rate - 1) < 0.03, (tile, fit["rates"][tile], rate)
    assert fit["tail_splits"] and abs(fit["tail_cost"] / truth["tail_cost"] - 1) < 0.3
    assert fit["partial_cost"] >= 0.9                  # the truth's partial waves cost a full one
    lines = gemm_tune.judge(_sweep_rows(gemm_tune.HELD_OUT, "held_out", truth), fit)
    assert len(lines) == len(gemm_tune.HELD_OUT)
    for line in lines:
        assert line["pick_us"] is not None and line["fastest_us"] / line["pick_us"] > 0.96, line


def test_the_rule_uses_a_committed_fit_and_not_a_broken_one(tmp_path, monkeypatch):
    monkeypatch.setenv("MKRT_JIT_CACHE_DIR", str(tmp_path))
    fit_path = tmp_path / "fit.json"
    monkeypatch.setattr(gemm_rule, "FIT_PATH", fit_path)
    fit = {"rates": {"128x256": 5.0e6, "128x128": 4.9e6}, "split_cost": 0.0, "launch_us": 5.0}
    fit_path.write_text(json.dumps(fit))
    # 2048^3: 128 tiles of 128x256 leave 4 of 132 SMs idle in one wave; with split-K 2 on
    # 128x256 (256 part-tiles, 2 waves) the model sees no gain; the fitted rule decides
    tile, why = gemm_rule.choose_tile(2048, 2048, 2048, sms=132)
    assert why == "rule: the fitted wave model"
    assert tile == gemm_rule.best_configuration(2048, 2048, 2048, 132, fit)
    # a tile the fit does not rate is never chosen
    assert tile[:2] in ((128, 256), (128, 128)) and tile.cluster == ""
    fit_path.write_text("{broken")
    assert gemm_rule.choose_tile(2048, 2048, 2048, sms=132)[0] == gemm_rule.Choice(*gemm_rule.DEFAULT_TILE)


def test_clusters_count_pairs_of_tile_rows_on_half_the_sms():
    fit = {"rates": {"128x256": 5.0e6, "128x256_m2": 5.0e6}, "launch_us": 0.0, "splits": [1]}
    # 64 x 32 tiles: 2048 tiles over 132 SMs = 16 waves; 32 x 32 pairs over 66 clusters = 16
    one = gemm_rule.predicted_us(8192, 8192, 8192, 132, (128, 256), 1, fit)
    pairs = gemm_rule.predicted_us(8192, 8192, 8192, 132, (128, 256), 1, fit, "m2")
    assert one == pairs == 16 * 128 * 256 * 8192 / 5.0e6
    # one tile row: the partner of every pair computes nothing, so twice the waves
    assert gemm_rule.predicted_us(128, 256 * 132, 4096, 132, (128, 256), 1, fit, "m2") == \
        2 * gemm_rule.predicted_us(128, 256 * 132, 4096, 132, (128, 256), 1, fit)
    # split-K with clusters: pairs of parts, twice the waves of half the K; no clusters on one SM
    assert gemm_rule.predicted_us(8192, 8192, 8192, 132, (128, 256), 2, fit, "m2") == pytest.approx(pairs)
    assert gemm_rule.predicted_us(8192, 8192, 8192, 1, (128, 256), 1, fit, "m2") == float("inf")
    # a faster cluster rate is chosen; an unrated one never is
    fit["rates"]["128x256_m2"] = 6.0e6
    assert gemm_rule.best_configuration(8192, 8192, 8192, 132, fit) == gemm_rule.Choice(128, 256, 1, "m2")
    del fit["rates"]["128x256_m2"]
    assert gemm_rule.best_configuration(8192, 8192, 8192, 132, fit).cluster == ""


def test_rows_off_a_sector_cost_per_row_loaded_and_clusters_load_half_of_b():
    assert gemm_rule.odd_rows(4096, 4040, "nk") == (True, True)        # 8080-byte rows
    assert gemm_rule.odd_rows(4096, 4048, "nk") == (False, False)      # 8096 = 253 x 32
    assert gemm_rule.odd_rows(4100, 4096, "kn") == (False, True)       # B [K, N]: N padded to 4104
    fit = {"rates": {"128x256": 5.0e6, "128x256_m2": 4.8e6}, "row_cost": 1e-3, "launch_us": 0.0}
    # aligned rows: the faster rate wins; rows off a sector: the pair loads 128 + 128 rows per
    # k-block instead of 128 + 256, and wins
    assert gemm_rule.best_configuration(4096, 4096, 4048, 132, fit).cluster == ""
    assert gemm_rule.best_configuration(4096, 4096, 4040, 132, fit).cluster == "m2"
    _, _, odd, _ = gemm_rule.wave_terms(4096, 4096, 4040, 132, (128, 256), 1)
    waves, k_blocks = -(-32 * 16 // 132), -(-4040 // 64)
    assert odd == waves * k_blocks * (128 + 256)
    _, _, odd_pairs, _ = gemm_rule.wave_terms(4096, 4096, 4040, 132, (128, 256), 1, "m2")
    assert odd_pairs == -(-16 * 16 // 66) * k_blocks * (128 + 128)


def test_config_names_round_trip():
    for choice in [gemm_rule.Choice(128, 256), gemm_rule.Choice(64, 128, 4),
                   gemm_rule.Choice(128, 192, 3, "m2", True), gemm_rule.Choice(128, 256, 2, "", True)]:
        assert gemm_rule.parse_config(gemm_rule.config_name(choice)) == choice
    assert gemm_rule.config_name(gemm_rule.Choice(128, 256, 3, "m2", True)) == "128x256_g8_tk3_m2"
    assert gemm_rule.parse_config("96x96_g8") is None
    with pytest.raises(ValueError):
        gemm_rule.parse_config("garbage")


def test_the_tail_split_terms():
    """3000 x 5000 x 7000 in 128 x 256 tiles on 132 SMs: 480 tiles, 3 whole waves and 84
    tiles of 110 k-blocks; in 3 parts the tail is 252 parts on 132 SMs, 2 of 37 k-blocks."""
    whole = gemm_rule.wave_terms(3000, 5000, 7000, 132, (128, 256), 1)
    tail = gemm_rule.wave_terms(3000, 5000, 7000, 132, (128, 256), 3, split_tail=True)
    tile_work = 128 * 256 * 7000
    assert whole[0] == pytest.approx(4 * tile_work) and whole[3] == 0
    assert tail[0] == pytest.approx((3 + 2 * 37 / 110) * tile_work)
    assert tail[1] == pytest.approx(2 * 128 * 256 * 84 / 132) and tail[3] == 3 * 128 * 256
    # the odd-row term follows the waves: K = 7000 puts every other row off a sector
    assert tail[2] / whole[2] == pytest.approx((3 + 2 * 37 / 110) / 4)
    # no tail (whole waves) or no whole wave: not a tail split
    assert gemm_rule.wave_terms(128 * 12, 256 * 11, 1024, 132, (128, 256), 2, split_tail=True) is None
    assert gemm_rule.wave_terms(256, 1024, 4096, 132, (128, 256), 2, split_tail=True) is None
    # clusters: units are pairs of tile rows on 66 clusters
    pairs = gemm_rule.wave_terms(3000, 5000, 7000, 132, (128, 256), 3, "m2", split_tail=True)
    assert pairs[0] == pytest.approx((3 + 2 * 37 / 110) * tile_work)


def test_the_rule_takes_a_tail_split_only_where_the_fit_allows_it():
    fit = {"rates": {"128x256": 3e6}, "splits": [1], "launch_us": 5.0}
    assert gemm_rule.best_configuration(3000, 5000, 7000, 132, fit).split_k == 1
    fit["tail_splits"] = [2, 3]
    assert gemm_rule.best_configuration(3000, 5000, 7000, 132, fit) == gemm_rule.Choice(128, 256, 3, "", True)
    # a fix-up cost large enough to eat the idle SMs' time: no split
    fit["tail_cost"] = 1.0
    assert gemm_rule.best_configuration(3000, 5000, 7000, 132, fit).split_k == 1


def test_a_partial_wave_costs_what_the_fit_says():
    assert gemm_rule.waves(264, 132) == 2.0
    assert gemm_rule.waves(330, 132) == 3.0                         # 2.5 waves: a full third
    assert gemm_rule.waves(330, 132, partial_cost=0.0) == pytest.approx(2.5)
    assert gemm_rule.waves(330, 132, partial_cost=0.5) == pytest.approx(2.75)
    fit = {"rates": {"128x256": 3e6}, "splits": [1], "launch_us": 0.0}
    full = gemm_rule.predicted_us(3000, 5000, 7000, 132, (128, 256), 1, fit)
    fit["partial_cost"] = 0.0                                        # 480 tiles: 3.64 waves
    assert gemm_rule.predicted_us(3000, 5000, 7000, 132, (128, 256), 1, fit) == \
        pytest.approx(full * (480 / 132) / 4)


def test_a_split_counts_as_a_win_only_by_a_margin():
    """A split-K count enters the rule only if it beat every configuration without split-K
    on some shape by more than the noise between two configurations."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
    import gemm_tune

    def rows(tail_us):
        base = {"experiment": "gemm_tune", "metric": "us", "case": "3000x5000x7000", "sms": 132,
                "block_m": 128, "block_n": 256}
        return [dict(base, value=100.0, split_k=1), dict(base, value=tail_us, split_k=3, split_tail=True)]
    assert gemm_tune.winning_splits(rows(99.0), split_tail=True) == []       # 1% faster: noise
    assert gemm_tune.winning_splits(rows(95.0), split_tail=True) == [3]
    assert gemm_tune.winning_splits(rows(95.0)) == [1]                       # not a split of every tile


def test_the_fit_finds_what_a_partial_wave_costs():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
    import gemm_tune
    for partial_cost in (0.3, 0.7):
        truth = {"rates": {"128x256": 5.0e6, "128x192": 4.6e6, "64x128": 3.3e6,
                           "128x256_m2": 5.4e6}, "split_cost": 2e-4, "launch_us": 6.0,
                 "partial_cost": partial_cost}
        fit = gemm_tune.fit_model(_sweep_rows(gemm_tune.FIT, "fit", truth, noise=0.01, seed=2))
        assert abs(fit["partial_cost"] - partial_cost) <= 0.1, fit


def test_trimmed_widths_keep_the_waves_of_256_wide_tiles():
    # 3000 x 5000: 24 tile rows (12 pairs); 256 wide: 20 columns, 240 pairs = 4 waves of 66
    # clusters; 240 wide: 21 columns, 252 pairs, still 4; 224 wide: 23 columns, 276: 5
    assert gemm_rule.trimmed_width(3000, 5000, 132, "m2") == 240
    assert gemm_rule.trimmed_width(3000, 5000, 132) == 240        # 480 / 504 tiles: 4 waves
    # 8192 x 8192 in pairs: 32 x 32 = 1024 units, 16 waves; 240 wide: 35 columns, 17 waves
    assert gemm_rule.trimmed_width(8192, 8192, 132, "m2") is None
    # one wave of few tiles: the narrowest width with no more columns than SMs allow
    assert gemm_rule.trimmed_width(128, 4096, 132) == 144
    for m, n, sms, cluster in [(3000, 5000, 132, "m2"), (2504, 2500, 132, "m2"), (96, 28672, 132, ""),
                               (4096, 14336, 116, ""), (777, 3001, 100, "m2")]:
        width = gemm_rule.trimmed_width(m, n, sms, cluster)
        if width is None:
            continue
        c = 2 if cluster else 1

        def waves(w):
            return -(-(-(-(-(-m // 128)) // c) * -(-n // w)) // (sms // c))
        assert width in gemm_rule.TRIM_WIDTHS and width < 256 and waves(width) == waves(256)
        assert all(waves(w) > waves(256) for w in gemm_rule.TRIM_WIDTHS if w < width)


def test_trimmed_widths_are_named_parsed_and_rated_as_one_family():
    choice = gemm_rule.Choice(128, 240, 1, "m2")
    assert gemm_rule.config_name(choice) == "128x240_g8_m2"
    assert gemm_rule.parse_config("128x240_g8_m2") == choice
    assert gemm_rule.parse_config("64x240_g8") is None           # 64-row tiles are not trimmed
    assert gemm_rule.parse_config("128x250_g8") is None
    assert gemm_rule.parse_config("128x240_g8_sk2") is None        # trimmed widths run whole tiles
    assert gemm_rule.rate_key((128, 240), "m2") == gemm_rule.rate_key((128, 144), "m2") == "128xT_m2"
    assert gemm_rule.rate_key((128, 256)) == "128x256"


def test_the_rule_picks_a_trimmed_width_only_where_rated_and_b_is_n_by_k():
    fit = {"rates": {"128x256": 5.0e6, "128x256_m2": 5.0e6, "128x192": 4.0e6}, "launch_us": 5.0}
    shape = (3000, 5000, 7000)
    assert gemm_rule.best_configuration(*shape, 132, fit).block_n == 256   # no "128xT" rate
    fit["rates"]["128xT_m2"] = 5.0e6                      # as fast per element as 256
    assert gemm_rule.best_configuration(*shape, 132, fit) == gemm_rule.Choice(128, 240, 1, "m2")
    assert gemm_rule.best_configuration(*shape, 132, fit, b_layout="kn").block_n == 256
    fit["rates"]["128xT_m2"] = 4.5e6                      # 10% slower per element: 6% less work loses
    assert gemm_rule.best_configuration(*shape, 132, fit).block_n == 256


def test_trimmed_widths_take_direct_stores_and_b_as_n_by_k():
    from mkrt.kernels import gemm
    p = gemm.plan(3000, 5000, 7000, block_m=128, block_n=240, cluster="m2")
    assert p.spec.block_n == 240 and p.spec.epilogue == "direct" and p.tiles_n == 21
    assert p.grid == 132
    with pytest.raises(ValueError, match="trimmed width.*whole tiles"):
        gemm.plan(3000, 5000, 7000, block_m=128, block_n=240, split_k=2)
    with pytest.raises(ValueError, match="trimmed width.*b_layout='nk', epilogue='direct'"):
        gemm.plan(3000, 5000, 7000, block_m=128, block_n=240, epilogue="tma")
    with pytest.raises(ValueError, match="trimmed width"):
        gemm.plan(3000, 5000, 7000, b_layout="kn", block_m=128, block_n=240)
    with pytest.raises(ValueError, match="multiple of 16"):
        gemm.plan(3000, 5000, 7000, block_m=128, block_n=232)
    # the fused kernels build multiples of 64 only
    from mkrt.kernels import grouped_gemm
    with pytest.raises(ValueError, match="fused kernels build tile widths"):
        grouped_gemm.spec_for("bf16", 128, 240)
    assert any(s.block_n == 240 and s.cluster == "m2" for s in gemm.default_specs())


def test_the_fit_rates_trimmed_widths_from_the_sweeps_trimmed_rows():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
    import gemm_tune
    truth = {"rates": {"128x256": 5.0e6, "128x192": 4.6e6, "128x128": 4.2e6, "64x256": 3.9e6,
                       "64x128": 3.3e6, "128x256_m2": 5.4e6, "128xT": 4.7e6, "128xT_m2": 5.3e6},
             "split_cost": 2e-4, "launch_us": 6.0}
    rows = _sweep_rows(gemm_tune.FIT, "fit", truth, noise=0.01, seed=2, trim=True)
    assert any(r["block_n"] == 240 and r["cluster"] == "m2" for r in rows)
    fit = gemm_tune.fit_model(rows)
    for key in ("128xT", "128xT_m2"):
        assert abs(fit["rates"][key] / truth["rates"][key] - 1) < 0.03, (key, fit["rates"])
    assert gemm_rule.best_configuration(3000, 5000, 7000, 132, fit) == gemm_rule.Choice(128, 240, 1, "m2")


def test_a_rule_picked_trimmed_width_gives_way_to_asked_for_tma_stores(monkeypatch):
    from mkrt.kernels import gemm
    monkeypatch.setattr(gemm_rule, "choose_tile",
                        lambda *a, **k: (gemm_rule.Choice(128, 240, 1, "m2"), "test"))

    class View:           # what _gemm_plan reads of its arrays, after _full_checks
        pass
    monkeypatch.setattr(gemm, "_full_checks", lambda a, b, out, layout: (3000, 5000, 7000, "bf16", 0))
    monkeypatch.setattr(gemm, "device_sm_count", lambda device: 132)
    options = dict(b_layout="nk", sms=None, group_m=8, block_m=None, block_n=None, stages=None)
    p = gemm._gemm_plan(View(), View(), None, epilogue="auto", **options)
    assert (p.spec.block_n, p.spec.epilogue, p.spec.cluster) == (240, "direct", "m2")
    p = gemm._gemm_plan(View(), View(), None, epilogue="tma", **options)
    assert (p.spec.block_n, p.spec.epilogue, p.spec.cluster) == (256, "tma", "m2")


def test_stream_k_takes_the_last_wave_only_where_it_was_measured_to_pay():
    tile = gemm_rule.Choice(128, 256)
    # 7168^3 on 116 SMs: 13 whole waves and a last wave 52% full: shared out
    assert gemm_rule.stream_k_pays(7168, 7168, 7168, 116, tile)
    # 32768 x 1024 x 4096 on 100 SMs: 10 waves, 24% full
    assert gemm_rule.stream_k_pays(32768, 1024, 4096, 100, tile)
    # the same grid at K = 1024: its fix-up would cost more than the idle SMs
    assert not gemm_rule.stream_k_pays(32768, 1024, 1024, 100, tile)
    # 7168^3 on the full chip: the last wave 88% full, little to gain
    assert not gemm_rule.stream_k_pays(7168, 7168, 7168, 132, tile)
    # 3000 x 5000 x 7000 on 116 SMs: 14% full, each tail tile cut in 7 parts (1.006x)
    assert not gemm_rule.stream_k_pays(3000, 5000, 7000, 116, tile)
    # 8192 x 1024 x 8192 on 116 SMs: 2 whole waves (0.89x measured)
    assert not gemm_rule.stream_k_pays(8192, 1024, 8192, 116, tile)
    # whole waves: nothing to share
    assert not gemm_rule.stream_k_pays(128 * 58, 256 * 10, 4096, 116, tile)
    # other tiles, split-K and clusters were not measured with it
    for other in (gemm_rule.Choice(64, 128), gemm_rule.Choice(128, 192),
                  gemm_rule.Choice(128, 256, 2), gemm_rule.Choice(128, 256, 1, "m2")):
        assert not gemm_rule.stream_k_pays(7168, 7168, 7168, 116, other)


def test_the_rule_adds_stream_k_to_the_fitted_pick(tmp_path, monkeypatch):
    monkeypatch.setenv("MKRT_JIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MKRT_GEMM_STREAM_K_RULE", "1")
    fit = {"rates": {"128x256": 3e6}, "splits": [1], "launch_us": 5.0}
    monkeypatch.setattr(gemm_rule, "fitted_model", lambda: fit)
    choice, why = gemm_rule.choose_tile(7168, 7168, 7168, sms=116)
    assert choice == gemm_rule.Choice(128, 256, 1, "", False, True) and "stream-K" in why
    assert gemm_rule.choose_tile(7168, 7168, 7168, sms=132)[0] == gemm_rule.Choice(128, 256)
    # a tuned table is taken as it is
    key = gemm_rule.table_key(7168, 7168, 7168, "bf16", "nk", 116)
    (tmp_path / "gemm_table.json").write_text(json.dumps({key: "128x256_g8"}))
    assert gemm_rule.choose_tile(7168, 7168, 7168, sms=116) == (gemm_rule.Choice(128, 256), "tuned table")


def test_stream_k_config_names_round_trip():
    choice = gemm_rule.Choice(128, 256, 1, "", False, True)
    assert gemm_rule.config_name(choice) == "128x256_g8_streamk"
    assert gemm_rule.parse_config("128x256_g8_streamk") == choice
    # stream-K runs alone on one CTA per whole-width tile
    for name in ("128x256_g8_sk2_streamk", "128x256_g8_streamk_m2", "128x240_g8_streamk"):
        assert gemm_rule.parse_config(name) is None


def test_stream_k_by_rule_is_on_by_default_and_turned_off_by_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("MKRT_JIT_CACHE_DIR", str(tmp_path))
    fit = {"rates": {"128x256": 3e6}, "splits": [1], "launch_us": 5.0}
    monkeypatch.setattr(gemm_rule, "fitted_model", lambda: fit)
    monkeypatch.delenv("MKRT_GEMM_STREAM_K_RULE", raising=False)      # on by default
    assert gemm_rule.choose_tile(7168, 7168, 7168, sms=116)[0].stream_k
    monkeypatch.setenv("MKRT_GEMM_STREAM_K_RULE", "0")
    assert gemm_rule.choose_tile(7168, 7168, 7168, sms=116) == (gemm_rule.Choice(128, 256),
                                                               "rule: the fitted wave model")
