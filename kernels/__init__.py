"""llmc.kernels."""
