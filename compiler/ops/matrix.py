"""The op x backend matrix that `llmc ops` prints and the coverage test reads.

Each cell is what the op's record says the backend does: lowered (where), declined (why), or
missing: the record is silent, which no op may be (a backend must lower an op or say why not).
Leaves (graph inputs and weights) are not ops a backend runs and are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from .record import BACKENDS, Declined, Lowered
from .registry import OPS


@dataclass(frozen=True)
class Cell:
    op: str
    backend: str
    status: str            # "lowered", "declined" or "missing"
    detail: str            # where it is lowered, or why it is declined

    def __str__(self) -> str:
        return self.status if not self.detail else f"{self.status}: {self.detail}"


def cell(op: str, backend: str) -> Cell:
    answer = OPS[op].lowering(backend)
    if isinstance(answer, Lowered):
        return Cell(op, backend, "lowered", answer.where)
    if isinstance(answer, Declined):
        return Cell(op, backend, "declined", answer.reason)
    return Cell(op, backend, "missing", "")


def op_matrix() -> list[list[Cell]]:
    """One row per op (leaves left out), one cell per backend, in BACKENDS order."""
    return [[cell(op, b) for b in BACKENDS] for op, r in OPS.items() if r.kind != "leaf"]


def missing_cells() -> list[Cell]:
    return [c for row in op_matrix() for c in row if c.status == "missing"]


def format_matrix(verbose: bool = False) -> str:
    """The matrix as text: a compact table (L lowered, D declined, ! missing) and, with `verbose`,
    every cell's detail below it."""
    width = max(len(op) for op in OPS) + 2
    lines = ["op".ljust(width) + "kind".ljust(15) + " ".join(b.ljust(9) for b in BACKENDS)]
    marks = {"lowered": "L", "declined": "D", "missing": "! missing"}
    for row in op_matrix():
        kind = OPS[row[0].op].kind
        lines.append(row[0].op.ljust(width) + kind.ljust(15) + " ".join(marks[c.status].ljust(9) for c in row))
    lines.append("L lowered, D declined (with a reason); every op's profile kind is its kind")
    if verbose:
        for row in op_matrix():
            lines += ["", f"{row[0].op}: {OPS[row[0].op].doc}"] + [f"  {c.backend:<10} {c}" for c in row]
    return "\n".join(lines)
