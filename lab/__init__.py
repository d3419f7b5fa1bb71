"""The kernel lab: lab builds of the fused kernel, their Python twins and tools (not part of the package)."""
