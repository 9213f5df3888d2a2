"""GEMM+AllReduce on the CPU: the planner (ownership, exactly-once, no wait cycle), the
role-split rule, the fused/unfused decision, the argument layout, sm_90a builds."""

from __future__ import annotations

import itertools

import pytest

from mkrt.controller.cost import default_reduce_ctas
from mkrt.kernels import gemm_allreduce as gar
from mkrt.kernels.schedule import find_stall

WORLDS = [(n, g) for n, g in itertools.product([1, 2, 3, 4], [1, 2, 4, 8]) if n * g > 1]


@pytest.mark.parametrize("nodes,per_node", WORLDS)
@pytest.mark.parametrize("m,n", [(1024, 1024), (1000, 777), (128, 256), (4096, 512)])
def test_plan_reduces_and_sends_each_tile_once_without_wait_cycles(nodes, per_node, m, n):
    p = gar.plan(m, n, 64, nodes=nodes, ranks_per_node=per_node, ctas=8, fuse=True)
    assert p.check() == []
    owners = [p.owner(t) for t in range(p.tiles)]
    assert sorted(t for local in range(per_node) for t in p.owned(local)) == list(range(p.tiles))
    assert all(owners[t] == t % per_node for t in range(p.tiles))
    traffic = p.traffic()
    # Each byte of C crosses to every other node exactly once.
    assert traffic["network_per_node"] == p.tiles * p.tile_bytes * (nodes - 1)


def test_schedule_check_catches_a_cycle_and_a_missing_worker():
    workers = {"a": ["x1", "x2"], "b": ["y1"]}
    assert find_stall(workers, {"x2": ["y1"]}) == []
    assert find_stall(workers, {"x1": ["y1"], "y1": ["x2"]}) == [("a", "x1"), ("b", "y1")]
    with pytest.raises(ValueError, match="nobody runs"):
        find_stall(workers, {"x1": ["z"]})


def test_a_plan_whose_owner_never_reduces_is_reported(monkeypatch):
    p = gar.plan(512, 512, 64, nodes=1, ranks_per_node=2, ctas=4, fuse=True)
    real = p.schedule

    def broken():
        workers, depends = real()
        workers[("reduce", 1, 0)] = []          # rank 1 forgets its tiles
        return workers, depends
    monkeypatch.setattr(p.__class__, "schedule", lambda self: broken())
    problems = p.check()
    assert any("not node-reduced exactly once" in text for text in problems)


@pytest.mark.parametrize("k,expected_share", [(256, (0.5, 0.75)), (1024, (0.2, 0.4)), (8192, (0.0, 0.08))])
def test_default_role_split_follows_k(k, expected_share):
    reduce = default_reduce_ctas(k, 132)
    assert 1 <= reduce < 132
    low, high = expected_share
    assert low <= reduce / 132 <= high, (k, reduce)


def test_small_shapes_fall_back_and_large_ones_fuse():
    small = gar.plan(256, 256, 64, nodes=1, ranks_per_node=2, ctas=66)
    large = gar.plan(16384, 16384, 1024, nodes=1, ranks_per_node=8, ctas=132)
    assert not small.fused and "unfused" in small.reason
    assert large.fused
    forced = gar.plan(256, 256, 64, nodes=1, ranks_per_node=2, ctas=66, fuse=True)
    assert forced.fused and "requested" in forced.reason
    single = gar.plan(1000, 1000, 64, nodes=1, ranks_per_node=1, ctas=132)
    assert not single.fused and single.reduce_ctas == 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(m=0, n=8, k=8), "m=0"), (dict(m=8, n=8, k=12), "multiple of 8"),
    (dict(m=8, n=8, k=8, reduce_ctas=8), "reduce_ctas=8"),
    (dict(m=8, n=8, k=8, nodes=1, ranks_per_node=64), "at most 32"),
])
def test_plan_rejects_bad_problems(kwargs, match):
    args = dict(nodes=1, ranks_per_node=2, ctas=8) | kwargs
    with pytest.raises(ValueError, match=match):
        gar.plan(**args)


def test_flag_layout_words_do_not_overlap():
    layout = gar.FlagLayout(G=4, nodes=3, slots=5, tiles=18)
    words = ([layout.arrive(p) for p in range(4)] + [layout.target(p) for p in range(4)]
             + [layout.node_arrive(n) for n in range(3)]
             + [layout.partial(s, j) for s in range(4) for j in range(5)]
             + [layout.inter(n, j) for n in range(3) for j in range(5)]
             + [layout.final_tile(t) for t in range(18)])
    assert len(set(words)) == len(words) and max(words) < layout.words - 3


def test_args_struct_matches_its_numpy_mirror():
    """Same fields, same order, same kinds (pointer: u8, int: i4) in C and in ARGS_DTYPE."""
    import re
    source = gar.default_specs()[0].render()
    assert f"static_assert(sizeof(Args) == {gar.ARGS_DTYPE.itemsize}" in source
    body = source.split("struct Args {")[1].split("};")[0]
    body = re.sub(r"//[^\n]*", "", body)
    fields = []
    for declaration in filter(None, (d.strip() for d in body.split(";"))):
        kind = "<u8" if "*" in declaration else "<i4"
        first, *rest = declaration.split(",")
        names = [first.split()[-1]] + [r.strip() for r in rest]
        fields += [(name.lstrip("*"), kind) for name in names]
    mirror = [(name, gar.ARGS_DTYPE.fields[name][0].str) for name in gar.ARGS_DTYPE.names]
    assert fields == mirror


def test_default_specs_compile_without_spills():
    for spec in gar.default_specs():
        build = spec.build(check_spills=True)
        assert build.resources["gemm_allreduce"].spills == 0


def test_fitted_layouts_use_the_fitted_models_and_others_the_analytical_one():
    from mkrt.controller import cost
    fit = cost.fusion_fit()
    assert set(fit["layouts"]) >= {"1x2", "1x4", "2x2"}
    for entry in fit["layouts"].values():
        terms = cost.fusion_terms(4096, 4096, 512, ctas=66, reduce_ctas=20,
                                  ranks_per_gpu=entry["ranks_per_gpu"])
        assert len(entry["fused"]) == len(terms[0]) and len(entry["unfused"]) == len(terms[1])
    fitted = gar.plan(4096, 4096, 512, nodes=1, ranks_per_node=2, ctas=66, ranks_per_gpu=2)
    assert fitted.reason.startswith("fitted model")
    # The fit was made with every rank on one GPU: one rank per GPU is another machine.
    spread = gar.plan(4096, 4096, 512, nodes=1, ranks_per_node=2, ctas=132, ranks_per_gpu=1)
    assert spread.reason.startswith("analytical model")
    unknown = gar.plan(4096, 4096, 512, nodes=1, ranks_per_node=8, ctas=16, ranks_per_gpu=8)
    assert unknown.reason.startswith("analytical model")


def test_the_fitted_rule_fuses_tiny_problems_and_not_huge_k():
    """What every calibration run showed on 1x2: fused wins where launches dominate,
    unfused where the GEMM dominates (K >= 6144 on aligned shapes)."""
    tiny = gar.plan(256, 256, 256, nodes=1, ranks_per_node=2, ctas=66, ranks_per_gpu=2)
    huge_k = gar.plan(3072, 6144, 12288, nodes=1, ranks_per_node=2, ctas=66, ranks_per_gpu=2)
    assert tiny.fused and not huge_k.fused


def test_the_shipped_fit_is_what_the_committed_rows_give():
    """fusion_fit.json must be reproducible: refitting the committed calibration rows of
    the commit it names gives the same weights."""
    import importlib.util
    import re
    from pathlib import Path

    from mkrt.controller import cost
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("planner_experiment", root / "experiments" / "planner.py")
    planner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(planner)
    shipped = cost.fusion_fit()
    commit = re.search(r"--commit (\w+)", shipped["fitted_on"]).group(1)
    refit = planner.fit(root / "experiments" / "results" / "planner.jsonl", commit)
    for layout, entry in shipped["layouts"].items():
        assert refit["layouts"][layout]["fused"] == pytest.approx(entry["fused"], rel=1e-4)
        assert refit["layouts"][layout]["unfused"] == pytest.approx(entry["unfused"], rel=1e-4)


@pytest.mark.parametrize("block_n", [128, 192])
@pytest.mark.parametrize("nodes,per_node,collective", [(1, 2, "allreduce"), (2, 2, "allreduce"),
                                                        (2, 4, "reducescatter"), (1, 8, "allreduce")])
def test_narrower_tiles_plan_exactly_once(block_n, nodes, per_node, collective):
    """The fused kernel with 128 x 192 and 128 x 128 tiles: every tile computed and reduced
    once, no wait cycle."""
    p = gar.plan(2048, 1000, 512, nodes=nodes, ranks_per_node=per_node, ctas=66, fuse=True,
                 b_layout="nk", collective=collective, block_n=block_n)
    assert p.block_n == block_n and p.tiles_n == -(-1000 // block_n)
    assert p.check() == []


@pytest.mark.parametrize("block_n", [128, 192])
@pytest.mark.parametrize("collective", ["allreduce", "reducescatter"])
def test_narrower_tiles_compile_without_spills(block_n, collective):
    p = gar.plan(2048, 1024, 512, nodes=2, ranks_per_node=2, ctas=66, fuse=True,
                 b_layout="nk", collective=collective, block_n=block_n)
    assert gar.spec_for(p).build(check_spills=True).resources["gemm_allreduce"].spills == 0


@pytest.mark.parametrize("bad", [64, 320, 256.0, True, "256"])
def test_tile_width_is_checked(bad):
    with pytest.raises(ValueError, match="block_n"):
        gar.plan(256, 256, 256, nodes=1, ranks_per_node=2, ctas=8, block_n=bad)


def test_tile_width_left_to_the_rule_follows_it_on_the_compute_ctas(monkeypatch):
    """block_n=None: the GEMM rule's pick for the compute CTAs of the default split, which
    changes with the shape; the widest tile without a fit; not the default."""
    from mkrt.kernels import gemm_rule
    from mkrt.kernels.gemm_allreduce_plan import TILE_WIDTHS
    picks = {}
    for shape in ((768, 2560, 3072), (8192, 8192, 8192)):
        p = gar.plan(*shape, nodes=1, ranks_per_node=2, ctas=66, fuse=True, b_layout="nk",
                     block_n=None)
        expected = gemm_rule.fused_tile_width(*shape, p.compute_ctas, TILE_WIDTHS, "nk")
        assert p.block_n == expected and p.check() == []
        picks[shape] = p.block_n
    assert picks == {(768, 2560, 3072): 192, (8192, 8192, 8192): 256}       # the fit of 5f5b2f5
    monkeypatch.setattr(gemm_rule, "fitted_model", lambda: None)
    assert gar.plan(768, 2560, 3072, nodes=1, ranks_per_node=2, ctas=66, fuse=True,
                    b_layout="nk", block_n=None).block_n == 256
    # the default stays the measured 256 tile
    monkeypatch.undo()
    assert gar.plan(768, 2560, 3072, nodes=1, ranks_per_node=2, ctas=66, fuse=True,
                    b_layout="nk").block_n == 256
