"""No weight is silently dropped, on any family: every parameter of the transformers model is
loaded under its llmc name with its values, and every loaded weight (embedding, norms, every
projection and bias, the LM head) changes the logits of both compiled entry graphs when it
changes, through the whole pipeline, the weights that fold_weights merges included."""

from __future__ import annotations

import copy

import pytest
import torch

from llmc.compiler.frontend import ENTRIES, trace
from llmc.models.config import expected_weights
from llmc.models.families import family_of
from llmc.models.hf_loader import canonical_name
from llmc.models.loader import load_model
from llmc.passes.pipeline import run_pipeline
from llmc.passes.rewrite import PassContext
from llmc.runtime.torch_backend import interpret
from llmc.tools.feeds import Step, step_feeds
from tiny_models import FAMILIES

# The decode step has context in the (random) cache: with nothing cached, attention over the one
# new token returns its V, and Q and K would change nothing.
STEPS = {"prefill": Step.prefill("prefill", [[5, 17, 3, 99, 42], [8, 1, 120]]),
         "decode": Step.after_context("decode", [list(range(3, 13)), [9, 8, 7, 6, 5, 4, 3]], [1, 1])}


def as_loaded(hf_name: str, p: torch.Tensor, family, shapes: dict) -> dict[str, torch.Tensor]:
    """What the loader must make of transformers parameter `hf_name`: its llmc name(s) and values
    (a fused weight's parts cut along rows at the heights `shapes` gives, a Gemma norm as 1 + w)."""
    name = canonical_name(hf_name, family.hf_layer_names)
    prefix, module, suffix = name.rsplit(".", 2) if name.count(".") >= 2 else ("", "", "")
    if module in family.fused_weights:
        parts = [f"{prefix}.{part}.{suffix}" for part in family.fused_weights[module]]
        return dict(zip(parts, p.detach().split([shapes[part][0] for part in parts])))
    if name.endswith("norm.weight") and family.hf_norm_offset:
        return {name: p.detach().float() + family.hf_norm_offset}
    return {name: p.detach()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_transformers_parameter_is_loaded_with_its_values(tiny_family, family):
    model, folder, _ = tiny_family(family)
    loaded = load_model(folder)
    fam, shapes = family_of(loaded.config.architecture), expected_weights(loaded.config)
    expected = {}
    for name, p in model.named_parameters():            # a tied LM head is listed once, as the embedding
        expected |= as_loaded(name, p, fam, shapes)
    assert sorted(loaded.weights) == sorted(expected)
    for name, w in expected.items():
        assert torch.equal(loaded.weights[name], w), name


def compiled_logits(traced: dict, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Both entry graphs through the whole pipeline (fold_weights computes from `weights`), run."""
    out = {}
    for entry in ENTRIES:
        ctx = PassContext(weights=dict(weights))
        graph, _ = run_pipeline(copy.deepcopy(traced[entry]), ctx)
        out[entry] = interpret(graph, ctx.weights, step_feeds(graph, STEPS[entry]))[0]
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_weight_changes_the_compiled_logits(tiny_family, family):
    loaded = load_model(tiny_family(family)[1])
    traced = {entry: trace(loaded.config, entry) for entry in ENTRIES}
    base = compiled_logits(traced, loaded.weights)
    g = torch.Generator().manual_seed(0)
    unread = []
    for name, w in sorted(loaded.weights.items()):
        bumped = {**loaded.weights, name: w + torch.randn(w.shape, generator=g) * w.abs().mean().clamp_min(0.1)}
        logits = compiled_logits(traced, bumped)
        unread += [f"{name} ({entry})" for entry in ENTRIES if torch.allclose(logits[entry], base[entry])]
    assert not unread, f"weights the compiled graphs never read: {unread}"
