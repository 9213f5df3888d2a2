"""The tile choice of mkrt.gemm: a tuned table in the JIT cache folder, else the rule."""

from __future__ import annotations

import json

from mkrt.kernels import gemm_rule


def test_without_a_table_the_rule_gives_the_default_tile(tmp_path, monkeypatch):
    monkeypatch.setenv("MKRT_JIT_CACHE_DIR", str(tmp_path))
    tile, why = gemm_rule.choose_tile(2048, 2048, 2048, sms=132)
    assert tile == (*gemm_rule.DEFAULT_TILE, 1) and why.startswith("rule")


def test_the_tuned_table_wins_for_its_exact_shape_only(tmp_path, monkeypatch):
    monkeypatch.setenv("MKRT_JIT_CACHE_DIR", str(tmp_path))
    key = gemm_rule.table_key(2048, 2048, 2048, "bf16", "nk", 132)
    (tmp_path / "gemm_table.json").write_text(json.dumps({
        key: "128x128_g8",                                             # as gemm_tune writes it
        gemm_rule.table_key(16, 4096, 8192, "bf16", "nk", 132): "128x256_g8_sk4",
        gemm_rule.table_key(1, 2, 8, "bf16", "nk", 132): "96x96_g8",   # no such tile: ignored
        gemm_rule.table_key(3, 2, 8, "bf16", "nk", 132): "garbage"}))
    default = (*gemm_rule.DEFAULT_TILE, 1)
    assert gemm_rule.choose_tile(2048, 2048, 2048, sms=132) == ((128, 128, 1), "tuned table")
    assert gemm_rule.choose_tile(16, 4096, 8192, sms=132)[0] == (128, 256, 4)
    assert gemm_rule.choose_tile(2048, 2048, 2048, sms=100)[0] == default
    assert gemm_rule.choose_tile(2048, 2048, 2048, sms=132, b_layout="kn")[0] == default
    assert gemm_rule.choose_tile(1, 2, 8, sms=132)[0] == default
    assert gemm_rule.choose_tile(3, 2, 8, sms=132)[0] == default


def test_an_unreadable_table_is_no_table(tmp_path, monkeypatch):
    monkeypatch.setenv("MKRT_JIT_CACHE_DIR", str(tmp_path))
    (tmp_path / "gemm_table.json").write_text("{not json")
    assert gemm_rule.choose_tile(64, 64, 64, sms=132)[0] == (*gemm_rule.DEFAULT_TILE, 1)


def test_every_tile_the_rule_can_name_is_one_the_engine_builds():
    from mkrt.kernels import gemm
    for block_m, block_n in gemm_rule.TILES:
        gemm.plan(256, 256, 256, block_m=block_m, block_n=block_n)


def test_the_sweep_measures_every_tile_the_rule_may_choose():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
    import gemm_tune
    assert tuple(map(tuple, gemm_tune.CONFIGS)) == gemm_rule.TILES
    assert not set(gemm_tune.FIT) & set(gemm_tune.HELD_OUT)
    assert len(gemm_tune.FIT) + len(gemm_tune.HELD_OUT) == 30
