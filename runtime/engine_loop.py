"""EngineLoop: the one owner of an Engine, stepping it in its own thread (DESIGN decision 11).

Callers in any thread talk to the loop, never to the engine:
  submit(prompt, params, sink) -> id   validates and tokenizes in the caller's thread (a bad
                                       request raises RequestError there, nothing is queued),
                                       then posts an `add` command to the loop's inbox
  abort(id)                            posts an `abort` command; the request ends at the next step
  stream / generate                    blocking front ends built on submit, one queue per request
  begin_shutdown(grace) / shutdown      stop accepting, let running requests finish within `grace`
                                       seconds, abort the rest (shutdown also joins the thread)
The loop thread drains the inbox, runs one engine step, and hands each output to its own
request's sink, so no consumer can see, or lose, another request's tokens. With async scheduling
(engine.async_scheduling; step_pipeline.py) a turn plans step N+1 while step N computes in a
worker thread, finishes N, launches N+1, and delivers N's outputs while N+1 computes; commands are
taken at the start of a turn, never while the engine is between stages. A step that fails
fails only the requests computed in it (the engine reports them finished with an error); an
unexpected error outside a step's computation fails every request in flight, and the loop goes
on serving new ones. Back-pressure: with `max_waiting`, a submit that would leave more than that
many requests waiting to be scheduled raises QueueFull. `start` ends the starting thread's idle
OpenMP workers (step_pipeline.release_idle_threads): with two threads' pools alive the loop
thread's team sleeps at the step's barriers instead of spinning.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from .request import Completion, PreparedRequest, RequestOutput
from .sampling_params import RequestError, SamplingParams
from .step_pipeline import release_idle_threads

if TYPE_CHECKING:
    from .engine import Engine, EngineStats
    from .step_pipeline import LaunchedStep

Sink = Callable[[RequestOutput], None]
log = logging.getLogger("llmc")


class QueueFull(RequestError):
    """More requests are waiting than the loop accepts; the caller should retry later."""


class LoopStopped(RequestError):
    """The loop is shutting down (or its thread has ended) and takes no new requests."""


@dataclass(frozen=True)
class _Add:
    request_id: int
    request: PreparedRequest
    priority: int
    sink: Sink


@dataclass(frozen=True)
class _Abort:
    request_id: int


@dataclass(frozen=True)
class _Stop:
    deadline: float      # time.monotonic() after which unfinished requests are aborted


class EngineLoop:
    def __init__(self, engine: "Engine", max_waiting: int | None = None,
                 on_finished: Callable[[RequestOutput], None] | None = None):
        if max_waiting is not None and max_waiting < 1:
            raise RequestError(f"max_waiting={max_waiting} must be at least 1")
        self.engine = engine
        self.max_waiting = max_waiting
        self.on_finished = on_finished            # called in the loop thread for every finished request
        self._inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()             # guards _queued_adds, _accepting and id reservation
        self._queued_adds = 0                     # add commands posted but not yet taken by the loop
        self._accepting = False
        self._sinks: dict[int, Sink] = {}         # loop thread only
        self._stats = engine.stats()
        self._thread = threading.Thread(target=self._run, name="llmc-engine-loop", daemon=True)

    # ------------------------------------------------------------- any thread

    def start(self) -> "EngineLoop":
        if self.engine.has_unfinished():
            raise RuntimeError("the engine already has requests added directly; finish them before a loop owns it")
        self._accepting = True
        release_idle_threads(self.engine.runner.device)     # the loop thread's team: the process's only one
        self._thread.start()
        return self

    def __enter__(self) -> "EngineLoop":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown(grace=0.0)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._accepting

    def stats(self) -> "EngineStats":
        """The engine's counters as of the loop's last step (a snapshot; never blocks)."""
        return self._stats

    def num_waiting(self) -> int:
        return self._stats.waiting + self._queued_adds

    def submit(self, prompt: list[int] | str, params: SamplingParams, sink: Sink, priority: int = 0) -> int:
        """Queue one request; its outputs go to `sink` (called in the loop thread). Returns its id."""
        return self.submit_many([(prompt, params)], [sink], priority)[0]

    def submit_many(self, requests: list[tuple[list[int] | str, SamplingParams]], sinks: list[Sink],
                    priority: int = 0) -> list[int]:
        """Queue several requests all or none (an OpenAI `n` or a list of prompts)."""
        prepared = [self.engine.prepare(prompt, params) for prompt, params in requests]
        return self._submit_prepared(prepared, sinks, priority)

    def _submit_prepared(self, prepared: list[PreparedRequest], sinks: list[Sink], priority: int) -> list[int]:
        with self._lock:
            if not self._accepting or not self._thread.is_alive():
                raise LoopStopped("the server is shutting down and takes no new requests")
            self._check_room(len(prepared))
            ids = [self.engine.next_request_id() for _ in prepared]
            self._queued_adds += len(prepared)
        for rid, request, sink in zip(ids, prepared, sinks):
            self._inbox.put(_Add(rid, request, priority, sink))
        return ids

    def _check_room(self, count: int) -> None:
        if self.max_waiting is None:
            return
        if count > self.max_waiting:
            raise RequestError(f"this request asks for {count} sequences but at most {self.max_waiting} may wait "
                               "(--max-waiting); lower n or send fewer prompts")
        if self.num_waiting() + count > self.max_waiting:
            raise QueueFull(f"{self.num_waiting()} requests are already waiting (limit {self.max_waiting}); "
                            "retry after a moment")

    def abort(self, request_id: int) -> None:
        """End a request at the next step and free its KV blocks (a no-op once it has finished)."""
        self._inbox.put(_Abort(request_id))

    def begin_shutdown(self, grace: float = 0.0) -> None:
        """Take no new requests; running ones get `grace` seconds to finish, then are aborted."""
        with self._lock:
            self._accepting = False
        if self._thread.is_alive():
            self._inbox.put(_Stop(time.monotonic() + grace))

    def shutdown(self, grace: float = 0.0) -> None:
        """begin_shutdown(grace), then wait for the loop thread to end."""
        self.begin_shutdown(grace)
        if self._thread.is_alive():
            self._thread.join()

    # ------------------------------------------------------ blocking front ends

    def stream(self, prompt: list[int] | str, params: SamplingParams) -> Iterator[RequestOutput]:
        """Yield one request's outputs as they come; closing the iterator early aborts it."""
        outputs: queue.Queue[RequestOutput] = queue.Queue()
        rid = self.submit(prompt, params, outputs.put)
        finished = False
        try:
            while not finished:
                out = outputs.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(rid)

    def generate(self, prompts: list[list[int]] | list[str],
                 params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """Run a batch to completion; return each prompt's completion, in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        prepared = [self.engine.prepare(p, sp) for p, sp in zip(prompts, plist)]
        queues: list[queue.Queue[RequestOutput]] = [queue.Queue() for _ in prompts]
        ids = self._submit_prepared(prepared, [q.put for q in queues], priority=0)
        return [self._collect(rid, r.prompt_ids, q) for rid, r, q in zip(ids, prepared, queues)]

    def _collect(self, request_id: int, prompt_ids: list[int], outputs: "queue.Queue[RequestOutput]") -> Completion:
        done = Completion(request_id, prompt_ids, [], "", None, None, None)
        while True:
            out = outputs.get()
            done.token_ids += out.new_token_ids
            done.text += out.new_text
            if out.finished:
                done.finish_reason, done.stop_reason, done.metrics = out.finish_reason, out.stop_reason, out.metrics
                done.error = out.error
                return done

    # -------------------------------------------------------------- loop thread

    def _run(self) -> None:
        overlap = self.engine.async_scheduling
        worker = ThreadPoolExecutor(1, thread_name_prefix="llmc-step") if overlap else None
        deadline, inflight = None, None
        try:
            while True:
                idle = inflight is None and not self.engine.has_unfinished() and deadline is None
                deadline = self._take_commands(block=idle, deadline=deadline)
                if deadline is not None and (not self.engine.has_unfinished() or time.monotonic() >= deadline):
                    self._settle(inflight)
                    self._abort_all()
                    self._take_commands(block=False, deadline=deadline)   # adds that raced the stop
                    self._abort_all()
                    self._stats = self.engine.stats()
                    return
                inflight = self._overlapped_step(inflight, worker) if overlap else self._step()
        finally:
            if worker is not None:
                worker.shutdown(wait=True)

    def _take_commands(self, block: bool, deadline: float | None) -> float | None:
        """Apply every command in the inbox (waiting for one when idle); return the stop deadline."""
        taken, adds = 0, 0
        while True:
            try:
                command = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                break
            block, taken = False, taken + 1
            if isinstance(command, _Add):
                self._add(command, refuse=deadline is not None)
                adds += 1
            elif isinstance(command, _Abort):
                self._deliver_all([out] if (out := self.engine.abort(command.request_id)) else [])
            else:
                deadline = command.deadline if deadline is None else min(deadline, command.deadline)
        if taken:   # added requests count as waiting in the new stats before they leave _queued_adds
            with self._lock:
                self._stats = self.engine.stats()
                self._queued_adds -= adds
        return deadline

    def _add(self, command: _Add, refuse: bool) -> None:
        self._sinks[command.request_id] = command.sink
        try:
            if refuse:
                raise LoopStopped("the server shut down before this request started")
            request = command.request
            self.engine.add_request(request.prompt_ids, request.params, command.priority,
                                    request_id=command.request_id, grammar=request.grammar)
        except RequestError as exc:      # checked at submit; only a shutdown gets here
            self._deliver(RequestOutput.failed(command.request_id, str(exc)))
        except Exception as exc:         # a bug: this request fails, the loop goes on
            log.exception("the engine could not take request %d", command.request_id)
            self._deliver(RequestOutput.failed(command.request_id, f"the engine could not take this request: "
                                                                   f"{type(exc).__name__}: {exc}"))

    def _step(self) -> None:
        """One step, start to end, then its outputs delivered (no overlap)."""
        try:
            outputs = self.engine.step()
        except Exception as exc:   # a bug outside a step's computation: fail what is in flight, go on
            log.exception("the engine loop failed outside a model step; failing every request in flight")
            outputs = self.engine.fail_all(f"the engine failed: {type(exc).__name__}: {exc}")
        self._deliver_all(outputs)
        self._stats = self.engine.stats()

    def _overlapped_step(self, inflight: "LaunchedStep | None", worker: ThreadPoolExecutor) -> "LaunchedStep | None":
        """One turn of async scheduling: plan step N+1 while step N (`inflight`) computes, finish N
        (its tokens recorded before N+1 reads them), launch N+1, then detokenise and deliver N's
        outputs while N+1 computes. Returns the step now in flight."""
        try:
            planned = self.engine.plan_step()
            committed = self.engine.finish_step(inflight) if inflight is not None else []
            inflight = None
            launched = self.engine.launch(planned, worker) if planned is not None else None
            self._deliver_all(self.engine.emit(committed))
        except Exception as exc:   # a bug outside a step's computation: fail what is in flight, go on
            log.exception("the engine loop failed outside a model step; failing every request in flight")
            self._settle(inflight)
            self._deliver_all(self.engine.fail_all(f"the engine failed: {type(exc).__name__}: {exc}"))
            launched = None
        self._stats = self.engine.stats()
        return launched

    def _settle(self, inflight: "LaunchedStep | None") -> None:
        """Finish the step in flight, if any, and deliver its outputs."""
        if inflight is not None:
            self._deliver_all(self.engine.emit(self.engine.finish_step(inflight)))

    def _abort_all(self) -> None:
        self._deliver_all([out for rid in list(self._sinks) if (out := self.engine.abort(rid))])
        for rid in list(self._sinks):   # requests the engine never took (refused at add)
            self._deliver(RequestOutput.failed(rid, "the server shut down before this request finished"))

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        with self.engine.host_times.timed("output"):
            for out in outputs:
                self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        sink = self._sinks.pop(out.request_id) if out.finished else self._sinks.get(out.request_id)
        if sink is None:
            return
        try:
            sink(out)
        except Exception:      # a consumer that went away must not stop the loop
            log.warning("dropped an output of request %d: its consumer is gone", out.request_id)
        if out.finished and self.on_finished is not None:
            self.on_finished(out)
