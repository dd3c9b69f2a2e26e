"""Value liveness over a run of launches: after which launch each value is dead.

Both of the torch backend's ways of running a graph ask it: a SlotProgram (slot_program.py) drops
a slot's tensor after the launch it dies at, and a step plan's lowering (step_plan.py) hands that
value's register to a later temporary.

Contract: `dying_after(launches, keep)` takes launches in run order, each as (reads, writes) of
hashable values, and returns, per launch, the values that die there: those it reads or writes
whose last reader it is (a value nobody reads dies at its writer), `keep` aside, each once, in
the order the launch names them (reads, then writes). It does not look at what the values are.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from typing import TypeVar

V = TypeVar("V", bound=Hashable)


def dying_after(launches: Sequence[tuple[Sequence[V], Sequence[V]]],
                keep: Collection[V] = ()) -> list[tuple[V, ...]]:
    """Per launch, the values it is the last to touch (see the module's contract)."""
    last: dict[V, int] = {}
    for i, (reads, writes) in enumerate(launches):
        for v in (*writes, *reads):
            last[v] = i
    return [tuple(v for v in dict.fromkeys((*reads, *writes)) if last[v] == i and v not in keep)
            for i, (reads, writes) in enumerate(launches)]
