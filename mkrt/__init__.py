"""mkrt: multi-GPU, multi-node fused kernels (CuPy + Numba + mpi4py + pyverbs).

    import mkrt
    world = mkrt.init(emulate="1x2")        # or mkrt.init() under mpiexec
    out = mkrt.allgather([x0, x1])          # one array per rank this process holds
"""

import logging as _logging
import os as _os

# Persistent kernels wait for each other; CUDA's lazy loading can make a kernel's first
# launch wait for running kernels (a deadlock until the bounded wait fires). Load eagerly
# unless the user chose otherwise (only effective before CUDA initialises).
_os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
# Ranks' streams, proxy copy streams and the caller's stream must not share hardware work
# queues: a proxy's flag write queued behind a kernel that waits for it never runs. 32 is
# the most CUDA allows (default 8); only effective before CUDA initialises.
_os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

from mkrt import envs as _envs
from mkrt.errors import CommTimeout, CompileError, MkrtError, WaitRecord
from mkrt.kernels.allgather import AllGather, allgather
from mkrt.kernels.allgather_gemm import AllGatherGemm, allgather_gemm
from mkrt.kernels.attention import attention
from mkrt.kernels.ring_attention import RingAttention, ring_attention
from mkrt.kernels.gemm import gemm
from mkrt.kernels.grouped_gemm import grouped_gemm
from mkrt.kernels.moe_experts import grouped_mlp
from mkrt.kernels.moe import MoE, moe, moe_combine, moe_dispatch
from mkrt.kernels.gemm_allreduce import GemmAllReduce, gemm_allreduce
from mkrt.kernels.gemm_reducescatter import GemmReduceScatter, gemm_reducescatter
from mkrt.memory import SymmetricBuffer
from mkrt.world import World, current_world, init

__version__ = "0.1.0"

__all__ = ["init", "current_world", "World", "SymmetricBuffer", "AllGather", "allgather", "gemm",
           "AllGatherGemm", "allgather_gemm", "attention", "RingAttention", "ring_attention", "grouped_gemm", "grouped_mlp", "MoE", "moe", "moe_dispatch", "moe_combine",
           "GemmAllReduce", "gemm_allreduce", "GemmReduceScatter", "gemm_reducescatter",
           "CommTimeout", "CompileError", "MkrtError", "WaitRecord"]


def _configure_logging() -> None:
    logger = _logging.getLogger("mkrt")
    if not logger.handlers:
        handler = _logging.StreamHandler()
        handler.setFormatter(_logging.Formatter("[mkrt %(name)s] %(levelname)s %(message)s"))
        logger.addHandler(handler)
    try:
        level = _envs.get("MKRT_LOG_LEVEL")
    except ValueError as error:          # a typo in a log level must not stop the import
        import warnings
        warnings.warn(f"{error}; using WARNING", stacklevel=2)
        level = "WARNING"
    logger.setLevel(level)


_configure_logging()
