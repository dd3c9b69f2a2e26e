"""`llmc compile`: load a model, trace both entry graphs, run the pipeline, write the artifact.

IR dumps (`dump_ir`): the IR of each entry graph after tracing and after every pass, as
`DIR/prefill/00_traced.ir`, `DIR/prefill/01_canonicalize.ir`, ... and the same under
`DIR/decode/` (and `DIR/draft/`, whose 00_traced.ir is the traced prefill with the layers skipped). The number is the pass's place in the pipeline (`llmc passes`), so a disabled
pass leaves a gap and a pass has the same file name in every dump, ready for `llmc debug diff`.

Stopping early (`stop_after`): the pipeline ends after that pass. A stop before a pass the
runtime needs (insert_paged_attention) leaves graphs that no runtime can run, so it writes the
IR dumps and no artifact, as inspecting a phase in TVM / MLC builds nothing; without `dump_ir`
such a stop is refused with a sentence saying so.

A self-speculative draft (`draft_skip` N > 0): compiler/draft.py chooses N layers against the
calibration text, passes/skip_layers.py bypasses them in the traced prefill, and the result goes
through the same pipeline as the other entries, as a third entry graph `draft` over the same
weights; the choice and its measured acceptance go into report.json as "draft".
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from llmc.compiler.draft import CALIBRATION_TOKENS, DraftChoice, calibration_tokens, check_draft_skip, choose_draft_skip
from llmc.compiler.dtypes import USER_DTYPES, to_torch
from llmc.compiler.frontend import ENTRIES, trace
from llmc.compiler.ir import Graph, print_graph
from llmc.models.config import LoadedModel, ModelError
from llmc.models.loader import load_model
from llmc.passes.pipeline import Pass, PassError, check_pass_options, pass_names, required_after, run_pipeline
from llmc.passes.rewrite import PassContext
from llmc.passes.skip_layers import skip_layers

from .artifact import check_target, write_artifact
from .quant_recipe import QuantRecipe
from .tensor_parallel import TensorParallelPlan
from .codegen import Lowering, lower
from .codegen.cpu_lowering import CpuLowering, lower_cpu

Progress = Callable[[str, int, int], None]     # (stage, stages done before it, total stages)
Assess = Callable[[LoadedModel, dict[str, Graph], dict], dict]
STAGES = ["loading model", *(f"{what} {entry}" for entry in ENTRIES for what in ("tracing", "running passes on")),
          "choosing draft layers", "running passes on draft", "generating kernels", "writing artifact"]
TARGETS = ("cpu", "cuda")      # cpu: IR and the C++ CPU kernels for the torch backend; cuda: also the Triton kernels


@dataclass(frozen=True)
class CompileConfig:
    """Options of one compile; validated on construction."""

    dtype: str = "float32"
    disabled_passes: tuple[str, ...] = ()
    stop_after: str | None = None
    dump_ir: Path | None = None
    target: str = "cpu"
    quant: QuantRecipe = QuantRecipe()
    draft_skip: int = 0         # N > 0: also a self-speculative `draft` graph skipping N layers
    tp: int = 1                 # N > 1: the graphs one of N tensor-parallel ranks runs (passes/shard.py)

    def __post_init__(self) -> None:
        if self.draft_skip < 0:
            raise ModelError(f"--draft-skip {self.draft_skip} is negative; give the number of layers the draft skips")
        if self.tp < 1:
            raise ModelError(f"--tp {self.tp} is not a rank count; give 1 or more")
        if self.tp > 1 and self.draft_skip:
            raise ModelError(f"--draft-skip {self.draft_skip} cannot go with --tp {self.tp}: the draft graph is not "
                             f"sharded; drop one of them")
        if self.target not in TARGETS:
            raise ModelError(f"target {self.target!r} is unknown; choose one of {', '.join(TARGETS)}")
        if self.dtype not in USER_DTYPES:
            raise ModelError(f"dtype {self.dtype!r} is not supported; choose one of {', '.join(USER_DTYPES)}")
        check_pass_options(self.disabled_passes, self.stop_after)
        missing = required_after(self.stop_after)
        if missing and self.dump_ir is None:
            raise PassError(f"--stop-after {self.stop_after} ends before {missing[0]}, which the runtime needs, "
                            f"so no artifact could run; add --dump-ir DIR to write the IR up to that pass, "
                            f"or stop at {missing[0]} or later")

    @property
    def writes_artifact(self) -> bool:
        return not required_after(self.stop_after)


class IRDumper:
    """Writes one entry graph's IR after tracing and after each pass (see module docstring)."""

    def __init__(self, root: Path, entry: str):
        self.folder = Path(root) / entry
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob("[0-9][0-9]_*.ir"):  # from an earlier dump with other options
            stale.unlink()
        self.position = {name: i + 1 for i, name in enumerate(pass_names())}

    def traced(self, graph: Graph) -> None:
        (self.folder / "00_traced.ir").write_text(print_graph(graph))

    def __call__(self, p: Pass, graph: Graph) -> None:
        (self.folder / f"{self.position[p.name]:02d}_{p.name}.ir").write_text(print_graph(graph))


_LAYER_WEIGHT = re.compile(r"^w\.layers\.(\d+)\.")


def _layer_of(graph_nodes: dict, node) -> int | None:
    """The decoder layer whose weights the node reads; -1 for other weights; None for none."""
    for v in node.inputs:
        if graph_nodes[v.node].op == "weight":
            m = _LAYER_WEIGHT.match(v.node)
            return int(m.group(1)) if m else -1
    return None


def layer_op_counts(graph: Graph, layer: int) -> dict[str, int]:
    """Ops of one decoder layer: from the first op reading its weights up to the first op that
    reads another layer's (or a non-layer) weight."""
    nodes = graph.node_map()
    ops = [n for n in graph.nodes if n.op not in ("input", "weight")]
    owners = [_layer_of(nodes, n) for n in ops]
    if layer not in owners:
        return {}
    start = owners.index(layer)
    end = next((i for i in range(start, len(ops)) if owners[i] not in (None, layer)), len(ops))
    counts: dict[str, int] = {}
    for node in ops[start:end]:
        counts[node.op] = counts.get(node.op, 0) + 1
    return counts


def _report(graphs: dict[str, Graph], records: list, num_layers: int, seconds: dict[str, float]) -> dict:
    layer = num_layers // 2
    per_layer = {entry: layer_op_counts(g, layer) for entry, g in graphs.items()}
    return {"passes": [dataclasses.asdict(r) for r in records],
            "op_counts": {entry: g.op_counts() for entry, g in graphs.items()},
            "layer_op_counts": {"layer": layer, **per_layer},
            "ops_per_layer": {entry: sum(c.values()) for entry, c in per_layer.items()},
            "seconds": seconds}


def compile_model(source: str | Path | None, out: str | Path, config: CompileConfig = CompileConfig(),
                  progress: Progress = lambda stage, done, total: None, assess: Assess | None = None) -> Path | None:
    """Compile `source` (HF folder, .gguf, or None for the embedded default) into `out`.

    Returns the artifact path, or None when `config` stops before a pass the runtime needs (then
    only the IR dumps are written). `assess(model, graphs, weights)`, when given, measures the
    compiled graphs (e.g. tools/quality.py against an unquantized compile); its result goes into
    report.json as "quality"."""
    if config.writes_artifact:
        check_target(Path(out))     # before minutes of work, not after
    seconds, start = {}, time.perf_counter()
    stage = lambda name: progress(name, STAGES.index(name), len(STAGES))  # noqa: E731
    stage("loading model")
    model = load_model(source)
    if config.draft_skip:
        check_draft_skip(config.draft_skip, model.config.num_layers)     # before minutes of work
    seconds["load"], start = time.perf_counter() - start, time.perf_counter()
    ir_dtype = USER_DTYPES[config.dtype]
    weights = dict(model.weights)  # fold_weights adds the merged tensors here, quantize_weights the codes
    quantized = dict(model.quantized)
    graphs, records, seconds["trace"], pass_records, draft = {}, [], 0.0, {}, None
    for entry in ENTRIES:
        stage(f"tracing {entry}")
        traced = trace(model.config, entry, ir_dtype)
        if entry == "prefill" and config.draft_skip:
            stage("choosing draft layers")
            draft = _choose_draft(model, traced, config.draft_skip, seconds)
            stage("running passes on draft")
            graphs["draft"], draft_records = _draft_graph(traced, draft, config, weights, quantized)
            records += draft_records
            start = time.perf_counter()
        seconds["trace"] += time.perf_counter() - start
        dumper = IRDumper(config.dump_ir, entry) if config.dump_ir else None
        if dumper:
            dumper.traced(traced)
        stage(f"running passes on {entry}")
        ctx = PassContext(options={"quant": config.quant, "tp": config.tp}, weights=weights, quantized=quantized)
        graphs[entry], entry_records = run_pipeline(traced, ctx, config.disabled_passes, config.stop_after,
                                                    on_pass=dumper)
        records += entry_records
        pass_records |= ctx.records
        start = time.perf_counter()
    seconds["passes"] = sum(r.seconds for r in records)
    if not config.writes_artifact:
        return None
    graphs = {entry: graphs[entry] for entry in (*ENTRIES, "draft") if entry in graphs}     # the file order
    stage("generating kernels")
    kernels = _generate_kernels(graphs, seconds) if config.target == "cuda" else None
    cpu_kernels = _generate_cpu_kernels(graphs, seconds)
    stage("writing artifact")
    report = _report(graphs, records, model.config.num_layers, seconds) | pass_records
    if draft is not None:
        report["draft"] = draft.to_dict()
    if assess is not None:
        report["quality"] = assess(model, graphs, weights)
    if kernels is not None:
        report["kernels"] = {"modules": len(kernels.modules), "units": {e: len(p) for e, p in kernels.plan.items()}}
    report["cpu_kernels"] = {"functions": len(cpu_kernels.functions),
                             "units": {e: len(p) for e, p in cpu_kernels.plan.items()},
                             "generated_units": {e: sum(f is not None for f in p) for e, p in cpu_kernels.plan.items()}}
    compile_info = {"dtype": config.dtype, "target": config.target,
                    "passes": [r.name for r in records if r.graph == "prefill"],
                    "disabled_passes": list(config.disabled_passes), "stop_after": config.stop_after,
                    "quant": config.quant.to_dict(), "draft_skip": config.draft_skip, "tp": config.tp}
    plan = TensorParallelPlan(config.tp, report.pop("shard", {}).get("weights", {}))
    return write_artifact(Path(out), model, graphs, compile_info, report, weights,
                          kernels.modules if kernels is not None else None, cpu_kernels.source(), plan)


def _choose_draft(model: LoadedModel, traced_prefill: Graph, n: int, seconds: dict[str, float]) -> DraftChoice:
    """The N layers to skip, measured on the calibration text (compiler/draft.py)."""
    weights = {n.name[2:]: model.weights[n.name[2:]].to(to_torch(n.type.dtype)) for n in traced_prefill.weights()}
    tokens = calibration_tokens(model.tokenizer, min(CALIBRATION_TOKENS, model.config.max_position_embeddings))
    choice = choose_draft_skip(traced_prefill, weights, tokens, n)
    seconds["draft_search"] = choice.seconds
    return choice


def _draft_graph(traced_prefill: Graph, draft: DraftChoice, config: CompileConfig, weights: dict,
                 quantized: dict) -> tuple[Graph, list]:
    """The draft entry: the traced prefill without the chosen layers, through the same pipeline."""
    ctx = PassContext(options={"quant": config.quant, "draft_skip": draft.skip}, weights=weights, quantized=quantized)
    traced = skip_layers(traced_prefill, ctx)
    dumper = IRDumper(config.dump_ir, "draft") if config.dump_ir else None
    if dumper:
        dumper.traced(traced)
    return run_pipeline(traced, ctx, config.disabled_passes, config.stop_after, on_pass=dumper)


def _generate_kernels(graphs: dict[str, Graph], seconds: dict[str, float]) -> Lowering:
    """Every unit of both graphs lowered to a Triton kernel module (CodegenError names one that is not)."""
    start = time.perf_counter()
    lowering = lower(graphs)
    seconds["codegen"] = time.perf_counter() - start
    return lowering


def _generate_cpu_kernels(graphs: dict[str, Graph], seconds: dict[str, float]) -> CpuLowering:
    """Every generated CPU unit of both graphs as C++ (CodegenError names one it cannot write)."""
    start = time.perf_counter()
    lowering = lower_cpu(graphs)
    seconds["cpu_codegen"] = time.perf_counter() - start
    return lowering
