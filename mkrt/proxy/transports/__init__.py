"""Transports behind the proxy: `host` (CPU), `ce` (copy engine), `verbs` (RDMA)."""

from mkrt.proxy.transports.base import Transport, TransportUnavailable

__all__ = ["Transport", "TransportUnavailable"]
