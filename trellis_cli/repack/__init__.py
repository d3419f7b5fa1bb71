"""The global route/descriptor layout the fused kernel reads, and the repack that writes it."""
