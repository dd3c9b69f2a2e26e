"""llmc.compiler."""
