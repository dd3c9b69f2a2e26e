"""`llmc serve`: an OpenAI-compatible HTTP server in front of one EngineLoop (DESIGN decision 7).

The server only translates: a request body becomes SamplingParams and prompt token ids
(openai_protocol.py), is submitted to the engine loop (which owns the engine in its own thread,
so the event loop never blocks on a step; tokenising and rendering chat templates run in worker
threads, so it never blocks on a long prompt either), and the loop's outputs come back through one
asyncio queue per HTTP request, as one JSON body or as server-sent events in OpenAI's chunk
format ending in `data: [DONE]` (openai_responses.py).

  POST /v1/completions, POST /v1/chat/completions   (stream or not; n choices; logprobs)
  GET  /v1/models, GET /health, GET /metrics        (Prometheus text; server_metrics.py)

A client that disconnects has its requests aborted at once and their KV blocks freed. A full
waiting queue answers 429 with Retry-After; bad input answers 400 (401 for a wrong API key, 404
for an unknown model) with OpenAI's error JSON naming the field. On SIGTERM uvicorn stops
accepting, lets running requests finish within the grace period, the rest are aborted, and the
process exits 0.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import socket
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import Engine
from .engine_loop import EngineLoop, LoopStopped, QueueFull
from .openai_protocol import (APIError, ChatCompletionRequest, CompletionRequest, chat_logprobs, chat_max_tokens,
                              chat_messages, choice_params, completion_logprobs, grammar_spec, parse_request,
                              prompt_list, sampling_params)
from .openai_responses import Choice, Reply
from .sampling_params import RequestError, SamplingParams
from .server_metrics import CONTENT_TYPE, ServerMetrics
from .tokenizer import Tokenizer
from .tool_calls import ToolPlan, chat_prompt, plan_tools

log = logging.getLogger("llmc")
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class ServerConfig:
    model_name: str | None = None        # the id clients name; default: the artifact folder's name
    api_key: str | None = None
    max_waiting: int | None = 256        # most requests waiting to be scheduled; beyond it, 429
    grace_period: float = 30.0           # seconds running requests get to finish after SIGTERM

    def __post_init__(self) -> None:
        if self.max_waiting is not None and self.max_waiting < 1:
            raise RequestError(f"max_waiting={self.max_waiting} must be at least 1")
        if self.grace_period < 0:
            raise RequestError(f"grace_period={self.grace_period} must not be negative")
        if self.api_key == "":
            raise RequestError("the API key is empty; give a non-empty --api-key or none")


@dataclass
class _Job:
    """One HTTP generation request: its choices, their engine ids, the queue their outputs reach."""

    loop: EngineLoop
    reply: Reply
    choices: list[Choice]
    prompts_tokens: list[int]
    request_ids: list[int]
    outputs: asyncio.Queue


def create_app(engine: Engine, config: ServerConfig) -> FastAPI:
    """The FastAPI app over a new EngineLoop that owns `engine`; the loop runs while the app does."""
    config = replace(config, model_name=config.model_name or engine.artifact.path.name)
    metrics = ServerMetrics()
    loop = EngineLoop(engine, config.max_waiting, on_finished=metrics.observe_finished)
    metrics.watch_engine(loop.stats)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        loop.start()
        yield
        await asyncio.to_thread(loop.shutdown, 0.0)     # uvicorn already gave running requests the grace

    app = FastAPI(title="llmc", lifespan=lifespan)
    app.state.loop, app.state.metrics, app.state.config = loop, metrics, config
    _add_error_handlers(app, metrics)
    _add_routes(app, loop, metrics, config)
    return app


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        metrics.observe_rejected(exc.status)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        metrics.observe_rejected(exc.status_code)
        return JSONResponse(APIError(str(exc.detail), exc.status_code).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("a request failed inside the server")
        error = APIError(f"the server failed on this request: {type(exc).__name__}: {exc}", 500, type="server_error")
        return JSONResponse(error.body(), status_code=500)


def _check_auth(request: Request, config: ServerConfig) -> None:
    if config.api_key is None:
        return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {config.api_key}".encode()):
        raise APIError("the API key is missing or wrong; send it as 'Authorization: Bearer KEY'", 401,
                       code="invalid_api_key")


def _check_model(name: str | None, config: ServerConfig) -> None:
    if name is not None and name != config.model_name:
        raise APIError(f"the model {name!r} does not exist; this server serves {config.model_name!r}", 404,
                       param="model", code="model_not_found")


def _add_routes(app: FastAPI, loop: EngineLoop, metrics: ServerMetrics, config: ServerConfig) -> None:
    engine = loop.engine
    max_len = engine.max_sequence_tokens

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = loop.is_running
        return JSONResponse({"status": "ok" if ok else "stopping"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        _check_auth(request, config)
        return JSONResponse({"object": "list", "data": [
            {"id": config.model_name, "object": "model", "created": 0, "owned_by": "llmc", "max_model_len": max_len}]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        _check_auth(request, config)
        body = parse_request(CompletionRequest, await request.body())
        _check_model(body.model, config)
        prompts, prefixes = await asyncio.to_thread(_completion_prompts, engine.tokenizer, prompt_list(body),
                                                    body.echo)
        logprobs = completion_logprobs(body)
        params = sampling_params(body, body.max_tokens if body.max_tokens is not None else 16, logprobs,
                                 _request_value(grammar_spec, body), logprobs if body.echo else None)
        reply = Reply(False, config.model_name, engine.tokenizer, body.include_usage)
        job = await _submit(loop, reply, prompts, prefixes, params, body.n)
        return await _respond(request, job, body.stream, first_chunks=body.echo)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        _check_auth(request, config)
        body = parse_request(ChatCompletionRequest, await request.body())
        _check_model(body.model, config)
        tools = _request_value(plan_tools, body.tools, body.tool_choice, engine.tokenizer.files.chat_template)
        grammar = _request_value(grammar_spec, body)
        if tools is not None and tools.grammar() is not None:
            if grammar is not None:
                raise APIError(f"tool_choice {tools.mode!r} and {grammar.param} both constrain the reply; "
                               "send one of them", param="tool_choice")
            grammar = tools.grammar()
        prompt = await asyncio.to_thread(_chat_tokens, engine.tokenizer, chat_messages(body), tools)
        params = sampling_params(body, _chat_max_tokens(body, len(prompt), max_len), chat_logprobs(body), grammar)
        reply = Reply(True, config.model_name, engine.tokenizer, body.include_usage, tools)
        job = await _submit(loop, reply, [prompt], [""], params, body.n)
        return await _respond(request, job, body.stream, first_chunks=True)


def _completion_prompts(tokenizer: Tokenizer, given: list[str | list[int]],
                        echo: bool) -> tuple[list[list[int]], list[str]]:
    """Each prompt's token ids, and the text an echo prepends ("" without echo; a token-id prompt
    decoded). Milliseconds for a long prompt: the route runs it in a worker thread, off the event loop."""
    prompts = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in given]
    if not echo:
        return prompts, [""] * len(prompts)
    return prompts, [tokenizer.decode(ids) if isinstance(p, list) else p for p, ids in zip(given, prompts)]


def _chat_tokens(tokenizer: Tokenizer, messages: list[dict], tools: ToolPlan | None) -> list[int]:
    """The chat's prompt ids (template rendered, then tokenised: run in a worker thread, off the
    event loop); a template that refuses the messages is a 400 naming messages."""
    try:
        return chat_prompt(tokenizer, messages, tools)
    except RequestError as exc:
        raise APIError(str(exc), param="messages") from None


def _chat_max_tokens(body: ChatCompletionRequest, prompt_tokens: int, max_len: int) -> int:
    """The request's max_(completion_)tokens, or else the rest of the context after the prompt
    (a 400 naming messages when the prompt leaves none)."""
    max_tokens = chat_max_tokens(body)
    if max_tokens is not None:
        return max_tokens
    if max_len - prompt_tokens < 1:
        raise APIError(f"the messages take {prompt_tokens} tokens, the whole context of {max_len}; "
                       "shorten them", param="messages")
    return max_len - prompt_tokens


def _request_value(make, *args):
    """make(*args), its RequestError answered as a 400 naming the field."""
    try:
        return make(*args)
    except RequestError as exc:
        raise APIError(str(exc), param=exc.param) from None


async def _submit(loop: EngineLoop, reply: Reply, prompts: list[list[int]], prefixes: list[str],
                  params: SamplingParams, n: int) -> _Job:
    """Queue n choices per prompt with the engine loop; their outputs arrive on the job's queue.
    The requests are prepared (a grammar built: up to a second for a large one) in a worker thread,
    so the event loop goes on serving meanwhile."""
    aio_loop = asyncio.get_running_loop()
    outputs: asyncio.Queue = asyncio.Queue()
    per_choice = choice_params(params, n)
    choices = [Choice(p * n + j, len(ids), prefixes[p]) for p, ids in enumerate(prompts) for j in range(n)]

    def sink(index: int):
        return lambda out: aio_loop.call_soon_threadsafe(outputs.put_nowait, (index, out))

    requests = [(prompts[c.index // n], per_choice[c.index % n]) for c in choices]
    try:
        ids = await asyncio.to_thread(loop.submit_many, requests, [sink(c.index) for c in choices])
    except QueueFull as exc:
        raise APIError(str(exc), 429, type="rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except LoopStopped as exc:
        raise APIError(str(exc), 503, type="server_error") from None
    except RequestError as exc:
        raise APIError(str(exc), param=exc.param) from None
    return _Job(loop, reply, choices, [len(p) for p in prompts], ids, outputs)


async def _abort_on_disconnect(request: Request, loop: EngineLoop, ids: list[int]) -> None:
    """Abort the job's requests as soon as the client goes away (or the response has ended)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for rid in ids:
        loop.abort(rid)


async def _respond(request: Request, job: _Job, stream: bool, first_chunks: bool) -> Response:
    watcher = asyncio.create_task(_abort_on_disconnect(request, job.loop, job.request_ids))
    if stream:
        return StreamingResponse(_events(job, watcher, first_chunks), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        for _ in job.choices:
            while True:
                index, out = await job.outputs.get()
                job.choices[index].add(out)
                if out.finished:
                    break
    finally:
        watcher.cancel()
    if failed := [c for c in job.choices if c.finish_reason == "error"]:
        raise APIError(failed[0].error or "the engine failed on this request", 500, type="server_error")
    return JSONResponse(job.reply.response(job.choices, job.prompts_tokens))


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _events(job: _Job, watcher: asyncio.Task, first_chunks: bool) -> AsyncIterator[str]:
    """The SSE stream of a job: first chunks (chat role / echoed prompt), deltas, usage, [DONE]."""
    reply, remaining = job.reply, len(job.choices)
    try:
        if first_chunks:
            for c in job.choices:
                yield _sse(reply.chunk(c, None, first=True))
        while remaining:
            index, out = await job.outputs.get()
            choice = job.choices[index]
            choice.add(out)
            remaining -= out.finished
            if out.finish_reason == "error":
                yield _sse(APIError(out.error or "the engine failed", 500, type="server_error").body())
                break
            if out.new_text or out.logprobs or out.finished:
                yield _sse(reply.chunk(choice, out, first=False))
        else:
            if reply.include_usage:
                yield _sse(reply.usage_chunk(job.choices, job.prompts_tokens))
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        if remaining:                 # the client went away, or a choice failed: end the others
            for rid in job.request_ids:
                job.loop.abort(rid)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: any free port); RequestError if it cannot be had."""
    if not 0 <= port <= 65535:
        raise RequestError(f"port {port} is out of range; choose one in 0..65535")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except (OSError, UnicodeError) as exc:
        sock.close()
        raise RequestError(f"cannot listen on {host}:{port} ({getattr(exc, 'strerror', None) or exc}); "
                           "pick another --host or --port") from None
    sock.listen(2048)
    return sock


class GracefulServer(uvicorn.Server):
    """uvicorn's server over an llmc app, handing the grace period to the engine loop at shutdown.

    On SIGTERM uvicorn stops accepting and waits for open connections. Before that wait, the
    engine loop is told to stop: running requests get the grace period, then are aborted, so
    every stream still ends with a final chunk and [DONE] rather than being cut by uvicorn (whose
    own timeout is a backstop a little longer than the grace period)."""

    def __init__(self, app: FastAPI):
        self.loop: EngineLoop = app.state.loop
        self.grace_period: float = app.state.config.grace_period
        super().__init__(uvicorn.Config(app, log_level="warning", access_log=False,
                                        timeout_graceful_shutdown=self.grace_period + 10.0))

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop.begin_shutdown(self.grace_period)
        await super().shutdown(sockets)


def run_server(engine: Engine, config: ServerConfig, sock: socket.socket) -> None:
    """Serve until SIGTERM or SIGINT, then shut down gracefully and return (exit code 0)."""
    server = GracefulServer(create_app(engine, config))
    # uvicorn re-raises the signal that stopped it once it has shut down; the graceful shutdown is
    # already done then, so the re-raised signal is absorbed here and the process exits 0.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
