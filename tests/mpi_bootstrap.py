"""Run under mpiexec by tests/test_mpi.py: each rank writes what mkrt.init() built."""

import json
import sys

import mkrt

world = mkrt.init(gpus=int(sys.argv[2]))
(me,) = world.local
table = world.comm.gather({"rank": me.rank, "node": me.node, "local_rank": me.local_rank,
                           "device": me.device, "size": world.size, "nodes": world.nodes,
                           "node_comm_size": world.node_comm.Get_size(),
                           "node_ranks": world.node_ranks(me.node)}, root=0)
if me.rank == 0:
    with open(sys.argv[1], "w") as handle:
        json.dump(table, handle)
