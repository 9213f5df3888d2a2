"""Fused kernels, one module each: template, spec, launcher/op, reference, cases."""

# Every kernel template requires shared CUDA pieces by name: register them.
from mkrt.kernels import device as _device  # noqa: F401
