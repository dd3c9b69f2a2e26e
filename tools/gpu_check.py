"""The device check: `python -m llmc.tools.gpu_check --bundle DIR` on a GPU machine.

Builds SmolLM2-135M's exact shapes with seeded random weights from a small bundle (see
tools/gpu_check_model.py; write it with `python -m llmc.tools.gpu_check prepare --out DIR` where the
embedded model is installed), compiles it with --target cuda in each dtype, and checks the
candidate backend (triton, with CUDA graphs) against the torch backend on the same device:
logits, greedy tokens, decode step time with and without graphs, each kernel's bandwidth against
a device-to-device copy, the batch-1 step against the bytes it must read, and `llmc bench`
against transformers. It prints one table last (tools/gpu_check_table.py) and can write JSON.

With `--device cpu --backend torch` the whole script runs on a CPU, the torch backend standing
in for triton, so CI checks its arguments, comparisons and table on a tiny model.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import logging
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from llmc.compiler.driver import CompileConfig, compile_model
from llmc.models.config import ModelError
from llmc.runtime.artifact import ArtifactError, load_artifact
from llmc.runtime.model_runner import ModelRunner
from llmc.runtime.sampling_params import RequestError

from . import gpu_check_measure as measure
from .gpu_check_model import prepare_bundle, write_random_model
from .gpu_check_table import DTYPES, format_table, logits_tolerance

PROMPTS = ("What is the capital of France?", "Write a haiku about a GPU.", "List three prime numbers and say why.")
USER_ERRORS = (ModelError, ArtifactError, RequestError)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m llmc.tools.gpu_check", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    prep = sub.add_parser("prepare", help="write the small bundle (config, tokenizer, gguf package) to carry")
    prep.add_argument("--out", type=Path, required=True)
    prep.add_argument("--gguf", type=Path, default=None, help="GGUF to read (default: the embedded SmolLM2)")
    p.add_argument("--bundle", type=Path, help="folder from `prepare` (or any HF folder: its config and tokenizer)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", choices=("triton", "torch"), default="triton", help="the candidate backend")
    p.add_argument("--dtypes", default="bfloat16,float16", type=_names(DTYPES))
    p.add_argument("--batches", default="1,8,64", type=_ints, help="decode batch sizes to time")
    p.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per batch size")
    p.add_argument("--context", type=int, default=128, help="tokens each timed sequence holds")
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--bench", default="default,256", type=_names({"default": 0, "256": 0, "none": 0}),
                   help="llmc bench workloads: default (64 requests) and 256 (256 concurrent); none")
    p.add_argument("--bench-requests", type=int, default=None, help="override every workload's request count")
    p.add_argument("--bench-prompt-len", default=None, help="override the prompt length (N or LO:HI)")
    p.add_argument("--bench-output-len", default=None, help="override the output length (N or LO:HI)")
    p.add_argument("--hf", default="static,continuous", type=_names({"static": 0, "continuous": 0, "none": 0}),
                   help="transformers baselines to run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", type=Path, default=None, help="folder for the model and artifacts (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.command is None and args.bundle is None:
        p.error("--bundle is required (write one with `prepare --out DIR`)")
    return args


def _names(allowed: dict):
    def parse(text: str) -> list[str]:
        names = [n for n in text.split(",") if n]
        if bad := [n for n in names if n not in allowed]:
            raise argparse.ArgumentTypeError(f"{bad[0]!r} is not one of {', '.join(allowed)}")
        return [n for n in names if n != "none"]
    return parse


def _ints(text: str) -> list[int]:
    try:
        values = [int(n) for n in text.split(",") if n]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of batch sizes") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive; got {text!r}")
    return values


def environment(args: argparse.Namespace, device: torch.device) -> dict:
    import triton

    try:
        import transformers
        hf_version = transformers.__version__
    except ImportError:
        hf_version = "absent"
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "no GPU (CPU run)"
    return {"device": device.type, "gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
            "transformers": hf_version, "date": datetime.date.today().isoformat(), "backend": args.backend,
            "copy_bandwidth": measure.copy_bandwidth(device)}


def prompt_ids(artifact) -> list[list[int]]:
    from llmc.runtime.tokenizer import Tokenizer

    tok = Tokenizer(artifact.tokenizer)
    return [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]


def check_dtype(args: argparse.Namespace, folder: Path, dtype: str, kernels: bool) -> dict:
    """Every per-dtype measurement (see gpu_check_measure) of `folder` compiled in `dtype`."""
    artifact = load_artifact(compile_model(folder, args.work / f"artifact-{dtype}",
                                           CompileConfig(dtype=dtype, target="cuda")))
    vocab, prompts = artifact.config.vocab_size, prompt_ids(artifact)
    longest = max(map(len, prompts)) + args.greedy_tokens + 2
    blocks = max(measure.blocks_for(len(prompts), longest),
                 measure.blocks_for(max(args.batches), args.context + args.decode_steps + 3)) + 4
    # the torch refs on both sides when torch stands in for triton: the comparisons then have a known answer
    runner = lambda backend, graphs: ModelRunner.for_backend(  # noqa: E731
        artifact, blocks, measure.BLOCK_SIZE, backend,
        {"cuda_graphs": graphs, **({"kernels": "reference"} if backend == "torch" else {})},
        args.device, max(max(args.batches), 4))
    reference, candidate = runner("torch", False), runner(args.backend, None)
    out = {"graphs": candidate.cuda_graphs, "graph_error": candidate.graph_error,
           "capture": candidate.graph_report.__dict__ if candidate.graph_report else None}
    out["logits"] = measure.compare_logits(candidate, reference, prompts, 8, blocks)
    out["logits"]["tolerance"] = logits_tolerance(dtype, out["logits"]["scale"])
    got, _ = measure.greedy(candidate, prompts, args.greedy_tokens, blocks)
    want, want_logits = measure.greedy(reference, prompts, args.greedy_tokens, blocks)
    out["greedy"] = measure.first_divergence(got, want, want_logits, DTYPES[dtype])
    del reference
    eager = runner(args.backend, False)
    out["decode"] = {str(b): {"eager": measure.decode_seconds(eager, b, args.decode_steps, args.context, vocab),
                              "graphs": measure.decode_seconds(candidate, b, args.decode_steps, args.context, vocab)
                              if candidate.cuda_graphs else None} for b in args.batches}
    from .profile_steps import decode_bytes

    floor_bytes = decode_bytes(artifact.graphs["decode"], artifact, args.context)
    out["floor"] = {"bytes": floor_bytes, "seconds": floor_bytes / args.copy_bandwidth,
                    "replay": candidate.executor.graphs.replay_seconds(1, 50) if candidate.cuda_graphs else None}
    if kernels:
        out["kernels"] = [row.__dict__ for row in measure.kernel_table(eager, args.context, 5, vocab)]
    return out


def run_bench(args: argparse.Namespace, artifact_path: Path, name: str) -> dict:
    """One `llmc bench` workload with llmc and the transformers baselines on the same device."""
    from .bench import Workload, parse_range, run_llmc
    from .bench_hf import hf_baselines
    from llmc.runtime.engine import Engine, EngineConfig

    concurrent = 256 if name == "256" else 64
    lengths = {key: parse_range(text, key.replace("_", " ")) for key, text in
               (("prompt_len", args.bench_prompt_len), ("output_len", args.bench_output_len)) if text}
    workload = Workload(num_requests=args.bench_requests or concurrent, seed=args.seed, **lengths)
    engine = Engine(artifact_path, EngineConfig(kv_cache_bytes=(4 if concurrent > 64 else 1) << 30,
                                                max_num_seqs=concurrent, backend=args.backend, device=args.device))
    requests = workload.requests(engine.artifact.config.vocab_size)
    out = {"llmc": run_llmc(engine, requests, lambda: None), "graphs": engine.runner.cuda_graphs}
    artifact = engine.artifact
    del engine
    _free(args.device)
    if args.hf:
        out["baselines"] = hf_baselines(artifact, None, requests, _Quiet(), args.device, "continuous" in args.hf,
                                         tune_static=False)     # the device's minutes: batches of 64 as they are
    return out


class _Quiet:
    """The progress interface hf_baselines reports to, silent."""

    def add_task(self, *args, **kwargs) -> int:
        return 0

    def advance(self, *args) -> None:
        pass

    def remove_task(self, *args) -> None:
        pass


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def run_check(args: argparse.Namespace) -> dict:
    """Every measurement; with --json the file is rewritten after each part, so a run cut short
    by a time limit still leaves what it measured."""
    device = torch.device(args.device)
    args.work = args.work or Path(tempfile.mkdtemp(prefix="llmc-gpu-check-"))
    result = {"env": {**environment(args, device), "seconds": {}}, "dtypes": {}, "bench": {}}
    args.copy_bandwidth = result["env"]["copy_bandwidth"]
    folder = write_random_model(args.bundle, args.work / "model", args.seed)
    print(f"model: {folder} (seed {args.seed}); artifacts in {args.work}", file=sys.stderr)
    for section, name in plan(args):
        print(f"{section} {name} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        if section == "dtypes":
            result[section][name] = _part(lambda: check_dtype(args, folder, name, kernels=name == args.dtypes[0]))
        else:
            result[section][name] = _part(lambda: run_bench(args, args.work / f"artifact-{args.dtypes[0]}", name))
        result["env"]["seconds"][f"{section} {name}"] = time.perf_counter() - start
        _checkpoint(args, result)
        _free(args.device)
    return result


def plan(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The parts in the order that keeps the issue's targets first if time runs out: the first
    dtype, the default bench (which uses it), the other dtypes, the other benches."""
    first = [("dtypes", args.dtypes[0])] + [("bench", b) for b in args.bench if b == "default"]
    rest = [("dtypes", d) for d in args.dtypes[1:]] + [("bench", b) for b in args.bench if b != "default"]
    return first + rest


def _part(measure_part) -> dict:
    """One part's results, or {"error": ...} with its traceback on stderr: a part that fails on a
    GPU (a kernel that does not compile there, say) must not hide the others' numbers."""
    try:
        return measure_part()
    except USER_ERRORS:
        raise
    except Exception as exc:  # noqa: BLE001  (reported in the table and on stderr, then the next part)
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"}


@contextlib.contextmanager
def llmc_log_on_stderr():
    """llmc's log lines (each CUDA-graph capture: sizes, time, memory) on stderr while the check runs."""
    log, handler = logging.getLogger("llmc"), logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("llmc: %(message)s"))
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def _checkpoint(args: argparse.Namespace, result: dict) -> None:
    """The results so far: JSON to --json, and the table so far to stderr."""
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    print(format_table(result), file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "prepare":
            print(f"wrote {prepare_bundle(args.out, args.gguf)}")
            return 0
        with llmc_log_on_stderr():
            result = run_check(args)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    print(format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
