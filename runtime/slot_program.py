"""A graph resolved once into a list of launches over numbered value slots.

Both backends run a graph this way: the torch backend launches one torch function per node, the
triton backend one kernel per unit. Resolving the graph once (which slots each launch reads and
writes, and after which launch each value is dead) means a call does no lookups by name and
frees every intermediate right after its last reader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import time

import torch

from llmc.compiler.ir import Graph, Value

from .liveness import dying_after

Launch = Callable[[list[torch.Tensor], dict[str, Any]], "torch.Tensor | tuple[torch.Tensor, ...]"]


class MissingInputError(KeyError):
    """A graph input was not fed."""


@dataclass(frozen=True)
class LaunchSpec:
    """One launch: its function, attributes, the values it reads and the values it returns, and
    (for profiles) a label and the kind of op it computes."""

    fn: Launch
    attrs: dict[str, Any]
    reads: tuple[Value, ...]
    writes: tuple[Value, ...]
    label: str = ""
    kind: str = ""


@dataclass(frozen=True)
class LaunchTime:
    label: str
    kind: str
    seconds: float
    read_bytes: int = 0         # the tensors it took and returned, each counted once; the paged KV
    written_bytes: int = 0      # cache (input `kv_cache`) is left out: what a kernel touches of it
                                # depends on the step's lengths, which a profile adds itself
    waits: tuple[float, ...] = ()   # a step plan's: each thread's seconds at the barrier after it (its
                                    # team's threads that finished their share early wait for the last)
    weights: tuple[str, ...] = ()   # the weights it takes, by their names in the artifact (a GEMM's
                                    # codes, scales and mins): a profile's time by weight


def weight_names(values) -> tuple[str, ...]:
    """The weights among `values`, by their names in the artifact (a weight node is `w.<name>`)."""
    return tuple(dict.fromkeys(v.node[2:] for v in values if v.node.startswith("w.")))


def _nbytes(tensors, skip: set[int]) -> int:
    seen = {(t.data_ptr(), t.nbytes) for t in tensors if isinstance(t, torch.Tensor) and t.data_ptr() not in skip}
    return sum(n for _, n in seen)


@dataclass(frozen=True)
class _Step:
    fn: Launch
    attrs: dict[str, Any]
    label: str
    kind: str
    args: tuple[int, ...]       # slots read
    outs: tuple[int, ...]       # slots written, one per result
    free: tuple[int, ...]       # slots whose last reader is this step (or that nobody reads)
    weights: tuple[str, ...]    # the weights among its reads, by name (LaunchTime.weights)


class SlotProgram:
    """`launches` (in a valid order) of `graph`, bound to its weights; call with input tensors."""

    def __init__(self, graph: Graph, weights: dict[str, torch.Tensor], launches: list[LaunchSpec]):
        self.graph = graph
        values = [n.value() for n in graph.nodes if n.op in ("input", "weight")]
        values += [v for spec in launches for v in spec.writes]
        self._slots = slot = {v: i for i, v in enumerate(dict.fromkeys(values))}
        self._constants = {slot[n.value()]: weights[n.name[2:]] for n in graph.weights()}
        self._input_slots = {n.name: slot[n.value()] for n in graph.inputs()}
        self._outputs = [slot[v] for v in graph.outputs]
        self._steps = self._plan(launches, keep={*graph.outputs, *(n.value() for n in graph.weights())})

    @property
    def constants(self) -> list:
        """What the program holds: its weights, as the launches take them."""
        return list(self._constants.values())

    def _plan(self, launches: list[LaunchSpec], keep: set[Value]) -> list[_Step]:
        slot = self._slots
        dying = dying_after([(spec.reads, spec.writes) for spec in launches], keep)   # liveness.py
        return [_Step(spec.fn, spec.attrs, spec.label, spec.kind, tuple(slot[v] for v in spec.reads),
                      tuple(slot[v] for v in spec.writes), tuple(slot[v] for v in dead), weight_names(spec.reads))
                for spec, dead in zip(launches, dying, strict=True)]

    def _run(self, feeds: dict[str, torch.Tensor], free: bool,
             timings: list[LaunchTime] | None = None, sync: Callable[[], None] = lambda: None) -> list[Any]:
        env: list[Any] = [None] * len(self._slots)
        for s, t in self._constants.items():
            env[s] = t
        for name, s in self._input_slots.items():
            if name not in feeds:
                raise MissingInputError(f"graph {self.graph.name} needs input {name!r}")
            env[s] = feeds[name]
        skip = {feeds["kv_cache"].data_ptr()} if "kv_cache" in feeds else set()
        for step in self._steps:
            start = time.perf_counter() if timings is not None else 0.0
            args = [env[s] for s in step.args]
            result = step.fn(args, step.attrs)
            if timings is not None:
                sync()
                seconds = time.perf_counter() - start
                outs = result if isinstance(result, tuple) else (result,)
                timings.append(LaunchTime(step.label, step.kind, seconds, _nbytes(args, skip), _nbytes(outs, skip),
                                          weights=step.weights))
            if len(step.outs) == 1 and not isinstance(result, tuple):
                env[step.outs[0]] = result
            else:
                for s, t in zip(step.outs, result, strict=True):
                    env[s] = t
            if free:
                for s in step.free:
                    env[s] = None
        return env

    def __call__(self, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        env = self._run(feeds, free=True)
        return [env[s] for s in self._outputs]

    def timed(self, feeds: dict[str, torch.Tensor],
              sync: Callable[[], None] = lambda: None) -> tuple[list[torch.Tensor], list[LaunchTime]]:
        """The outputs, and each launch's wall time (after `sync`, which waits for a device)."""
        timings: list[LaunchTime] = []
        env = self._run(feeds, free=True, timings=timings, sync=sync)
        return [env[s] for s in self._outputs], timings

    def values(self, feeds: dict[str, torch.Tensor]) -> dict[Value, torch.Tensor]:
        """Every value the graph computes (for debugging: nothing is freed)."""
        env = self._run(feeds, free=False)
        return {v: env[s] for v, s in self._slots.items()}
