"""llama.cpp as the peer for quantized batch-1 decode and its prompt: the SAME GGUF through
llama-cpp-python and through llmc's int4 artifact of it, in one run.

    python -m llmc.tools.bench_llamacpp [--gguf FILE] [--decode-tokens 128] [--depth 0] [--repeats 3]
        [--llama-python PY] [--artifact ART] [--work-dir DIR] [--json FILE]

Both decode greedily the same chat prompt (llmc's tokenizer and template; the peer is given the
token ids), with --depth N behind filler text to N tokens in all (llama-bench's depth: the context
each decode step's attention reads, where llmc's fp32 KV cache and llama.cpp's f16 one differ),
batch 1, with llmc's thread count (torch's; llama.cpp's n_threads and n_threads_batch), timed at
the same boundaries as `llmc generate` and `llmc profile`'s decode: wall time from the first token
out to the last, over the tokens after the first. The prompt's processing is timed too, from the
call to the first token out (llmc's TTFT), from an empty cache on both sides (llmc's prefix caching
off, the peer's cache reset): with --depth 512, llama-bench's pp512 at batch 1. Each side first runs
2 tokens untimed, then `--repeats` times, taking turns, and its best run counts (each figure's own
best). llama.cpp runs in a child process of `--llama-python` (by
default this interpreter), tools/llamacpp_peer.py, which prints JSON, so it may live in a venv of
its own: llama-cpp-python is never a dependency of llmc. Where it cannot be imported the script
says so in one line, with how to install it, and exits 0 before measuring anything.

The llmc side is the int4 artifact of the GGUF (`llmc bench-quant`'s, compiled into --work-dir
once and again when llmc's compiler code changed), or --artifact.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import typer

from llmc.models.embedded import embedded_model_path
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.sampling_params import RequestError, SamplingParams

from .bench_quant import compiled
from .profile_steps import cpu_name

PEER_SCRIPT = Path(__file__).with_name("llamacpp_peer.py")
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
FILLER = ("The keeper climbed the stairs at dusk, trimmed the wick, wound the clockwork and wrote the weather "
          "in the log: wind from the west, a swell from the south, three ships seen and none in trouble. ")
INSTALL = ("python3 -m venv /tmp/lcpp && CMAKE_ARGS=... /tmp/lcpp/bin/pip install llama-cpp-python==0.3.36 "
           "(../shared/ENVIRONMENT.md has the flags), then --llama-python /tmp/lcpp/bin/python")


def run_peer(llama_python: str, *args: str, timeout: float = 1800) -> dict:
    """The peer child's JSON answer; RequestError naming the interpreter when it fails."""
    try:
        # -I: not this folder on the child's sys.path, where tools/inspect.py would shadow the standard library's
        proc = subprocess.run([llama_python, "-I", str(PEER_SCRIPT), *args], capture_output=True, text=True,
                              timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RequestError(f"--llama-python {llama_python} could not run the llama.cpp peer ({exc}); "
                           "name a Python interpreter") from None
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        raise RequestError(f"the llama.cpp peer in {llama_python} failed (exit {proc.returncode}): {tail[0]}")
    return json.loads(lines[-1])


def depth_prompt(engine: Engine, depth: int) -> list[int]:
    """The chat prompt's ids behind the filler text's, `depth` ids in all (the chat prompt alone where
    depth is not longer than it)."""
    chat = engine.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    filler = engine.tokenizer.encode(FILLER, add_special_tokens=False)
    needed = max(0, depth - len(chat))
    return (filler * (needed // len(filler) + 1))[:needed] + chat


def llmc_decode(engine: Engine, prompt_ids: list[int], tokens: int) -> dict:
    """One greedy batch-1 decode through the engine, timed as the peer's: first token out to last,
    and the prompt from the call to the first token out."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    out, first, last, first_count = [], None, 0.0, 0
    start = time.perf_counter()
    for step in engine.stream(prompt_ids, params):
        last = time.perf_counter()
        out.extend(step.new_token_ids)
        if first is None:
            first, first_count = last, len(out)
    return {"decode_s": last - first, "tokens": len(out) - first_count, "token_ids": out, "prefill_s": first - start}


def recipe_name(manifest: dict) -> str:
    """'int4-g32, int8 embeddings' and the like: what the llmc side's weights are."""
    quant = manifest.get("compile", {}).get("quant") or {}
    tables = "int8 embeddings" if quant.get("embeddings") else "float embeddings"
    return f"{quant.get('weights', 'none')}, {tables}" if quant.get("bits") else "float"


def best(runs: list[dict], prompt_tokens: int) -> dict:
    """The fastest decode run, with its tok/s, and the fastest prompt's time and tok/s."""
    run = min(runs, key=lambda r: r["decode_s"] / max(r["tokens"], 1))
    prefill_s = min(r["prefill_s"] for r in runs)
    return {**run, "tok_s": run["tokens"] / run["decode_s"], "prefill_s": prefill_s,
            "prompt_tok_s": prompt_tokens / prefill_s}


def side_row(name: str, side: dict) -> str:
    """One engine's row: decode tok/s and ms/token, the prompt's ms and tokens per second."""
    return (f"{name:<28} {side['tok_s']:>8.1f} {1000 / side['tok_s']:>9.2f} {1000 * side['prefill_s']:>10.1f} "
            f"{side['prompt_tok_s']:>9.1f}")


def format_result(result: dict) -> str:
    """The table: each side's decode tok/s and prompt time, and llmc's over llama.cpp's."""
    llmc, peer = result["llmc"], result["llama.cpp"]
    same = "the same" if llmc["token_ids"] == peer["token_ids"] else "different"
    return "\n".join([
        f"{result['cpu']} | threads {result['threads']} | {Path(result['gguf']).name} | batch 1, greedy, "
        f"{result['decode_tokens']} tokens after a {result['prompt_tokens']}-token prompt, best of {result['repeats']}",
        f"{'engine':<28} {'tok/s':>8} {'ms/token':>9} {'prompt ms':>10} {'prompt/s':>9}",
        side_row("llmc " + result["artifact_recipe"], llmc),
        side_row("llama.cpp " + result["peer_version"], peer),
        f"llmc / llama.cpp: {llmc['tok_s'] / peer['tok_s']:.2f}x ({same} greedy tokens); the prompt "
        f"{peer['prefill_s'] / llmc['prefill_s']:.2f}x"])


def bench_llamacpp(
    gguf: Optional[Path] = typer.Option(None, help="the GGUF both run; default: the embedded SmolLM2 (Q4_1)"),
    decode_tokens: int = typer.Option(128, help="tokens each side decodes after the prompt"),
    depth: int = typer.Option(0, help="tokens of prompt (filler text, then the chat prompt) before the decode; "
                                     "0: the chat prompt alone"),
    repeats: int = typer.Option(3, help="runs per side, taking turns; the best counts"),
    llama_python: str = typer.Option(sys.executable, help="a Python interpreter with llama-cpp-python installed"),
    artifact: Optional[Path] = typer.Option(None, help="llmc's artifact of the GGUF; default: its int4 compile"),
    work_dir: Path = typer.Option(Path("artifacts/bench-quant"), help="where the int4 artifact is kept"),
    json_file: Optional[Path] = typer.Option(None, "--json", help="write the results to this JSON file"),
) -> None:
    """Batch-1 greedy decode and its prompt of one GGUF: llmc's int4 artifact against llama.cpp, in one run."""
    if decode_tokens < 2 or repeats < 1 or depth < 0:
        raise RequestError(f"--decode-tokens {decode_tokens}, --repeats {repeats} and --depth {depth}: decode at "
                           "least 2 tokens, at least once, after a prompt of 0 tokens or more")
    probe = run_peer(llama_python, "probe", timeout=120)
    if "missing" in probe:
        typer.echo(f"llama.cpp peer skipped: llama_cpp is not importable by {llama_python} ({probe['missing']}); "
                   f"install it in a venv of its own: {INSTALL}")
        return
    own = gguf is None                          # the embedded model: bench-quant's int4 artifact, shared
    gguf = gguf or embedded_model_path()
    folder = work_dir if own else work_dir / gguf.stem
    path = artifact or compiled(None if own else str(gguf), "int4", "float32", folder)
    engine = Engine(path, EngineConfig(enable_prefix_caching=False))   # each run's prompt processed, as the peer's
    prompt_ids = depth_prompt(engine, depth)
    if len(prompt_ids) + decode_tokens > engine.max_sequence_tokens:
        raise RequestError(f"--depth {depth} and --decode-tokens {decode_tokens} need "
                           f"{len(prompt_ids) + decode_tokens} tokens of context; this engine holds "
                           f"{engine.max_sequence_tokens}: ask for fewer")
    threads = torch.get_num_threads()
    ours, theirs, version = [], [], "unknown"
    llmc_decode(engine, prompt_ids, 2)                  # untimed, as the peer's first decode
    for _ in range(repeats):
        ours.append(llmc_decode(engine, prompt_ids, decode_tokens))
        peer = run_peer(llama_python, "decode", str(gguf), str(threads), str(decode_tokens), json.dumps(prompt_ids),
                        "1")
        theirs += peer["runs"]
        version = peer.get("version", version)
    result = {"cpu": cpu_name(), "threads": threads, "gguf": str(gguf), "artifact": str(path),
              "artifact_recipe": recipe_name(engine.artifact.manifest),
              "decode_tokens": decode_tokens, "prompt_tokens": len(prompt_ids), "repeats": repeats,
              "peer_version": version, "llmc": best(ours, len(prompt_ids)),
              "llama.cpp": best(theirs, len(prompt_ids))}
    typer.echo(format_result(result))
    if json_file:
        json_file.write_text(json.dumps(result, indent=2))


def main() -> None:
    try:
        typer.run(bench_llamacpp)
    except RequestError as exc:              # typer.run exits itself; a user error is one line, exit 1
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()
