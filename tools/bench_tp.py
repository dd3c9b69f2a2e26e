"""`llmc bench-tp`: what tensor parallelism buys on this machine, TP 1 against TP N in one run.

    llmc bench-tp [MODEL] [--tp 1,3] [--decode-tokens 32] [--num-requests 64] [--json FILE]

For every rank count it compiles the model (once, into --work-dir; again when llmc's compiler code
changed) or takes --artifacts, starts the ranks as `llmc bench --tp N` does (ranks 1..N-1 are local
workers; every rank gets cores // N threads) and measures on rank 0, with the torch backend and native
kernels:
- batch-1 decode, ms/token: `llmc profile`'s boundaries (tools/profile_steps.py `profile_decode`: the
  mean untimed step over --decode-tokens tokens after the prompt and one warm-up step);
- the collectives' share of a decode step: the same decode again with every step-plan instruction
  timed (runtime/step_plan.py StepPlanProgram.timed), the seconds of kind "collective" (all_reduce,
  all_gather) over the timed step's. Rank 0's all_reduce returns when the slowest rank has added its
  part, so its time is the exchange PLUS rank 0's wait for the other ranks (which start each step
  after rank 0's broadcast of it, and on an oversubscribed machine wait for a core): an upper bound
  on the exchange's cost;
- the default `llmc bench` workload (64 requests, prompts 32:256, outputs 16:192, all at once):
  output tok/s and TTFT p50.
The table gives each figure and its ratio TP N / TP 1, the CPU, the cores and the threads per rank.
The default --tp is 1,3: the embedded SmolLM2-135M has 9 attention heads and 3 KV heads, which 2
does not divide; give --tp 1,2 with a model whose head counts 2 divides.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch
import typer

from llmc.compiler.artifact import stale_code
from llmc.compiler.artifact_format import read_manifest
from llmc.compiler.driver import CompileConfig, compile_model
from llmc.compiler.tensor_parallel import TensorParallelPlan
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.sampling_params import RequestError, SamplingParams
from llmc.runtime.scheduler import Chunk
from llmc.runtime.sequence import Sequence
from llmc.runtime.step_inputs import build_step_inputs
from llmc.runtime.tensor_parallel.world import DEFAULT_TIMEOUT

from .bench import Workload, parse_range, run_llmc
from .profile_steps import PROMPT_FOR_DECODE, cpu_name, profile_decode
from .tp_cli import tensor_parallel

DEFAULT_TP = "1,3"


def parse_tp(text: str) -> list[int]:
    """'1,3' -> [1, 3]: rank counts, 1 (what the ratios divide by) added where missing, in order."""
    try:
        counts = {int(part) for part in text.split(",") if part.strip()}
    except ValueError:
        raise RequestError(f"--tp {text!r} is not a list of rank counts like 1,2") from None
    if not counts or min(counts) < 1:
        raise RequestError(f"--tp {text!r} must list rank counts of 1 or more, like 1,2")
    return sorted(counts | {1})


def compiled(model: Optional[str], tp: int, dtype: str, work_dir: Path) -> Path:
    """The artifact of `model` for `tp` ranks, compiled into work_dir once and reused while the code that
    made it is this code."""
    out = work_dir / f"{dtype}-tp{tp}"
    manifest = out / "manifest.json"
    if not manifest.is_file() or stale_code(json.loads(manifest.read_text())):
        compile_model(model, out, CompileConfig(dtype=dtype, tp=tp))
    return out


def given_artifacts(paths: str) -> dict[int, Path]:
    """--artifacts: rank count (each artifact's shard plan) -> artifact; one of them for one rank."""
    found: dict[int, Path] = {}
    for path in (Path(p.strip()) for p in paths.split(",") if p.strip()):
        found[TensorParallelPlan.from_manifest(read_manifest(path)).size] = path
    if 1 not in found:
        raise RequestError(f"--artifacts {paths} has no artifact compiled for one rank; add one (llmc compile "
                           "without --tp), which the ratios divide by")
    return dict(sorted(found.items()))


def decode_collectives(engine: Engine, tokens: int, seed: int = 0) -> dict:
    """Batch-1 greedy decode of `tokens` tokens after a PROMPT_FOR_DECODE-token prompt with every launch
    timed: mean seconds of the timed step and of its launches of kind "collective"."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, engine.artifact.config.vocab_size, (PROMPT_FOR_DECODE,), generator=g).tolist()
    seq = Sequence(0, prompt, SamplingParams(max_tokens=tokens + 1))
    engine.blocks.allocate(seq.seq_id, seq.prompt_ids)
    engine.blocks.append(seq.seq_id, PROMPT_FOR_DECODE + tokens + 1)
    step_s = collective_s = 0.0
    for i in range(tokens + 1):                                  # the prefill, then `tokens` decode steps
        chunk = Chunk(seq, 0 if i == 0 else seq.num_tokens - 1, seq.num_tokens)
        start = time.perf_counter()
        logits, launches = engine.runner.run_timed("prefill" if i == 0 else "decode",
                                                   build_step_inputs([chunk], engine.blocks))
        seq.num_computed = chunk.end
        seq.output_ids.append(int(logits[-1].argmax()))
        if i:
            step_s += time.perf_counter() - start
            collective_s += sum(launch.seconds for launch in launches if launch.kind == "collective")
    engine.blocks.free(seq.seq_id)
    return {"timed_step_s": step_s / tokens, "collective_s": collective_s / tokens}


def measure(artifact: Path, tp: int, decode_tokens: int, workload: Workload, timeout: float) -> dict:
    """Rank 0's figures of `artifact` run by `tp` ranks (this process's thread count restored after)."""
    threads = torch.get_num_threads()
    try:
        with tensor_parallel(tp, timeout, artifact) as ranks:
            engine = Engine(artifact, EngineConfig(kv_cache_bytes=2**30, backend_options={"kernels": "native"},
                                                   ranks=ranks))                 # `llmc bench`'s defaults
            decode, _ = profile_decode(engine, decode_tokens)
            collectives = decode_collectives(engine, decode_tokens)
            bench = run_llmc(engine, workload.requests(engine.artifact.config.vocab_size), lambda: None)
            rank_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
    return {"artifact": str(artifact), "threads_per_rank": rank_threads, "decode_s": decode.seconds, **collectives,
            "collective_share": collectives["collective_s"] / collectives["timed_step_s"],
            "bench_output_tok_s": bench["output_tok_s"], "ttft_p50_s": bench["ttft_s"]["p50"],
            "async_scheduling": engine.async_scheduling, "kernels": engine.kernels}


def format_table(result: dict) -> str:
    """One row per rank count, each figure with its ratio to TP 1's from the same run."""
    one = result["runs"]["1"]
    ratio = lambda r, key: r[key] / one[key]  # noqa: E731
    lines = [f"{result['cpu']} | {result['cores']} cores | {result['dtype']} | {result['model']} | rank 0's "
             f"figures; collectives: all_reduce + all_gather in a timed decode step, rank 0's wait for the other "
             f"ranks included",
             f"{'tp':>3} {'threads/rank':>12} {'decode ms/tok':>13} {'TP N/TP 1':>9} {'collect. ms':>11} "
             f"{'of step':>7} {'bench tok/s':>11} {'TP N/TP 1':>9} {'TTFT p50 ms':>11} {'TP N/TP 1':>9} {'async':>5}"]
    for tp, r in result["runs"].items():
        lines.append(f"{tp:>3} {r['threads_per_rank']:>12} {1000 * r['decode_s']:>13.2f} "
                     f"{ratio(r, 'decode_s'):>8.2f}x {1000 * r['collective_s']:>11.2f} "
                     f"{100 * r['collective_share']:>6.1f}% {r['bench_output_tok_s']:>11.1f} "
                     f"{ratio(r, 'bench_output_tok_s'):>8.2f}x {1000 * r['ttft_p50_s']:>11.0f} "
                     f"{ratio(r, 'ttft_p50_s'):>8.2f}x {'on' if r['async_scheduling'] else 'off':>5}")
    return "\n".join(lines)


def bench_tp_cmd(
    model: Optional[str] = typer.Argument(None, help="HF folder or .gguf; omit for the embedded SmolLM2-135M-Instruct"),
    tp: str = typer.Option(DEFAULT_TP, help="comma-separated rank counts, 1 always measured; the default 1,3 suits "
                           "the embedded SmolLM2 (9 heads, 3 KV heads: 2 does not divide them)"),
    artifacts: Optional[str] = typer.Option(None, help="comma-separated artifacts to measure instead of compiling "
                                            "MODEL: one per rank count (their shard plans say which), one for 1"),
    dtype: str = typer.Option("float32", help="compute dtype: float32 or bfloat16"),
    decode_tokens: int = typer.Option(32, help="tokens of the batch-1 decode measurements"),
    num_requests: int = typer.Option(64, help="requests in the `llmc bench` workload (its default)"),
    prompt_len: str = typer.Option("32:256", help="the workload's prompt length: N or a uniform range LO:HI"),
    output_len: str = typer.Option("16:192", help="the workload's output length: N or a uniform range LO:HI"),
    work_dir: Path = typer.Option(Path("artifacts/bench-tp"), help="where the compiled artifacts are kept"),
    tp_timeout: float = typer.Option(DEFAULT_TIMEOUT, help="seconds a collective waits for the other ranks"),
    json_file: Optional[Path] = typer.Option(None, "--json", help="write the results to this JSON file"),
) -> None:
    """TP 1 against TP N: batch-1 decode, the collectives' share of a decode step, bench throughput and TTFT."""
    if model is not None and artifacts is not None:
        raise RequestError("give MODEL (compiled for each --tp) or --artifacts (already compiled), not both")
    if decode_tokens < 1:
        raise RequestError(f"--decode-tokens {decode_tokens} must be at least 1")
    workload = Workload(num_requests, parse_range(prompt_len, "prompt length"),
                        parse_range(output_len, "output length"))
    if artifacts is not None:
        paths = given_artifacts(artifacts)
    else:
        work_dir.mkdir(parents=True, exist_ok=True)
        paths = {n: compiled(model, n, dtype, work_dir) for n in parse_tp(tp)}
    result = {"cpu": cpu_name(), "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
              else os.cpu_count(), "dtype": dtype, "model": model or artifacts or "embedded SmolLM2-135M-Instruct",
              "workload": asdict(workload), "runs": {}}
    for n, path in paths.items():
        result["runs"][str(n)] = measure(path, n, decode_tokens, workload, tp_timeout)
    typer.echo(format_table(result))
    if json_file:
        json_file.write_text(json.dumps(result, indent=2, default=str))
