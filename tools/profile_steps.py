"""`llmc profile ART`: where a step's time goes, against the machine's own floors measured in the
same run.

Floors: the read bandwidth (tools/read_floor.py: a native pass written to read as fast as the
machine allows, over buffers of several sizes; no llmc kernel can beat it) and the matmul peak in
the artifact's dtype (the best of torch.mm, F.linear and the oneDNN-packed linear on a
[512, 2048] x [2048, 2048] product). On a shared machine the read bandwidth moves with the neighbours' load (20-80 GB/s
within minutes on the 2-core EPYC), so the decode runs in rounds of `ROUND_TOKENS` steps with a
bandwidth sample before and after each, and each round is compared with the mean of the two
samples beside it: the fraction printed is the median over the rounds.
Batch-1 decode: one sequence decodes `--decode-tokens` tokens after a short prompt, each token
twice: with every launch timed, which splits a step into GEMM/GEMV, attention and the other
kernels (by the IR op kind of each launch), and untimed, which gives the step time; Python/dispatch
is the rest of that time (its metadata, the runner, the greedy pick; a serving engine's scheduler
and sampler are not in it). The bytes one decode step must read are every
weight it multiplies by (the embedding table only for its one row) plus the sequence's K/V;
bytes / step time, against the bandwidth, is how near the step is to memory speed.
Batch-1 decode as served: one request of the same prompt length streamed as `llmc generate`
streams it (engine.stream: an engine loop's thread runs the scheduler, the steps, the sampler and
the detokenizer), first token out to last token out, and its ratio to the step above (what the
serving path adds: the host work, and a step run from another thread than the one that built the
engine): the figure `--baseline hf` compares with transformers' `generate` timed at the same
boundaries (profile_hf).
Prefill: one prompt of `--prompt-len` tokens; its FLOPs are 2 x rows x every GEMM weight (rows:
every token, or one after the logits gather) plus causal attention's
2 x 2 x heads x head_dim x tokens (tokens + 1) / 2 per layer; FLOP/s against the matmul peak is
how near it is to compute speed.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import typer

from llmc.compiler.artifact import stale_code
from llmc.compiler.ir import Graph
from llmc.kernels.amx import describe_attention_path, describe_gemm_path
from llmc.kernels.argmax import argmax_rows
from llmc.kernels.linear import PackedLinear, packable
from llmc.runtime.artifact import Artifact
from llmc.runtime.engine import Engine, EngineConfig, kv_cache_dtype
from llmc.runtime.host_times import HOST_PHASES
from llmc.runtime.memory_plan import kv_bytes_per_token
from llmc.runtime.sampling_params import RequestError, SamplingParams
from llmc.runtime.scheduler import Chunk
from llmc.runtime.sequence import Sequence
from llmc.runtime.slot_program import weight_names
from llmc.runtime.step_inputs import build_step_inputs

from .bench import ACTIVATIONS_OPTION, KERNELS_OPTION, STEP_PLANS_OPTION, given_backend_options
from .profile_launches import flop_lines, gemm_by_weight, gemm_flops, mean_by_weight, waits_line, weight_lines
from .read_floor import ReadBandwidth

CATEGORIES = {"gemm": "GEMM/GEMV", "attention": "attention"}     # any other op kind: "other kernels"
PROMPT_FOR_DECODE = 16
ROUND_TOKENS = 8            # decode steps between two bandwidth samples
PREFILL_REPEATS = 2         # timed prefills after the warm-up, the fastest kept (as for each of transformers' paths)


@dataclass(frozen=True)
class StepProfile:
    seconds: float                     # mean wall time of one step
    by_category: dict[str, float]      # mean seconds per step: GEMM/GEMV, attention, other kernels, python/dispatch
    rounds: tuple[float, ...] = ()     # decode: the mean step time of each round of ROUND_TOKENS steps
    floors: tuple[float, ...] = ()     # and the read bandwidth beside each round (bytes/s), where it was sampled
    paired: tuple[float, ...] = ()     # and the mean time of the floor's read of a step's bytes after each step
    waits: dict[str, tuple[float, ...]] = field(default_factory=dict)   # a step plan's: each thread's mean
    # seconds a step at the barriers after the instructions of each kind (its share done, the team's not)
    by_weight: dict[str, dict] = field(default_factory=dict)   # mean GEMM time and bytes a step by weight
    # (profile_launches.gemm_by_weight)

    def of_bandwidth(self, step_bytes: int) -> float:
        """Median over the rounds of (bytes per step / step time) / the bandwidth beside the round."""
        return _median([step_bytes / s / floor for s, floor in zip(self.rounds, self.floors)])

    def of_paired_read(self) -> float:
        """Median over the rounds of the floor's read of the step's bytes / the step, each pair timed
        back to back (so the neighbours' load moves both)."""
        return _median([read / s for s, read in zip(self.rounds, self.paired)])


def _median(values: list[float]) -> float:
    """The median (nan for no values: nothing was measured)."""
    values, mid = sorted(values), len(values) // 2
    if not values:
        return float("nan")
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def best_of(fn: Callable[[], None], repeats: int, between: Callable[[], None] | None = None) -> float:
    """The fastest of `repeats` timed calls of fn after an untimed one; `between` (untimed) after each."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if between:
            between()
    return min(times)


def matmul_peak(dtype: torch.dtype, m: int = 512, n: int = 2048, k: int = 2048) -> float:
    """FLOP/s of the fastest large GEMM on this CPU in `dtype`: torch.mm, F.linear, or the
    oneDNN-packed linear that llmc's native kernels use (where it exists)."""
    x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    wt = w.t().contiguous()
    candidates = [lambda: torch.mm(x, wt), lambda: torch.nn.functional.linear(x, w)]
    if packable(w):
        packed = PackedLinear(w)
        candidates.append(lambda: packed(x))
    return max(2 * m * n * k / best_of(fn, 5) for fn in candidates)


def decode_bytes(graph: Graph, artifact: Artifact, context: int) -> int:
    """Bytes one batch-1 decode step must read: the weights its ops take (one embedding row) and the
    K/V of `context` cached tokens."""
    weights, total = artifact.weights, 0
    for node in graph.nodes:
        for name in weight_names(node.inputs):
            w = weights[name]
            row = node.op in ("embedding", "qembedding")            # a gather reads one row of each part
            total += (w[0] if row else w).numel() * w.element_size()
    return total + context * kv_bytes_per_token(artifact.config, kv_cache_dtype(artifact))


def prefill_flops(graph: Graph, artifact: Artifact, tokens: int) -> int:
    """FLOPs of one sequence's prefill: each GEMM over its rows (every token, or after the logits
    gather one row per sequence) plus causal attention."""
    cfg = artifact.config
    attention = cfg.num_layers * 4 * cfg.num_heads * cfg.head_dim * tokens * (tokens + 1) // 2
    return sum(gemm_flops(graph, tokens).values()) + attention


def _profile_step(engine: Engine, entry: str, chunks: list[Chunk], on_token=None,
                  flops: dict[str, int] | None = None) -> StepProfile:
    """One step through the runner with per-launch timing, then a greedy pick for `on_token`; its GEMMs
    by weight count `flops` (gemm_flops) where given."""
    totals = {name: 0.0 for name in (*CATEGORIES.values(), "other kernels", "python/dispatch")}
    start = time.perf_counter()
    logits, launches = engine.runner.run_timed(entry, build_step_inputs(chunks, engine.blocks))
    for c in chunks:
        c.seq.num_computed = c.end
    if on_token:
        on_token(int(argmax_rows(logits[-1:])[0]))
    elapsed = time.perf_counter() - start
    waits: dict[str, list[float]] = {}
    for launch in launches:
        kind = CATEGORIES.get(launch.kind, "other kernels")
        totals[kind] += launch.seconds
        if launch.waits:
            kept = waits.setdefault(kind, [0.0] * len(launch.waits))
            for thread, seconds in enumerate(launch.waits):
                kept[thread] += seconds
    totals["python/dispatch"] = elapsed - sum(launch.seconds for launch in launches)
    return StepProfile(elapsed, totals, waits={kind: tuple(w) for kind, w in waits.items()},
                       by_weight=gemm_by_weight(launches, engine.artifact.weights, flops))


def _plain_step(engine: Engine, chunks: list[Chunk], on_token) -> float:
    """One decode step as a serving engine runs it (its metadata from the engine's persistent input
    batch, no per-launch timing), then a greedy pick; its seconds."""
    start = time.perf_counter()
    out = engine.runner.run_step("decode", engine.input_batch.build(chunks))
    for c in chunks:
        c.seq.num_computed = c.end
    on_token(int(out.greedy_tokens()[-1]))
    return time.perf_counter() - start


def decode_final_context(tokens: int, prompt: int = PROMPT_FOR_DECODE) -> int:
    """The tokens a decode profile of `tokens` tokens ends with: its prompt, the prefill's token, a
    warm-up step's, each token twice."""
    return prompt + 2 + 2 * tokens


def profile_decode(engine: Engine, tokens: int, seed: int = 0, bandwidth: ReadBandwidth | None = None,
                   step_bytes: int = 0, prompt: int = PROMPT_FOR_DECODE) -> tuple[StepProfile, int]:
    """Batch-1 decode of `tokens` tokens after a `prompt`-token prompt; the profile and the mean
    context length read. Each token is decoded twice in a row: once with every launch timed (the
    split by kind) and once as serving runs it (the step time; timing each launch costs ~10% of a
    decode step), and the Python/dispatch share is the plain step's time beyond the kernels'. One
    untimed decode step goes first (a first call's one-time costs, such as a JIT, are no step's).
    With `bandwidth`, a sample of it is taken before and after every round of ROUND_TOKENS tokens,
    and with `step_bytes` too, the floor's fastest strategy reads that many bytes right after each
    plain step."""
    g = torch.Generator().manual_seed(seed)
    seq = Sequence(0, torch.randint(3, engine.artifact.config.vocab_size, (prompt,), generator=g).tolist(),
                   SamplingParams(max_tokens=decode_final_context(tokens, prompt) - prompt))
    engine.blocks.allocate(seq.seq_id, seq.prompt_ids)
    engine.blocks.append(seq.seq_id, decode_final_context(tokens, prompt))
    _profile_step(engine, "prefill", [Chunk(seq, 0, seq.num_tokens)], seq.output_ids.append)
    newest = lambda: [Chunk(seq, seq.num_tokens - 1, seq.num_tokens)]  # noqa: E731
    _plain_step(engine, newest(), seq.output_ids.append)        # warm-up: first-call costs are not a step's
    profiles, samples, reads, waits, by_weight = [], [bandwidth.sample()] if bandwidth else [], [], [], []
    for i in range(tokens):
        timed = _profile_step(engine, "decode", newest(), seq.output_ids.append)
        kernels = {k: v for k, v in timed.by_category.items() if k != "python/dispatch"}
        waits.append(timed.waits)
        by_weight.append(timed.by_weight)
        plain = _plain_step(engine, newest(), seq.output_ids.append)
        if bandwidth and step_bytes:
            reads.append(bandwidth.beside(step_bytes))
        profiles.append(StepProfile(plain, {**kernels, "python/dispatch": plain - sum(kernels.values())}))
        if bandwidth and ((i + 1) % ROUND_TOKENS == 0 or i + 1 == tokens):
            samples.append(bandwidth.sample())
    engine.blocks.free(seq.seq_id)
    mean = StepProfile(sum(p.seconds for p in profiles) / tokens,
                       {k: sum(p.by_category[k] for p in profiles) / tokens for k in profiles[0].by_category},
                       _round_means([p.seconds for p in profiles]),
                       tuple((a + b) / 2 for a, b in zip(samples, samples[1:])),
                       _round_means(reads),
                       {kind: tuple(sum(w[kind][t] for w in waits) / tokens for t in range(len(per_thread)))
                        for kind, per_thread in waits[0].items()}, mean_by_weight(by_weight))
    return mean, decode_mean_context(tokens, prompt)


def _round_means(xs: list[float]) -> tuple[float, ...]:
    """The mean of each round of ROUND_TOKENS values (the last round may be shorter)."""
    return tuple(sum(r) / len(r) for r in (xs[i:i + ROUND_TOKENS] for i in range(0, len(xs), ROUND_TOKENS)))


def decode_mean_context(tokens: int, prompt: int = PROMPT_FOR_DECODE) -> int:
    """The mean context of a decode profile of `tokens` tokens: its prompt and the prefill's token, then
    2 x tokens steps (each token is decoded twice); a step's bytes count this context's K/V."""
    return prompt + 1 + tokens


def profile_prefill(engine: Engine, tokens: int, seed: int = 1) -> StepProfile:
    """A prefill of `tokens` random tokens: a warm-up, then the fastest of PREFILL_REPEATS timed runs of
    the same step (profile_hf times each of transformers' paths so: best_of(..., PREFILL_REPEATS))."""
    g = torch.Generator().manual_seed(seed)
    seq = Sequence(1, torch.randint(3, engine.artifact.config.vocab_size, (tokens,), generator=g).tolist(),
                   SamplingParams(max_tokens=1))
    engine.blocks.allocate(seq.seq_id, seq.prompt_ids)
    _profile_step(engine, "prefill", [Chunk(seq, 0, seq.num_tokens)])      # warm-up, then the same again
    flops = gemm_flops(engine.artifact.graphs["prefill"], tokens)
    runs = [_profile_step(engine, "prefill", [Chunk(seq, 0, seq.num_tokens)], flops=flops)
            for _ in range(PREFILL_REPEATS)]
    engine.blocks.free(seq.seq_id)
    return min(runs, key=lambda run: run.seconds)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _split(step: dict) -> str:
    return " | ".join(f"{name} {100 * t / step['seconds']:.0f}%" for name, t in step["by_category"].items())


def format_profile(r: dict, baseline: list[str] = ()) -> str:
    """The profile's text; `baseline`: lines on the peer (profile_hf.baseline_lines) to end it."""
    d, p = r["decode"], r["prefill"]
    return "\n".join([
        f"{r['cpu']} | torch threads {r['threads']} | {r['dtype']} | {r['kernels']} kernels | {r['graphs']}"
        + (f" | {r['cpu_gemm']}" if r.get("cpu_gemm") else ""),
        f"floors, measured now: read bandwidth {r['bandwidth'] / 1e9:.1f} GB/s ({r['floor_kernel']} beside "
        f"each decode round: median, {min(r['bandwidth_samples']) / 1e9:.0f}-{max(r['bandwidth_samples']) / 1e9:.0f} "
        f"over the rounds), "
        f"matmul peak {r['matmul_peak'] / 1e9:.1f} GFLOP/s ({r['dtype']} 512x2048x2048, best GEMM path)",
        f"batch-1 decode, {r['decode_tokens']} tokens after a {r['decode_context']}-token prompt: "
        f"{1000 * d['seconds']:.1f} ms/token = "
        f"{1 / d['seconds']:.1f} tok/s; {_split(d)}",
        f"    reads {d['bytes'] / 1e6:.1f} MB/token -> {d['bytes'] / d['seconds'] / 1e9:.1f} GB/s = "
        f"{100 * d['of_bandwidth']:.0f}% of the read bandwidth (median of {len(d['rounds'])} rounds of "
        f"{ROUND_TOKENS} tokens, each against the samples beside it)",
        f"    against the floor's fastest strategy reading {d['bytes'] / 1e6:.1f} MB right after each step (the same "
        f"neighbours' load): {100 * d['of_paired_read']:.0f}% (median of the rounds)",
        *waits_line(d["waits"]),
        *weight_lines(d["by_weight"], d["bytes"] / _median(list(d["paired"]))),
        f"batch-1 decode as served (engine.stream: the engine loop's thread with the scheduler, sampler and "
        f"detokenizer, first token out to last): {1000 * r['served_decode_s']:.1f} ms/token = "
        f"{r['served_decode_s'] / d['seconds']:.2f}x the step above",
        f"    per engine step of it: the forward {1000 * r['served_per_step']['compute']:.2f} ms, the host "
        f"{1000 * r['served_per_step']['host']:.2f} ms (schedule, build, sample, commit, output: "
        f"{_phases(r['served_per_step'])} ms)",
        f"prefill, {r['prompt_len']} tokens: {1000 * p['seconds']:.0f} ms; {_split(p)}",
        f"    {p['flops'] / 1e9:.1f} GFLOP -> {p['flops'] / p['seconds'] / 1e9:.1f} GFLOP/s = "
        f"{100 * p['flops'] / p['seconds'] / r['matmul_peak']:.0f}% of the matmul peak",
        *flop_lines(p["by_weight"], r["matmul_peak"]),
        *baseline,
    ])


def _phases(per_step: dict[str, float]) -> str:
    return " / ".join(f"{1000 * per_step[phase]:.2f}" for phase in HOST_PHASES)


def profile_cmd(
    artifact: Optional[Path] = typer.Argument(None, help="artifact directory from `llmc compile` (not with --serving)"),
    decode_tokens: int = typer.Option(32, help="tokens of the batch-1 decode profile"),
    decode_context: int = typer.Option(PROMPT_FOR_DECODE, help="tokens of the prompt the decode profile follows "
                                       "(the context its attention reads: llama-bench's depth)"),
    prompt_len: int = typer.Option(512, help="tokens of the prefill profile"),
    kernels: Optional[str] = KERNELS_OPTION,
    activations: Optional[str] = ACTIVATIONS_OPTION,
    backend: str = typer.Option("torch", help="torch or triton (generated kernels: a GPU, or TRITON_INTERPRET=1)"),
    step_plans: Optional[bool] = STEP_PLANS_OPTION,
    baseline: Optional[str] = typer.Option(None, help="'hf': also time transformers' batch-1 decode and prefill"),
    hf_model: Optional[str] = typer.Option(None, help="model for the baseline (default: the artifact's source)"),
    hf_compile: bool = typer.Option(True, "--hf-compile/--no-hf-compile", help="among the baseline's paths, also "
                                    "try torch.compile over transformers' static cache (a first compile: ~1 min)"),
    json_file: Optional[Path] = typer.Option(None, "--json", help="write the results to this JSON file"),
    serving: bool = typer.Option(False, "--serving", help="instead: an engine step's host time by phase, before, "
                                 "with the persistent input batch, and with async scheduling too, on a tiny model"),
    batches: str = typer.Option("1,64,256", help="--serving: batch sizes"),
    contexts: str = typer.Option("128,2048,8192", help="--serving: tokens each sequence holds"),
    steps: int = typer.Option(16, help="--serving: decode steps measured at each batch and context"),
) -> None:
    """Profile batch-1 decode and a prefill: time by kind of kernel, against bandwidth and matmul floors
    (with --serving: host time per engine step by phase, tools/profile_serving.py)."""
    if serving:
        return _serving(artifact, batches, contexts, steps, json_file)
    if artifact is None:
        raise RequestError("name the artifact directory to profile (from `llmc compile`), or give --serving")
    if baseline not in (None, "hf"):
        raise RequestError(f"baseline {baseline!r} is unknown; the only baseline is 'hf'")
    if min(decode_tokens, prompt_len, decode_context) < 1:
        raise RequestError("--decode-tokens, --decode-context and --prompt-len must be at least 1")
    from .profile_hf import baseline_lines, decode_prompt, hf_profile, llmc_prefill, served_decode

    options = given_backend_options(kernels=kernels, step_plans=step_plans, cuda_graphs=False,   # timed: eager
                                    activations=activations)
    engine = Engine(artifact, EngineConfig(backend=backend, backend_options=options))
    needed = max(prompt_len, decode_final_context(decode_tokens, decode_context))
    if needed > engine.max_sequence_tokens:
        raise RequestError(f"the profile needs {needed} tokens of context but this engine holds "
                           f"{engine.max_sequence_tokens}; lower --prompt-len or --decode-context")
    art, dtype = engine.artifact, next(iter(engine.artifact.weights.values())).dtype
    capabilities = engine.runner.capabilities
    if stale := stale_code(engine.artifact.manifest):
        typer.echo(f"note: {stale}", err=True)
    result = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "dtype": str(dtype).removeprefix("torch."),
              "kernels": engine.kernels, "step_plans": capabilities.plans(), "graphs": capabilities.describe_plans(),
              "cpu_gemm": (f"{describe_attention_path(art.config.head_dim, getattr(torch, kv_cache_dtype(art)))}; "
                           f"{describe_gemm_path()}" if engine.kernels.startswith("native") and dtype == torch.bfloat16
                           else ""),
              "decode_tokens": decode_tokens, "decode_context": decode_context, "prompt_len": prompt_len,
              "matmul_peak": matmul_peak(dtype)}
    floor = ReadBandwidth()
    result["floor_kernel"] = floor.describe()
    step_bytes = decode_bytes(art.graphs["decode"], art, decode_mean_context(decode_tokens, decode_context))
    decode, _ = profile_decode(engine, decode_tokens, bandwidth=floor, step_bytes=step_bytes, prompt=decode_context)
    result["decode"] = {**decode.__dict__, "bytes": step_bytes, "of_bandwidth": decode.of_bandwidth(step_bytes),
                        "of_paired_read": decode.of_paired_read()}
    result["bandwidth_samples"] = sorted(decode.floors)
    result["bandwidth"] = result["bandwidth_samples"][len(decode.floors) // 2]
    result["served_decode_s"], result["served_per_step"] = served_decode(
        engine, decode_prompt(art.config.vocab_size, decode_context), decode_tokens)
    prefill = profile_prefill(engine, prompt_len)
    result["prefill"] = {**prefill.__dict__, "flops": prefill_flops(art.graphs["prefill"], art, prompt_len)}
    if baseline == "hf":
        result["hf"] = hf_profile(art, hf_model, decode_tokens, prompt_len, decode_context, compile=hf_compile,
                                  beside=llmc_prefill(engine, prompt_len))
    typer.echo(format_profile(result, baseline_lines(result)))
    if json_file:
        json_file.write_text(json.dumps(result, indent=2))


def _serving(artifact: Path | None, batches: str, contexts: str, steps: int, json_file: Path | None) -> None:
    """`llmc profile --serving` (tools/profile_serving.py), which builds its own model: no artifact."""
    if artifact is not None:
        raise RequestError(f"--serving profiles its own tiny model, not {artifact}; leave the artifact out")
    from .profile_serving import profile_serving_cmd
    profile_serving_cmd(batches, contexts, steps, json_file)
