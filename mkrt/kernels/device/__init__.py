"""Shared CUDA device code, one string module per topic, included by name.

Importing this package registers every piece with mkrt.jit.render, so a template's
``requires=("sync",)`` finds it.
"""

from mkrt.kernels.device import base, copy, sync  # noqa: F401
from mkrt.kernels.device import queue  # noqa: F401,E402  (command queue, mkrt/proxy)
from mkrt.kernels.device import gather  # noqa: F401,E402  (all-gather steps)
from mkrt.kernels.device import gemm_tile, partial_sums, tma, wgmma  # noqa: F401,E402  (GEMM engine)
from mkrt.kernels.device import grouped_tiles  # noqa: F401,E402  (grouped GEMM work lists)
from mkrt.kernels.device import tile_queue  # noqa: F401,E402  (tiles claimed at run time)
from mkrt.kernels.device import attention_tile  # noqa: F401,E402  (attention engine)
from mkrt.kernels.device import roles  # noqa: F401,E402  (task queues and the controller)
