"""AllGather inside a node: every rank pushes its buffer to every peer, then signals.

out[r][s] = x[s] for every pair of ranks r, s of one node (group="node"). One launch per
rank, ``ctas`` CTAs each:

1. *arrive*: the launch has started, so everything earlier on this rank's stream (the
   readers of its previous output) is done. It tells each peer so, and where its output
   lives (emulated worlds: peers write straight into it; under mpiexec into the rank's
   symmetric receive buffer, copied out at the end).
2. *push*: for each peer (itself last), wait for the peer's arrival, copy x into the peer's
   slot with 16-byte stores; the last CTA done with a peer release-stores ``ready``.
3. *wait*: wait until every peer's ``ready`` reaches this epoch (then copy out if staged).

Flags are epochs (launch count), read and advanced on the device: no host sync between
calls, no reset, nothing the host must know per call (graph-capturable).

Flag words per rank (W = ranks in the node):
  [0, W)     arrive[p]   epoch when p's launch began
  [W, 2W)    ready[p]    epoch when p's data for this rank is complete
  [2W, 3W)   target[p]   where p wants this rank's data (p's output; emulated worlds)
  [3W, 4W)   pushed[p]   CTAs of this rank done pushing to p (all launches, local counter)
  4W         finished    CTAs of this rank done (all launches, local counter)
  4W+1       ctas_before CTAs of all previous launches (written by the last CTA)
  4W+2       launches    epoch of the last completed launch
"""

from __future__ import annotations

import dataclasses
import numpy as np

from mkrt.jit import cuda_source
from mkrt.kernels.op import Op, shared_op
from mkrt.jit.spec import KernelSpec
from mkrt.memory import SymmetricBuffer, flags
from mkrt.status import kernel_id

ALLGATHER = cuda_source("allgather", r"""
using namespace mkrt;

extern "C" __global__ void __launch_bounds__($THREADS)
allgather(const unsigned char* input, unsigned char* output, u64 nbytes,
          u64* flags, const u64* peer_flags, const u64* peer_receive,
          int me, int node_size, int muted_rank,
          u64* status, u64* host_flag, int slot, int rank, u64 timeout_ns) {
    const Context ctx{status, host_flag, slot, rank, timeout_ns, $KERNEL_ID};
    const int W = node_size;
    u64* arrive = flags;
    u64* ready = flags + W;
    u64* target = flags + 2 * W;
    u64* pushed = flags + 3 * W;
    u64* finished = flags + 4 * W;
    u64* ctas_before = flags + 4 * W + 1;
    u64* launches = flags + 4 * W + 2;
    const bool staged = peer_receive != nullptr;

    // The previous launch on this stream is complete, so these words are stable.
    __shared__ u64 epoch_shared, base_shared;
    if (threadIdx.x == 0) {
        epoch_shared = ld_acquire_gpu(launches) + 1;
        base_shared = ld_acquire_gpu(ctas_before);
    }
    __syncthreads();
    const u64 epoch = epoch_shared;
    const u64 all_ctas = base_shared + gridDim.x;   // counters reach this when every CTA is done

    // 1. arrive: tell each peer this launch runs and where its data for us goes.
    if (blockIdx.x == 0 && threadIdx.x < W) {
        u64* peer = (u64*)peer_flags[threadIdx.x];
        st_relaxed_sys(peer + 2 * W + me, (u64)output);
        st_release_sys(peer + me, epoch);
    }

    // 2. push: peers in rotated order, this rank last, so the node's links share the load.
    const u64 worker = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 workers = (u64)gridDim.x * blockDim.x;
    for (int step = 1; step <= W; ++step) {
        const int peer = (me + step) % W;
        if (!cta_wait_at_least(arrive + peer, epoch, ctx, ROLE_INTRA, peer, peer)) return;
        unsigned char* base = staged ? (unsigned char*)peer_receive[peer]
                                     : (unsigned char*)ld_relaxed_sys(target + peer);
        copy_span(base + (u64)me * nbytes, input, nbytes, worker, workers);
        __threadfence_system();
        __syncthreads();
        if (threadIdx.x == 0) {
            const u64 done = fetch_add_acq_rel_gpu(pushed + peer, 1) + 1;
            if (done == all_ctas && me != muted_rank) {
                st_release_sys((u64*)peer_flags[peer] + W + me, epoch);
            }
        }
    }

    // 3. wait for every peer's data; staged data is then copied out by all CTAs.
    for (int source = 0; source < W; ++source) {
        if (!staged && source % (int)gridDim.x != (int)blockIdx.x) continue;
        if (!cta_wait_at_least(ready + source, epoch, ctx, ROLE_INTRA, source, W + source)) return;
    }
    if (staged) {
        copy_span(output, (const unsigned char*)peer_receive[me], (u64)W * nbytes, worker, workers);
    }

    // The last CTA out publishes the epoch for the next launch.
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const u64 done = fetch_add_acq_rel_gpu(finished, 1) + 1;
        if (done == all_ctas) {
            st_release_gpu(ctas_before, all_ctas);
            st_release_gpu(launches, epoch);
        }
    }
}
""", requires=("sync", "copy"), register=False)

KERNEL_ID = kernel_id("allgather")


def flag_words(node_size: int) -> int:
    return 4 * node_size + 3


@dataclasses.dataclass(frozen=True)
class AllGatherSpec(KernelSpec):
    family = "allgather"
    entry_points = ("allgather",)
    threads: int = dataclasses.field(default=512, metadata={"short": "t"})

    def template(self):
        return ALLGATHER

    def params(self):
        return {"THREADS": self.threads, "KERNEL_ID": f"{KERNEL_ID}ull"}


def default_specs() -> list[AllGatherSpec]:
    return [AllGatherSpec(threads=512)]


def reference(inputs: list) -> list:
    """What every rank of a node holds afterwards: the stack of the node's inputs."""
    import cupy
    stacked = cupy.stack([cupy.asarray(x) for x in inputs])
    return [stacked.copy() for _ in inputs]


class AllGather(Op):
    """``out = op(x)``: each rank gets ``[node_size, *x.shape]``, slot s holding rank s's x.

    ``ctas``: CTAs per rank (default: as many as the rank's SM share, fewer for small
    inputs). ``muted_rank``: a node-local rank that never signals (tests of the bounded
    waits); leave it None.
    """

    name = "allgather"

    def __init__(self, world=None, *, ctas: int | None = None, threads: int = 512,
                 timeout_ms: float | None = None, muted_rank: int | None = None):
        super().__init__(world, timeout_ms=timeout_ms)
        if ctas is not None and ctas < 1:
            raise ValueError(f"mkrt.allgather: ctas must be >= 1, got {ctas}")
        self.spec = AllGatherSpec(threads=threads)
        self.ctas = ctas
        self.muted_rank = -1 if muted_rank is None else int(muted_rank)
        self.node_size = max(len(self.world.node_ranks(n)) for n in range(self.world.nodes))
        self._flags = flags(self.world, flag_words(self.node_size), name="allgather.flags")
        self._receive: SymmetricBuffer | None = None
        self._receive_tables: dict[int, object] = {}

    def _grid(self, rank: int, nbytes: int) -> int:
        if self.ctas is not None:
            return self.ctas
        # About 256 KiB per CTA: small gathers need few CTAs, large ones the rank's share.
        wanted = -(-nbytes * self.node_size // (256 * 1024))
        return int(max(1, min(self.world.sm_count(rank), wanted)))

    def _staged_receive(self, rank: int, nbytes: int):
        """Under mpiexec: symmetric receive buffers big enough for the node's data."""
        needed = nbytes * self.node_size
        if self._receive is None or self._receive.nbytes < needed:
            if self._receive is not None:
                self._receive.close()
            self._receive = SymmetricBuffer(self.world, max(needed, 1), name="allgather.receive",
                                            zero=False)
            self._receive_tables.clear()
        if rank not in self._receive_tables:
            self._receive_tables[rank] = self._receive.peer_table(rank)
        return self._receive_tables[rank]

    def __call__(self, x, out=None):
        import cupy
        inputs, as_list = self.per_rank(x, "x")
        self.same_everywhere(inputs, "x")
        shape, dtype = inputs[0].shape, inputs[0].dtype
        out_shape = (self.node_size, *shape)
        outputs = []
        if out is not None:
            outputs, _ = self.per_rank(out, "out")
            for i, o in enumerate(outputs):
                if o.shape != out_shape or o.dtype != dtype:
                    raise ValueError(f"mkrt.allgather: out[{i}] is {o.shape} {o.dtype}; "
                                     f"expected {out_shape} {dtype}")
        for info in self.world.local:
            if len(self.world.node_ranks(info.node)) != self.node_size:
                raise ValueError("mkrt.allgather: nodes of different sizes are not supported "
                                 f"(layout {self.world.layout})")
        self.before_launch()
        nbytes = inputs[0].nbytes
        if not outputs:
            for info in self.world.local:
                with cupy.cuda.Device(info.device):
                    outputs.append(cupy.empty(out_shape, dtype))
        if nbytes == 0:
            return outputs if as_list else outputs[0]
        # Load on every device before any launch: loading may wait for running kernels.
        functions = [self.spec.function("allgather", info.device) for info in self.world.local]
        self.join_caller_stream()
        for info, source, target, function in zip(self.world.local, inputs, outputs, functions):
            receive = 0 if self.world.emulated else self._staged_receive(info.rank, nbytes).data.ptr
            stream = self.world.stream(info.rank)
            args = (source, target, np.uint64(nbytes),
                    np.uint64(self._flags.local_ptr(info.rank)),
                    self._flags.peer_table(info.rank), np.uint64(receive),
                    np.int32(info.local_rank), np.int32(self.node_size), np.int32(self.muted_rank),
                    *self.context_args(info.rank))
            with cupy.cuda.Device(info.device):
                function((self._grid(info.rank, nbytes),), (self.spec.threads,), args, stream=stream)
        self.release_to_caller_stream()
        self.after_launch()
        if out is not None:
            return out
        return outputs if as_list else outputs[0]

    def close(self) -> None:
        self._flags.close()
        if self._receive is not None:
            self._receive.close()


def allgather(x, *, world=None, out=None, ctas: int | None = None, timeout_ms: float | None = None):
    """Gather x from every rank of the node; see :class:`AllGather`. Keeps one op per
    (world, ctas, timeout); an op that failed is replaced on the next call."""
    return shared_op(AllGather, world, ctas=ctas, timeout_ms=timeout_ms)(x, out=out)
