"""GPU-issued commands carried by a host proxy to a transport (mkrt/DESIGN.md, "Command queue
and host proxy").

Device side: ``mkrt/kernels/device/queue.py`` (``mkrt::post_put`` and friends).
Host side: :class:`QueueSet` (rings + headers), a region table (:func:`new_region_table`,
:func:`set_region`), :class:`Proxy` (compiled polling threads) and a transport
(:class:`HostTransport`, :func:`copy_engine_transport`, ``transports.verbs``).

Exports load lazily: kernels that include the queue's device code import
``mkrt.proxy.queue`` (numpy only) without paying for Numba.
"""

import importlib

_EXPORTS = {
    "Proxy": "mkrt.proxy.proxy", "ProxyError": "mkrt.proxy.proxy", "STAT_NAMES": "mkrt.proxy.proxy",
    "COMMAND_DTYPE": "mkrt.proxy.queue", "NO_REGION": "mkrt.proxy.queue",
    "OP_BARRIER": "mkrt.proxy.queue", "OP_FENCE": "mkrt.proxy.queue", "OP_NOP": "mkrt.proxy.queue",
    "OP_PUT": "mkrt.proxy.queue", "OP_PUT_SIGNAL": "mkrt.proxy.queue",
    "OP_SIGNAL": "mkrt.proxy.queue", "REGION_DEVICE": "mkrt.proxy.queue",
    "REGION_HOST": "mkrt.proxy.queue", "QueueSet": "mkrt.proxy.queue",
    "new_region_table": "mkrt.proxy.queue", "set_region": "mkrt.proxy.queue",
    "Transport": "mkrt.proxy.transports.base",
    "TransportUnavailable": "mkrt.proxy.transports.base",
    "HostTransport": "mkrt.proxy.transports.host",
    "CopyEngineTransport": "mkrt.proxy.transports.ce",
    "VerbsTransport": "mkrt.proxy.transports.verbs",
    "VerbsProxy": "mkrt.proxy.verbs_proxy",
}
__all__ = sorted(_EXPORTS) + ["copy_engine_transport"]


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mkrt.proxy' has no attribute {name!r}")


def copy_engine_transport(*args, **kwargs):
    """The `ce` transport (needs libcuda)."""
    from mkrt.proxy.transports.ce import CopyEngineTransport
    return CopyEngineTransport(*args, **kwargs)
