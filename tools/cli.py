"""The `llmc` command line: compile, generate, inspect.

Generated text goes to stdout and statistics to stderr, so `llmc generate ... | cmd` pipes only
the answer. A user error (bad model, bad artifact, bad request) prints one sentence and exits 1.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.markup import escape

from llmc.compiler.ir import IRError
from llmc.compiler.quant_recipe import QuantRecipeError
from llmc.kernels.native import NativeBuildError
from llmc.models.config import ModelError
from llmc.passes.pipeline import PassError
from llmc.runtime.artifact import ArtifactError
from llmc.runtime.sampling_params import RequestError

from .inspect import artifact_summary
from .bench import (ACTIVATIONS_OPTION, ASYNC_SCHEDULING_OPTION, CUDA_GRAPHS_OPTION, KERNELS_OPTION,
                    NUM_DRAFT_TOKENS_OPTION, SPECULATIVE_OPTION, STEP_PLANS_OPTION, bench_cmd, given_backend_options,
                    speculative_config)
from .bench_quant import bench_quant_cmd
from .bench_tp import bench_tp_cmd
from .bench_serve import bench_serve_cmd
from .bench_spec import bench_spec_cmd
from .bench_structured import bench_structured_cmd
from .kernels_cmd import kernels_cmd
from .profile_steps import profile_cmd
from .quality import eval_cmd
from .debug_cli import register as register_debug_tools
from .plan import plan_cmd
from .tp_cli import TP_OPTION, TP_TIMEOUT_OPTION, tensor_parallel

QUALITY_WINDOW = 512          # tokens per sequence when measuring quality (each window a fresh prompt)
USER_ERRORS = (ModelError, ArtifactError, IRError, PassError, RequestError, NativeBuildError, QuantRecipeError)

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True,
                  help="llmc: compile a decoder model (models/families) into an artifact, then run it.")


class CurrentStderr(logging.StreamHandler):
    """A log handler writing to whatever sys.stderr is at the time of each line: an in-process
    caller (a test's CliRunner) swaps stderr for one invocation and closes it afterwards."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _ignored) -> None:
        pass


@app.callback()
def show_progress_notes() -> None:
    """llmc's own log lines (a one-time kernel build, a fallback) go to stderr as plain sentences;
    other libraries' loggers are left as they are."""
    handler = CurrentStderr()
    handler.setFormatter(logging.Formatter("llmc: %(message)s"))
    log = logging.getLogger("llmc")
    log.handlers, log.propagate = [handler], False
    log.setLevel(logging.INFO)


def user_errors(command: Callable) -> Callable:
    """Turn llmc's user-facing errors into one line on stderr and exit code 1."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except USER_ERRORS as exc:
            Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
            raise typer.Exit(1) from None

    return wrapper


@app.command("compile")
@user_errors
def compile_cmd(
    model: Optional[str] = typer.Argument(None, help="HF folder or .gguf file; omit for the embedded SmolLM2-135M-Instruct"),
    out: Path = typer.Option(..., "-o", "--out", help="artifact directory to write"),
    dtype: str = typer.Option("float32", help="compute dtype: float32, bfloat16 or float16"),
    disable_pass: list[str] = typer.Option([], "--disable-pass", help="skip a pass by name (repeatable)"),
    dump_ir: Optional[Path] = typer.Option(None, "--dump-ir", help="write the IR after tracing and after every "
                                           "pass: DIR/prefill/00_traced.ir, DIR/prefill/01_canonicalize.ir, ..."),
    stop_after: Optional[str] = typer.Option(None, "--stop-after", help="end the pipeline after this pass (a stop "
                                             "before insert_paged_attention writes only the --dump-ir files)"),
    target: str = typer.Option("cpu", help="cpu (IR for the torch backend) or cuda (also a generated Triton kernel "
                               "for every fusion group, in the artifact's kernels/)"),
    quant: str = typer.Option("none", help="GEMM weights: none, int8 (per output channel) or int4[-g32|-g64|-g128] "
                              "(scale and min per group; int4 = int4-g32); a GGUF's Q8_0/Q4_0/Q4_1 blocks are kept"),
    kv_dtype: str = typer.Option("auto", help="KV cache: auto (the compute dtype) or int8 (a scale per token and head)"),
    quant_embeddings: Optional[bool] = typer.Option(None, "--quant-embeddings/--no-quant-embeddings",
                                                    help="the token embedding and LM head as int8 (the default with "
                                                    "--quant int8/int4), or kept in the compute dtype"),
    requantize: bool = typer.Option(False, "--requantize", help="round every weight from its float values, even "
                                    "where a GGUF's own Q8_0/Q4_0/Q4_1 blocks fit the recipe (kept by default)"),
    quality: bool = typer.Option(False, "--quality", help="measure perplexity, KL and top-1 agreement against the "
                                 "unquantized compile on a held text; stored in report.json, shown by inspect"),
    quality_tokens: int = typer.Option(1024, help="tokens of held text --quality reads"),
    draft_skip: int = typer.Option(0, "--draft-skip", help="also build a self-speculative `draft` graph: the "
                                   "model without the N layers whose skipping keeps its next-token choices "
                                   "closest on a calibration text (measured and recorded in report.json)"),
    tp: int = typer.Option(1, "--tp", help="shard over N tensor-parallel ranks: the graphs one rank runs, with "
                           "all_reduce / all_gather between them, and the shard plan in the manifest (llmc inspect)"),
) -> None:
    """Compile MODEL into an artifact directory."""
    from llmc.compiler.driver import CompileConfig, compile_model
    from llmc.compiler.quant_recipe import QuantRecipe

    recipe = QuantRecipe.parse(quant, kv_dtype, quant_embeddings, requantize)
    config = CompileConfig(dtype=dtype, disabled_passes=tuple(disable_pass), stop_after=stop_after, dump_ir=dump_ir,
                           target=target, quant=recipe, draft_skip=draft_skip, tp=tp)
    console = Console(stderr=True)
    start = time.perf_counter()
    with Progress(TextColumn("{task.description:<28}"), BarColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("compiling", total=1)

        def show(stage: str, done: int, total: int) -> None:
            bar.update(task, description=stage, completed=done, total=total)

        assess = None
        if quality:
            from llmc.tools.quality import compile_assessment
            assess = compile_assessment(config, quality_tokens, QUALITY_WINDOW)
        path = compile_model(model, out, config, progress=show, assess=assess)
    if path is None:
        console.print(f"stopped after {stop_after}: wrote the IR to {dump_ir}; no artifact, since the graphs "
                      "are not yet lowered for the runtime", highlight=False)
        return
    dumped = f"; IR after every pass in {dump_ir}" if dump_ir else ""
    console.print(f"wrote {path} in {time.perf_counter() - start:.1f} s{dumped}", highlight=False)


@app.command()
@user_errors
def generate(
    artifact: Path = typer.Argument(..., help="artifact directory from `llmc compile`"),
    prompt: str = typer.Argument(..., help="the user message (or raw prompt with --no-chat)"),
    max_tokens: int = typer.Option(128, help="most tokens to generate"),
    temperature: float = typer.Option(0.0, help="0 is greedy; higher samples more freely"),
    seed: Optional[int] = typer.Option(None, help="seed for sampling, for reproducible output"),
    chat: bool = typer.Option(True, "--chat/--no-chat", help="wrap the prompt in the model's chat template"),
    system: Optional[str] = typer.Option(None, help="system message (chat mode)"),
    kernels: Optional[str] = KERNELS_OPTION,
    activations: Optional[str] = ACTIVATIONS_OPTION,
    backend: str = typer.Option("auto", help="torch (CPU), triton (the artifact's generated kernels: a GPU, or "
                                "TRITON_INTERPRET=1 on the CPU), or auto (triton on a GPU if the artifact has kernels)"),
    cuda_graphs: Optional[bool] = CUDA_GRAPHS_OPTION,
    step_plans: Optional[bool] = STEP_PLANS_OPTION,
    speculative: Optional[str] = SPECULATIVE_OPTION,
    num_draft_tokens: int = NUM_DRAFT_TOKENS_OPTION,
    tp: int = TP_OPTION,
    tp_timeout: float = TP_TIMEOUT_OPTION,
) -> None:
    """Generate a reply to PROMPT, streaming it to stdout."""
    from llmc.runtime.engine import Engine, EngineConfig
    from llmc.runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
    options = given_backend_options(kernels=kernels, cuda_graphs=cuda_graphs, step_plans=step_plans,
                                    activations=activations)
    with tensor_parallel(tp, tp_timeout, artifact) as ranks:
        engine = Engine(artifact, EngineConfig(backend=backend, backend_options=options, ranks=ranks,
                                               speculative=speculative_config(speculative, num_draft_tokens)))
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        ids = engine.tokenizer.encode_chat(messages) if chat else engine.tokenizer.encode(prompt)
        _stream_to_stdout(engine, ids, params)


def _stream_to_stdout(engine, prompt_ids: list[int], params) -> None:
    start = time.perf_counter()
    first = None
    count = 0
    for out in engine.stream(prompt_ids, params):
        first = first or time.perf_counter()
        count += len(out.new_token_ids)
        sys.stdout.write(out.new_text)
        sys.stdout.flush()
        reason = out.finish_reason
    end = time.perf_counter()
    sys.stdout.write("\n")
    tpot = (end - first) / (count - 1) if count > 1 else 0.0
    Console(stderr=True, soft_wrap=True).print(
        f"prompt {len(prompt_ids)} tokens, generated {count} tokens ({reason}); "
        f"TTFT {1000 * (first - start):.0f} ms, TPOT {1000 * tpot:.1f} ms, "
        f"{(count - 1) / (end - first) if count > 1 else 0:.1f} tok/s decode", highlight=False)


@app.command()
@user_errors
def inspect(artifact: Path = typer.Argument(..., help="artifact directory")) -> None:
    """Verify an artifact's files against its manifest and print a summary."""
    typer.echo(artifact_summary(artifact))


@app.command()
@user_errors
def serve(
    artifact: Optional[Path] = typer.Argument(None, help="artifact directory; omit to serve the embedded default "
                                              "(compiled once into the cache folder)"),
    host: str = typer.Option("127.0.0.1", help="address to bind (loopback unless told otherwise)"),
    port: int = typer.Option(8000, help="port to listen on (0: any free port, printed at start)"),
    api_key: Optional[str] = typer.Option(None, help="require 'Authorization: Bearer KEY' on /v1/ routes"),
    served_model_name: Optional[str] = typer.Option(None, help="model id clients name (default: the artifact "
                                                    "folder's name)"),
    max_num_seqs: int = typer.Option(64, help="most sequences computed at once"),
    max_batched_tokens: int = typer.Option(2048, help="token budget per step (prompt chunks + decodes)"),
    kv_memory: str = typer.Option("1GiB", help="KV cache memory, e.g. 512MiB or 2GiB"),
    max_waiting: int = typer.Option(256, help="most requests waiting to be scheduled; more get 429"),
    grace_period: float = typer.Option(30.0, help="seconds running requests get to finish after SIGTERM"),
    prefix_cache_salt: Optional[str] = typer.Option(None, "--prefix-cache-salt", help="a salt every prefix-cache key "
                                                    "starts from (with each request's cache_salt): this server's "
                                                    "cached KV is keyed apart from any engine with another salt; "
                                                    "requests are kept apart from each other by their cache_salt"),
    async_scheduling: Optional[bool] = ASYNC_SCHEDULING_OPTION,
    kernels: Optional[str] = KERNELS_OPTION,
    activations: Optional[str] = ACTIVATIONS_OPTION,
    backend: str = typer.Option("auto", help="torch (CPU), triton (the artifact's generated kernels: a GPU, or "
                                "TRITON_INTERPRET=1 on the CPU), or auto (triton on a GPU if the artifact has kernels)"),
    cuda_graphs: Optional[bool] = CUDA_GRAPHS_OPTION,
    step_plans: Optional[bool] = STEP_PLANS_OPTION,
    speculative: Optional[str] = SPECULATIVE_OPTION,
    num_draft_tokens: int = NUM_DRAFT_TOKENS_OPTION,
    tp: int = TP_OPTION,
    tp_timeout: float = TP_TIMEOUT_OPTION,
) -> None:
    """Serve an artifact with an OpenAI-compatible API (completions, chat, streaming, /metrics)."""
    from llmc.runtime.engine import Engine, EngineConfig
    from llmc.runtime.memory_plan import parse_bytes
    from llmc.runtime.server import ServerConfig, bind_socket, run_server

    from .default_artifact import default_artifact

    options = given_backend_options(kernels=kernels, cuda_graphs=cuda_graphs, step_plans=step_plans,
                                    activations=activations)
    artifact = artifact if artifact is not None else default_artifact()
    with tensor_parallel(tp, tp_timeout, artifact, stop_server_on_failure=True) as ranks:
        config = EngineConfig(kv_cache_bytes=parse_bytes(kv_memory), max_num_seqs=max_num_seqs,
                              max_batched_tokens=max_batched_tokens, backend=backend, backend_options=options,
                              speculative=speculative_config(speculative, num_draft_tokens),
                              prefix_cache_salt=prefix_cache_salt, async_scheduling=async_scheduling, ranks=ranks)
        server = ServerConfig(served_model_name, api_key, max_waiting, grace_period)
        sock = bind_socket(host, port)
        engine = Engine(artifact, config)
        bound_host, bound_port = sock.getsockname()[:2]
        name = served_model_name or engine.artifact.path.name
        ranks_note = f", {tp} tensor-parallel ranks" if tp > 1 else ""
        Console(stderr=True, soft_wrap=True).print(
            f"llmc: serving {name} at http://{bound_host}:{bound_port}/v1 ({engine.kernels} kernels, "
            f"{engine.blocks.num_blocks} KV blocks of {engine.blocks.block_size} tokens{ranks_note}); Ctrl-C or "
            "SIGTERM stops", highlight=False)
        run_server(engine, server, sock)


app.command("plan")(user_errors(plan_cmd))
app.command("bench")(user_errors(bench_cmd))
app.command("bench-serve")(user_errors(bench_serve_cmd))
app.command("bench-spec")(user_errors(bench_spec_cmd))
app.command("bench-structured")(user_errors(bench_structured_cmd))
app.command("kernels")(user_errors(kernels_cmd))
app.command("profile")(user_errors(profile_cmd))
app.command("eval")(user_errors(eval_cmd))
app.command("bench-quant")(user_errors(bench_quant_cmd))
app.command("bench-tp")(user_errors(bench_tp_cmd))
register_debug_tools(app, user_errors)  # passes, ir, debug bisect|diff (tools/debug_cli.py)


if __name__ == "__main__":
    app()
