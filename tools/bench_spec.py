"""`llmc bench-spec`: decode tokens per second with and without speculative decoding, per draft
source, on code-like / repetitive prompts and on chat prompts, at several batch sizes, in one run.

Sources: none, ngram, self (when the artifact has a `draft` graph: `llmc compile --draft-skip N`)
and draft:ART (with --draft ART). Each source gets its own engine, warmed up once, then every
(prompt kind, batch size) is measured on it. The prompts are built in (below), rendered with the
artifact's chat template, decoded greedily with the same max_tokens; batch B submits B prompts
together, the kind's prompts taken B at a time (cycled to fill the last batch).

Decode tok/s of a batch = sum over its requests of (output tokens - 1) / (finish - first token
time) (RequestMetrics: e2e - ttft); a row gives the mean over its batches. Speculation counters
are the engine's (Engine.stats().speculation) over the row's batches: acceptance rate = accepted /
drafted, mean accepted length = tokens a verifying sequence gained per step, draft share = draft
time / the row's wall time (prefill included). Sources are measured interleaved, batch by batch,
all engines resident, so a change in the machine's load falls on every source alike.

Greedy speculative decoding emits exactly the tokens plain greedy decoding emits, so every source
must give every prompt the same tokens as `none` at the same batch size; the report says so, and
a mismatch (a bug) is printed loudly and makes the command exit 1.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import typer

from llmc.compiler.artifact_format import artifact_entries, read_manifest
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.memory_plan import parse_bytes
from llmc.runtime.request import Completion
from llmc.runtime.sampling_params import RequestError, SamplingParams
from llmc.runtime.speculative.speculator import SpeculationStats

from .bench import parse_sizes, speculation_summary, speculative_config
from .profile_steps import cpu_name

_CODE = """class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1]

    def __len__(self):
        return len(self.items)
"""
_FRUIT = ("apples, bananas, cherries, dates, elderberries, figs, grapes, honeydew, kiwis, lemons, mangoes, "
          "nectarines")
_JSON = ('{"name": "llmc", "version": "0.3.1", "license": "MIT", "dependencies": ["torch", "typer", '
         '"tokenizers"], "scripts": {"build": "make", "test": "pytest -q"}}')
# rewrite-like tasks whose answer mostly copies the prompt (what n-gram lookup is for), chosen so that
# SmolLM2-135M-Instruct answers each at length rather than in a line
CODE_PROMPTS = (
    f"Rename the class Stack to LifoQueue in this code and reply with the complete code:\n```python\n{_CODE}```",
    f"Add a comment above every method of this class and reply with the whole class:\n```python\n{_CODE}```",
    f"Repeat this list exactly: {_FRUIT}, oranges, papayas, quinces, raspberries.",
    "Copy this text exactly, word for word: The committee met on Monday to discuss the budget for the new "
    "library. After a long debate, the members agreed to spend more on books and less on furniture. The chair "
    "thanked everyone for their time and closed the meeting at five o'clock.",
    f"Format this JSON with two spaces of indent:\n{_JSON}",
    "Fix the typos in this paragraph and return the whole paragraph: The qiuck brown fox jumpd over the lazy "
    "dog. Then the dog woke up and chased the fox acros the field, but the fox was to fast and escaped into "
    "the forrest.",
    f"Convert this list to a numbered list: {_FRUIT}.",
    "Write the numbers from 1 to 50 separated by commas.",
)
CHAT_PROMPTS = (
    "Tell me about the ocean.",
    "What makes a good friend?",
    "Explain how a bicycle works.",
    "Write a short story about a lost cat.",
    "What are the benefits of reading books?",
    "How do plants grow?",
    "Describe a perfect weekend.",
    "Why is the sky blue?",
)
PROMPT_KINDS = {"code": CODE_PROMPTS, "chat": CHAT_PROMPTS}


@dataclass(frozen=True)
class Row:
    """One (prompt kind, batch size, source) measurement."""

    kind: str
    batch: int
    source: str
    decode_tok_s: float
    output_tokens: int
    seconds: float                    # wall time of the row's batches (prefill included)
    speculation: dict | None          # speculation_summary over the row's batches (None: no speculation)
    outputs: list[list[int]]          # each prompt's generated token ids, in prompt order


def available_sources(artifact: Path, draft: Path | None) -> list[str]:
    """none and ngram always; self when the artifact has a draft graph; draft:ART when given."""
    sources = ["none", "ngram"]
    if "draft" in artifact_entries(read_manifest(artifact)):
        sources.append("self")
    return sources + ([f"draft:{draft}"] if draft is not None else [])


def batches_of(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
    """The prompts taken `batch` at a time, cycled so that the last batch is full."""
    count = -(-max(len(prompts), batch) // batch) * batch
    cycled = [prompts[i % len(prompts)] for i in range(count)]
    return [cycled[i:i + batch] for i in range(0, count, batch)]


def decode_tok_s(completions: list[Completion]) -> float:
    """Sum over the batch's requests of (output tokens after the first) / (finish - first token)."""
    rate = 0.0
    for c in completions:
        m = c.metrics
        if m is not None and m.output_tokens > 1 and m.e2e > m.ttft:
            rate += (m.output_tokens - 1) / (m.e2e - m.ttft)
    return rate


def stats_between(before: SpeculationStats, after: SpeculationStats) -> SpeculationStats:
    """The speculation counters of what ran between two snapshots."""
    minus = lambda a, b: [x - y for x, y in zip(a, b)]  # noqa: E731
    return SpeculationStats(after.max_k, after.drafted - before.drafted, after.accepted - before.accepted,
                            after.verified_seqs - before.verified_seqs, after.emitted - before.emitted,
                            after.draft_seconds - before.draft_seconds, after.verify_seconds - before.verify_seconds,
                            minus(after.accepted_at, before.accepted_at), minus(after.drafted_at, before.drafted_at))


def run_batch(engine: Engine, source: str, group: list[list[int]],
              params: SamplingParams) -> tuple[list[Completion], float]:
    """One batch submitted together; its completions and wall seconds."""
    start = time.perf_counter()
    done = engine.generate(group, params)
    if failed := [c.error for c in done if c.finish_reason == "error"]:
        raise RequestError(f"a {source} request failed during the benchmark: {failed[0]}")
    return done, time.perf_counter() - start


def measure(engines: dict[str, Engine], kind: str, batch: int, prompts: list[list[int]],
            params: SamplingParams) -> list[Row]:
    """Every batch of the kind's prompts through each source's engine in turn: interleaved, so that a
    change in the machine's load falls on every source alike."""
    before = {source: e.stats().speculation for source, e in engines.items()}
    rates = {source: [] for source in engines}
    outputs = {source: [] for source in engines}
    seconds = dict.fromkeys(engines, 0.0)
    for group in batches_of(prompts, batch):
        for source, engine in engines.items():
            done, wall = run_batch(engine, source, group, params)
            rates[source].append(decode_tok_s(done))
            outputs[source] += [c.token_ids for c in done]
            seconds[source] += wall
    rows = []
    for source, engine in engines.items():
        spec = before[source] and speculation_summary(stats_between(before[source], engine.stats().speculation))
        rows.append(Row(kind, batch, source, sum(rates[source]) / len(rates[source]),
                        sum(map(len, outputs[source])), seconds[source], spec, outputs[source]))
    return rows


def chat_prompts(engine: Engine, num_prompts: int) -> dict[str, list[list[int]]]:
    """Each kind's first `num_prompts` prompts, rendered with the chat template, as token ids."""
    return {kind: [engine.tokenizer.encode_chat([{"role": "user", "content": text}]) for text in texts[:num_prompts]]
            for kind, texts in PROMPT_KINDS.items()}


def bench_sources(artifact: Path, configs: dict[str, EngineConfig], batches: list[int], num_prompts: int,
                  params: SamplingParams) -> list[Row]:
    """An engine per source, each warmed up once, then each (prompt kind, batch size) on all of them."""
    engines = {source: Engine(artifact, config) for source, config in configs.items()}
    prompts = chat_prompts(next(iter(engines.values())), num_prompts)
    for engine in engines.values():
        engine.generate(prompts["code"][:1], SamplingParams(max_tokens=min(8, params.max_tokens), temperature=0.0))
    rows = [row for kind, kind_prompts in prompts.items() for batch in batches
            for row in measure(engines, kind, batch, kind_prompts, params)]
    order = list(engines)
    return sorted(rows, key=lambda r: order.index(r.source))       # stable: by source, then as measured


def draft_graph_note(artifact: Path) -> str | None:
    """What the compiler measured of the artifact's self-speculative draft (report.json), if it has one."""
    try:
        draft = json.loads((artifact / "report.json").read_text()).get("draft")
    except (OSError, ValueError):
        return None
    if not draft:
        return None
    return (f"self: the draft graph skips layers {draft['skip']} of {draft['num_layers']}; at compile time it "
            f"agreed with the target on {draft['agreement']:.0%} of {draft['calibration_tokens']} calibration "
            f"tokens (expected accepted of 4 drafts: {draft['expected_accepted_k4']:.2f})")


def mismatches(rows: list[Row]) -> list[str]:
    """Each prompt whose tokens under a source differ from no speculation's at the same batch size."""
    plain = {(r.kind, r.batch): r.outputs for r in rows if r.source == "none"}
    found = []
    for r in rows:
        for i, (got, want) in enumerate(zip(r.outputs, plain[(r.kind, r.batch)])):
            if got != want:
                at = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                found.append(f"{r.source} on {r.kind} prompt {i} at batch {r.batch}: tokens differ from "
                             f"no speculation's from output position {at} ({len(got)} vs {len(want)} tokens)")
    return found


def _cells(row: Row, plain: Row) -> str:
    ratio = f"{row.decode_tok_s / plain.decode_tok_s:.2f}x" if plain.decode_tok_s > 0 else "-"
    s = row.speculation
    if s is None or not s["drafted"]:
        spec = f"{s['drafted'] if s else '-':>9}{'-':>8}{'-':>10}{'-':>8}"
    else:
        share = s["draft_seconds"] / row.seconds if row.seconds > 0 else 0.0
        spec = f"{s['drafted']:>9}{s['acceptance_rate']:>8.0%}{s['mean_accepted_length']:>10.2f}{share:>8.1%}"
    return f"{row.decode_tok_s:>10.1f}{ratio:>9}{spec}{row.output_tokens:>8}"


def format_table(rows: list[Row], cpu: str, num_draft_tokens: int, bad: list[str]) -> str:
    plain = {(r.kind, r.batch): r for r in rows if r.source == "none"}
    width = max(len(r.source) for r in rows) + 2
    lines = [f"llmc bench-spec on {cpu}; greedy, K <= {num_draft_tokens} (adaptive), decode tok/s summed over "
             "each batch's requests",
             f"{'prompts':<8}{'batch':>6}  {'source':<{width}}{'tok/s':>10}{'vs none':>9}{'drafted':>9}{'accept':>8}"
             f"{'mean len':>10}"
             f"{'draft':>8}{'tokens':>8}"]
    for r in rows:
        lines.append(f"{r.kind:<8}{r.batch:>6}  {r.source:<{width}}{_cells(r, plain[(r.kind, r.batch)])}")
    lines.append("drafted: tokens drafted (adaptive K drafts none when it would not pay); accept: accepted / "
                 "drafted; mean len: tokens a verifying sequence gained per step; draft: drafting's share of the "
                 "row's wall time; tokens: output tokens of the row")
    if bad:
        lines += ["!" * 72, f"!!! OUTPUT MISMATCH: {len(bad)} prompt(s) decoded differently with speculation "
                  "(greedy output must be identical; this is a bug)"] + [f"!!! {m}" for m in bad] + ["!" * 72]
    else:
        count = sum(len(r.outputs) for r in rows if r.source != "none")
        lines.append(f"equal output: every source gave each of its {count} requests token for token what "
                     "no speculation gave at the same batch size")
    return "\n".join(lines)


def bench_spec_cmd(
    artifact: Path = typer.Argument(..., help="artifact directory from `llmc compile` (with --draft-skip N "
                                    "for the self source)"),
    num_draft_tokens: int = typer.Option(4, "--num-draft-tokens", help="most tokens drafted per sequence and step"),
    batch: str = typer.Option("1,8", help="batch sizes to measure, comma-separated"),
    output_len: int = typer.Option(128, help="max_tokens of every request (greedy; EOS ends a request early)"),
    draft: Optional[Path] = typer.Option(None, "--draft", help="also measure draft:ART, a smaller artifact of the "
                                         "same vocabulary"),
    num_prompts: int = typer.Option(len(CODE_PROMPTS), help="prompts of each kind (at most "
                                    f"{len(CODE_PROMPTS)})"),
    kv_memory: str = typer.Option("256MiB", help="KV cache memory of each source's engine (all are resident at once)"),
    json_file: Optional[Path] = typer.Option(None, "--json", help="write the rows to this JSON file"),
) -> None:
    """Decode tok/s with and without each speculative source, at each batch size, on code-like and chat
    prompts, with acceptance rates; checks that every source gives the same greedy tokens."""
    batches = parse_sizes(batch, "--batch", "1,8")
    if not 1 <= num_prompts <= len(CODE_PROMPTS) or output_len < 2:
        raise RequestError(f"--num-prompts {num_prompts} must be in 1..{len(CODE_PROMPTS)} and --output-len "
                           f"{output_len} at least 2")
    params = SamplingParams(max_tokens=output_len, temperature=0.0)
    configs = {source: EngineConfig(kv_cache_bytes=parse_bytes(kv_memory), max_num_seqs=max(batches),
                                    speculative=speculative_config(None if source == "none" else source,
                                                                   num_draft_tokens))
               for source in available_sources(artifact, draft)}
    rows = bench_sources(artifact, configs, batches, num_prompts, params)
    bad = mismatches(rows)
    typer.echo(format_table(rows, cpu_name(), num_draft_tokens, bad))
    if "self" in {r.source for r in rows} and (note := draft_graph_note(artifact)):
        typer.echo(note)
    if json_file:
        json_file.write_text(json.dumps({"cpu": cpu_name(), "num_draft_tokens": num_draft_tokens,
                                         "output_len": output_len, "mismatches": bad,
                                         "rows": [asdict(r) for r in rows]}, indent=2))
    if bad:
        raise typer.Exit(1)
