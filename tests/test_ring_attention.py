"""Ring attention on the CPU: the kernel's Python mirrors (source order, the key blocks a
tile visits) against the plan, sharding, compile checks; GPU tests in
tests/test_ring_attention_gpu.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mkrt.kernels import attention as A
from mkrt.kernels import ring_attention as RA
from mkrt.kernels import ring_attention_plan as R

LAYOUTS = [(1, 2), (1, 4), (2, 2), (3, 1), (2, 4), (4, 8)]


@pytest.mark.parametrize("spec", RA.default_specs(), ids=lambda s: s.uri)
def test_default_specs_compile_without_spills(spec):
    build = spec.build(check_spills=True)
    resources = build.resources["ring_attention"]
    assert resources.spills == 0, resources
    assert "serialized" not in build.log, build.log
    assert spec.uri.startswith("ring_attention_")


@pytest.mark.parametrize("nodes,G", LAYOUTS)
def test_sources_follow_the_plan(nodes, G):
    for causal in (False, True):
        p = R.plan(nodes, G, causal=causal)
        for rank in range(nodes * G):
            assert RA.source_order(rank // G, rank % G, G, nodes) == list(p.order[rank])


@pytest.mark.parametrize("nodes,G", LAYOUTS[:5])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("chunk", [128, 200, 384])
def test_every_tile_visits_exactly_the_keys_it_may_see(nodes, G, causal, chunk):
    W = nodes * G
    for rank in range(W):
        for slot in range(2):
            for start in range(0, chunk, 128):
                q_row, q_rows = slot * chunk + start, min(128, chunk - start)
                qc = R.chunks_of(rank, W, causal)[slot]
                last_query = qc * chunk + start + q_rows - 1
                blocks = RA.tile_blocks(rank, G, nodes, chunk, q_row, q_rows, causal)
                keys = [b[2] + i for b in blocks for i in range(b[3])]
                assert len(keys) == len(set(keys)), "a key visited twice"
                limit = last_query + 1 if causal else 2 * W * chunk
                assert set(range(limit)) <= set(keys), "a visible key never visited"
                # nothing past the tile's reach beyond one diagonal block's slack
                assert all(k < limit + 128 for k in keys)
                # the rows read from a source are that source's rows of the key chunk
                for source, row, position, count in blocks:
                    kslot = row // chunk
                    kc = R.chunks_of(source, W, causal)[kslot]
                    assert position == kc * chunk + row - kslot * chunk and count <= 128
                # own K/V first
                assert blocks[0][0] == rank


@pytest.mark.parametrize("nodes,G", [(1, 2), (2, 2), (1, 4)])
def test_causal_work_is_the_same_on_every_rank(nodes, G):
    W, chunk = nodes * G, 512
    work = []
    for rank in range(W):
        work.append(sum(len(RA.tile_blocks(rank, G, nodes, chunk, slot * chunk + s, 128, True))
                        for slot in range(2) for s in range(0, chunk, 128)))
    assert len(set(work)) == 1, work


def test_shard_and_unshard_round_trip():
    x = np.arange(2 * 24 * 3 * 2).reshape(2, 24, 3, 2)
    for causal in (False, True):
        parts = [RA.shard(x, r, 3, causal=causal) for r in range(3)]
        assert parts[0].shape == (2, 8, 3, 2)
        assert np.array_equal(RA.unshard(parts, causal=causal), x)
        lse = np.moveaxis(x, 1, 2)
        lse_parts = [np.moveaxis(p, 1, 2) for p in parts]
        assert np.array_equal(RA.unshard(lse_parts, causal=causal, axis=2), lse)
    with pytest.raises(ValueError, match="multiple of 2 x world"):
        RA.shard(x, 0, 5, causal=True)
    assert [int(v) for v in RA.shard(x, 1, 3, causal=True)[0, :, 0, 0] // 6] == \
        [4, 5, 6, 7, 16, 17, 18, 19]      # chunks 1 and 4 (zigzag) of 6 chunks of 4 rows


def test_the_ring_reference_is_attention_over_the_whole_sequence():
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 16, 2, 8)) for _ in range(3))
    for causal in (False, True):
        full_o, full_lse = A.reference(q, k, v, causal=causal, dtype=np.float64)
        results = R.ring_reference(q, k, v, nodes=2, ranks_per_node=2, causal=causal)
        for rank, chunks in enumerate(results):
            o = np.concatenate([o for _, o, _ in chunks], axis=1)
            lse = np.concatenate([lse for _, _, lse in chunks], axis=2)
            np.testing.assert_allclose(o, RA.shard(full_o, rank, 4, causal=causal), atol=1e-12)
            np.testing.assert_allclose(
                lse, np.moveaxis(RA.shard(np.moveaxis(full_lse, 2, 1), rank, 4, causal=causal), 1, 2),
                atol=1e-12)


def test_op_checks_before_launch():
    import mkrt
    world = mkrt.init(emulate="2x2", gpus=0)
    try:
        op = mkrt.RingAttention(world)
        assert op.split() == (132, 33)       # no GPU: 132 CTAs, a quarter of them copy first
        assert mkrt.RingAttention(world, ctas=66).split() == (66, 16)
        assert mkrt.RingAttention(world, ctas=8).split() == (8, 2)       # the gathering default
        assert mkrt.RingAttention(world, ctas=2).split() == (2, 1)
        with pytest.raises(ValueError, match="comm_ctas"):
            mkrt.RingAttention(world, comm_ctas=500).split()
        with pytest.raises(ValueError, match="muted_rank"):
            mkrt.RingAttention(world, muted_rank=4)
    finally:
        world.close()


def test_the_ring_runs_two_consumer_warpgroups():
    assert RA.spec_for("bf16", 64).consumers == 2
    with pytest.raises(ValueError, match="the ring runs 2"):
        RA.RingAttentionSpec("bf16", 64, 128, 3, 1, 3)
    with pytest.raises(ValueError, match="always claim"):
        RA.RingAttentionSpec("bf16", 64, 128, 3, 1, 2, claimed=0)


def _ring_work_get(batches, heads, kv_heads, chunk, band, causal, t, block_q=128):
    """RingWork::get's index arithmetic (ring_attention.py's kernel source), line for line."""
    group, q_blocks = heads // kv_heads, -(-chunk // block_q)
    units = batches * kv_heads
    if t >= 2 * q_blocks * units * group:
        return None
    per_band = 2 * q_blocks * band * group
    b = t // per_band
    width = min(band, units - b * band) * group
    r = t - b * per_band
    order = r // width
    slot = (1 if order < q_blocks else 0) if causal else order // q_blocks
    q_block = q_blocks - 1 - order % q_blocks
    w = r - order * width
    unit = b * band + w // group
    batch = unit // kv_heads
    kv_head = unit - batch * kv_heads
    return batch, kv_head * group + (w - (w // group) * group), slot * chunk + q_block * block_q


@pytest.mark.parametrize("shape", [(2, 6, 3, 300), (4, 16, 16, 3072), (1, 64, 8, 4096)])
def test_ring_tiles_come_once_each_in_bands_and_match_the_kernels_arithmetic(shape):
    B, Hq, Hkv, chunk = shape
    q_blocks = -(-chunk // 128)
    for band in (1, 3, B * Hkv):
        for causal in (False, True):
            order = RA.tile_order(B, Hq, Hkv, chunk, band, causal)
            assert sorted(order) == sorted((b, h, slot * chunk + q * 128) for b in range(B)
                                           for h in range(Hq) for slot in (0, 1)
                                           for q in range(q_blocks))
            assert [_ring_work_get(B, Hq, Hkv, chunk, band, causal, t)
                    for t in range(len(order))] == order
            assert _ring_work_get(B, Hq, Hkv, chunk, band, causal, len(order)) is None
    # 2 x 3072 rows per rank on 4 ranks: 24576 gathered rows, 12 MB of K and V per head;
    # 16384 rows (2 ranks of 2 x 4096): 8 MB, two heads per band
    assert A.kv_band(4, 16, 128, 4 * 2 * 3072) == 1
    assert A.kv_band(1, 8, 128, 2 * 2 * 4096) == 2


@pytest.mark.parametrize("batches,chunk,row_bytes,comm_ctas", [(4, 1536, 16 * 128 * 2, 16),
                                                               (1, 4096, 8 * 128 * 2, 8),
                                                               (2, 100, 2 * 64 * 2, 2),
                                                               (3, 130, 1 * 64 * 2, 33)])
def test_a_key_block_waits_for_exactly_the_chunks_holding_its_k_and_v_rows(batches, chunk, row_bytes,
                                                                            comm_ctas):
    from mkrt.kernels.gathering import chunk_begin, gather_chunks
    chunks = gather_chunks(comm_ctas, RA.RING_CHUNKS)
    rows = batches * 2 * chunk
    nbytes = 2 * rows * row_bytes
    bounds = [chunk_begin(nbytes, c, chunks) for c in range(chunks + 1)]
    for batch in range(batches):
        for row in range(0, 2 * chunk, 128):
            count = min(128, 2 * chunk - row)
            waited = RA.block_chunks(batch, row, count, batches, chunk, row_bytes, comm_ctas)
            spans = [((batch * 2 * chunk + row) * row_bytes, (batch * 2 * chunk + row + count) * row_bytes)]
            spans.append((spans[0][0] + rows * row_bytes, spans[0][1] + rows * row_bytes))
            # every byte of the K rows and the V rows lies in a waited chunk ...
            for x0, x1 in spans:
                covering = [c for c in range(chunks) if bounds[c] < x1 and bounds[c + 1] > x0]
                assert set(covering) <= set(waited)
            # ... and every waited chunk holds some of them
            for c in waited:
                assert any(bounds[c] < x1 and bounds[c + 1] > x0 for x0, x1 in spans)


def test_the_kernels_wait_is_the_mirrored_one():
    text = RA.spec_for("bf16", 128).render()
    assert f"constexpr int RING_CHUNKS = {RA.RING_CHUNKS};" in text
    assert "const int row0 = tile.batch * 2 * chunk + block.row, row1 = row0 + block.count - 1;" in text
    assert "wait_gathered_rows(flags, L, block.source, row0, row1, row_bytes, 2 * rows, chunks," in text
    assert "wait_gathered_rows(flags, L, block.source, rows + row0, rows + row1, row_bytes," in text
    # chunks from the host's split (the same on every rank), as block_chunks takes them
    assert "const int chunks = gather_chunks((int)gridDim.x - a.compute_ctas, RING_CHUNKS);" in text
    assert "chunks, row_bytes, &tma_k_own, &tma_v_own};" in text
    assert "GatherArgs gather = gather_args(a, a.k, kv_bytes, a.v, kv_bytes, chunks);" in text
    # the rank's own keys come from its inputs: no wait, and on one node no copy of them
    assert "if (OWN_IN_INPUT && is_own(block.source)) return true;" in text
    assert "constexpr bool OWN_IN_INPUT = DIRECT_OWN || SLOTS > 0;" in text
    assert "gather.own_in_input = DIRECT_OWN;" in text
    assert "targets[p] = (p == a.me && a.N == 1 && a.own_in_input) ? nullptr" in text


def test_the_band_keeps_gathered_kv_in_the_ranks_share_of_l2():
    """Ranks that share a GPU share its L2: each one's band holds 1/n of the K/V budget."""
    from types import SimpleNamespace
    from mkrt.kernels import attention as A
    problem = SimpleNamespace(batches=4, kv_heads=16, head_dim=128, sk=4096)
    for sharing, size in ((1, 2), (2, 2), (4, 4)):
        world = SimpleNamespace(size=size, device_sharing=lambda rank, n=sharing: n)
        op = RA.RingAttention.__new__(RA.RingAttention)
        op.world, op.band, op.slots = world, None, 0
        band = op.band_for(problem, 0)
        per_head = 2 * size * 4096 * 128 * 2
        assert band == max(1, A.KV_L2_BYTES // sharing // per_head)
        assert band == 1 or band * per_head * sharing <= A.KV_L2_BYTES
    op.band = 3
    assert op.band_for(problem, 0) == 3
    op.band = 1000
    assert op.band_for(problem, 0) == 4 * 16
    for bad in (0, -1, True, 2.5, "4"):
        with pytest.raises(ValueError, match="band="):
            RA.RingAttention(object(), band=bad)


def test_stages_and_trace_options_are_checked_and_reach_the_spec():
    from types import SimpleNamespace
    for bad in (1, 0, True, 2.5, "3"):
        with pytest.raises(ValueError, match="stages="):
            RA.RingAttention(object(), stages=bad)
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match="trace="):
            RA.RingAttention(object(), trace=bad)
        with pytest.raises(ValueError, match="direct_own="):
            RA.RingAttention(object(), direct_own=bad)
    problem = SimpleNamespace(dtype="bf16", head_dim=128, causal=True)
    op = RA.RingAttention.__new__(RA.RingAttention)
    op.stages, op.tracing, op.direct_own, op.slots = None, False, False, 0
    assert op.spec(problem) == RA.spec_for("bf16", 128, True)
    op.direct_own = True
    assert op.spec(problem).direct_own == 1 and "_o1_" in op.spec(problem).uri
    op.stages, op.tracing, op.direct_own = 3, True, False
    spec = op.spec(problem)
    assert (spec.stages, spec.trace, spec.direct_own) == (3, 1, 0) and "_t1_o0_" in spec.uri
    op.slots, op.tracing = 2, False
    assert op.spec(problem).slots == 2 and op.spec(problem).uri.endswith("_k2_sm90a")
    op.tracing = True
    with pytest.raises(ValueError, match="trace\\(\\) needs"):
        op.tracing = False
        op.trace()


@pytest.mark.parametrize("direct_own", [0, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_the_trace_build_compiles_without_spills_and_mirrors_its_words(causal, direct_own):
    import dataclasses
    direct = dataclasses.replace(RA.spec_for("bf16", 128, causal), direct_own=1)
    assert direct.build(check_spills=True).resources["ring_attention"].spills == 0
    spec = dataclasses.replace(RA.spec_for("bf16", 128, causal), trace=1, direct_own=direct_own)
    text = spec.render()
    assert f"constexpr int TRACE_WORDS = {len(RA.TRACE_FIELDS) + 2 * RA.TRACE_SOURCES};" in text
    assert f"constexpr int TRACE_SOURCES = {RA.TRACE_SOURCES};" in text
    assert "constexpr bool RING_TRACE = true;" in text
    resources = spec.build(check_spills=True).resources["ring_attention"]
    assert resources.spills == 0, resources
    plain = RA.spec_for("bf16", 128, causal)
    assert "constexpr bool RING_TRACE = false;" in plain.render()


def _ring_cursor(rank, G, N, chunk, q_row, q_rows, causal, block_kv=128):
    """RingWork's cursor (first_block, next_block, enter_next_chunk in the kernel source),
    line for line: the blocks it steps through, (source, row, position, count)."""
    W = G * N
    kv_blocks = -(-chunk // block_kv)
    sources = RA.source_order(rank // G, rank % G, G, N)      # RingWork::source_at

    def chunk_of(r, slot):
        return R.chunks_of(r, W, causal)[slot]

    slot = q_row // chunk
    q_position = chunk_of(rank, slot) * chunk + (q_row - slot * chunk)

    def blocks_of(qc, kc):
        if not causal or kc < qc:
            return kv_blocks
        if kc > qc:
            return 0
        return min(kv_blocks, (q_position + q_rows - 1 - kc * chunk) // block_kv + 1)

    block = dict(step=0, part=-1, left=0)

    def enter_next_chunk():
        qc = q_position // chunk
        while True:
            block["part"] += 1
            if block["part"] == 2:
                block["part"], block["step"] = 0, block["step"] + 1
            if block["step"] >= W:
                block["left"] = 0
                return
            s = sources[block["step"]]
            kc = chunk_of(s, block["part"])
            n = blocks_of(qc, kc)
            if n > 0:
                block.update(source=s, row=block["part"] * chunk, position=kc * chunk,
                             count=min(block_kv, chunk), left=n)
                return

    def next_block():
        block["left"] -= 1
        if block["left"] > 0:
            block["row"] += block_kv
            block["position"] += block_kv
            block["count"] = min(block_kv, (block["part"] + 1) * chunk - block["row"])
            return
        enter_next_chunk()

    enter_next_chunk()
    seen = []
    while block["left"] > 0:
        seen.append((block["source"], block["row"], block["position"], block["count"]))
        next_block()
    return seen


@pytest.mark.parametrize("nodes,G", LAYOUTS[:5])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("chunk", [128, 200, 384, 1000])
def test_the_consumers_cursor_steps_through_the_producers_blocks(nodes, G, causal, chunk):
    """Producer and consumers step RingWork's cursor independently; its blocks must be the
    tile's, in tile_blocks' order (the gathered rows the producer loads and the positions
    the consumers mask by must agree)."""
    W = G * nodes
    for rank in range(W):
        for slot in range(2):
            for start in range(0, chunk, 128):
                q_row, q_rows = slot * chunk + start, min(128, chunk - start)
                assert _ring_cursor(rank, G, nodes, chunk, q_row, q_rows, causal) == \
                    RA.tile_blocks(rank, G, nodes, chunk, q_row, q_rows, causal)


def test_the_trace_summary_reads_per_rank_times_from_the_records():
    """mkrt.kernels.ring_trace.summarise on a synthetic 1x2 trace: times from the first
    start, copies from the copying CTAs only, sources in each rank's visiting order."""
    from mkrt.kernels.ring_trace import summarise
    ctas, compute = 4, 3
    records = []
    for rank in range(2):
        start = np.array([1_000, 2_000, 3_000, 4_000]) + 10_000 * rank
        r = {"start_ns": start, "copies_done_ns": np.array([0, 0, 0, 50_000 + 10_000 * rank]),
             "producer_done_ns": start + 100_000, "consumer_done_ns": start + 101_000,
             "flag_wait_ns": np.array([0.0, 1_000.0, 2_000.0, 3_000.0]),
             "starved_ns": np.full(ctas, 4_000.0), "tiles": np.array([3, 3, 2, 1]),
             "blocks": np.array([10, 10, 5, 2]), "ns_per_cycle": np.full(ctas, 0.5),
             "source_reached_ns": np.zeros((ctas, RA.TRACE_SOURCES), np.int64),
             "source_whole_ns": np.zeros((ctas, RA.TRACE_SOURCES), np.int64)}
        other = 1 - rank
        r["source_reached_ns"][:, rank] = start + 10
        r["source_reached_ns"][:, other] = start + 60_000
        r["source_whole_ns"][1:, other] = 70_000
        records.append(r)
    span, ranks = summarise(records, compute, G=2, N=1)
    assert span == (14_000 + 101_000 - 1_000) / 1e3
    r0, r1 = ranks
    assert (r0["start_first"], r0["start_last"], r1["start_first"]) == (0.0, 3.0, 10.0)
    assert (r0["copies_median"], r1["copies_last"]) == (49.0, 59.0)
    assert (r0["end_first"], r0["end_last"]) == (101.0, 104.0)
    assert r0["flag_wait_mean"] == 1.5 and r0["starved_max"] == 4.0
    assert (r0["tiles_min"], r0["tiles_max"], r0["blocks"]) == (1, 3, 27)
    assert [s["source"] for s in r0["sources"]] == [0, 1]
    assert [s["source"] for s in r1["sources"]] == [1, 0]
    assert r0["sources"][0]["whole_first"] is None            # own keys: never waited for
    assert r0["sources"][1]["reached_first"] == 60.0 and r0["sources"][1]["whole_first"] == 69.0


def test_slots_option_is_checked():
    import mkrt
    for bad in (0, -1, True, 2.5, "2", RA.MAX_SLOTS + 1):
        with pytest.raises(ValueError, match="slots="):
            RA.RingAttention(object(), slots=bad)
    world = mkrt.init(emulate="2x2", gpus=0)
    try:
        assert mkrt.RingAttention(world, slots=2).slots == 2
    finally:
        world.close()
    world = mkrt.init(emulate="5x16", gpus=0)
    try:
        with pytest.raises(ValueError, match="at most 64 ranks"):
            mkrt.RingAttention(world, slots=2)
    finally:
        world.close()
    world = mkrt.init(emulate="1x4", gpus=0)
    try:
        assert mkrt.RingAttention(world, slots=2).slots == 2
        # the copying CTAs work beside the whole launch: a few, not a quarter
        assert mkrt.RingAttention(world, slots=2).split() == (132, 4)
        assert mkrt.RingAttention(world).split() == (132, 33)
        assert mkrt.RingAttention(world, slots=9).slots == 3      # one per peer at most
        assert mkrt.RingAttention(world).slots == 0               # the gathered buffer
    finally:
        world.close()
    with pytest.raises(ValueError, match="slots="):
        RA.RingAttentionSpec("bf16", 128, 128, 2, 1, slots=RA.MAX_SLOTS + 1)


def slot_transfers(nodes, per_node):
    """The steps move_to_slots uses, in Python: for rank (n, l), {(kind, peer or node,
    step at the receiver, source)} as the kernel's arithmetic gives them."""
    G, N = per_node, nodes
    out = {}
    for n in range(N):
        for me in range(G):
            mine, moves = n * G + me, set()
            for p in range(G):
                if p != me:
                    moves.add(("push", n * G + p, (me - p + G) % G, mine))
            for i in range(1, N):
                m = (n + N - i) % N                       # we are node m's source i nodes on
                moves.add(("put", m * G + me, G * i, mine))
                source = ((n + i) % N) * G + me           # put here, our step G i
                for p in range(G):
                    if p != me:
                        moves.add(("forward", n * G + p, G * i + (me - p + G) % G, source))
            out[mine] = moves
    return out


@pytest.mark.parametrize("nodes,per_node", [(1, 2), (1, 4), (2, 1), (2, 2), (3, 1), (2, 3), (3, 2),
                                            (4, 4)])
def test_slot_transfers_deliver_every_source_once_at_the_step_it_is_visited(nodes, per_node):
    """The kernel's transfer arithmetic (mirrored in slot_transfers; its text checked
    below): every rank receives every other source exactly once, at the step its source
    order visits it, each source crossing to each other node once."""
    W = nodes * per_node
    moves = slot_transfers(nodes, per_node)
    received = {}
    for sender, ms in moves.items():
        for kind, receiver, step, source in ms:
            assert (receiver, source) not in received, (kind, receiver, source)
            received[(receiver, source)] = step
            assert RA.source_order(receiver // per_node, receiver % per_node, per_node, nodes)[step] == source
            if kind == "forward":      # forwarded by the rank the source was put to
                assert ("put", sender, step - (sender % per_node - receiver % per_node) % per_node,
                        source) in moves[source]
    assert set(received) == {(r, s) for r in range(W) for s in range(W) if r != s}
    crossings = [(m[3], m[1] // per_node) for ms in moves.values() for m in ms if m[0] == "put"]
    assert len(crossings) == len(set(crossings)) == W * (nodes - 1)


def test_slot_moves_follow_the_checked_schedule():
    """The kernel's text does what slot_transfers and ring_slots_plan.kernel_schedule say:
    other nodes' sources land apart and are forwarded from there, the rest take the visit
    slots in turn (slot_region), a visit slot is free after its last visit, the landing
    region after its visit and forwards, puts wait for credits, a visit resumes from the
    step before; the model has no wait cycle and no region overwritten before its reader."""
    from mkrt.kernels import ring_slots_plan as plan
    from mkrt.kernels.schedule import find_stall, unordered_accesses
    text = dataclasses.replace(RA.spec_for("bf16", 128), slots=2).render()
    for piece in ("if (slot_free(p, (me - p + G) % G, word, seen)) { open_kind = PUSH; open_index = p; }",
                  "const int m = (node + N - i) % N;       // we are node m's source i nodes on",
                  "const u64 want = epoch * W + (u64)G * i;",
                  "if (landing_free(i, word, seen)) { open_kind = CREDIT; open_index = i; }",
                  "const int i = t / G + 1, p = t % G, s = G * i;",
                  "const int w = L.chunk(SLOTS, chunk_at(k, chunks, pairs));",
                  "if (slot_free(p, s + (me - p + G) % G, word, seen)) { open_kind = FORWARD; open_index = t; }",
                  "const int i = index, source = ((node + i) % N) * G + me;",
                  "const int step = s + (me - p + G) % G;             // p's step of the same source",
                  "word = L.ready(step_of_local(index - SLOTS, G, N));",
                  "word = L.ready(G * (i - 1));",
                  "word = L.forwarded_step(G * (i - 1));",
                  "return N > 1 && step >= G && step % G == 0;",
                  "return N > 1 ? index + (index - 1) / (G - 1) : index;",
                  "return put_here(step, G, N) ? SLOTS : (local_index(step, G, N) - 1) % (SLOTS > 0 ? SLOTS : 1);",
                  "const int region = region_of(block.step, G, N);",
                  "source = SLOTS > 0 ? region_of(block.step, G, N) : block.source;",
                  "(u64)SLOTS * nbytes + x0, (unsigned)a.gathered_region,",
                  "(u64)(SLOTS + 1) * nbytes + x0, x1 - x0, (unsigned)a.flags_region,",
                  "epoch * world() + step - 1, ctx, tile.index, PARTIAL_FLAG);",
                  "count_towards(w.partial_flags + 2 * (u64)T + step, 2 * (u64)T, (u64*)w.flags + w.L.ready(step),",
                  "count_towards(forward_counters + s, (u64)comm_ctas * (G - 1), a.flags + L.forwarded_step(s),"):
        assert piece in text, piece
    # slot_region (the kernel's region_of): the visit slots in turn, other nodes' sources apart
    for nodes, G in ((1, 4), (2, 3), (3, 2)):
        W = nodes * G
        for k in (1, 2, 3):
            local = [s for s in range(1, W) if not (nodes > 1 and s % G == 0)]
            assert [RA.slot_region(s, G, nodes, k) for s in local] == [i % k for i in range(len(local))]
            assert all(RA.slot_region(s, G, nodes, k) == k for s in range(G, W, G)) or nodes == 1
    for nodes, G in ((1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (3, 1), (2, 3), (3, 2)):
        for k in (1, 2, 3):
            s = plan.kernel_schedule(nodes, G, slots=k, epochs=2)
            assert find_stall(s.workers, s.depends_on) == []
            problems, _ = unordered_accesses(s.workers, s.depends_on, s.reads, s.writes,
                                             epoch_of=lambda t: t[-1])
            assert problems == []


def test_slot_builds_trace_without_spills_and_the_plain_build_has_no_slot_state():
    spec = dataclasses.replace(RA.spec_for("bf16", 128, True), slots=2, trace=1)
    assert spec.build(check_spills=True).resources["ring_attention"].spills == 0
    plain = RA.spec_for("bf16", 128).render()
    assert "template <bool ON> struct RingSlots {" in plain
    assert "const RingWork work{{}, RingSlots<(SLOTS > 0)>::make(a)," in plain
    assert "constexpr int SLOTS = 0;" in plain
