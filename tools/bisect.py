"""`llmc debug bisect`: find the first pass that changes what a model computes.

The pipeline runs one pass at a time over both entry graphs (stage 0: the traced graphs). Each
stage is interpreted with the torch backend on the same probes: random token ids (a prefill of
two sequences, odd T; a decode of one token per sequence) and the model's chat template around
a real prompt. Every probe is computed from an empty KV cache, where a graph before
insert_paged_attention and one after it compute the same logits (tools/feeds.py). The first
stage whose logits differ from the traced graph's beyond the tolerance names the pass. Within
that pass, the values before and after it are compared node by node through the rewrite's
value map (old value -> the value that stands for it), and the first value that differs is
printed as IR text with its error. Last, greedy decoding of the prompt with the traced graphs
and with the culprit's (or else the final) graphs shows the first step whose token flips.

Tolerance: the rounding error of a dot product of length K grows like sqrt(K) units of the
dtype's epsilon (llm.c's rule); a model chains a few dozen such products, so the bound is
eps * sqrt(K) * SAFETY, times the magnitude of the reference values (at least 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from llmc.compiler.dtypes import USER_DTYPES, to_torch
from llmc.compiler.frontend import ENTRIES, trace
from llmc.compiler.ir import Graph, Value, format_node
from llmc.models.config import LoadedModel, ModelConfig
from llmc.passes.pipeline import pass_names, run_pipeline
from llmc.passes.rewrite import PassContext
from llmc.runtime.tokenizer import Tokenizer
from llmc.runtime.torch_backend import TorchProgram

from .feeds import Step, greedy_tokens, step_feeds

EPS = {"f32": 2.0**-23, "bf16": 2.0**-7, "f16": 2.0**-10}
SAFETY = 16.0
DEFAULT_PROMPT = "What is the capital of France?"


def tolerance(dtype: str, reduction: int, magnitude: float) -> float:
    """Largest max-abs error that rounding alone explains (see module docstring)."""
    return EPS[dtype] * math.sqrt(reduction) * SAFETY * max(float(magnitude), 1.0)


def max_abs_error(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


@dataclass(frozen=True)
class Stage:
    """Both entry graphs after one pass (index: its place in the pipeline; 0 = traced)."""

    index: int
    name: str
    graphs: dict[str, Graph]
    value_maps: dict[str, dict[Value, Value] | None]


def pipeline_stages(config: ModelConfig, ir_dtype: str, weights: dict[str, torch.Tensor],
                    disabled: tuple[str, ...] = ()) -> list[Stage]:
    """The traced graphs and the graphs after every pass that runs."""
    positions = {name: i + 1 for i, name in enumerate(pass_names())}
    runs: dict[str, list[tuple[str, Graph, dict | None]]] = {}
    for entry in ENTRIES:
        traced = trace(config, entry, ir_dtype)
        ctx = PassContext(weights=weights)
        runs[entry] = [("traced", traced, None)]
        run_pipeline(traced, ctx, disabled,
                     on_pass=lambda p, g, seq=runs[entry], c=ctx: seq.append((p.name, g, c.value_map)))
    return [Stage(positions.get(name, 0), name, {e: runs[e][i][1] for e in ENTRIES},
                  {e: runs[e][i][2] for e in ENTRIES}) for i, (name, _, _) in enumerate(runs["prefill"])]


@dataclass(frozen=True)
class Probe:
    entry: str
    step: Step


def make_probes(config: ModelConfig, prompt_ids: list[int], seed: int) -> list[Probe]:
    g = torch.Generator().manual_seed(seed)

    def rand(n: int, high: int = config.vocab_size) -> list[int]:
        return torch.randint(0, high, (n,), generator=g).tolist()

    return [Probe("prefill", Step.prefill("random prefill", [rand(7), rand(4)])),
            Probe("prefill", Step.prefill("chat prompt", [prompt_ids])),
            Probe("decode", Step.decode("random decode", rand(3), rand(3, high=64)))]


def _logits(graph: Graph, weights: dict, step: Step) -> torch.Tensor:
    with torch.inference_mode():
        return TorchProgram(graph, weights)(step_feeds(graph, step))[0].float()


@dataclass(frozen=True)
class Check:
    """One stage on one probe: max abs error of the logits against the traced graph's."""

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

    def render(self) -> str:
        from .bisect_report import render

        return render(self)


def _result_text(graph: Graph, value: Value) -> str:
    node = graph.node_map()[value.node]
    suffix = f"  (result #{value.index})" if len(node.types) > 1 else ""
    return format_node(node) + suffix


def _localize(before: Stage, check: Check, probe: Probe, weights: dict, ir_dtype: str, reduction: int) -> Culprit:
    """Compare every value of the graph before the pass with the value standing for it after."""
    after, entry = check.stage, probe.entry
    value_map = after.value_maps[entry]
    if value_map is None:
        return Culprit(check)
    gb, ga = before.graphs[entry], after.graphs[entry]
    feeds_b, feeds_a = step_feeds(gb, probe.step), step_feeds(ga, probe.step)
    with torch.inference_mode():
        vb = TorchProgram(gb, weights).values(feeds_b)
        va = TorchProgram(ga, weights).values(feeds_a)
    aliased = {t.data_ptr() for t in (*feeds_b.values(), *feeds_a.values())}  # the cache, updated in place
    for node in gb.nodes:
        if node.op in ("input", "weight"):
            continue
        for i in range(len(node.types)):
            old, new = node.value(i), value_map.get(node.value(i))
            if new is None or new not in va or vb[old].data_ptr() in aliased:
                continue
            err = max_abs_error(vb[old], va[new])
            tol = tolerance(ir_dtype, reduction, vb[old].float().abs().max() if vb[old].numel() else 0.0)
            if not err <= tol:
                return Culprit(check, _result_text(gb, old), _result_text(ga, new), err, tol)
    return Culprit(check)


def _reduction(graph: Graph) -> int:
    """The longest dot product in the graph (the reduction dim of its widest linear)."""
    nodes = graph.node_map()
    return max((nodes[n.inputs[1].node].types[n.inputs[1].index].shape[1] for n in graph.nodes
                if n.op == "linear"), default=1)


def _greedy(stages: list[Stage], culprit: Culprit | None, weights: dict, prompt: list[int],
            steps: int) -> list[GreedyCheck]:
    def run(stage: Stage) -> list[int]:
        programs = [TorchProgram(stage.graphs[e], weights) for e in ENTRIES]
        return greedy_tokens(*programs, prompt, steps)

    reference = run(stages[0])
    chosen = [culprit.check.stage] if culprit else []
    if stages[-1] not in chosen:
        chosen.append(stages[-1])
    return [GreedyCheck(s.name, reference, run(s)) for s in chosen]


def bisect(model: LoadedModel, name: str = "model", dtype: str = "float32", steps: int = 16,
           prompt: str = DEFAULT_PROMPT, disabled: tuple[str, ...] = (), seed: int = 0) -> BisectReport:
    """Run the pipeline pass by pass and find the first pass that changes the model's output."""
    ir_dtype = USER_DTYPES[dtype]
    weights = {k: v.to(to_torch(ir_dtype)) for k, v in model.weights.items()}
    stages = pipeline_stages(model.config, ir_dtype, weights, disabled)
    tokenizer = Tokenizer(model.tokenizer)
    messages = [{"role": "user", "content": prompt}]
    prompt_ids = tokenizer.encode_chat(messages) if tokenizer.has_chat_template else tokenizer.encode(prompt)
    probes = make_probes(model.config, prompt_ids, seed)
    reduction = _reduction(stages[0].graphs["prefill"])
    report = BisectReport(name, dtype, [p.step.name for p in probes])
    for probe in probes:
        reference = _logits(stages[0].graphs[probe.entry], weights, probe.step)
        tol = tolerance(ir_dtype, reduction, reference.abs().max())
        for k, stage in enumerate(stages):
            check = Check(stage, probe.step.name, max_abs_error(_logits(stage.graphs[probe.entry], weights,
                                                                         probe.step), reference), tol)
            report.checks.append(check)
            if check.diverged and (report.culprit is None or stage.index < report.culprit.check.stage.index):
                report.culprit = _localize(stages[k - 1], check, probe, weights, ir_dtype, reduction)
    if steps > 0:
        report.greedy = _greedy(stages, report.culprit, weights, prompt_ids, steps)
        ids = {t for g in report.greedy for t in (*g.reference, *g.tokens)}
        report.token_text = {t: tokenizer.decode([t], skip_special_tokens=False) for t in ids}
    return report
