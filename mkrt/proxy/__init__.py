"""GPU-issued commands carried by a host proxy to a transport (DESIGN.md, "Command queue
and host proxy").

Device side: ``mkrt/kernels/device/queue.py`` (``mkrt::post_put`` and friends).
Host side: :class:`QueueSet` (rings + headers), a region table, :class:`Proxy` (compiled
polling threads) and a transport (:class:`HostTransport`, ``CopyEngineTransport``,
``VerbsTransport``).
"""

from mkrt.proxy.proxy import STAT_NAMES, Proxy, ProxyError
from mkrt.proxy.queue import (COMMAND_DTYPE, NO_REGION, OP_BARRIER, OP_FENCE, OP_NOP, OP_PUT,
                              OP_PUT_SIGNAL, OP_SIGNAL, REGION_DEVICE, REGION_HOST, QueueSet,
                              new_region_table, set_region)
from mkrt.proxy.transports.base import Transport, TransportUnavailable
from mkrt.proxy.transports.host import HostTransport


def copy_engine_transport(*args, **kwargs):
    """The `ce` transport (needs libcuda); imported lazily."""
    from mkrt.proxy.transports.ce import CopyEngineTransport
    return CopyEngineTransport(*args, **kwargs)


__all__ = ["COMMAND_DTYPE", "HostTransport", "NO_REGION", "OP_BARRIER", "OP_FENCE", "OP_NOP",
           "OP_PUT", "OP_PUT_SIGNAL", "OP_SIGNAL", "Proxy", "ProxyError", "QueueSet",
           "REGION_DEVICE", "REGION_HOST", "STAT_NAMES", "Transport", "TransportUnavailable",
           "copy_engine_transport", "new_region_table", "set_region"]
