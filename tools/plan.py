"""`llmc plan`: size the KV cache for a model and a memory budget, without loading weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from llmc.models.config import ModelConfig
from llmc.models.loader import load_config
from llmc.runtime.artifact import read_manifest
from llmc.runtime.memory_plan import MemoryPlan, parse_bytes, plan_memory

from .inspect import human_bytes


def _config(model: str) -> ModelConfig:
    path = Path(model)
    if path.is_dir() and (path / "manifest.json").is_file():
        return ModelConfig.from_dict(read_manifest(path)["model"])
    return load_config(path)


def format_plan(cfg: ModelConfig, plan: MemoryPlan, weight_dtype: str, kv_dtype: str) -> str:
    sliding = ([f"sliding layers    {plan.sliding_layers} of {cfg.num_layers} attend within {plan.sliding_window:,} "
                "tokens; their KV keeps every token, as the runtime allocates it (counted above)"]
               if plan.sliding_layers else [])
    return "\n".join([
        f"model             {cfg.architecture}: {plan.parameters / 1e9:.2f} B parameters, {cfg.num_layers} layers, "
        f"{cfg.num_kv_heads} kv heads x {cfg.head_dim}",
        f"memory            {human_bytes(plan.memory_bytes, 2)}",
        f"weights           {human_bytes(plan.weight_bytes, 2)} ({weight_dtype})",
        f"KV per token      {human_bytes(plan.kv_bytes_per_token, 2)} ({kv_dtype}; 2 x {cfg.num_layers} layers x "
        f"{cfg.num_kv_heads} kv heads x {_row(cfg, plan, kv_dtype)} bytes)",
        *sliding,
        f"KV tokens         {plan.kv_tokens:,} in the {human_bytes(plan.memory_bytes - plan.weight_bytes, 2)} the weights leave",
        f"max sequences     {plan.max_sequences:,} at a context of {plan.context:,} tokens",
    ])


def _row(cfg: ModelConfig, plan: MemoryPlan, kv_dtype: str) -> str:
    """How one token's K (or V) row of one head adds up."""
    row = plan.kv_bytes_per_token // (2 * cfg.num_layers * cfg.num_kv_heads)
    if kv_dtype == "int8":
        return f"({cfg.head_dim} int8 codes + a 4-byte scale) = {row}"
    return f"{cfg.head_dim} dims x {row // cfg.head_dim}"


def plan_cmd(
    model: str = typer.Argument(..., help="config.json, HF folder, .gguf or artifact (weights are not read)"),
    memory: str = typer.Option(..., help="memory budget, e.g. 80GiB or 24GB"),
    weight_dtype: str = typer.Option("float16", help="float32, bfloat16, float16, int8 or int4 (GEMM weights as "
                                     "codes + fp16 scales, embeddings as int8; norms at 2 bytes)"),
    kv_dtype: str = typer.Option("float16", help="float32, bfloat16, float16 or int8 (codes + a scale per token "
                                 "per KV head)"),
    context: Optional[int] = typer.Option(None, help="tokens per sequence (default: the model's context)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    """Print weight bytes, KV bytes per token, tokens that fit and max concurrent sequences."""
    cfg = _config(model)
    plan = plan_memory(cfg, parse_bytes(memory), weight_dtype, kv_dtype, context)
    typer.echo(json.dumps(plan.to_dict(), indent=2) if as_json else format_plan(cfg, plan, weight_dtype, kv_dtype))
