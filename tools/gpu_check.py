"""The device check: `python -m llmc.tools.gpu_check --bundle DIR` on a GPU machine.

Builds SmolLM2-135M's exact shapes with seeded random weights from a small bundle (see
tools/gpu_check_model.py; write it with `python -m llmc.tools.gpu_check prepare --out DIR` where the
embedded model is installed), compiles it with --target cuda in each dtype, and checks the
candidate backend (triton, with CUDA graphs) against the torch backend on the same device:
logits and greedy tokens, each judged against an fp32 anchor (tools/gpu_check_correct.py), decode
step time with and without graphs, each kernel's device time and bandwidth against a
device-to-device copy, the batch-1 step against the bytes it must read, the quantized recipes
(int8, int4 weights, int8 KV) against the recipe compiled in fp32, their kernels' share of the
quality loss within the recipe's budget (tools/gpu_check_parts.py), and `llmc bench`
against transformers (each baseline in a child process with a time limit). It prints one table
last (tools/gpu_check_table.py) and writes JSON as each part completes (tools/gpu_check_run.py).

Its first second imports everything any part needs (tools/gpu_check_env.py): a missing package
is one sentence with the wheel commands that bring it, before any minute of device time is spent.

With `--device cpu --backend torch` the whole script runs on a CPU, the torch backend standing
in for triton, so CI checks its arguments, comparisons and table on a tiny model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .gpu_check_env import MissingPackage, require_packages

DTYPE_NAMES = ("float32", "bfloat16", "float16")          # llmc.compiler.dtypes.USER_DTYPES (a test checks)
RECIPE_NAMES = ("int8", "int4", "kv8")                    # gpu_check_parts.RECIPES (a test checks)
HF_TIMEOUT = 300.0


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m llmc.tools.gpu_check", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    prep = sub.add_parser("prepare", help="write the small bundle (config, tokenizer, gguf package) to carry")
    prep.add_argument("--out", type=Path, required=True)
    prep.add_argument("--gguf", type=Path, default=None, help="GGUF to read (default: the embedded SmolLM2)")
    p.add_argument("--bundle", type=Path, help="folder from `prepare` (or any HF folder: its config and tokenizer)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda where there is a GPU")
    p.add_argument("--backend", choices=("triton", "torch"), default="triton", help="the candidate backend")
    p.add_argument("--dtypes", default="bfloat16,float16", type=_names(DTYPE_NAMES))
    p.add_argument("--quant", default="int8,int4,kv8", type=_names(RECIPE_NAMES + ("none",)),
                   help="quantized recipes, compiled in the first dtype: int8, int4 (-g32) weights, kv8 (int8 KV)")
    p.add_argument("--batches", default="1,8,64", type=_ints, help="decode batch sizes to time")
    p.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per batch size")
    p.add_argument("--context", type=int, default=128, help="tokens each timed sequence holds")
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--bench", default="default,256", type=_names(("default", "256", "none")),
                   help="llmc bench workloads: default (64 requests) and 256 (256 concurrent); none")
    p.add_argument("--bench-requests", type=int, default=None, help="override every workload's request count")
    p.add_argument("--bench-prompt-len", default=None, help="override the prompt length (N or LO:HI)")
    p.add_argument("--bench-output-len", default=None, help="override the output length (N or LO:HI)")
    p.add_argument("--hf", default="static", type=_names(("static", "continuous", "none")),
                   help="transformers baselines, each in a child process: static, continuous (4.56+), none")
    p.add_argument("--hf-timeout", type=float, default=HF_TIMEOUT,
                   help="seconds each transformers baseline may take, loading included, before it is killed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", type=Path, default=None, help="folder for the model and artifacts (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None, help="write the results here, after every part")
    args = p.parse_args(argv)
    if args.command is None and args.bundle is None:
        p.error("--bundle is required (write one with `prepare --out DIR`)")
    if args.hf_timeout <= 0:
        p.error(f"--hf-timeout {args.hf_timeout:g} must be a positive number of seconds")
    return args


def _names(allowed: tuple[str, ...]):
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "prepare":
        from .gpu_check_model import prepare_bundle     # the CPU machine's step, with the embedded model

        print(f"wrote {prepare_bundle(args.out, args.gguf)}")
        return 0
    try:
        versions = require_packages(args)               # everything any part imports, now
    except MissingPackage as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    import torch                                        # imported (and checked) just now: no part waits on one

    from .gpu_check_run import USER_ERRORS, llmc_log_on_stderr, run_check, save_json
    from .gpu_check_table import format_table

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not args.dtypes:
        print("error: --dtypes names no dtype; give at least one of " + ", ".join(DTYPE_NAMES), file=sys.stderr)
        return 1
    try:
        with llmc_log_on_stderr():
            result = run_check(args, versions)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    save_json(args.json, result)
    print(format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
