"""`llmc bench-quant`: what each quantization recipe buys, measured in one run on this machine.

For every recipe it compiles the model (once, into --work-dir) and measures, with the torch
backend and native kernels: batch-1 decode (ms/token, tok/s), the bytes one decode step reads
(weights + KV, tools/profile_steps.py's `decode_bytes`), the GB/s that is, and its fraction of a
memory-read bandwidth sampled beside every few decode steps (profile_steps.py: the median over
the rounds, each against the samples beside it); and the default `llmc bench` workload's output tok/s;
decode and bench tok/s also as ratios to recipe none's (unquantized) in the same run. A recipe is WEIGHTS
(none, int8, int4, int4-g64, ...) with an optional `+kv8` for the int8 KV cache and `+rtn` to
round from the float values even where a GGUF's own blocks fit (`--requantize`). `--activations`
sets the quantized GEMMs' activations (by default bf16 prompts where the CPU has AMX-BF16, int8 where it
has AVX512-VNNI or AVX2); the table says per recipe what the kernels were.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch
import typer

from llmc.compiler.artifact import stale_code
from llmc.compiler.driver import CompileConfig, compile_model
from llmc.compiler.quant_recipe import QuantRecipe
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.sampling_params import RequestError
from llmc.runtime.torch_executor import TorchOptions

from .bench import Workload, parse_range, run_llmc
from .profile_steps import ROUND_TOKENS, cpu_name, decode_bytes, profile_decode
from .read_floor import ReadBandwidth

DEFAULT_RECIPES = "none,int8,int4,int4+rtn,int8+kv8"


def parse_recipe(text: str) -> QuantRecipe:
    weights, *suffixes = text.split("+")
    if unknown := [s for s in suffixes if s not in ("kv8", "rtn")]:
        raise RequestError(f"recipe {text!r} has an unknown suffix {unknown[0]!r}; write WEIGHTS[+kv8][+rtn]")
    return QuantRecipe.parse(weights, "int8" if "kv8" in suffixes else "auto", requantize="rtn" in suffixes)


def compiled(model: Optional[str], recipe: str, dtype: str, work_dir: Path) -> Path:
    """The artifact of `recipe`, compiled into work_dir once and reused while the code that made it
    is this code."""
    out = work_dir / f"{dtype}-{recipe.replace('+', '-')}"
    manifest = out / "manifest.json"
    if not manifest.is_file() or stale_code(json.loads(manifest.read_text())):
        compile_model(model, out, CompileConfig(dtype=dtype, quant=parse_recipe(recipe)))
    return out


def measure(artifact: Path, decode_tokens: int, workload: Workload, bandwidth: ReadBandwidth,
            activations: str = "auto") -> dict:
    engine = Engine(artifact, EngineConfig(kv_cache_bytes=2**30,                # `llmc bench`'s defaults
                                           backend_options={"kernels": "native", "activations": activations}))
    decode, context = profile_decode(engine, decode_tokens, bandwidth=bandwidth)
    art = engine.artifact
    weight_bytes = sum(t.numel() * t.element_size() for t in art.weights.values())
    step_bytes = decode_bytes(art.graphs["decode"], art, context)
    bench = run_llmc(engine, workload.requests(art.config.vocab_size), lambda: None)
    return {"decode_s": decode.seconds, "decode_bytes": step_bytes, "of_bandwidth": decode.of_bandwidth(step_bytes),
            "bandwidth": sorted(decode.floors)[len(decode.floors) // 2],
            "stored_weight_bytes": weight_bytes, "bench_output_tok_s": bench["output_tok_s"], "kernels": engine.kernels}


def format_table(result: dict) -> str:
    quantized = sorted({r["kernels"] for r in result["recipes"].values()} - {"native"})   # 'native, int8 activations'
    lines = [f"{result['cpu']} | torch threads {result['threads']} | {result['dtype']} | "
             f"{'; '.join(quantized) if quantized else 'native kernels'} | "
             f"floor: the native read floor (tools/read_floor.py) sampled beside every {ROUND_TOKENS} decode steps; "
             f"'of floor' is the median over those rounds",
             f"{'recipe':<12} {'weights MB':>10} {'MB/token':>9} {'ms/token':>9} {'tok/s':>7} {'vs none':>7} "
             f"{'GB/s':>6} {'floor GB/s':>10} {'of floor':>8} {'bench tok/s':>11} {'vs none':>7}"]
    fp = result["recipes"]["none"]                  # the same run's unquantized artifact
    for name, r in result["recipes"].items():
        gbs = r["decode_bytes"] / r["decode_s"]
        lines.append(f"{name:<12} {r['stored_weight_bytes'] / 1e6:>10.1f} {r['decode_bytes'] / 1e6:>9.1f} "
                     f"{1000 * r['decode_s']:>9.2f} {1 / r['decode_s']:>7.1f} {fp['decode_s'] / r['decode_s']:>6.2f}x "
                     f"{gbs / 1e9:>6.1f} {r['bandwidth'] / 1e9:>10.1f} {100 * r['of_bandwidth']:>7.0f}% "
                     f"{r['bench_output_tok_s']:>11.1f} {r['bench_output_tok_s'] / fp['bench_output_tok_s']:>6.2f}x")
    return "\n".join(lines)


def bench_quant_cmd(
    model: Optional[str] = typer.Argument(None, help="HF folder or .gguf; omit for the embedded SmolLM2-135M-Instruct"),
    recipes: str = typer.Option(DEFAULT_RECIPES, help="comma-separated recipes: WEIGHTS[+kv8][+rtn]; none (the "
                                "compute dtype, which the 'vs none' ratios divide by) is always measured"),
    dtype: str = typer.Option("float32", help="compute dtype: float32 or bfloat16"),
    decode_tokens: int = typer.Option(32, help="tokens of the batch-1 decode measurement"),
    num_requests: int = typer.Option(64, help="requests in the `llmc bench` workload (its default)"),
    prompt_len: str = typer.Option("32:256", help="the workload's prompt length: N or a uniform range LO:HI"),
    output_len: str = typer.Option("16:192", help="the workload's output length: N or a uniform range LO:HI"),
    work_dir: Path = typer.Option(Path("artifacts/bench-quant"), help="where the recipes' artifacts are kept"),
    json_file: Optional[Path] = typer.Option(None, "--json", help="write the results to this JSON file"),
    activations: str = typer.Option("auto", help="quantized GEMMs' activations: int8, bf16, f32, float or auto "
                                    "(`llmc bench --activations` says what each is)"),
) -> None:
    """Per quantization recipe: batch-1 decode speed and bytes against the bandwidth floor, and bench throughput."""
    names = [r.strip() for r in recipes.split(",") if r.strip()]
    names = names if "none" in names else ["none", *names]       # every recipe against fp in the same run
    TorchOptions(activations=activations)           # checked before minutes of work, as every recipe
    for name in names:
        parse_recipe(name)
    work_dir.mkdir(parents=True, exist_ok=True)
    workload = Workload(num_requests, parse_range(prompt_len, "prompt length"), parse_range(output_len, "output length"))
    result = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "dtype": dtype, "workload": asdict(workload),
              "recipes": {}}
    bandwidth = ReadBandwidth()
    for name in names:
        artifact = compiled(model, name, dtype, work_dir)
        result["recipes"][name] = measure(artifact, decode_tokens, workload, bandwidth, activations)
    typer.echo(format_table(result))
    if json_file:
        json_file.write_text(json.dumps(result, indent=2, default=str))
