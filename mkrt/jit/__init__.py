"""JIT: CUDA templates in Python strings -> rendered per spec -> NVRTC cubin (cached)."""

from mkrt.jit.compiler import Build, KernelResources, compile_cuda, load_function
from mkrt.jit.render import CudaSource, cuda_source, get_source, render

__all__ = ["Build", "KernelResources", "compile_cuda", "load_function", "CudaSource",
           "cuda_source", "get_source", "render"]
