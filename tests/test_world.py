"""World construction without a GPU: emulated layouts, node/local-rank/GPU mapping."""

from __future__ import annotations

import pytest

from mkrt.world import emulated_world, parse_layout


@pytest.mark.parametrize("layout,nodes,per_node", [("1x1", 1, 1), ("1x4", 1, 4), ("2x2", 2, 2),
                                                   ("2x4", 2, 4), ("4x8", 4, 8), ("3x1", 3, 1)])
def test_emulated_layouts(layout, nodes, per_node):
    world = emulated_world(layout, gpus=0)
    assert world.size == nodes * per_node and world.nodes == nodes
    assert world.ranks_per_node == per_node and world.layout == layout
    assert [r.rank for r in world.local] == list(range(world.size))
    for r in world.ranks:
        assert r.node == r.rank // per_node and r.local_rank == r.rank % per_node
        assert world.node_ranks(r.node)[r.local_rank] == r.rank
    assert world.same_node(0, per_node - 1)
    if nodes > 1:
        assert not world.same_node(0, per_node)


@pytest.mark.parametrize("layout,gpus,expected", [
    ("2x2", 1, [0, 0, 0, 0]),
    ("2x2", 2, [0, 0, 1, 1]),
    ("1x4", 2, [0, 0, 1, 1]),
    ("2x4", 8, list(range(8))),
    ("1x3", 2, [0, 0, 1]),
])
def test_ranks_are_spread_over_gpus_in_blocks(layout, gpus, expected):
    world = emulated_world(layout, gpus=gpus) if gpus == 1 else _no_peer(layout, gpus)
    assert [r.device for r in world.ranks] == expected
    for device in set(expected):
        on = world.ranks_on_device(device)
        assert [world.device_slot(r.rank) for r in on] == list(range(len(on)))


def _no_peer(layout, gpus):
    # Peer access needs real GPUs; the mapping itself does not.
    import mkrt.world as world_module
    saved = world_module._enable_peer_access
    world_module._enable_peer_access = lambda devices: None
    try:
        return emulated_world(layout, gpus=gpus)
    finally:
        world_module._enable_peer_access = saved


@pytest.mark.parametrize("bad", ["", "2", "2x", "x2", "0x2", "2x0", "2*2", "a x b"])
def test_bad_layouts_are_refused(bad):
    with pytest.raises(ValueError, match="NxG"):
        parse_layout(bad)


def test_world_without_gpu_says_so():
    world = emulated_world("1x2", gpus=0)
    with pytest.raises(RuntimeError, match="no GPU"):
        world.stream(0)


def test_init_uses_environment_layout(monkeypatch):
    import mkrt
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MKRT_EMULATE", "2x3")
    world = mkrt.init(gpus=0)
    assert world.layout == "2x3" and world.emulated and mkrt.current_world() is world
    with pytest.raises(ValueError):
        mkrt.init(emulate="2x2", comm=object())


def test_too_few_hardware_queues_for_the_proxy_are_refused(monkeypatch):
    from mkrt.proxy.world import _check_connections
    world = emulated_world("2x2", gpus=0)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.raises(ValueError, match="CUDA_DEVICE_MAX_CONNECTIONS=1"):
        _check_connections(world, threads_per_gpu=1)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    _check_connections(world, threads_per_gpu=1)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    _check_connections(world, threads_per_gpu=1)


def test_ranks_sharing_a_gpu_split_its_sms(monkeypatch):
    import mkrt.world as world_module
    monkeypatch.setattr(world_module, "device_sm_count", lambda device: 132)
    world = emulated_world("1x4", gpus=1)
    monkeypatch.setattr(world, "_require_device", lambda rank: world.ranks[rank].device)
    assert [world.sm_count(r) for r in range(4)] == [33, 33, 33, 33]
    assert not world.copies_need_sms(0)


def test_nodes_sharing_a_gpu_leave_sms_for_copy_kernels(monkeypatch):
    import mkrt.world as world_module
    monkeypatch.setattr(world_module, "device_sm_count", lambda device: 132)
    world = emulated_world("2x2", gpus=1)
    monkeypatch.setattr(world, "_require_device", lambda rank: world.ranks[rank].device)
    assert all(world.copies_need_sms(r) for r in range(4))
    assert [world.sm_count(r) for r in range(4)] == [(132 - world_module.CE_COPY_SMS) // 4] * 4
