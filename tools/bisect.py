"""`llmc debug bisect`: find the first pass that changes what a model computes.

The pipeline runs one pass at a time over both entry graphs (stage 0: the traced graphs). Each
stage is interpreted with the torch backend on the same probes (tools/bisect_probes.py: random
prefills and decodes, the chat prompt, a decode and a chunked-prefill step over real cached
context in shuffled blocks). The first stage whose logits are too far from the truth names the
pass. Within that pass, the values before and after it are compared node by node through the
rewrite's value map (old value -> the value that stands for it), and the first value that
differs is printed as IR text with its error. Last, greedy decoding of the prompt with the
traced graphs and with the culprit's (or else the final) graphs shows the first step whose
token flips.

Tolerance. The truth is the traced graph run in float64 on the same probe (weights cast up from
the working dtype, so only rounding separates the two). The traced graph run in the working
dtype misses it by E, the rounding error this dtype costs this model on this probe; a correct
pass only reorders or fuses rounding steps, so its graphs miss the truth by about as much, while
a wrong rewrite adds an error of its own that does not shrink with the dtype's epsilon. A stage
diverges when its error exceeds FACTOR * E (E at least eps * max|logit|, so an exact float32
run still has a bound). FACTOR = 4 sits above the largest ratio a clean pipeline showed on every
tiny family and SmolLM2 in f32, bf16 and f16 (at most 1.54, SmolLM2 in bf16), and below what
the planted bugs of tests/test_bisect.py cause (6x for gate and up swapped in bf16, up to 10^6x).
A bug smaller than the dtype's own rounding is not flagged: RoPE theta or the attention scale
1% off shows in f32 (~10^4x) but is within 1.5x in bf16, where the traced graph is that far
off. The same rule, per value, localises the bug: a value after the pass diverges when it misses
the before-graph's value by more than FACTOR times that value's own float64 error.

With --tp N the pipeline shards, and every stage from the shard pass on runs its N ranks in
lockstep in one process (tools/bisect_ranks.py: the collectives sum or join the ranks' values),
rank 0's logits against the same truth and tolerance: the ranks' partial sums only reorder fp32
rounding. Inside the shard pass only the values every rank holds whole (the residual stream, a
collective's result) can stand for unsharded ones; a rank's heads or partial sums are not compared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from llmc.compiler.dtypes import FLOAT_DTYPES, USER_DTYPES, to_torch
from llmc.compiler.frontend import ENTRIES, trace
from llmc.compiler.ir import Graph, Value, format_node
from llmc.compiler.tensor_parallel import TensorParallelPlan
from llmc.models.config import LoadedModel, ModelConfig
from llmc.passes.pipeline import pass_names, run_pipeline
from llmc.passes.rewrite import PassContext
from llmc.runtime.tokenizer import Tokenizer

from .bisect_probes import Probe, make_probes, prepare, probe_logits, runs_as_is
from .bisect_ranks import Ranks, stage_program
from .feeds import greedy_tokens

EPS = {d: torch.finfo(to_torch(d)).eps for d in FLOAT_DTYPES}      # f32 2^-23, bf16 2^-7, f16 2^-10
FACTOR = 4.0
DEFAULT_PROMPT = "What is the capital of France?"


def max_abs_error(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def tolerance(dtype: str, rounding_error: float, magnitude: float) -> float:
    """FACTOR times the working dtype's own error against float64 (at least eps * magnitude)."""
    return FACTOR * max(rounding_error, EPS[dtype] * float(magnitude))


@dataclass(frozen=True)
class Stage:
    """Both entry graphs after one pass (index: its place in the pipeline; 0 = traced); `ranks`
    once the graphs are sharded."""

    index: int
    name: str
    graphs: dict[str, Graph]
    value_maps: dict[str, dict[Value, Value] | None]
    ranks: Ranks | None = None


def pipeline_stages(config: ModelConfig, ir_dtype: str, weights: dict[str, torch.Tensor],
                    disabled: tuple[str, ...] = (), tp: int = 1) -> list[Stage]:
    """The traced graphs and the graphs after every pass that runs (sharded for `tp` ranks)."""
    positions = {name: i + 1 for i, name in enumerate(pass_names())}
    runs: dict[str, list[tuple[str, Graph, dict | None, Ranks | None]]] = {}
    for entry in ENTRIES:
        traced = trace(config, entry, ir_dtype)
        ctx = PassContext(options={"tp": tp}, weights=weights)
        runs[entry] = [("traced", traced, None, None)]

        def seen(p, g, seq=runs[entry], c=ctx):
            plan = c.records.get("shard")
            ranks = Ranks(TensorParallelPlan(plan["size"], plan["weights"]), config.num_kv_heads) if plan else None
            seq.append((p.name, g, c.value_map, ranks))
        run_pipeline(traced, ctx, disabled, on_pass=seen)
    return [Stage(positions.get(name, 0), name, {e: runs[e][i][1] for e in ENTRIES},
                  {e: runs[e][i][2] for e in ENTRIES}, ranks) for i, (name, _, _, ranks) in enumerate(runs["prefill"])]


@dataclass(frozen=True)
class Check:
    """One stage on one probe: max abs error of the logits against the float64 traced graph's."""

    stage: Stage
    probe: str
    error: float
    tolerance: float

    @property
    def diverged(self) -> bool:
        return not self.error <= self.tolerance  # NaN diverges too


@dataclass(frozen=True)
class Culprit:
    """The first pass whose logits diverge, and the first value inside it that does."""

    check: Check
    node_before: str | None = None
    node_after: str | None = None
    node_error: float | None = None
    node_tolerance: float | None = None


@dataclass(frozen=True)
class GreedyCheck:
    stage: str
    reference: list[int]
    tokens: list[int]

    @property
    def first_flip(self) -> int | None:
        return next((i for i, (a, b) in enumerate(zip(self.reference, self.tokens)) if a != b), None)


@dataclass
class BisectReport:
    model: str
    dtype: str
    probes: list[str]
    checks: list[Check] = field(default_factory=list)
    culprit: Culprit | None = None
    greedy: list[GreedyCheck] = field(default_factory=list)
    token_text: dict[int, str] = field(default_factory=dict)
    tp: int = 1

    def render(self) -> str:
        from .bisect_report import render

        return render(self)


def _result_text(graph: Graph, value: Value) -> str:
    node = graph.node_map()[value.node]
    suffix = f"  (result #{value.index})" if len(node.types) > 1 else ""
    return format_node(node) + suffix


def _values(stage: Stage, weights: dict, probe: Probe, cache_dtype=None) -> dict[Value, torch.Tensor]:
    """Every value of the probe's entry graph on the probe, cache contents excepted (updated in place);
    of a sharded stage, those every rank holds whole."""
    program, feeds = prepare(stage.graphs, weights, probe, cache_dtype, stage.ranks)
    with torch.inference_mode():
        values = program.values(feeds)
    aliased = {t.data_ptr() for t in feeds.values()}
    return {v: t for v, t in values.items() if t.data_ptr() not in aliased}


@dataclass(frozen=True)
class Weights:
    """The model's weights in the working dtype and in float64 (cast up from those)."""

    dtype: str
    working: dict[str, torch.Tensor]
    exact: dict[str, torch.Tensor]


def _localize(before: Stage, check: Check, probe: Probe, weights: Weights) -> Culprit:
    """Compare every value of the graph before the pass with the value standing for it after."""
    after = check.stage
    entry = probe.entry if runs_as_is(before.graphs, probe) else "prefill"   # the graph that computes it
    value_map = after.value_maps[entry]
    if value_map is None:
        return Culprit(check)
    gb = before.graphs[entry]
    vb = _values(before, weights.working, probe)
    exact = _values(before, weights.exact, probe, torch.float64)
    va = _values(after, weights.working, probe)
    for node in gb.nodes:
        if node.op in ("input", "weight"):
            continue
        for i in range(len(node.types)):
            old, new = node.value(i), value_map.get(node.value(i))
            if new not in va or old not in vb or old not in exact or not vb[old].is_floating_point():
                continue
            err = max_abs_error(vb[old], va[new])
            magnitude = exact[old].abs().max() if exact[old].numel() else 0.0
            tol = tolerance(weights.dtype, max_abs_error(vb[old], exact[old]), magnitude)
            if not err <= tol:
                return Culprit(check, _result_text(gb, old), _result_text(after.graphs[entry], new), err, tol)
    return Culprit(check)


def _greedy(stages: list[Stage], culprit: Culprit | None, weights: dict, prompt: list[int],
            steps: int) -> list[GreedyCheck]:
    def run(stage: Stage) -> list[int]:
        programs = [stage_program(stage.graphs[e], weights, stage.ranks) for e in ENTRIES]
        return greedy_tokens(*programs, prompt, steps)

    reference = run(stages[0])
    chosen = [culprit.check.stage] if culprit else []
    if stages[-1] not in chosen:
        chosen.append(stages[-1])
    return [GreedyCheck(s.name, reference, run(s)) for s in chosen]


def _check_stages(report: "BisectReport", stages: list[Stage], probes: list[Probe], weights: Weights) -> None:
    """Every stage on every probe against the float64 traced graph; the earliest divergence is
    localised, on a probe that runs the same tokens before and after the pass."""
    first: dict[int, list[tuple[Check, Probe]]] = {}
    for probe in probes:
        truth = probe_logits(stages[0].graphs, weights.exact, probe, torch.float64)
        rounding = max_abs_error(probe_logits(stages[0].graphs, weights.working, probe), truth)
        tol = tolerance(weights.dtype, rounding, truth.abs().max())
        for k, stage in enumerate(stages):
            logits = probe_logits(stage.graphs, weights.working, probe, ranks=stage.ranks)
            check = Check(stage, probe.step.name, max_abs_error(logits, truth), tol)
            report.checks.append(check)
            if check.diverged:
                first.setdefault(k, []).append((check, probe))
    if not first:
        return
    k = min(first)
    local = [(c, p) for c, p in first[k] if runs_as_is(stages[k - 1].graphs, p) == runs_as_is(stages[k].graphs, p)]
    check, probe = (local or first[k])[0]
    report.culprit = _localize(stages[k - 1], check, probe, weights) if local and k > 0 else Culprit(check)


def bisect(model: LoadedModel, name: str = "model", dtype: str = "float32", steps: int = 16,
           prompt: str = DEFAULT_PROMPT, disabled: tuple[str, ...] = (), seed: int = 0, tp: int = 1) -> BisectReport:
    """Run the pipeline pass by pass (sharded for `tp` ranks) and find the first pass that changes
    the model's output."""
    ir_dtype = USER_DTYPES[dtype]
    working = {k: v.to(to_torch(ir_dtype)) for k, v in model.weights.items()}
    stages = pipeline_stages(model.config, ir_dtype, working, disabled, tp)
    weights = Weights(ir_dtype, working, {k: v.double() for k, v in working.items()})  # after fold_weights ran
    tokenizer = Tokenizer(model.tokenizer)
    messages = [{"role": "user", "content": prompt}]
    prompt_ids = tokenizer.encode_chat(messages) if tokenizer.has_chat_template else tokenizer.encode(prompt)
    probes = make_probes(model.config, prompt_ids, seed)
    report = BisectReport(name, dtype, [p.step.name for p in probes], tp=tp)
    _check_stages(report, stages, probes, weights)
    if steps > 0:
        report.greedy = _greedy(stages, report.culprit, working, prompt_ids, steps)
        ids = {t for g in report.greedy for t in (*g.reference, *g.tokens)}
        report.token_text = {t: tokenizer.decode([t], skip_special_tokens=False) for t in ids}
    return report
