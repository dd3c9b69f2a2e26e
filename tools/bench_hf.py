"""Hugging Face transformers baselines for `llmc bench`, on the same requests.

hf_static: `model.generate` in static batches in arrival order, prompts left-padded, each batch
    running until its longest request is done (how most users call it), on the best path found by
    trying the options a user would (hf_paths.tune: batch size, sdpa or eager, static cache, bf16
    autocast for float32) on the same requests with shorter outputs. Its throughput counts the
    tokens generate returned, each request's up to what it asked for.
hf_continuous: transformers' own continuous-batching manager, where the installed version has
    one, with every request's own max_new_tokens.
Both ignore EOS and decode greedily, like llmc's side of the benchmark.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from llmc.compiler.dtypes import USER_DTYPES, to_torch
from llmc.models.embedded import EMBEDDED_FILE, embedded_model_path
from llmc.runtime.artifact import Artifact
from llmc.runtime.sampling_params import RequestError

from .hf_paths import HfPath, tune


def _model_path(artifact: Artifact, hf_model: str | None) -> Path:
    if hf_model:
        return Path(hf_model)
    source = artifact.manifest["source"]
    if source.get("path") and Path(source["path"]).exists():
        return Path(source["path"])
    if EMBEDDED_FILE in source["files"]:
        return embedded_model_path()
    raise RequestError("the artifact's source model was not found; name it with --hf-model")


def dense_gguf_kwargs(file_name: str) -> dict[str, Any]:
    """`from_pretrained` kwargs that load the GGUF file `file_name` as a dense model, every tensor
    dequantized, as a reference or a peer must be. transformers from 5.2x keeps a quantized file's
    blocks packed when Hugging Face's `kernels` package is installed (its matmuls then cast every
    input and output) and otherwise dequantizes after a warning that the packed weights would be
    faster; `GgufConfig(dequantize=True)` asks for the dense model outright. Earlier versions have
    no GgufConfig and always dequantize."""
    import transformers
    kwargs: dict[str, Any] = {"gguf_file": file_name}
    if hasattr(transformers, "GgufConfig"):
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    return kwargs


def load_hf_model(artifact: Artifact, hf_model: str | None, device: str | None = None):
    """The transformers model of the artifact's source, in the artifact's compute dtype, on `device`
    (default: the GPU where there is one, as llmc's engine runs there, else the CPU)."""
    try:
        import transformers
    except ImportError:
        raise RequestError("--baseline hf needs transformers; install it with pip install 'llmc[test]'") from None
    path = _model_path(artifact, hf_model)
    dtype = to_torch(USER_DTYPES[artifact.manifest["compile"]["dtype"]])
    kwargs: dict[str, Any] = {"dtype": dtype}
    if path.suffix == ".gguf":
        path, kwargs = path.parent, {**kwargs, **dense_gguf_kwargs(path.name)}
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device).eval()
    model.generation_config.eos_token_id = None    # ignore EOS, as llmc's side does
    return model


def run_hf_static(model, requests, on_batch, path: HfPath = HfPath()) -> dict:
    """`generate` over the requests in static batches of path.batch_size; the output tokens are
    counted from what generate returned (each request's new tokens, up to what it asked for)."""
    pad, produced = 0, 0
    start = time.perf_counter()
    for i in range(0, len(requests), path.batch_size):
        batch = requests[i:i + path.batch_size]
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch], device=model.device)
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch],
                            device=model.device)
        out = path.generate(model, ids, attention_mask=mask, max_new_tokens=max(r.max_tokens for r in batch),
                            do_sample=False, pad_token_id=pad)
        produced += sum(min(out.shape[1] - width, r.max_tokens) for r in batch)
        on_batch(len(batch))
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": produced, "output_tok_s": produced / elapsed, "path": path.label}


TUNE_SHRINK = 4           # the tuning runs ask each request for a quarter of its output tokens


def tune_hf_static(model, requests, batch_sizes=(16, 32, 64)) -> tuple[HfPath, list[dict]]:
    """transformers' fastest static path on this workload, tried on the same requests with a
    quarter of their output lengths (the spread of lengths, and so the padding, kept)."""
    short = [replace(r, max_tokens=max(2, -(-r.max_tokens // TUNE_SHRINK))) for r in requests]
    useful = sum(r.max_tokens for r in short)
    seconds_per_token = lambda path: run_hf_static(model, short, lambda n: None, path)["seconds"] / useful  # noqa: E731
    return tune(model.dtype, [b for b in batch_sizes if b <= len(requests)] or [len(requests)], seconds_per_token)


STALL_SECONDS = 300.0     # the continuous-batching manager gave no result this long: give up on it


def run_hf_continuous(model, requests, on_done, stall_seconds: float = STALL_SECONDS) -> dict:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max(r.max_tokens for r in requests), do_sample=False,
                              eos_token_id=-1, pad_token_id=0)
    start, produced, finished = time.perf_counter(), 0, 0
    with model.continuous_batching_context_manager(generation_config=config, block=True) as manager:
        for r in requests:
            manager.add_request(r.prompt_ids, max_new_tokens=r.max_tokens, eos_token_id=-1)
        last = time.perf_counter()
        while finished < len(requests):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous-batching thread stopped before finishing")
                if time.perf_counter() - last > stall_seconds:
                    raise RuntimeError(f"transformers' continuous-batching manager gave no result for "
                                       f"{stall_seconds:.0f} s")
                continue
            last = time.perf_counter()
            if result.is_finished():
                produced += len(result.generated_tokens)
                finished += 1
                on_done()
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": produced, "output_tok_s": produced / elapsed}


def hf_baselines(artifact: Artifact, hf_model: str | None, requests, progress, device: str | None = None,
                 continuous: bool = True, tune_static: bool = True) -> dict:
    """Run every available transformers baseline (continuous batching unless told not to); the
    static one on its best path (tune_hf_static) unless told to take the defaults; a failing
    optional one reports its error."""
    model = load_hf_model(artifact, hf_model, device)
    ordered = sorted(requests, key=lambda r: r.arrival)
    results = {}
    if tune_static:
        task = progress.add_task("hf: trying its options", total=None)
        path, tries = tune_hf_static(model, ordered)
        progress.remove_task(task)
    else:
        path, tries = HfPath(), []
    task = progress.add_task(f"hf static batches ({path.label})", total=len(requests))
    results["hf_static"] = {**run_hf_static(model, ordered, lambda n: progress.advance(task, n), path),
                            "tried": tries}
    if continuous and hasattr(model, "continuous_batching_context_manager"):
        task = progress.add_task("hf continuous batching", total=len(requests))
        try:
            results["hf_continuous"] = run_hf_continuous(model, ordered, lambda: progress.advance(task))
        except Exception as exc:  # an optional peer: report why it could not run, keep the rest
            results["hf_continuous"] = {"error": f"{type(exc).__name__}: {exc}"}
    return results
