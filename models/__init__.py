"""llmc.models."""
