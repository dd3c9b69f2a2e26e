"""llmc.tools."""
