"""Choosing the self-speculative draft's layers (`llmc compile --draft-skip N`), at compile time.

The draft is the target with N decoder layers bypassed (passes/skip_layers.py). Which N is chosen
by measuring, on a fixed calibration text (compiler/calibration_text.py, tokenized with the model's
own tokenizer, its first CALIBRATION_TOKENS tokens), teacher-forced, how often the draft's most
likely next token is the target's (`agreement`), with the mean KL(target || draft) as the tie-break.

The search is greedy backward elimination: start from the full model; each round try skipping each
remaining candidate layer on top of those already skipped and keep the one whose draft agrees most
with the target; N rounds. Layer 0 and the last layer are candidates only when N leaves no other
choice (they hold the embedding-to-stream and stream-to-logits work; skipping them costs the most in
the published layer-skip studies). Greedy rather than Bayesian optimisation because its cost is
known in advance and small: rounds x candidates = N x (L - 2 - (N - 1) / 2) drafts scored on the
calibration tokens (SmolLM2, L = 30, N = 8: 196), each resuming from the current draft's residual
entering the candidate layer (one full forward per round records them), so a candidate runs only
the layers after it, about half a forward on average; deterministic, and each step is
explainable (the report keeps every round's pick, agreement and expected accepted length; the
rounds are nested, so a search for N also tells what every smaller N would choose); a Bayesian
search (SWIFT) helps when a forward is expensive or N is large and fits a later issue.

Forwards run the traced graphs through the op records' torch references on the CPU, in the compile
dtype, on the unquantized weights: the measured acceptance is the layer skip's, not a quantization
recipe's. `expected_accepted_k4` is the mean, over calibration positions, of the number of
consecutive agreeing positions starting there, capped at 4: the accepted length of K = 4 drafts if
the draft proposed along the text (teacher-forced, so an estimate of what serving sees).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
from tokenizers import Tokenizer

from llmc.compiler.dtypes import to_torch
from llmc.compiler.ir import Graph, Value
from llmc.compiler.ops import OPS, bind
from llmc.models.config import ModelError, TokenizerFiles
from llmc.passes.rewrite import PassContext
from llmc.passes.skip_layers import TAIL, layer_regions, residual_streams, skip_layers

from .calibration_text import CALIBRATION_TEXT

CALIBRATION_TOKENS = 256
DRAFT_WIDTH = 4                 # the K of expected_accepted_k4


@dataclass(frozen=True)
class DraftChoice:
    """What the search chose and measured (report.json's "draft")."""

    skip: tuple[int, ...]
    num_layers: int
    agreement: float
    mean_kl: float
    expected_accepted_k4: float
    calibration_tokens: int
    search: str
    rounds: list[dict]
    forwards: int
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self) | {"skip": list(self.skip), "kept": self.num_layers - len(self.skip)}


def check_draft_skip(n: int, num_layers: int) -> None:
    """ModelError unless 0 <= n < num_layers (a draft keeps at least one layer)."""
    if n < 0 or n >= num_layers:
        raise ModelError(f"--draft-skip {n} must be between 1 and {num_layers - 1}, since the model has "
                         f"{num_layers} layers and the draft keeps at least one; choose a smaller N")


def calibration_tokens(files: TokenizerFiles, limit: int) -> list[int]:
    """The first `limit` tokens of the calibration text in the model's tokenizer."""
    ids = Tokenizer.from_str(files.tokenizer_json).encode(CALIBRATION_TEXT, add_special_tokens=False).ids
    return ids[:limit]


@torch.inference_mode()
def run_graph(graph: Graph, weights: dict[str, torch.Tensor], feeds: dict[str, torch.Tensor],
              resume: dict[Value, torch.Tensor] | None = None, done: frozenset[str] = frozenset()) -> dict:
    """Every value of a cache-less graph, each op through its record's torch reference. `resume`
    gives values already known; the ops named in `done` (those only they depend on) are not run."""
    env = {n.value(): feeds[n.name] for n in graph.inputs()} | (resume or {})
    env |= {n.value(): weights[n.name[2:]].to(to_torch(n.type.dtype)) for n in graph.weights()}
    for node in graph.nodes:
        if node.op in ("input", "weight") or node.name in done:
            continue
        record = OPS[node.op]
        out = record.reference(bind(record, [env[v] for v in node.inputs], node.attrs), node.attrs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        env |= {node.value(i): t for i, t in enumerate(outs)}
    return env


def interpret(graph: Graph, weights: dict[str, torch.Tensor], feeds: dict[str, torch.Tensor]) -> torch.Tensor:
    """The graph's one output (a cache-less graph, through the op references)."""
    return run_graph(graph, weights, feeds)[graph.outputs[0]]


def resume_point(draft: Graph, layer: int, residual: torch.Tensor) -> tuple[dict[Value, torch.Tensor], frozenset[str]]:
    """Seeds and skipped ops to run `draft` from `residual`, the stream entering `layer` (a layer the
    draft skips): the first kept layer after it (or the tail) starts from it; nothing before runs."""
    streams, regions = residual_streams(draft), layer_regions(draft)
    first = min((r for r in streams if r != TAIL and r > layer), default=TAIL)
    order = lambda r: -1 if r is None else (len(regions) if r == TAIL else r)  # noqa: E731
    done = frozenset(name for name, r in regions.items() if order(r) < order(first))
    return {streams[first]: residual}, done


class Calibration:
    """The target's next-token distribution on the calibration tokens, and drafts scored against it."""

    def __init__(self, traced_prefill: Graph, weights: dict[str, torch.Tensor], tokens: list[int]):
        n = len(tokens)
        self.prefill, self.weights, self.forwards = traced_prefill, weights, 0
        self.feeds = {"input_ids": torch.tensor(tokens, dtype=torch.int64),
                      "positions": torch.arange(n, dtype=torch.int64),
                      "query_start_loc": torch.tensor([0, n], dtype=torch.int32),
                      "logits_indices": torch.arange(n, dtype=torch.int64)}
        self.target = torch.log_softmax(self._logits(traced_prefill), -1)        # [n, V]
        self.target_top = self.target.argmax(-1)

    def _logits(self, graph: Graph) -> torch.Tensor:
        self.forwards += 1
        return interpret(graph, self.weights, self.feeds).float()

    def _draft(self, skip: tuple[int, ...]) -> Graph:
        return skip_layers(self.prefill, PassContext(options={"draft_skip": skip}))

    def residuals(self, skip: tuple[int, ...]) -> dict[int, torch.Tensor]:
        """The residual stream entering each kept layer of the draft skipping `skip` (one forward)."""
        draft = self._draft(skip)
        self.forwards += 1
        env = run_graph(draft, self.weights, self.feeds)
        return {r: env[v] for r, v in residual_streams(draft).items() if r != TAIL}

    def score(self, skip: tuple[int, ...], resume: tuple[int, torch.Tensor] | None = None) -> tuple[torch.Tensor, float]:
        """Per-position agreement (bool [n]) of the draft skipping `skip`, and its mean KL; with
        `resume` = (layer, the residual entering it), only the layers after `layer` run."""
        draft = self._draft(skip)
        self.forwards += 1
        seeds, done = resume_point(draft, *resume) if resume else ({}, frozenset())
        logits = run_graph(draft, self.weights, self.feeds, seeds, done)[draft.outputs[0]].float()
        logp = torch.log_softmax(logits, -1)
        kl = float((self.target.exp() * (self.target - logp)).sum(-1).mean())
        return logp.argmax(-1) == self.target_top, kl


def expected_accepted(agree: torch.Tensor, k: int = DRAFT_WIDTH) -> float:
    """Mean over positions of the run of agreeing positions starting there, capped at k."""
    run = torch.zeros(len(agree), dtype=torch.float64)
    for _ in range(k):                          # run_j(t) = agree(t) * (1 + run_{j-1}(t + 1))
        run = agree.double() * (1 + torch.cat([run[1:], run.new_zeros(1)]))
    return float(run.mean())


def candidates(num_layers: int, skipped: tuple[int, ...], n: int) -> list[int]:
    """Layers the next round may skip: not the first or last unless N needs them."""
    inner = [i for i in range(1, num_layers - 1) if i not in skipped]
    if n <= num_layers - 2:
        return inner
    return [i for i in range(num_layers) if i not in skipped]


def choose_draft_skip(traced_prefill: Graph, weights: dict[str, torch.Tensor], tokens: list[int],
                      n: int) -> DraftChoice:
    """Greedy backward elimination of `n` layers (module docstring), measured on `tokens`."""
    start = time.perf_counter()
    num_layers = len([r for r in residual_streams(traced_prefill) if r != TAIL])
    check_draft_skip(n, num_layers)
    calib = Calibration(traced_prefill, weights, tokens)
    skipped: tuple[int, ...] = ()
    rounds, best = [], None
    for _ in range(n):
        scored, entering = [], calib.residuals(skipped)
        for layer in candidates(num_layers, skipped, n):
            agree, kl = calib.score(tuple(sorted(skipped + (layer,))), (layer, entering[layer]))
            scored.append((float(agree.double().mean()), -kl, -layer, layer, agree, kl))
        best = max(scored, key=lambda s: s[:3])
        skipped = tuple(sorted(skipped + (best[3],)))
        rounds.append({"skip": best[3], "agreement": best[0], "mean_kl": best[5],
                       "expected_accepted_k4": expected_accepted(best[4]), "tried": len(scored)})
    agreement, agree, kl = (best[0], best[4], best[5]) if best else (1.0, torch.ones(len(tokens), dtype=torch.bool), 0.0)
    return DraftChoice(skipped, num_layers, agreement, kl, expected_accepted(agree), len(tokens),
                       "greedy backward elimination", rounds, calib.forwards, time.perf_counter() - start)
