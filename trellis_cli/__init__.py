"""trellis: a toolchain for mixed-bitrate EXL3 ("trellis") Mixture-of-Experts checkpoints."""

__version__ = "0.1.0"
