"""Run by tests/test_proxy.py under `mpiexec -n 2 python -m mpi4py`.

Each rank owns a shared-memory segment (data + flags) and a queue set in shared memory.
Each rank's proxy serves its own queue; its region table maps the peer's segment at this
process's address. A host producer in each rank posts 1000 put+signal commands carrying
data that encodes the source rank into the peer's segment. Each rank then checks what
arrived in its own segment. Prints "rank R ok N".
"""

import os
import sys

import numpy as np
from mpi4py import MPI

from mkrt.proxy import HostTransport, Proxy, QueueSet, REGION_HOST, new_region_table, set_region
from mkrt.proxy import producer as P
from mkrt.proxy.queue import HostMemory, OP_PUT_SIGNAL

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
peer = 1 - rank
N, CHUNK = 1000, 64
DATA = N * CHUNK
tag = f"mkrt_test_{os.getppid()}_{comm.bcast(os.getpid() if rank == 0 else None)}"

mine = HostMemory(DATA + 4096, shared_name=f"{tag}_seg{rank}")
src = np.frombuffer(mine.array, dtype=np.uint8, count=DATA, offset=0)
src[:] = (np.arange(DATA) * (rank + 3)) % 251
comm.Barrier()
theirs = HostMemory(DATA + 4096, shared_name=f"{tag}_seg{peer}", create=False)
# receive area: a second segment so the peer writes into memory we read
inbox = HostMemory(DATA + 4096, shared_name=f"{tag}_in{rank}")
comm.Barrier()
peer_inbox = HostMemory(DATA + 4096, shared_name=f"{tag}_in{peer}", create=False)

regions = new_region_table(2, 2)
set_region(regions, rank, 0, mine.address, DATA, REGION_HOST)
set_region(regions, peer, 0, peer_inbox.address, DATA, REGION_HOST)
set_region(regions, peer, 1, peer_inbox.address + DATA, 4096, REGION_HOST)

qs = QueueSet(1, 16, [rank])
ok = False
with Proxy(qs, regions, HostTransport()) as proxy:
    cmds = P.commands([dict(opcode=OP_PUT_SIGNAL, dst_rank=peer, src_region=0, dst_region=0,
                            src_offset=i * CHUNK, dst_offset=i * CHUNK, nbytes=CHUNK,
                            signal_region=1, signal_offset=0, signal_value=i + 1)
                       for i in range(N)])
    posted = P.post_many(qs.ring, qs.header, np.uint64(qs.slots), 0, cmds, np.int64(2 * 10**9))
    flags = np.frombuffer(inbox.array, dtype=np.uint64, count=512, offset=DATA)
    arrived = P.wait_at_least(flags, 0, np.uint64(N), np.int64(4 * 10**9))
    got = np.frombuffer(inbox.array, dtype=np.uint8, count=DATA)
    expected = (np.arange(DATA) * (peer + 3)) % 251
    ok = posted == N and arrived and bool((got == expected).all())
    comm.Barrier()          # the peer finished reading before anyone closes
qs.close()
print(f"rank {rank} {'ok' if ok else 'FAILED'} {N}", flush=True)
comm.Barrier()
for m in (theirs, peer_inbox):
    m.close()
for m in (mine, inbox):
    m.close(unlink=True)
sys.exit(0 if ok else 1)
