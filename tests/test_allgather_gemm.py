"""AllGather+GEMM planning on the CPU (worlds 1x2 to 4x8): every block ready exactly once
at every rank, each block crossing to each other node once, every tile row computed once
after the blocks it reads, no wait cycle; options and shapes refused with clear errors;
the kernel compiles for sm_90a without spills (tests/test_jit.py compiles every default
spec; here the flag layout and the Args mirror)."""

from __future__ import annotations

import numpy as np
import pytest

from mkrt.kernels import allgather_gemm as agg
from mkrt.kernels import gathering
from mkrt.kernels.gathering import GATHER_MAX_CHUNKS

WORLDS = [(1, 2), (1, 4), (1, 8), (2, 2), (2, 3), (2, 4), (3, 1), (3, 2), (4, 2), (4, 8)]


@pytest.mark.parametrize("nodes,per_node", WORLDS)
@pytest.mark.parametrize("rows", [1, 100, 128, 300, 1024])
def test_plan_delivers_every_block_once_and_cannot_stall(nodes, per_node, rows):
    world = nodes * per_node
    p = agg.plan(rows * world, 512, 64, nodes=nodes, ranks_per_node=per_node, ctas=66)
    assert p.check() == []
    assert p.rows == rows and 1 <= p.comm_ctas < p.ctas
    for rank in range(world):
        order = p.tile_rows(rank)
        assert sorted(order) == list(range(p.tiles_m))
        assert rank in p.blocks_of(order[0])              # own rows first
    t = p.traffic()
    assert t["network_per_node"] == rows * 64 * 2 * per_node * (nodes - 1)   # each block once


def test_blocks_are_computed_in_arrival_order():
    """Own block, node peers' (pushed), then per other node the block put straight here,
    then those forwarded; one node or one rank per node: the plain rotation."""
    def blocks(nodes, per_node, rank, rows=256):
        p = agg.plan(rows * nodes * per_node, 512, 64, nodes=nodes, ranks_per_node=per_node, ctas=66)
        return list(dict.fromkeys(p.blocks_of(r)[0] for r in p.tile_rows(rank)))
    assert blocks(2, 2, 0) == [0, 1, 2, 3]
    assert blocks(2, 2, 1) == [1, 0, 3, 2]            # was 1, 2, 3, 0: a forwarded block first
    assert blocks(2, 2, 3) == [3, 2, 1, 0]
    assert blocks(3, 2, 3) == [3, 2, 5, 4, 1, 0]
    assert blocks(1, 4, 2) == [2, 3, 0, 1] and blocks(3, 1, 1) == [1, 2, 0]
    # blocks that are not whole tile rows keep the rotation
    p = agg.plan(100 * 4, 512, 64, nodes=2, ranks_per_node=2, ctas=66)
    assert p.tile_rows(1) == [(i + 100 // 128) % p.tiles_m for i in range(p.tiles_m)]
    # the device's formula is the mirror's
    assert "return ((node + i / G) % N) * G + (me + i % G) % G;" in agg.AllGatherGemmSpec().render()


def test_a_plan_that_waits_on_a_block_nobody_sends_is_reported(monkeypatch):
    p = agg.plan(4 * 256, 512, 64, nodes=2, ranks_per_node=2, ctas=66)
    monkeypatch.setattr(agg.Plan, "blocks_of", lambda self, tile_row: [self.world])   # no such block
    assert p.check()


@pytest.mark.parametrize("kwargs,match", [
    (dict(m=301), "must be the world size 2 times"),
    (dict(k=60), "multiple of 8"),
    (dict(n=100), "b_layout='kn' needs n % 8 == 0"),
    (dict(ctas=1), "ctas must be"),
    (dict(comm_ctas=66), "comm_ctas must be"),
    (dict(nodes=0), "nodes must be"),
])
def test_plan_refuses_what_the_kernel_cannot_run(kwargs, match):
    args = dict(m=512, n=512, k=64, nodes=1, ranks_per_node=2, ctas=66)
    args.update(kwargs)
    m, n, k = args.pop("m"), args.pop("n"), args.pop("k")
    with pytest.raises((ValueError, TypeError), match=match):
        agg.plan(m, n, k, **args)


def test_flag_layout_words_do_not_overlap():
    for G, N in [(1, 2), (2, 2), (4, 3), (8, 4)]:
        L = agg.FlagLayout(G, N)
        words = ([L.arrive(p) for p in range(G)] + [L.node_arrive(n) for n in range(N)]
                 + [L.ready(b) for b in range(N * G)]
                 + [L.pushed()] + [L.forwarded(n) for n in range(N)]
                 + [L.comm_before(), L.finished(), L.finished() + 1, L.finished() + 2]
                 + [L.chunk(b, c) for b in range(N * G) for c in range(GATHER_MAX_CHUNKS)]
                 + [L.claims()] + [L.credit(n) for n in range(N)]
                 + [L.forwarded_step(s) for s in range(N * G)])
        assert sorted(words) == list(range(L.words))
    # the device's layout and chunk count are the mirror's
    text = agg.AllGatherGemmSpec().render()
    assert f"constexpr int GATHER_MAX_CHUNKS = {GATHER_MAX_CHUNKS};" in text
    assert "int ready(int b) const { return G + N + b; }" in text
    assert "int pushed() const { return G + N + N * G; }" in text
    assert "int chunk(int b, int c) const { return finished() + 3 + b * GATHER_MAX_CHUNKS + c; }" in text
    assert "int claims() const { return chunk(N * G, 0); }" in text
    assert "int credit(int n) const { return claims() + 1 + n; }" in text
    assert "int forwarded_step(int s) const { return credit(N) + s; }" in text


_chunk_begin, _gather_chunks = gathering.chunk_begin, gathering.gather_chunks
_chunk_holding, _chunk_at = gathering.chunk_holding, gathering.chunk_at


def test_device_chunk_helpers_are_the_mirrored_ones():
    text = agg.AllGatherGemmSpec().render()
    assert "return min(comm_ctas * ((want + comm_ctas - 1) / comm_ctas), GATHER_MAX_CHUNKS);" in text
    assert "int c = min((int)(x * (u64)chunks / nbytes), chunks - 1);" in text
    assert "while (c + 1 < chunks && chunk_begin(nbytes, c + 1, chunks) <= x) ++c;" in text
    assert "return pairs ? (k & 1) * (chunks / 2) + (k >> 1) : k;" in text
    assert "const bool pairs = a.bytes1 == a.bytes0 && chunks % 2 == 0;" in text


@pytest.mark.parametrize("nbytes,comm_ctas,want", [(100 << 20, 16, 64), (4096 * 16, 2, 16),
                                                   (1000 * 72 * 2, 7, 64), (48, 1, 16),
                                                   (2 * 130 * 4 * 64 * 2, 8, 64)])
def test_chunk_holding_finds_the_chunk_of_every_byte(nbytes, comm_ctas, want):
    chunks = _gather_chunks(comm_ctas, want)
    bounds = [_chunk_begin(nbytes, c, chunks) for c in range(chunks + 1)]
    step = max(1, nbytes // 5000)
    for x in sorted({*range(0, nbytes, step), *(b - 1 for b in bounds[1:] if b), *bounds[:-1]}):
        c = _chunk_holding(nbytes, x, chunks)
        assert bounds[c] <= x < bounds[c + 1], (x, c)


@pytest.mark.parametrize("chunks", [16, 64, 14])
def test_two_equal_spans_are_copied_k_and_v_chunks_alternating(chunks):
    """Every chunk is copied once; with two equal spans the visit order alternates between
    the first span's chunks and the second's, each in order."""
    order = [_chunk_at(k, chunks, True) for k in range(chunks)]
    assert sorted(order) == list(range(chunks))
    assert order[0::2] == list(range(chunks // 2))
    assert order[1::2] == list(range(chunks // 2, chunks))
    assert [_chunk_at(k, chunks, False) for k in range(chunks)] == list(range(chunks))


@pytest.mark.parametrize("rows,k,comm_ctas", [(4096, 8192, 2), (1000, 72, 7), (3, 8, 25),
                                              (129, 4104, 64), (1, 8, 1)])
def test_chunks_tile_each_block_and_every_cta_gets_as_many(rows, k, comm_ctas):
    """Chunks of a block are contiguous, 16-byte aligned, cover it exactly once, and split
    evenly over the communication CTAs; the rows a tile waits for lie in the chunks it
    waits on (the device's wait_gathered_rows)."""
    chunks = _gather_chunks(comm_ctas)
    nbytes = rows * k * 2
    bounds = [_chunk_begin(nbytes, c, chunks) for c in range(chunks + 1)]
    assert bounds[0] == 0 and bounds[-1] == nbytes and bounds == sorted(bounds)
    assert all(b % 16 == 0 for b in bounds[:-1])
    assert chunks % comm_ctas == 0 or chunks == GATHER_MAX_CHUNKS
    for row0 in range(0, rows, max(1, rows // 7)):
        row1 = min(row0 + 127, rows - 1)
        x0, x1 = row0 * k * 2, (row1 + 1) * k * 2
        waited = [c for c in range(chunks) if bounds[c] < x1 and bounds[c + 1] > x0]
        assert bounds[waited[0]] <= x0 and bounds[waited[-1] + 1] >= x1
        assert waited == list(range(waited[0], waited[-1] + 1))


def test_args_mirror_matches_the_c_struct_size_assert():
    text = agg.AllGatherGemmSpec().render()
    assert f"static_assert(sizeof(Args) == {agg.ARGS_DTYPE.itemsize}" in text
    assert agg.ARGS_DTYPE.itemsize % 8 == 0


def test_op_options_are_checked_before_anything_runs():
    import mkrt
    world = mkrt.init(emulate="1x2")
    try:
        with pytest.raises(TypeError, match="mkrt.allgather_gemm: fuse"):
            mkrt.AllGatherGemm(world, fuse="yes")
        with pytest.raises(ValueError, match="muted_rank must be"):
            mkrt.AllGatherGemm(world, muted_rank=2)
        with pytest.raises(ValueError, match="b_layout"):
            mkrt.AllGatherGemm(world, b_layout="mk")
        op = mkrt.AllGatherGemm(world, b_layout="nk")
        p = op.plan_for(2 * 300, 520, 64, "bf16")
        assert p.rows == 300 and p.check() == []
    finally:
        world.close()


def test_reference_is_all_of_a_times_the_shard():
    rng = np.random.default_rng(0)
    a = [rng.standard_normal((3, 8)).astype(np.float16) for _ in range(2)]
    b = rng.standard_normal((8, 5)).astype(np.float16)
    expected = np.concatenate(a).astype(np.float64) @ b.astype(np.float64)
    assert np.allclose(agg.reference(a, b), expected)


def test_gather_split_picks_near_the_best_measured_split():
    """The split rule against experiments/agg_split.py's newest rows (the static splits
    timed per shape on 1x2 and 2x2, the kernel as it is since the communication CTAs join
    the compute role): the measured split nearest the rule's pick is within 5% of the best
    static split on every shape; a fixed 2 CTAs is not (1.7-4.4x the best)."""
    import json
    from collections import defaultdict
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "experiments/results/agg_split.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    newest = rows[-1]["commit"]
    shapes = defaultdict(dict)
    for row in rows:
        if row["commit"] == newest and row["path"].startswith("c"):
            shapes[(row["layout"], row["m"], row["n"], row["k"], row["ctas"])][row["comm_ctas"]] = row["value"]
    assert len(shapes) >= 10
    for (layout, m, n, k, ctas), times in shapes.items():
        nodes, per_node = (int(v) for v in layout.split("x"))
        pick = agg.gather_split(m, n, k, ctas=ctas, nodes=nodes, ranks_per_node=per_node)
        nearest = min(times, key=lambda c: (abs(c - pick), c))
        assert times[nearest] <= 1.05 * min(times.values()), (layout, m, n, k, pick, times)
    worst_fixed = max(times[2] / min(times.values()) for times in shapes.values())
    assert worst_fixed > 2


def test_every_rank_cuts_blocks_by_the_host_split():
    """The chunk count comes from the host's split (Args.compute_ctas), the same on every
    rank, not from a launch's split, which roles="search" sets per rank: a rank waits for
    chunks of other ranks' blocks by its own count."""
    text = agg.AllGatherGemmSpec().render()
    assert "const int chunks = gather_chunks((int)gridDim.x - a.compute_ctas);" in text
    assert "gather_args(a, a.input, (u64)a.rows * a.k * sizeof(T), nullptr, 0, chunks);" in text
    assert "const int chunks = a.chunks;" in text
    code = "\n".join(line.split("//")[0] for line in text.splitlines())
    assert "gather_chunks(comm_ctas" not in code
