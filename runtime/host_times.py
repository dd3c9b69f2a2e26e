"""HostTimes: where an engine's steps spend their time on the host, phase by phase (cumulative).

  schedule   choosing the step's chunks (Scheduler.schedule, speculative planning and drafting)
  build      the step's inputs: token ids, positions, slots, block tables (input_batch.py)
  compute    the forward pass, wall time from launch to its logits (in the worker that runs it)
  wait       the part of `compute` the engine loop spent blocked on it (less when work overlaps it)
  sample     grammar masks, prompt logprobs, sampling and speculative verification
  commit     recording sampled tokens: stop tokens, max_tokens, grammars, prefix-cache hashes
  output     detokenisation, stop strings and handing each request's output to its consumer

Host time per step is everything but `compute` and `wait`; `llmc profile --serving` prints the
split. A value, not a global: each Engine owns one and the loop thread alone writes it.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Iterator

HOST_PHASES = ("schedule", "build", "sample", "commit", "output")


@dataclass
class HostTimes:
    steps: int = 0
    schedule: float = 0.0
    build: float = 0.0
    compute: float = 0.0
    wait: float = 0.0
    sample: float = 0.0
    commit: float = 0.0
    output: float = 0.0

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the wall time of the `with` body to `phase`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, phase, getattr(self, phase) + time.perf_counter() - start)

    def snapshot(self) -> "HostTimes":
        """A copy (the engine loop takes one every step: dataclasses.replace cost ~30 us of it once
        the forward had evicted the caches, a plain copy of the instance's fields a few)."""
        copy = HostTimes.__new__(HostTimes)
        copy.__dict__.update(self.__dict__)
        return copy

    def since(self, earlier: "HostTimes") -> "HostTimes":
        """The times spent after `earlier` (a snapshot of this one)."""
        return HostTimes(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})

    @property
    def host(self) -> float:
        """Seconds of host work (every phase but compute and wait)."""
        return sum(getattr(self, p) for p in HOST_PHASES)

    def per_step(self) -> dict[str, float]:
        """Each phase's mean seconds per step (and `host`, their sum)."""
        n = max(self.steps, 1)
        return {f.name: getattr(self, f.name) / n for f in fields(self) if f.name != "steps"} | {"host": self.host / n}
