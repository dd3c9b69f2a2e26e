"""Compile-time benchmark: `python -m llmc.tools.bench_compile [MODEL] [--dtype D]`.

Compiles MODEL (default: the embedded SmolLM2-135M-Instruct) into a temporary directory and
prints the time of each stage (load, trace, passes, write) and of each pass, summed over the
prefill and decode graphs, from the artifact's report.json. A benchmark, not a test: the numbers
depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from llmc.compiler.driver import CompileConfig, compile_model
from llmc.runtime.artifact import REPORT_FILE


def _pass_table(report: dict) -> list[str]:
    seconds: dict[str, float] = {}
    hits: dict[str, list[int]] = {}
    for record in report["passes"]:
        seconds[record["name"]] = seconds.get(record["name"], 0.0) + record["seconds"]
        hits.setdefault(record["name"], []).append(record["hits"])
    lines = [f"  {'pass':<24}{'ms':>9}  hits (prefill, decode)"]
    lines += [f"  {name:<24}{1000 * s:>9.1f}  {', '.join(map(str, hits[name]))}" for name, s in seconds.items()]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="HF folder or .gguf (default: embedded SmolLM2)")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        compile_model(args.model, Path(tmp) / "artifact", CompileConfig(dtype=args.dtype))
        total = time.perf_counter() - start
        report = json.loads((Path(tmp) / "artifact" / REPORT_FILE).read_text())
    stages = report["seconds"]
    write = total - sum(stages.values())
    print(f"compile of {args.model or 'the embedded SmolLM2-135M-Instruct'} ({args.dtype}): {total:.2f} s total")
    print("  " + ", ".join(f"{k} {v:.2f} s" for k, v in stages.items()) + f", write (and rest) {write:.2f} s")
    print("\n".join(_pass_table(report)))
    print(f"  ops per layer (layer {report['layer_op_counts']['layer']}): "
          + ", ".join(f"{entry} {n}" for entry, n in report["ops_per_layer"].items()))


if __name__ == "__main__":
    main()
