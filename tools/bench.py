"""`llmc bench`: run a synthetic serving workload through the engine, optionally against
Hugging Face transformers on the same requests, and print throughput and latency percentiles.

The workload is drawn with a fixed seed: prompt and output lengths (fixed or uniform ranges),
random token ids, an optional shared prefix (a common system prompt), and arrivals all at once
or as a Poisson process at a request rate. EOS is ignored, so every run does the same work.
"""

from __future__ import annotations

import functools
import json
import math
import queue
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import typer

from llmc.compiler.artifact import stale_code
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.engine_loop import EngineLoop
from llmc.runtime.host_times import HOST_PHASES
from llmc.runtime.memory_plan import parse_bytes
from llmc.runtime.sampling_params import RequestError, SamplingParams

from .bench_hf import hf_baselines
from .tp_cli import TP_OPTION, TP_TIMEOUT_OPTION, tensor_parallel


@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: list[int]
    max_tokens: int
    arrival: float            # seconds after the start
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None   # the request's sampling seed (a sampled workload's runs draw the same tokens)

    def params(self) -> SamplingParams:
        """The request's sampling parameters; it runs to max_tokens whatever it samples."""
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              seed=self.seed, ignore_eos=True)


@dataclass(frozen=True)
class Workload:
    num_requests: int = 64
    prompt_len: tuple[int, int] = (32, 256)
    output_len: tuple[int, int] = (16, 192)
    shared_prefix: int = 0
    request_rate: float = math.inf
    seed: int = 0
    temperature: float = 0.0    # > 0: every request samples, seeded from the workload's seed and its index
    top_p: float = 1.0

    def requests(self, vocab_size: int) -> list[BenchRequest]:
        rng = random.Random(self.seed)
        prefix = [rng.randrange(3, vocab_size) for _ in range(self.shared_prefix)]
        out, clock = [], 0.0
        for index in range(self.num_requests):
            n = rng.randint(*self.prompt_len)
            prompt = prefix + [rng.randrange(3, vocab_size) for _ in range(n)]
            if math.isfinite(self.request_rate):
                clock += rng.expovariate(self.request_rate)
            seed = self.seed * self.num_requests + index if self.temperature > 0 else None
            out.append(BenchRequest(prompt, rng.randint(*self.output_len), clock, self.temperature, self.top_p, seed))
        return out


def parse_range(text: str, what: str) -> tuple[int, int]:
    """'128' -> (128, 128); '32:256' -> (32, 256)."""
    try:
        lo, _, hi = text.partition(":")
        span = (int(lo), int(hi or lo))
    except ValueError:
        raise RequestError(f"{what} {text!r} is not a length or a range like 32:256") from None
    if not 1 <= span[0] <= span[1]:
        raise RequestError(f"{what} {text!r} must be positive with the low end first")
    return span


def parse_sizes(text: str, option: str, example: str) -> list[int]:
    """'1,64' -> [1, 64]: a comma-separated list of positive sizes (batch sizes, context lengths);
    RequestError naming `option` otherwise (`example` shows a valid one)."""
    try:
        sizes = [int(s) for s in text.split(",")]
    except ValueError:
        raise RequestError(f"{option} {text!r} is not a comma-separated list of sizes like {example}") from None
    if min(sizes) < 1:
        raise RequestError(f"{option} {text!r} must list sizes of at least 1, like {example}")
    return sizes


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]  # noqa: E731
    return {"p50": pick(0.50), "p90": pick(0.90), "p99": pick(0.99)}


def run_llmc(engine: Engine, requests: list[BenchRequest], on_done: Callable[[], None]) -> dict:
    """Serve the workload with continuous batching through an EngineLoop, as the server does (with
    async scheduling when the engine's config says so); arrivals are honoured in real time."""
    finished: queue.Queue = queue.Queue()
    metrics = []
    with EngineLoop(engine) as loop:
        start = time.perf_counter()
        for r in sorted(requests, key=lambda r: r.arrival):
            time.sleep(max(0.0, start + r.arrival - time.perf_counter()))
            loop.submit(r.prompt_ids, r.params(), lambda out: finished.put(out) if out.finished else None)
        for _ in requests:
            metrics.append(finished.get().metrics)
            on_done()
        elapsed = time.perf_counter() - start
    output_tokens = sum(m.output_tokens for m in metrics)
    prompt_tokens = sum(m.prompt_tokens for m in metrics)
    return {
        "seconds": elapsed,
        "output_tokens": output_tokens,
        "output_tok_s": output_tokens / elapsed,
        "total_tok_s": (output_tokens + prompt_tokens) / elapsed,
        "ttft_s": percentiles([m.ttft for m in metrics]),
        "tpot_s": percentiles([m.tpot for m in metrics if m.output_tokens > 1]),
        "prefix_cache_hit_rate": engine.blocks.hit_rate(),
        "preemptions": engine.scheduler.num_preemptions,
        "kernels": engine.kernels,
        "async_scheduling": engine.async_scheduling,
        "ms_per_step": {phase: 1000 * s for phase, s in engine.host_times.per_step().items()},
        **({"speculation": {"source": engine.config.speculative.source, **speculation_summary(spec)}}
           if (spec := engine.stats().speculation) else {}),
    }


def speculation_summary(stats) -> dict:
    """A SpeculationStats as plain numbers: counters, rates, acceptance per draft position, times."""
    spent = stats.draft_seconds + stats.verify_seconds
    return {"max_k": stats.max_k, "drafted": stats.drafted, "accepted": stats.accepted,
            "verified_seqs": stats.verified_seqs,
            "acceptance_rate": stats.acceptance_rate, "mean_accepted_length": stats.mean_accepted_length,
            "accepted_at": list(stats.accepted_at), "drafted_at": list(stats.drafted_at),
            "draft_seconds": stats.draft_seconds, "verify_seconds": stats.verify_seconds,
            "draft_share": stats.draft_seconds / spent if spent > 0 else 0.0}


def format_speculation(spec: dict) -> list[str]:
    """The report's speculation lines: acceptance, mean accepted length, per position, draft vs verify."""
    per_position = "  ".join(f"{i + 1}: {a}/{d}" + (f" ({a / d:.0%})" if d else "")
                             for i, (a, d) in enumerate(zip(spec["accepted_at"], spec["drafted_at"])))
    return [
        f"speculation   {spec.get('source', '')} K <= {spec['max_k']}: acceptance {spec['acceptance_rate']:.0%} "
        f"({spec['accepted']} of {spec['drafted']} drafted "
        f"tokens), mean accepted length {spec['mean_accepted_length']:.2f} tokens per verifying step",
        f"              accepted per position {per_position}",
        f"              draft {spec['draft_seconds']:.2f} s, verify {spec['verify_seconds']:.2f} s "
        f"(draft {spec['draft_share']:.0%} of the two)",
    ]


def format_step_times(run: dict) -> str:
    """The report's line of where a step's time went: the host phases, their sum, the forward pass."""
    ms = run["ms_per_step"]
    phases = ", ".join(f"{p} {ms[p]:.2f}" for p in HOST_PHASES)
    return (f"              ms per step: host {ms['host']:.2f} ({phases}), compute {ms['compute']:.1f}; "
            f"async scheduling {'on' if run['async_scheduling'] else 'off'}")


def _sampling(workload: dict) -> str:
    """How the workload's requests pick tokens, in words."""
    if not workload.get("temperature"):
        return "greedy"
    return f"sampled at temperature {workload['temperature']:g}, top-p {workload.get('top_p', 1.0):g}"


def format_report(result: dict) -> str:
    llmc = result["llmc"]
    ms = lambda d: " / ".join(f"{1000 * d[k]:.0f}" for k in ("p50", "p90", "p99"))  # noqa: E731
    lines = [
        f"llmc          {llmc['output_tok_s']:8.1f} output tok/s  {llmc['total_tok_s']:8.1f} total tok/s  "
        f"({llmc['output_tokens']} output tokens in {llmc['seconds']:.1f} s)",
        f"              TTFT p50/p90/p99 {ms(llmc['ttft_s'])} ms   TPOT p50/p90/p99 {ms(llmc['tpot_s'])} ms",
        f"              prefix-cache hit rate {llmc['prefix_cache_hit_rate']:.0%}, preemptions {llmc['preemptions']}, "
        f"{llmc['kernels']} kernels, {_sampling(result.get('workload', {}))}",
    ]
    lines.append(format_step_times(llmc))
    if "speculation" in llmc:
        lines += format_speculation(llmc["speculation"])
    for name, base in result.get("baselines", {}).items():
        if "error" in base:
            lines.append(f"{name:<13} unavailable: {base['error']}")
            continue
        lines.append(f"{name:<13} {base['output_tok_s']:8.1f} output tok/s  ({base['seconds']:.1f} s)  "
                     f"llmc speedup {llmc['output_tok_s'] / base['output_tok_s']:.2f}x")
        if base.get("tried"):
            lines.append(f"              its best of {len(base['tried'])} paths tried: {base['path']}")
    return "\n".join(lines)


# generate, serve and bench take the same switches (profile the last two): the backend's options,
# put into EngineConfig.backend_options only when given, so each backend keeps its own defaults
KERNELS_OPTION = typer.Option(None, help="CPU kernels of the torch backend: native (built C++), reference (torch refs) "
                              "or auto (default: native where they build)")
ACTIVATIONS_OPTION = typer.Option(None, help="the native kernels' quantized GEMMs: int8 (activations "
                                 "quantized per block of 32, integer dot products), bf16 (int8, but a prompt's "
                                 "GEMMs of 32+ tokens multiply x and the weight dequantized in bf16 on AMX), "
                                 "f32 (int8, but those of 16+ tokens multiply x and the weight dequantized to "
                                 "fp32), float, or auto (default: bf16 where the CPU has AMX-BF16, int8 where it "
                                 "has AVX512-VNNI or AVX2)")
CUDA_GRAPHS_OPTION = typer.Option(None, "--cuda-graphs/--no-cuda-graphs", help="replay decode steps as CUDA graphs "
                                  "(default: on a GPU with the triton backend; the CPU has nothing to capture)")
STEP_PLANS_OPTION = typer.Option(None, "--step-plans/--no-step-plans", help="with the native CPU kernels, run a "
                                 "graph whose ops all have one as one native call per step, not op by op (default)")


ASYNC_SCHEDULING_OPTION = typer.Option(None, "--async-scheduling/--no-async-scheduling", help="plan each step "
                                       "(schedule, inputs) while the one before computes, and detokenise its outputs "
                                       "while the next computes (default: on a GPU, or on a CPU with a core beside "
                                       "torch's threads; speculating engines stay synchronous)")
SPECULATIVE_OPTION = typer.Option(None, "--speculative", help="draft and verify several tokens a step: ngram "
                                  "(prompt lookup), self (the artifact's draft graph: compile --draft-skip N) or "
                                  "draft:ARTIFACT (a smaller model of the same vocabulary)")
NUM_DRAFT_TOKENS_OPTION = typer.Option(4, "--num-draft-tokens", help="most tokens drafted per sequence and step "
                                       "with --speculative (adaptive: fewer, or none, when drafting does not pay)")


def speculative_config(source: str | None, num_draft_tokens: int):
    """EngineConfig.speculative from the command line (None without --speculative)."""
    from llmc.runtime.speculative.speculator import SpeculativeConfig

    return SpeculativeConfig(source, num_draft_tokens) if source is not None else None


def given_backend_options(**options: object) -> dict[str, object]:
    """The backend options given on the command line (None: not given), for EngineConfig.backend_options."""
    return {name: value for name, value in options.items() if value is not None}


def bench_cmd(
    artifact: Path = typer.Argument(..., help="artifact directory from `llmc compile`"),
    num_requests: int = typer.Option(64, help="requests in the workload"),
    prompt_len: str = typer.Option("32:256", help="prompt length: N or a uniform range LO:HI"),
    output_len: str = typer.Option("16:192", help="output length: N or a uniform range LO:HI"),
    shared_prefix: int = typer.Option(0, help="tokens of a prefix every prompt shares (a system prompt)"),
    request_rate: float = typer.Option(math.inf, help="Poisson arrivals per second (default: all at once)"),
    seed: int = typer.Option(0, help="seed of the workload draw (and of each request's sampling)"),
    temperature: float = typer.Option(0.0, help="sampling temperature of every request (0: greedy)"),
    top_p: float = typer.Option(1.0, help="top-p of every request (with --temperature above 0)"),
    kv_memory: str = typer.Option("1GiB", help="KV cache memory for llmc"),
    max_num_seqs: int = typer.Option(64, help="most sequences llmc runs at once"),
    max_batched_tokens: int = typer.Option(2048, help="llmc's token budget per step (prompt chunks + decodes)"),
    kernels: Optional[str] = KERNELS_OPTION,
    activations: Optional[str] = ACTIVATIONS_OPTION,
    backend: str = typer.Option("auto", help="torch, triton (generated kernels: a GPU, or TRITON_INTERPRET=1) or auto"),
    cuda_graphs: Optional[bool] = CUDA_GRAPHS_OPTION,
    step_plans: Optional[bool] = STEP_PLANS_OPTION,
    speculative: Optional[str] = SPECULATIVE_OPTION,
    num_draft_tokens: int = NUM_DRAFT_TOKENS_OPTION,
    async_scheduling: Optional[bool] = ASYNC_SCHEDULING_OPTION,
    baseline: Optional[str] = typer.Option(None, help="'hf': also run Hugging Face transformers; 'sync': also run "
                                           "llmc without async scheduling (a fresh engine, same requests)"),
    hf_model: Optional[str] = typer.Option(None, help="model for the baseline (default: the artifact's source)"),
    json_file: Optional[Path] = typer.Option(None, "--json", help="write the results to this JSON file"),
    tp: int = TP_OPTION,
    tp_timeout: float = TP_TIMEOUT_OPTION,
) -> None:
    """Benchmark the engine on a workload; with --baseline hf, compare against transformers."""
    if baseline == "sync" and tp > 1:
        raise RequestError("--baseline sync builds a second engine, which the ranks of --tp do not serve; drop one")
    if baseline not in (None, "hf", "sync"):
        raise RequestError(f"baseline {baseline!r} is unknown; choose 'hf' or 'sync'")
    if baseline == "hf" and math.isfinite(request_rate):
        raise RequestError("--baseline hf runs static batches and needs all requests at once; drop --request-rate")
    if baseline == "hf" and temperature > 0:
        raise RequestError("--baseline hf decodes greedily; drop --temperature to compare with it")
    SamplingParams(temperature=temperature, top_p=top_p)         # refuses a bad value in one sentence
    workload = Workload(num_requests, parse_range(prompt_len, "prompt length"),
                        parse_range(output_len, "output length"), shared_prefix, request_rate, seed, temperature, top_p)
    options = given_backend_options(kernels=kernels, cuda_graphs=cuda_graphs, step_plans=step_plans,
                                    activations=activations)
    config = EngineConfig(kv_cache_bytes=parse_bytes(kv_memory), max_num_seqs=max_num_seqs,
                          max_batched_tokens=max_batched_tokens, backend=backend, backend_options=options,
                          speculative=speculative_config(speculative, num_draft_tokens),
                          async_scheduling=async_scheduling)
    with tensor_parallel(tp, tp_timeout, artifact) as ranks:
        engine = Engine(artifact, replace(config, ranks=ranks))
        sync = functools.partial(Engine, artifact, replace(config, async_scheduling=False))
        result = _measure(engine, workload, baseline, hf_model, sync)
    hf = result.get("baselines", {}).get("hf_static", {})
    if "output_tok_s" in hf:
        result["speedup"] = result["llmc"]["output_tok_s"] / hf["output_tok_s"]
    typer.echo(format_report(result))
    if json_file:
        json_file.write_text(json.dumps(result, indent=2, default=str))


def _measure(engine: Engine, workload: "Workload", baseline: str | None, hf_model: str | None,
             sync_engine: Callable[[], Engine]) -> dict:
    """The workload's results on `engine` (and the baseline's, if any)."""
    from rich.progress import Progress

    requests = workload.requests(engine.artifact.config.vocab_size)
    if stale := stale_code(engine.artifact.manifest):
        typer.echo(f"note: {stale}", err=True)
    result: dict = {"workload": asdict(workload)}
    with Progress(transient=True) as progress:
        task = progress.add_task("llmc", total=len(requests))
        result["llmc"] = run_llmc(engine, requests, lambda: progress.advance(task))
        if baseline == "hf":
            result["baselines"] = hf_baselines(engine.artifact, hf_model, requests, progress)
        if baseline == "sync":
            task = progress.add_task("llmc, synchronous", total=len(requests))
            result["baselines"] = {"llmc_sync": run_llmc(sync_engine(), requests, lambda: progress.advance(task))}
    return result
