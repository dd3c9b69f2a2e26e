"""`llmc bench-structured`: decode throughput with and without a JSON-schema constraint, at each batch
size, in one run on one engine, and what the grammar mask costs.

Both sides send the same requests (the same prompts, the same max_tokens), greedy. The free side
ignores EOS, so it generates max_tokens each; the constrained side's schema should not let the
output end early: the default, an array of at least max_tokens integers (each one a token or
more), cannot; for a schema of the user's the table shows both sides' token counts, so an early
end is seen. Only decode
is timed: from the step after every request has its first token to the end. The mask's figures
come from the engine's own counters (EngineStats.grammar_rows / grammar_mask_seconds: filling each
row's bitmask and applying it), read around the constrained side's decode. Not a timed test.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import typer

from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.grammar import GrammarSpec
from llmc.runtime.memory_plan import parse_bytes
from llmc.runtime.sampling_params import RequestError, SamplingParams

from .bench import parse_sizes
from .profile_steps import cpu_name

PROMPT = "Write every integer from {start} to {end}, in order, as one JSON array."


@dataclass(frozen=True)
class DecodeRun:
    """One side at one batch size: decode tokens and seconds, and the mask's share of them."""

    batch: int
    tokens: int                 # every output token, the first ones (prefill's) included
    decode_tokens: int
    decode_seconds: float
    mask_rows: int
    mask_seconds: float

    @property
    def tok_s(self) -> float:
        return self.decode_tokens / self.decode_seconds


def default_schema(output_len: int) -> dict:
    """An array of integers that cannot end before `output_len` tokens."""
    return {"type": "array", "items": {"type": "integer"}, "minItems": output_len}


def read_schema(path: Path | None, output_len: int) -> GrammarSpec:
    """The constraint: the JSON schema in `path`, or default_schema."""
    if path is None:
        return GrammarSpec.json_schema(default_schema(output_len), "--schema")
    try:
        schema = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise RequestError(f"--schema {path} is not a readable JSON file: {exc}") from None
    return GrammarSpec.json_schema(schema, "--schema")


def prompts(engine: Engine, batch: int) -> list[list[int]]:
    """`batch` distinct prompts asking for a long array of integers (chat-formatted where the model chats)."""
    texts = [PROMPT.format(start=1 + 1000 * i, end=1000 * (i + 1)) for i in range(batch)]
    tok = engine.tokenizer
    if tok.has_chat_template:
        return [tok.encode_chat([{"role": "user", "content": t}]) for t in texts]
    return [tok.encode(t) for t in texts]


def run_decode(engine: Engine, prompt_ids: list[list[int]], params: SamplingParams) -> DecodeRun:
    """Serve the requests to their end; time the steps after every request has its first token."""
    for p in prompt_ids:
        engine.add_request(p, params)
    started, tokens = set(), 0
    while len(started) < len(prompt_ids) and engine.has_unfinished():   # prefill (and any first decodes)
        for out in engine.step():
            started.add(out.request_id)
            tokens += len(out.new_token_ids)
    before, start, decoded = engine.stats(), time.perf_counter(), 0
    while engine.has_unfinished():
        decoded += sum(len(out.new_token_ids) for out in engine.step())
    seconds, after = time.perf_counter() - start, engine.stats()
    return DecodeRun(len(prompt_ids), tokens + decoded, decoded, seconds, after.grammar_rows - before.grammar_rows,
                     after.grammar_mask_seconds - before.grammar_mask_seconds)


def measure(engine: Engine, spec: GrammarSpec, batch: int, output_len: int,
            repeats: int = 1) -> tuple[DecodeRun, DecodeRun]:
    """The free and the constrained side at one batch size, on the same prompts, taken in turn
    `repeats` times; each side's fastest run (on shared cores, the one least disturbed)."""
    ids = prompts(engine, batch)
    free = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=output_len, temperature=0.0, grammar=spec)
    runs = [(run_decode(engine, ids, free), run_decode(engine, ids, constrained)) for _ in range(repeats)]
    return max((f for f, _ in runs), key=lambda r: r.tok_s), max((c for _, c in runs), key=lambda r: r.tok_s)


def format_table(rows: list[tuple[DecodeRun, DecodeRun]], header: str) -> str:
    lines = [header, f"{'batch':>5} {'free tok/s':>11} {'constrained tok/s':>18} {'ratio':>6} "
             f"{'mask us/row':>12} {'mask share':>11} {'tokens free/constrained':>24}"]
    for free, con in rows:
        per_row = 1e6 * con.mask_seconds / con.mask_rows if con.mask_rows else 0.0
        lines.append(f"{free.batch:>5} {free.tok_s:>11.1f} {con.tok_s:>18.1f} {con.tok_s / free.tok_s:>6.2f} "
                     f"{per_row:>12.1f} {con.mask_seconds / con.decode_seconds:>11.1%} "
                     f"{f'{free.tokens}/{con.tokens}':>24}")
    lines.append("ratio: constrained / free decode tok/s; mask share: the mask's time over the constrained "
                 "decode's (filling and applying the bitmasks)")
    return "\n".join(lines)


def bench_structured_cmd(
    artifact: Path = typer.Argument(..., help="artifact directory from `llmc compile`"),
    batch: str = typer.Option("1,64", help="batch sizes to measure, comma-separated"),
    output_len: int = typer.Option(128, help="tokens each request generates"),
    schema: Optional[Path] = typer.Option(None, help="JSON schema file for the constrained side (default: "
                                          "an array of at least --output-len integers, which cannot end early)"),
    repeats: int = typer.Option(2, help="runs of each side per batch size, taken in turn; the fastest is shown"),
    kv_memory: str = typer.Option("1GiB", help="KV cache memory"),
    threads: Optional[int] = typer.Option(None, help="torch's intra-op threads (default: torch's own choice)"),
    json_file: Optional[Path] = typer.Option(None, "--json", help="write the results to this JSON file"),
) -> None:
    """Decode tok/s with and without a JSON-schema constraint at each batch size, and the mask's cost."""
    batches, spec = parse_sizes(batch, "--batch", "1,64"), read_schema(schema, output_len)
    if output_len < 2 or repeats < 1:
        raise RequestError(f"--output-len {output_len} must be at least 2 (decode starts after the first token) "
                           f"and --repeats {repeats} at least 1")
    if threads is not None:
        torch.set_num_threads(max(1, threads))
    engine = Engine(artifact, EngineConfig(kv_cache_bytes=parse_bytes(kv_memory), max_num_seqs=max(batches)))
    measure(engine, spec, 1, 4)                         # warm-up: kernels, the grammar's build and tokenizer
    rows = [measure(engine, spec, b, output_len, repeats) for b in batches]
    header = (f"{engine.artifact.path.name} | {cpu_name()} | torch threads {torch.get_num_threads()} | "
              f"load average {os.getloadavg()[0]:.1f} | {engine.kernels} kernels | output {output_len} tokens | "
              f"best of {repeats} | schema {spec.text}")
    typer.echo(format_table(rows, header))
    if json_file:
        json_file.write_text(json.dumps({"cpu": cpu_name(), "schema": json.loads(spec.text), "output_len": output_len,
                                         "repeats": repeats,
                                         "runs": [{"free": asdict(f), "constrained": asdict(c)} for f, c in rows]},
                                        indent=2))
