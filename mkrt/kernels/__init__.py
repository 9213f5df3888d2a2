"""Fused kernels, one module each: template, spec, launcher/op, reference, cases."""
