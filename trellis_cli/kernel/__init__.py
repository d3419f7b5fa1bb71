"""The bundled fused MoE kernel: nvcc build and cache, ctypes ABI, launch plan, checked launch."""
