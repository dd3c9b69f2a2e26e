"""llmc.runtime."""
