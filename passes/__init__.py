"""llmc.passes."""
