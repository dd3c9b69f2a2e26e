"""The op registry: every op's record, from the modules that define them (one module per kind of op).

`OPS` is the table every part of llmc reads (the verifier, the passes, every backend's table and
`llmc ops`). `registered(record)` adds an op for the length of a `with` block: how a test defines
a new op in one place and sees it flow through every backend.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from . import attention, collectives, elementwise, gathers, gemm, norms, rope
from .record import OpRecord

OPS: dict[str, OpRecord] = {r.name: r for m in (gathers, gemm, elementwise, norms, rope, attention, collectives)
                            for r in m.RECORDS}


@contextmanager
def registered(record: OpRecord) -> Iterator[OpRecord]:
    """`record` in OPS inside the block (it must be a new op's)."""
    if record.name in OPS:
        raise ValueError(f"op {record.name!r} is already registered")
    OPS[record.name] = record
    try:
        yield record
    finally:
        del OPS[record.name]
