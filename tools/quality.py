"""The quality of a quantized model against its unquantized reference, on a held text that needs no
download: the English text of Python's own `pydoc_data.topics` (the help topics), first N tokens.

Both models read the same tokens in windows of `window` tokens (each window a fresh sequence,
one prefill step with logits at every position, so an int8 KV cache is written and read as in
serving), through the torch reference kernels: the report measures what the recipe does to the
numbers, not how two kernels order their sums (so weights kept bit for bit score exactly 0). Reported, as llama.cpp's `perplexity --kl-divergence` does:
  perplexity       exp(mean negative log-likelihood of each next token), both models
  mean KL          mean over positions of KL(P_reference || P_quantized)
  top-1 agreement  fraction of positions where both models' most likely next token is the same
`llmc compile --quality` stores this as report.json's "quality"; `llmc eval ART --against REF`
prints it for two artifacts. `llmc eval --activations int8` runs ART's quantized GEMMs as the CPU
serves them instead (the native kernels, x quantized to int8 per block of 32): against ART itself it
is the int8 activations' own cost, against the unquantized artifact the whole cost. `--activations
bf16` measures what a prompt's GEMMs cost where the CPU has AMX-BF16 and serves them so by default
(x and the dequantized weight rounded to bf16; each window is a prompt); where it has no AMX-BF16
it runs int8 and the report says so. `--activations f32` measures a prompt's GEMMs with f32 prompts
(x times the weight dequantized to fp32: qlinear's own meaning, so against ART itself it scores about 0).
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
from dataclasses import asdict, dataclass

import torch
import typer

from llmc.compiler.artifact import graph_weights
from llmc.compiler.driver import CompileConfig
from llmc.compiler.dtypes import USER_DTYPES
from llmc.compiler.frontend import trace
from llmc.compiler.ir import Graph
from llmc.kernels.native_ops import choose_activations, choose_op_impls, prepare_weights
from llmc.models.config import LoadedModel, TokenizerFiles
from llmc.passes.pipeline import run_pipeline
from llmc.passes.rewrite import PassContext
from llmc.runtime.artifact import ArtifactError, load_artifact
from llmc.runtime.sampling_params import RequestError
from llmc.runtime.tokenizer import Tokenizer
from llmc.runtime.torch_backend import TorchProgram

from .feeds import Step, step_feeds

HELD_TEXT = f"pydoc_data.topics (Python {platform.python_version()})"


@dataclass(frozen=True)
class Quality:
    against: str
    text: str
    tokens: int
    text_sha256: str
    perplexity: float
    reference_perplexity: float
    delta_perplexity_percent: float
    mean_kl: float
    top1_agreement: float
    activations: str = "float"      # the measured model's quantized GEMMs: float (the refs), int8, bf16 or f32

    def to_dict(self) -> dict:
        return asdict(self)


def held_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def held_tokens(files: TokenizerFiles, count: int) -> list[int]:
    """The first `count` tokens of the held text in a model's tokenizer (RequestError if it is shorter)."""
    ids = Tokenizer(files).encode(held_text(), add_special_tokens=False)
    if len(ids) < count:
        raise RequestError(f"the held text has {len(ids)} tokens, fewer than the {count} asked for")
    return ids[:count]


class WindowScorer:
    """A prefill graph bound to its weights, giving logits [T, V] (fp32) at every token of a window."""

    def __init__(self, prefill: Graph, weights: dict[str, torch.Tensor], kernels: str = "reference",
                 activations: str = "float"):
        """activations 'int8': the native kernels' quantized GEMMs with x quantized per block of 32
        (kernels/quant.py's qlinear_int8act_ref); 'bf16': a prompt's in bf16 on AMX (qlinear_bf16_ref),
        or int8 where AMX-BF16 is not usable; 'f32': a prompt's in fp32 (qlinear_ref). `self.activations`
        says which ran."""
        native = activations in ("int8", "bf16", "f32")
        impls, _ = choose_op_impls("native" if native else kernels)
        self.activations = choose_activations(activations) if native else "float"
        if native:
            weights = prepare_weights([prefill], weights, self.activations)
        self.graph = prefill
        self.program = TorchProgram(prefill, weights, impls)

    def __call__(self, tokens: list[int]) -> torch.Tensor:
        feeds = step_feeds(self.graph, Step.prefill("window", [tokens]))     # outside inference mode, as the
        with torch.inference_mode():                                           # runner's buffers are
            (logits,) = self.program(feeds)
        return logits.float()


def score(windows, dtype: torch.dtype = torch.float32) -> dict:
    """Over windows of (logits [n, V], the reference's logits [n, V], the n next tokens), log-softmax
    in `dtype`: both perplexities of the next tokens, mean KL(reference || model) and top-1
    agreement per position, and the positions counted."""
    nll = ref_nll = kl = agree = 0.0
    count = 0
    for logits, ref_logits, next_tokens in windows:
        logp, ref_logp = torch.log_softmax(logits.to(dtype), -1), torch.log_softmax(ref_logits.to(dtype), -1)
        targets = torch.as_tensor(next_tokens)[:, None]
        nll -= float(logp.gather(1, targets).sum())
        ref_nll -= float(ref_logp.gather(1, targets).sum())
        kl += float((ref_logp.exp() * (ref_logp - logp)).sum())
        agree += float((logp.argmax(-1) == ref_logp.argmax(-1)).sum())
        count += len(next_tokens)
    ppl, ref_ppl = math.exp(nll / count), math.exp(ref_nll / count)
    return {"perplexity": ppl, "reference_perplexity": ref_ppl, "delta_perplexity_percent": 100 * (ppl / ref_ppl - 1),
            "mean_kl": kl / count, "top1_agreement": agree / count, "positions": count}


def compare(model: WindowScorer, reference: WindowScorer, tokens: list[int], window: int,
            against: str, activations: str = "float") -> Quality:
    """Perplexities, mean KL and top-1 agreement of `model` against `reference` on `tokens`."""
    chunks = [tokens[start:start + window + 1] for start in range(0, len(tokens) - 1, window)]
    s = score((model(c[:-1]), reference(c[:-1]), c[1:]) for c in chunks if len(c) >= 2)
    digest = hashlib.sha256(str(tokens).encode()).hexdigest()[:16]
    return Quality(against, HELD_TEXT, s["positions"], digest, s["perplexity"], s["reference_perplexity"],
                   s["delta_perplexity_percent"], s["mean_kl"], s["top1_agreement"], activations)


def reference_prefill(model: LoadedModel, config: CompileConfig, weights: dict) -> Graph:
    """The prefill graph `config` compiles to without its quantization recipe (same dtype and passes)."""
    traced = trace(model.config, "prefill", USER_DTYPES[config.dtype])
    graph, _ = run_pipeline(traced, PassContext(weights=weights, quantized=dict(model.quantized)),
                            config.disabled_passes)
    return graph


def compile_assessment(config: CompileConfig, tokens: int, window: int):
    """An `assess` hook for compile_model: the compiled graphs against the unquantized ones."""
    def assess(model: LoadedModel, graphs: dict[str, Graph], weights: dict) -> dict:
        reference = reference_prefill(model, config, weights)
        ids = held_tokens(model.tokenizer, tokens)
        span = min(window, model.config.max_position_embeddings)
        scorer = WindowScorer(graphs["prefill"], graph_weights({"prefill": graphs["prefill"]}, weights))
        ref_scorer = WindowScorer(reference, graph_weights({"prefill": reference}, weights))
        return compare(scorer, ref_scorer, ids, span, f"the unquantized {config.dtype} compile").to_dict()

    return assess


def evaluate_artifacts(path: str, against: str, tokens: int, window: int, activations: str = "float") -> Quality:
    """`llmc eval`: artifact `path` (its quantized GEMMs' activations as `activations` says) against
    artifact `against` (float activations, the refs) on the held text."""
    model, reference = load_artifact(path), load_artifact(against)
    if model.config.vocab_size != reference.config.vocab_size or model.tokenizer != reference.tokenizer:
        raise ArtifactError(f"{path} and {against} do not share a tokenizer and vocabulary, so their next-token "
                            "distributions cannot be compared; compile both from the same model")
    ids = held_tokens(model.tokenizer, tokens)
    span = min(window, model.config.max_position_embeddings)
    scorer = WindowScorer(model.graphs["prefill"], model.weights, activations=activations)
    ref_scorer = WindowScorer(reference.graphs["prefill"], reference.weights)
    return compare(scorer, ref_scorer, ids, span, str(against), scorer.activations)


def eval_cmd(
    artifact: str = typer.Argument(..., help="artifact to measure (e.g. a quantized compile)"),
    against: str = typer.Option(..., "--against", help="reference artifact of the same model (e.g. unquantized)"),
    tokens: int = typer.Option(1024, help="tokens of held text to read"),
    window: int = typer.Option(512, help="tokens per sequence (each window a fresh prompt)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a line"),
    activations: str = typer.Option("float", help="ARTIFACT's quantized GEMMs: float (the torch refs), int8 "
                                    "(the native kernels, x quantized per block of 32) or bf16 (a prompt's x and "
                                    "weights in bf16 on AMX, as a CPU with AMX-BF16 serves prompts) or f32 (a "
                                    "prompt's x times the weight dequantized to fp32, as an AVX2 CPU serves "
                                    "prompts); the reference always runs float"),
) -> None:
    """Perplexity, mean KL and top-1 agreement of ARTIFACT against a reference, on Python's help text."""
    from .inspect import quality_line

    if tokens < 2 or window < 1:
        raise RequestError(f"--tokens {tokens} and --window {window} must be at least 2 and 1")
    if activations not in ("float", "int8", "bf16", "f32"):
        raise RequestError(f"--activations {activations!r} is unknown; choose float, int8, bf16 or f32")
    quality = evaluate_artifacts(artifact, against, tokens, window, activations)
    typer.echo(json.dumps(quality.to_dict(), indent=2) if as_json else quality_line(quality.to_dict()))
