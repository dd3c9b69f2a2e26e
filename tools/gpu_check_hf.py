"""The device check's bench parts: `llmc bench` on a workload, then each transformers baseline in a
child process of its own with a time limit.

llmc's numbers for the workload are saved (the check rewrites its JSON) before any baseline
starts, so nothing a baseline does can lose them. Each baseline (static `generate` batches, or
transformers' continuous-batching manager, which needs 4.56+ and may stall) runs as
`python -m llmc.tools.gpu_check_hf SPEC RESULT` on the same device: SPEC holds the artifact, the
device, the mode and the requests, RESULT receives tools/bench_hf.py's numbers. A child that
exits with an error, is killed, or outlives `--hf-timeout` (then its whole process group is
killed) is recorded as that baseline's {"error": ...}; the next baseline still runs.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
from argparse import Namespace
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from llmc.runtime.artifact import load_artifact
from llmc.runtime.engine import Engine, EngineConfig

from .bench import BenchRequest, Workload, parse_range, run_llmc
from .bench_hf import load_hf_model, run_hf_continuous, run_hf_static

STDERR_TAIL = 300                  # characters of a failed child's stderr kept in its error


def run_bench(args: Namespace, artifact_path: Path, name: str, save: Callable[[dict], None]) -> dict:
    """One `llmc bench` workload with llmc, then the transformers baselines `args.hf` names; `save`
    is given the part's results so far after llmc's run and after each baseline."""
    concurrent = 256 if name == "256" else 64
    lengths = {key: parse_range(text, key.replace("_", " ")) for key, text in
               (("prompt_len", args.bench_prompt_len), ("output_len", args.bench_output_len)) if text}
    workload = Workload(num_requests=args.bench_requests or concurrent, seed=args.seed, **lengths)
    engine = Engine(artifact_path, EngineConfig(kv_cache_bytes=(4 if concurrent > 64 else 1) << 30,
                                                max_num_seqs=concurrent, backend=args.backend, device=args.device))
    requests = workload.requests(engine.artifact.config.vocab_size)
    out = {"llmc": run_llmc(engine, requests, lambda: None), "graphs": engine.runner.cuda_graphs}
    del engine
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()                # the baselines' processes share the device
    if args.hf:
        out["baselines"] = {}
    save(out)
    for mode in args.hf:
        out["baselines"][f"hf_{mode}"] = hf_baseline(artifact_path, requests, mode, args, args.work / f"hf-{name}")
        save(out)
    return out


def child_command(spec: Path, result: Path) -> list[str]:
    """The baseline's child process (tests put a stand-in here)."""
    return [sys.executable, "-m", "llmc.tools.gpu_check_hf", str(spec), str(result)]


def hf_baseline(artifact_path: Path, requests: list[BenchRequest], mode: str, args: Namespace, folder: Path) -> dict:
    """One baseline's numbers from its child process, or {"error": why it gave none}."""
    folder.mkdir(parents=True, exist_ok=True)
    spec, result = folder / f"{mode}-spec.json", folder / f"{mode}-result.json"
    result.unlink(missing_ok=True)
    spec.write_text(json.dumps({"artifact": str(artifact_path), "device": args.device, "mode": mode,
                                "stall_seconds": args.hf_timeout, "requests": [asdict(r) for r in requests]}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}   # llmc as this process finds it
    child = subprocess.Popen(child_command(spec, result), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, env=env, start_new_session=True)     # its own group: killed whole
    try:
        _, err = child.communicate(timeout=args.hf_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        sys.stderr.write(child.communicate()[1])
        return {"error": f"timed out after {args.hf_timeout:g} s (--hf-timeout); the child was killed"}
    sys.stderr.write(err)
    if child.returncode != 0 or not result.is_file():
        how = f"killed by signal {-child.returncode}" if child.returncode < 0 else f"exit code {child.returncode}"
        return {"error": f"the baseline's process ended with {how}: {err.strip()[-STDERR_TAIL:]}"}
    return json.loads(result.read_text())


def child_main(spec_path: str, result_path: str) -> int:
    """The child: the transformers model of the artifact's source, one baseline, its numbers to RESULT."""
    spec = json.loads(Path(spec_path).read_text())
    artifact = load_artifact(spec["artifact"])
    model = load_hf_model(artifact, None, spec["device"])
    requests = sorted((BenchRequest(**r) for r in spec["requests"]), key=lambda r: r.arrival)
    if spec["mode"] == "static":
        numbers = run_hf_static(model, requests, lambda n: None)   # the device's minutes: batches as they come
    else:
        numbers = run_hf_continuous(model, requests, lambda: None, spec["stall_seconds"])
    partial = Path(result_path).with_suffix(".partial")
    partial.write_text(json.dumps(numbers))
    os.replace(partial, result_path)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(*sys.argv[1:]))
