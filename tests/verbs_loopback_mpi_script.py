"""Run by tests/test_proxy_verbs_compiled.py under `mpiexec -n 2 python -m mpi4py`: the
verbs path between two processes over the loopback NIC, CPU only.

Each rank: a shared-memory inbox (data, then flags) that the peer writes into, local source
data, a VerbsTransport on the loopback NIC (its fabric holds two owners: this rank's own
registrations and aliases of the peer's, mapped where this process maps the peer's inbox),
connection data exchanged over MPI, and a CompiledVerbsProxy posting N put+signal commands
to the peer. Each rank checks what arrived in its own inbox. Prints "rank R ok N".
"""

import os

import numpy as np
from mpi4py import MPI

from mkrt.proxy import OP_PUT_SIGNAL, REGION_HOST, QueueSet
from mkrt.proxy import producer as P
from mkrt.proxy.queue import HostMemory
from mkrt.proxy.transports import loopback_nic as L
from mkrt.proxy.transports import verbs as V
from mkrt.proxy.verbs_loop import CompiledVerbsProxy

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
peer = 1 - rank
N, CHUNK = 2000, 64
DATA = N * CHUNK
FLAGS = 4096
tag = f"mkrt_verbs_{os.getppid()}_{comm.bcast(os.getpid() if rank == 0 else None)}"

inbox = HostMemory(DATA + FLAGS, shared_name=f"{tag}_in{rank}")
comm.Barrier()
peer_inbox = HostMemory(DATA + FLAGS, shared_name=f"{tag}_in{peer}", create=False)
source = np.array((np.arange(DATA) * (rank + 3)) % 251, dtype=np.uint8)

fabric = L.LoopbackFabric(owners=2, per_owner=64)
transport = V.VerbsTransport(rank, 2, 3, backend=L.LoopbackBackend(fabric, rank),
                             sq_depth=32, signal_every=8, timeout=10.0)
transport.register_region(0, inbox.address, DATA, kind=REGION_HOST)
transport.register_region(1, inbox.address + DATA, FLAGS, kind=REGION_HOST)
transport.register_region(2, source.ctypes.data, DATA, kind=REGION_HOST)
transport.connect(comm)
# the peer's registrations, reachable here through this process's mapping of its inbox
for region, offset, length in ((0, 0, DATA), (1, DATA, FLAGS)):
    base, rkey = int(transport.regions[peer, region, 0]), int(transport.rkeys[peer, region])
    fabric.alias(rkey, base, peer_inbox.address + offset, length)

qs = QueueSet(1, 64, [rank])
proxy = CompiledVerbsProxy(qs, transport.regions, transport)
cmds = P.commands([dict(opcode=OP_PUT_SIGNAL, dst_rank=peer, src_region=2, dst_region=0,
                        src_offset=i * CHUNK, dst_offset=i * CHUNK, nbytes=CHUNK,
                        signal_region=1, signal_offset=0, signal_value=i + 1) for i in range(N)])
posted = P.post_many(qs.ring, qs.header, np.uint64(qs.slots), 0, cmds, np.int64(2 * 10**9))
flags = np.frombuffer(inbox.array, dtype=np.uint64, count=FLAGS // 8, offset=DATA)
arrived = P.wait_at_least(flags, 0, np.uint64(N), np.int64(4 * 10**9))
got = np.frombuffer(inbox.array, dtype=np.uint8, count=DATA)
expected = (np.arange(DATA) * (peer + 3)) % 251
ok = posted == N and arrived and bool((got == expected).all())
comm.Barrier()                  # the peer finished writing and reading before anyone closes
proxy.close(timeout=10)
qs.close()
transport.close()
print(f"rank {rank} {'ok' if ok else 'FAILED'} {N}", flush=True)
comm.Barrier()
peer_inbox.close()
