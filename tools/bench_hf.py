"""Hugging Face transformers baselines for `llmc bench`, on the same requests.

hf_static: `model.generate` in static batches of up to 64 requests in arrival order, prompts
    left-padded, each batch running until its longest request is done (how most users call it).
    Its throughput counts only the tokens each request asked for.
hf_continuous: transformers' own continuous-batching manager, where the installed version has
    one, with every request's own max_new_tokens.
Both ignore EOS and decode greedily, like llmc's side of the benchmark.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from llmc.compiler.dtypes import USER_DTYPES, to_torch
from llmc.models.embedded import EMBEDDED_FILE, embedded_model_path
from llmc.runtime.artifact import Artifact
from llmc.runtime.sampling_params import RequestError

STATIC_BATCH = 64


def _model_path(artifact: Artifact, hf_model: str | None) -> Path:
    if hf_model:
        return Path(hf_model)
    source = artifact.manifest["source"]
    if source.get("path") and Path(source["path"]).exists():
        return Path(source["path"])
    if EMBEDDED_FILE in source["files"]:
        return embedded_model_path()
    raise RequestError("the artifact's source model was not found; name it with --hf-model")


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
        path, kwargs["gguf_file"] = path.parent, path.name
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device).eval()
    model.generation_config.eos_token_id = None    # ignore EOS, as llmc's side does
    return model


def run_hf_static(model, requests, on_batch) -> dict:
    pad = 0
    start = time.perf_counter()
    for i in range(0, len(requests), STATIC_BATCH):
        batch = requests[i:i + STATIC_BATCH]
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch], device=model.device)
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch],
                            device=model.device)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(r.max_tokens for r in batch),
                           do_sample=False, pad_token_id=pad)
        on_batch(len(batch))
    elapsed = time.perf_counter() - start
    useful = sum(r.max_tokens for r in requests)
    return {"seconds": elapsed, "output_tokens": useful, "output_tok_s": useful / elapsed}


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
                 continuous: bool = True) -> dict:
    """Run every available transformers baseline (continuous batching unless told not to); a
    failing optional one reports its error."""
    model = load_hf_model(artifact, hf_model, device)
    ordered = sorted(requests, key=lambda r: r.arrival)
    results = {}
    task = progress.add_task("hf static batches", total=len(requests))
    results["hf_static"] = run_hf_static(model, ordered, lambda n: progress.advance(task, n))
    if continuous and hasattr(model, "continuous_batching_context_manager"):
        task = progress.add_task("hf continuous batching", total=len(requests))
        try:
            results["hf_continuous"] = run_hf_continuous(model, ordered, lambda: progress.advance(task))
        except Exception as exc:  # an optional peer: report why it could not run, keep the rest
            results["hf_continuous"] = {"error": f"{type(exc).__name__}: {exc}"}
    return results
