"""`llmc bench-serve`: drive a running OpenAI-compatible server with concurrent streaming clients,
then send the same requests one at a time, and print throughput, TTFT and TPOT for both.

The requests are drawn with a fixed seed: prompts of random common words (so any model's
tokenizer takes them), output lengths in a range, EOS ignored so every run does the same work,
greedy. Each request streams from /v1/completions with usage included; TTFT is the time to the
first chunk that carries text, TPOT the time from there to the last chunk over the remaining
tokens. It measures any server that speaks the API (llmc's or another), not a timed test.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import httpx
import typer

from llmc.runtime.sampling_params import RequestError

from .bench import parse_range, percentiles

WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city community name president team minute idea kid body information back parent face others level").split()


@dataclass(frozen=True)
class ServeRequest:
    prompt: str
    max_tokens: int


@dataclass(frozen=True)
class RequestTiming:
    ttft: float
    tpot: float
    completion_tokens: int


def draw_requests(num: int, prompt_words: tuple[int, int], output_len: tuple[int, int],
                  seed: int) -> list[ServeRequest]:
    rng = random.Random(seed)
    return [ServeRequest(" ".join(rng.choice(WORDS) for _ in range(rng.randint(*prompt_words))),
                         rng.randint(*output_len)) for _ in range(num)]


async def _one(client: httpx.AsyncClient, url: str, model: str | None, req: ServeRequest) -> RequestTiming:
    body = {"prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **({"model": model} if model else {})}
    start, first, last, usage = time.perf_counter(), None, None, None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            detail = (await r.aread()).decode(errors="replace")
            raise RequestError(f"the server answered {r.status_code}: {detail[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any(c.get("text") for c in chunk.get("choices", [])):
                first = first or time.perf_counter()
                last = time.perf_counter()
    if usage is None or first is None:
        raise RequestError("the server's stream had no text or no usage; is it OpenAI-compatible?")
    n = usage["completion_tokens"]
    return RequestTiming(first - start, (last - first) / (n - 1) if n > 1 else 0.0, n)


async def run_phase(url: str, model: str | None, api_key: str | None, requests: list[ServeRequest],
                    concurrency: int) -> dict:
    """Send `requests` with at most `concurrency` in flight; throughput and latency percentiles."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 1)

    async def gated(client, req):
        async with gate:
            return await _one(client, url, model, req)

    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter()
        try:
            timings = await asyncio.gather(*(gated(client, r) for r in requests))
        except httpx.TransportError as exc:
            raise RequestError(f"cannot reach the server at {url} ({type(exc).__name__}); "
                               "start it with `llmc serve` or pass its URL") from None
        seconds = time.perf_counter() - start
    tokens = sum(t.completion_tokens for t in timings)
    return {"requests": len(requests), "concurrency": concurrency, "seconds": seconds, "output_tokens": tokens,
            "output_tok_s": tokens / seconds, "ttft_s": percentiles([t.ttft for t in timings]),
            "tpot_s": percentiles([t.tpot for t in timings if t.completion_tokens > 1] or [0.0])}


def wait_until_ready(url: str, seconds: float) -> None:
    """Poll GET /health until the server answers 200 (a server still starting: compiling, loading);
    RequestError when `seconds` pass first."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() >= deadline:
            raise RequestError(f"the server at {url} was not ready within {seconds:g} s (--wait-ready); "
                               "is it running?")
        time.sleep(0.5)


def format_phases(concurrent: dict, sequential: dict) -> str:
    ms = lambda d: f"{1000 * d['p50']:8.0f} {1000 * d['p99']:8.0f}"  # noqa: E731
    rows = [f"{'':<22}{'requests':>9}{'output tok/s':>14}{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>10}{'p99':>9}"
            f"{'seconds':>9}"]
    for name, p in ((f"{concurrent['concurrency']} at once", concurrent), ("one at a time", sequential)):
        rows.append(f"{name:<22}{p['requests']:>9}{p['output_tok_s']:>14.1f}  {ms(p['ttft_s'])}  {ms(p['tpot_s'])}"
                    f"{p['seconds']:>9.1f}")
    rows.append(f"throughput at {concurrent['concurrency']} at once: "
                f"{concurrent['output_tok_s'] / sequential['output_tok_s']:.2f}x one at a time (times in ms)")
    return "\n".join(rows)


def bench_serve_cmd(
    url: str = typer.Argument("http://127.0.0.1:8000", help="the server's base URL (without /v1)"),
    num_requests: int = typer.Option(64, help="requests in the workload"),
    prompt_words: str = typer.Option("24:192", help="prompt length in words: N or a uniform range LO:HI"),
    output_len: str = typer.Option("16:192", help="output tokens: N or a uniform range LO:HI"),
    concurrency: Optional[int] = typer.Option(None, help="most requests in flight (default: all at once)"),
    seed: int = typer.Option(0, help="seed of the workload draw"),
    model: Optional[str] = typer.Option(None, help="model id to ask for (default: the server's own)"),
    api_key: Optional[str] = typer.Option(None, help="API key, if the server wants one"),
    wait_ready: float = typer.Option(0.0, help="seconds to wait for the server's /health first (a server starting)"),
    json_file: Optional[Path] = typer.Option(None, "--json", help="write the results to this JSON file"),
) -> None:
    """Benchmark a running server: N concurrent streaming clients, then every one of the same requests one
    at a time (both rows do the same work, so their ratio compares like with like)."""
    if num_requests < 1 or (concurrency is not None and concurrency < 1):
        raise RequestError("--num-requests and --concurrency must be at least 1")
    requests = draw_requests(num_requests, parse_range(prompt_words, "prompt length"),
                             parse_range(output_len, "output length"), seed)
    url = url.rstrip("/").removesuffix("/v1")
    if wait_ready > 0:
        wait_until_ready(url, wait_ready)
    concurrent = asyncio.run(run_phase(url, model, api_key, requests, concurrency or num_requests))
    alone = asyncio.run(run_phase(url, model, api_key, requests, 1))
    typer.echo(format_phases(concurrent, alone))
    if json_file:
        workload = {"num_requests": num_requests, "prompt_words": prompt_words, "output_len": output_len, "seed": seed}
        json_file.write_text(json.dumps({"workload": workload, "concurrent": concurrent, "one_at_a_time": alone,
                                         "speedup": concurrent["output_tok_s"] / alone["output_tok_s"],
                                         "requests": [asdict(r) for r in requests]}, indent=2))
