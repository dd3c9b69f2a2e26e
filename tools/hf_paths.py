"""The ways a user would run transformers, from which the benchmarks' peer takes its best path.

A fair peer is not one default call: a user tries the batch size, the attention implementation
(sdpa or eager), transformers' static KV cache, torch.compile over it and, for a float32 model,
bf16 autocast, and keeps the fastest. `HfPath` is one such choice; `tune` tries them as a user
would on the same work and keeps every result, so a report shows what was tried and what won.
Every path times the same boundaries as llmc's side: `TokenClock` stamps each token as
`generate` hands it out (its streamer), so time per output token runs from the first token out
to the last, with transformers' own greedy pick inside it.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Iterable

import torch


@dataclass(frozen=True)
class HfPath:
    """One way to call transformers' `generate`."""
    batch_size: int = 64
    attn: str = "sdpa"            # attn_implementation: "sdpa" or "eager"
    cache: str = "dynamic"        # transformers' cache_implementation: "dynamic" or "static"
    autocast: bool = False        # bf16 autocast around a float32 model
    compile: bool = False         # torch.compile the forward (static cache only, as transformers requires)

    def __post_init__(self):
        if self.attn not in ("sdpa", "eager") or self.cache not in ("dynamic", "static"):
            raise ValueError(f"unknown transformers path {self}")
        if self.compile and self.cache != "static":
            raise ValueError("transformers compiles the forward only over its static cache")

    @property
    def label(self) -> str:
        parts = [f"batch {self.batch_size}", self.attn, f"{self.cache} cache"]
        return ", ".join(parts + ["bf16 autocast"] * self.autocast + ["torch.compile"] * self.compile)

    def generate(self, model, ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """model.generate(ids, **kwargs) the way this path runs it."""
        from transformers import CompileConfig

        if self.cache == "static":
            kwargs["cache_implementation"] = "static"
        if self.compile:
            config = CompileConfig(fullgraph=False, dynamic=False, mode="default")
            config._compile_all_devices = True       # transformers' own switch to compile on a CPU
            kwargs["compile_config"] = config
        else:
            kwargs["disable_compile"] = True
        with self._running(model):
            return model.generate(ids, **kwargs)

    def forward(self, model, ids: torch.Tensor, **kwargs):
        """One forward pass, model(ids, **kwargs), with this path's attention and autocast."""
        with self._running(model):
            return model(ids, **kwargs)

    @contextmanager
    def _running(self, model):
        model.set_attn_implementation(self.attn)
        with torch.inference_mode(), torch.autocast(model.device.type, torch.bfloat16, enabled=self.autocast):
            yield


class TokenClock:
    """A `generate` streamer that stamps each batch of new tokens as it comes out."""

    def __init__(self):
        self.stamps: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if self._prompt_seen:          # generate's first put is the prompt itself
            self.stamps.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass

    def seconds_per_token(self) -> float:
        """First token out to last token out, over the tokens between them."""
        if len(self.stamps) < 2:
            raise ValueError("time per output token needs at least two output tokens")
        return (self.stamps[-1] - self.stamps[0]) / (len(self.stamps) - 1)


def variations(path: HfPath, dtype: torch.dtype, compile: bool) -> list[HfPath]:
    """What a user tries once the batch size is chosen: eager attention, the static cache (and
    torch.compile over it, if asked) and, for a float32 model, bf16 autocast; one change each."""
    out = [replace(path, attn="eager"), replace(path, cache="static")]
    if compile:
        out.append(replace(path, cache="static", compile=True))
    if dtype == torch.float32:
        out.append(replace(path, autocast=True))
    return out


def tune(dtype: torch.dtype, batch_sizes: Iterable[int], seconds_of: Callable[[HfPath], float],
         compile: bool = False) -> tuple[HfPath, list[dict]]:
    """transformers' best path for `seconds_of` (the seconds of the same work on every path), found
    as a user would: the batch size first, then each variation of the fastest one, then the
    variations that helped, together. Returns the best path and every try (seconds or error)."""
    tries: list[dict] = []
    best = _fastest([HfPath(batch_size=b) for b in batch_sizes], seconds_of, tries)
    helped = [v for v in variations(best, dtype, compile) if _fastest([best, v], seconds_of, tries) == v]
    if len(helped) > 1:
        together = replace(best, **{f: getattr(v, f) for v in helped for f in ("attn", "cache", "autocast", "compile")
                                    if getattr(v, f) != getattr(best, f)})
        helped.append(together)
    return _fastest([best, *helped], seconds_of, tries), tries


def _fastest(paths: list[HfPath], seconds_of: Callable[[HfPath], float], tries: list[dict]) -> HfPath:
    """The path with the least seconds (each path timed once, its try recorded in `tries`); a path
    that raises is recorded with its error and passed over."""
    timed = {t["path"]: t for t in tries}
    best, best_s = None, float("inf")
    for path in paths:
        if path.label not in timed:
            try:
                timed[path.label] = {"path": path.label, "seconds": seconds_of(path)}
            except Exception as exc:  # a path this CPU or version cannot run: report it, try the others
                timed[path.label] = {"path": path.label, "error": f"{type(exc).__name__}: {exc}"}
            tries.append(timed[path.label])
        seconds = timed[path.label].get("seconds", float("inf"))
        if seconds < best_s:
            best, best_s = path, seconds
    if best is None:
        raise RuntimeError(f"no transformers path ran: {tries}")
    return best
