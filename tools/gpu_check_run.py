"""The device check's run: its parts in order, each one's results saved the moment it completes.

Parts (tools/gpu_check_parts.py, tools/gpu_check_hf.py), in the order that keeps the issue's
targets if a time limit cuts the run: the fp32 anchor, the first dtype, the default bench, the
other dtypes, the quantized recipes, the other benches. After each part, and inside a bench part
after llmc's run and after each transformers baseline, the whole result goes to `--json` by a
write to a temporary file and a rename, so a crash or a kill at any moment leaves the file as it
was after the last completed piece, never half written. A part that raises is recorded as
{"error": ...} with its traceback on stderr and the next part runs; a user error (a bad bundle or
request) stops the check with one sentence.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import logging
import os
import sys
import tempfile
import time
import traceback
from argparse import Namespace
from pathlib import Path
from typing import Callable

import torch

from llmc.models.config import ModelError
from llmc.runtime.artifact import ArtifactError
from llmc.runtime.sampling_params import RequestError

from . import gpu_check_measure as measure
from .gpu_check_hf import run_bench
from .gpu_check_model import write_random_model
from .gpu_check_parts import Anchor, build_anchor, check_dtype, check_recipe, dtype_artifact
from .gpu_check_table import format_table

USER_ERRORS = (ModelError, ArtifactError, RequestError)


def environment(args: Namespace, versions: dict[str, str]) -> dict:
    device = torch.device(args.device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "no GPU (CPU run)"
    return {"device": device.type, "gpu": gpu, **versions, "date": datetime.date.today().isoformat(),
            "backend": args.backend, "copy_bandwidth": measure.copy_bandwidth(device), "seconds": {}}


def plan(args: Namespace) -> list[tuple[str, str]]:
    """(section, name) of each part, in the order of the module docstring."""
    first = [("anchor", "float32"), ("dtypes", args.dtypes[0])] + [("bench", b) for b in args.bench if b == "default"]
    rest = [("dtypes", d) for d in args.dtypes[1:]] + [("quant", q) for q in args.quant]
    return first + rest + [("bench", b) for b in args.bench if b != "default"]


def run_check(args: Namespace, versions: dict[str, str]) -> dict:
    """Every part of `plan`; the result dict, as the JSON file holds it after each piece."""
    args.work = args.work or Path(tempfile.mkdtemp(prefix="llmc-gpu-check-"))
    result = {"env": environment(args, versions), "anchor": {}, "dtypes": {}, "quant": {}, "bench": {}}
    args.copy_bandwidth = result["env"]["copy_bandwidth"]
    folder = write_random_model(args.bundle, args.work / "model", args.seed)
    print(f"model: {folder} (seed {args.seed}); artifacts in {args.work}", file=sys.stderr)
    save_json(args.json, result)
    anchor: list[Anchor] = []
    for section, name in plan(args):
        print(f"{section} {name} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()

        def save(partial: dict, section=section, name=name) -> None:
            result[section][name] = partial
            save_json(args.json, result)

        outcome = _part(lambda: run_part(args, folder, anchor, section, name, save))
        if "error" in outcome and name in result[section]:      # what the part saved before it failed stays
            outcome = {**result[section][name], "interrupted": outcome["error"]}
        save(outcome)
        result["env"]["seconds"][f"{section} {name}"] = time.perf_counter() - start
        save_json(args.json, result)
        print(format_table(result), file=sys.stderr, flush=True)
        _free(args.device)
    return result


def run_part(args: Namespace, folder: Path, anchor: list[Anchor], section: str, name: str,
             save: Callable[[dict], None]) -> dict:
    """One part's results; `anchor` holds the fp32 anchor once its part has run."""
    if section == "anchor":
        anchor.append(build_anchor(args, folder))
        return {"artifact": str(anchor[0].artifact.path), "scale": max(x.abs().max().item() for x in anchor[0].logits)}
    if section == "bench":
        return run_bench(args, dtype_artifact(args, folder, args.dtypes[0]), name, save)
    if not anchor:
        raise RuntimeError("the fp32 anchor failed (its part shows why), so nothing can be judged against it")
    if section == "dtypes":
        return check_dtype(args, folder, anchor[0], name, kernels=name == args.dtypes[0])
    return check_recipe(args, folder, anchor[0], name)


def _part(measure_part: Callable[[], dict]) -> dict:
    """One part's results, or {"error": ...} with its traceback on stderr: a part that fails on a
    GPU (a kernel that does not compile there, say) must not hide the others' numbers."""
    try:
        return measure_part()
    except USER_ERRORS:
        raise
    except Exception as exc:  # noqa: BLE001  (reported in the table and on stderr, then the next part)
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"}


def save_json(path: Path | None, result: dict) -> None:
    """`result` to `path` atomically: a temporary file beside it, then a rename over it."""
    if path is None:
        return
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(result, indent=2, default=str))
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


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
