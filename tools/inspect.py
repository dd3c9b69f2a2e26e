"""`llmc inspect`: verify an artifact and summarise what is in it, and how the torch backend would
run its graphs on this CPU (as one step plan each, or op by op and why)."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import torch

from llmc.compiler.dtypes import dtype_info
from llmc.compiler.ir import Graph
from llmc.compiler.quant_format import weight_format
from llmc.compiler.tensor_parallel import TensorParallelPlan, describe
from llmc.kernels.amx import describe_attention_path, describe_gemm_path
from llmc.kernels.native import EXTENSION_NAME, NativeBuildError, cache_dir, load_native_kernels, native_kernels_loaded
from llmc.runtime.artifact import REPORT_FILE, load_artifact, verify_artifact


def human_bytes(n: float, digits: int = 1) -> str:
    """1536 -> '1.5 KiB'; whole bytes below 1 KiB; TiB is the largest unit."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    power = 0
    while n >= 1024 and power < len(units) - 1:
        n, power = n / 1024, power + 1
    return f"{n:,.0f} B" if power == 0 else f"{n:,.{digits}f} {units[power]}"


def artifact_summary(path: str | Path) -> str:
    """Verify every file hash, then describe model, compile options, graphs and files."""
    path = Path(path)
    manifest, graphs = verify_artifact(path)
    model, compile_info, versions = manifest["model"], manifest["compile"], manifest["versions"]
    lines = [
        f"artifact   {path}  (format {manifest['format']} v{manifest['format_version']}, verified)",
        f"model      {model['architecture']}: {model['num_layers']} layers, hidden {model['hidden_size']}, "
        f"heads {model['num_heads']}/{model['num_kv_heads']} (q/kv), head_dim {model['head_dim']}, "
        f"vocab {model['vocab_size']}, context {model['max_position_embeddings']}",
        f"source     {manifest['source']['format']}: " +
        ", ".join(f"{name} ({sha[:12]})" for name, sha in manifest["source"]["files"].items()),
        f"compile    dtype {compile_info['dtype']}; passes {' -> '.join(compile_info['passes'])}"
        + (f"; disabled {', '.join(compile_info['disabled_passes'])}" if compile_info["disabled_passes"] else ""),
        f"versions   llmc {versions['llmc']}, torch {versions['torch']}, triton {versions['triton']}; "
        f"backends {', '.join(manifest['backends'])}",
    ]
    for entry, graph in graphs.items():
        ops = graph.op_counts()
        body = sum(v for k, v in ops.items() if k not in ("input", "weight"))
        lines.append(f"graph      {entry}: {body} ops, {ops.get('weight', 0)} weights, inputs "
                     + ", ".join(f"{n.name}:{n.type}" for n in graph.inputs()))
    plan = TensorParallelPlan.from_manifest(manifest)
    plans = torch_plans(path) if plan.size == 1 else f"step plans built by each of the {plan.size} ranks (--tp)"
    lines.append(f"torch      on this CPU, native kernels: {plans}")
    report = json.loads((path / REPORT_FILE).read_text())
    lines += quant_lines(compile_info.get("quant"), graphs, report)
    if draft := report.get("draft"):
        lines.append(draft_line(draft))
    lines += tensor_parallel_lines(plan, graphs)
    for name, entry in manifest["files"].items():
        lines.append(f"file       {name:<24} {human_bytes(entry['bytes']):>10}  sha256 {entry['sha256'][:16]}")
    return "\n".join(lines)


def torch_plans(path: Path) -> str:
    """What the torch backend would run each graph as here ('step plans: prefill yes, decode yes', or
    a graph op by op and why), after a quantized artifact's activations ('int8 activations (avx512-vnni); '). Only building its executor knows (a plan takes the weights as the
    native kernels lay them out), so this builds one, on a cache of one block, where the native
    kernels are built already; elsewhere it says it does not know rather than spend a build. A bf16
    artifact's line also says which kernel runs its GEMMs here (AMX or AVX-512, and why)."""
    if not (native_kernels_loaded() or any(cache_dir().glob(f"{EXTENSION_NAME}*.so"))):
        return "step plans unknown (native kernels not built; `llmc generate` builds them once)"
    try:
        load_native_kernels()
    except NativeBuildError:
        return "step plans unknown (native kernels do not load here)"
    from llmc.runtime.backends import choose_backend
    from llmc.runtime.engine import EngineConfig
    from llmc.runtime.executor import KVCacheSpec

    artifact = load_artifact(path)
    backend = choose_backend("torch", artifact, "cpu", {"kernels": "native", "cuda_graphs": False})
    cache = KVCacheSpec.from_graph_type(artifact.graphs["prefill"].node_map()["kv_cache"].type, 1,
                                        EngineConfig().block_size)
    capabilities = backend.build(artifact, cache).capabilities()
    activations = capabilities.kernels.removeprefix("native").lstrip(", ")      # quantized GEMMs: 'int8 activations'
    bf16 = any(w.dtype == torch.bfloat16 for w in artifact.weights.values())
    gemms = f"; {describe_attention_path(cache.head_dim, cache.dtype)}; {describe_gemm_path()}" if bf16 else ""
    return (f"{activations}; " if activations else "") + capabilities.describe_plans() + gemms


def weight_bytes_by_format(graphs: dict[str, Graph]) -> dict[str, tuple[int, int]]:
    """Stored weight bytes and tensor counts per format: 'int4-g32', 'int8-g576', 'f32', ..."""
    formats: dict[str, str] = {}
    sizes: dict[str, int] = {}
    for graph in graphs.values():
        nodes = graph.node_map()
        for node in graph.nodes:
            if node.op in ("qlinear", "qembedding"):
                codes = nodes[node.inputs[1 if node.op == "qlinear" else 0].node].type
                per_channel = node.attrs["bits"] == 8 and node.attrs["group_size"] == codes.shape[1]
                fmt = "int8-channel" if per_channel else f"int{node.attrs['bits']}-g{node.attrs['group_size']}"
                parts = weight_format(node.attrs["bits"]).parts          # codes, scales[, mins]: not a bias
                for v in node.inputs:
                    if nodes[v.node].op == "weight" and v.node.rsplit(".", 1)[-1] in parts:
                        formats.setdefault(v.node, fmt)
        for node in graph.weights():
            n = 1
            for d in node.type.shape:
                n *= d
            sizes[node.name] = n * dtype_info(node.type.dtype).element_size
            formats.setdefault(node.name, node.type.dtype)
    out: dict[str, tuple[int, int]] = {}
    for name, fmt in formats.items():
        total, count = out.get(fmt, (0, 0))
        out[fmt] = (total + sizes[name], count + (0 if name.endswith((".scales", ".mins")) else 1))
    return out


def quant_lines(recipe: dict | None, graphs: dict[str, Graph], report: dict) -> list[str]:
    """The recipe, how each weight got its codes, bytes per format and the measured quality."""
    lines = []
    if recipe:
        records = report.get("quantize_weights", {})
        how = Counter(v.split(" to ")[0] for v in records.values())
        ways = ", ".join(f"{way} {count}" for way, count in sorted(how.items()))
        lines.append(f"quant      weights {recipe['weights']}" + (f" ({ways})" if ways else "")
                     + f"; kv cache {recipe['kv_dtype']}; embeddings {'quantized' if recipe['embeddings'] else 'float'}")
        lines += [f"           {way}: {names}" for way, names in weights_by_way(records).items()]
    for fmt, (size, count) in sorted(weight_bytes_by_format(graphs).items(), key=lambda kv: -kv[1][0]):
        lines.append(f"weights    {fmt:<10} {human_bytes(size):>10}  {count} tensors")
    if quality := report.get("quality"):
        lines.append(quality_line(quality))
    return lines


def tensor_parallel_lines(plan: TensorParallelPlan, graphs: dict[str, Graph]) -> list[str]:
    """The shard plan: the rank count, each rank's weight bytes, and per kind of weight (its layer
    number left out) the rule that cuts it and its bytes on a rank."""
    if plan.size == 1:
        return []
    kinds: dict[str, tuple[str, int, int]] = {}          # kind -> (rule, tensors, bytes a rank)
    for node in {n.name: n for g in graphs.values() for n in g.weights()}.values():
        name = node.name[2:]
        kind = re.sub(r"^layers\.\d+\.", "layers.*.", name)
        rule = plan.weights.get(name, {"rule": "replicate"})
        size = dtype_info(node.type.dtype).element_size
        for d in node.type.shape:
            size *= d
        if plan.weights.get(rule.get("source"), {}).get("rule") == "replicate":
            size = 0                                    # a view of a tensor the rank holds whole
        rule, count, total = kinds.get(kind, (describe(rule, plan.size), 0, 0))
        kinds[kind] = (rule, count + 1, total + size)
    lines = [f"tensor-par {plan.size} ranks, {human_bytes(sum(b for _, _, b in kinds.values()))} of weights on each"]
    width = max(len(k) for k in kinds)
    lines += [f"           {kind:<{width}} {human_bytes(b):>10} a rank  {rule}" + (f"  ({n} tensors)" if n > 1 else "")
              for kind, (rule, n, b) in kinds.items()]
    return lines


def weights_by_way(records: dict[str, str]) -> dict[str, str]:
    """'kept Q4_1' -> 'layers.*.down_proj.weight, layers.*.gate_up_proj.weight, ...': which weights
    each way took, one pattern per weight of a layer."""
    ways: dict[str, list[str]] = {}
    for name, how in sorted(records.items()):
        pattern = re.sub(r"^layers\.\d+\.", "layers.*.", name)
        names = ways.setdefault(how.split(" to ")[0], [])
        if pattern not in names:
            names.append(pattern)
    return {way: ", ".join(names) for way, names in sorted(ways.items())}


def draft_line(d: dict) -> str:
    """The self-speculative draft: which layers it skips and its measured acceptance."""
    return (f"draft      skips layers {', '.join(map(str, d['skip']))} of {d['num_layers']} "
            f"({d['search']}); top-1 agreement {d['agreement']:.3f}, mean KL {d['mean_kl']:.4f}, "
            f"expected accepted of 4 {d['expected_accepted_k4']:.2f}, on {d['calibration_tokens']} calibration tokens")


def quality_line(q: dict) -> str:
    return (f"quality    perplexity {q['perplexity']:.4f} vs {q['reference_perplexity']:.4f} for {q['against']} "
            f"({q['delta_perplexity_percent']:+.3f}%), mean KL {q['mean_kl']:.5f}, top-1 agreement "
            f"{100 * q['top1_agreement']:.2f}% over {q['tokens']} tokens of {q['text']}"
            + (f", {q['activations']} activations" if q.get("activations") in ("int8", "bf16", "f32") else ""))
